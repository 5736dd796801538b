"""Shared fixtures. Tests never touch the network; models are tiny random ones or the embedded SmolLM2."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # make test runs one worker per core: a worker (and the CLI subprocesses it starts) computes on
    # one thread, or two workers' OpenMP threads would fight over 2 cores (10-20x slower, FACTS.md)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

import gc
import shutil
import tempfile
from pathlib import Path

import pytest

# The user's model cache as it was when the session started. Session fixtures load through it
# (so repeated runs skip the ~15 s de-quantisation), even if a test points TRACEGYM_CACHE at a
# tmp_path before the fixture is first requested.
_SESSION_TRACEGYM_CACHE = os.environ.get("TRACEGYM_CACHE")


@pytest.fixture(scope="session")
def tokenizer():
    from tracegym.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


def _load_with_session_cache(name: str):
    from tracegym.models import load

    with pytest.MonkeyPatch.context() as patch:
        if _SESSION_TRACEGYM_CACHE is None:
            patch.delenv("TRACEGYM_CACHE", raising=False)
        else:
            patch.setenv("TRACEGYM_CACHE", _SESSION_TRACEGYM_CACHE)
        return load(name)


@pytest.fixture(scope="session")
def tiny_model():
    """``(model, tokenizer)`` of ``load("tiny-random")`` (seed 0), shared by the whole session.

    Treat it as read-only; a test that trains or edits weights loads its own copy with
    ``tracegym.models.load("tiny-random")`` (fast, and identical for the same seed).
    """
    return _load_with_session_cache("tiny-random")


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the real SmolLM2-135M-Instruct (float32), loaded through the user's
    cache: about 1-2 s when built, about 15 s the first time. Read-only, like ``tiny_model``."""
    return _load_with_session_cache("smollm2-135m")


@pytest.fixture
def base():
    """A base dir the sandbox's unprivileged uid can reach (pytest's tmp_path is root-only)."""
    folder = Path(tempfile.mkdtemp(prefix="tracegym-sandbox-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def frozen_gc():
    """Every test runs with what existed before it frozen out of the garbage collector.

    Every rollout and policy update ends in a full garbage collection (``release_memory``), which
    walks every object of the process: in a pytest process with torch and transformers imported
    that is ~0.2 s a call (0.22 s on an AVX2 EPYC VM), two a step. What exists before the test is
    long-lived (modules, the session's fixtures): frozen, the collections walk only what the test
    makes, and the test's own cycles are still collected. Unfrozen after the test, so garbage of one
    test left in a cycle is collectable again. (Not done in the library: freezing what is alive
    mid-run would keep it from ever being collected.)"""
    gc.freeze()
    yield
    gc.unfreeze()
