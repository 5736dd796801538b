"""Experiment trackers behind one small interface, and what keeps them from hurting a run.

A ``Tracker`` gets the run's config once (``log_params``), the scalars of every logged step
(``log_metrics``), output files or folders (``log_artifact``: the final model, the HTML report) and
``finish``. ``GuardedTracker`` runs one tracker's calls on a thread of its own, each bounded by
``timeout_s``: the first call that fails or takes longer is reported once (one warning line, secrets
masked) and the tracker is switched off for the rest of the run, which goes on. ``TensorBoardTracker``
is here; MLflow and W&B have a module each (``tracking_mlflow``, ``tracking_wandb``), which import
their package only when opened; ``require_packages`` names a missing one before anything is opened.

Secrets never reach a tracker or a warning: ``redact`` masks the values of config keys that name a
secret (``api_key``, ``token``, ``password``, ...), the password part of a URL and the value of any
secret-named environment variable (``WANDB_API_KEY``, ``OPENAI_API_KEY``, ...) found in a text.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence, TypeVar

__all__ = [
    "GuardedTracker",
    "MissingTrackerPackage",
    "Requirement",
    "TensorBoardTracker",
    "Tracker",
    "flatten_params",
    "read_run_id",
    "redact",
    "redact_text",
    "require_packages",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# A config key (its last part) whose value is a secret; ``*_env`` keys name a variable, not a secret.
_SECRET_NAME = re.compile(r"(^|[_\-.])(api[_\-]?key|apikey|secret|secret[_\-]?key|password|passwd|token|"
                          r"credentials?|authorization)$", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@", re.IGNORECASE)
MASK = "***"
_MIN_SECRET_LEN = 6  # shorter environment values ("1", "true") are not searched for


def _secret_values() -> list[str]:
    """Values of the environment variables whose names name a secret (longest first)."""
    found = {value for name, value in os.environ.items()
             if _SECRET_NAME.search(name) and len(value) >= _MIN_SECRET_LEN}
    return sorted(found, key=len, reverse=True)


def redact_text(text: str) -> str:
    """``text`` with URL passwords and the values of secret environment variables masked."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    for value in _secret_values():
        text = text.replace(value, MASK)
    return text


def redact(value: Any, key: str = "") -> Any:
    """A copy of a JSON-like ``value`` (the run's config) with every secret masked: the value of a key
    that names a secret, and secrets inside strings (``redact_text``)."""
    if key and _SECRET_NAME.search(key) and value not in (None, ""):
        return MASK
    if isinstance(value, Mapping):
        return {str(k): redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optim": {"lr": 1e-4}}`` -> ``{"optim.lr": "0.0001"}``; lists and empty sections as JSON."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, name + "."))
        elif isinstance(value, str):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def read_run_id(id_file: Path, resumed: bool) -> str | None:
    """The tracker run id kept in ``id_file`` when the run is resumed (a fresh run starts a new one)."""
    if resumed and id_file.is_file():
        return id_file.read_text(encoding="utf-8").strip() or None
    return None


# --- the interface -----------------------------------------------------------------------------------


class Tracker:
    """One experiment tracker. Every method may raise: ``GuardedTracker`` catches it."""

    name = "tracker"

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The run's config (nested, secrets already masked)."""

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        """The scalars of one logged step."""

    def log_artifact(self, path: Path, name: str, kind: str) -> None:
        """A file or folder the run wrote: ``name`` ``final`` (kind ``model``) or ``report`` (``report``)."""

    def finish(self, completed: bool) -> None:
        """End the tracker's run: ``completed`` when the run saved its final model."""


@dataclass(frozen=True)
class Requirement:
    """A module a backend imports, the package that brings it and how to install it."""

    module: str
    package: str
    install: str


class MissingTrackerPackage(RuntimeError):
    """A backend in ``logging.backends`` whose package is not installed (raised before the run opens)."""


def require_packages(backend: str, requirements: Sequence[Requirement]) -> list[ModuleType]:
    """Import each requirement's module; the first missing one is a one-line error naming the package
    and the command that installs it."""
    modules = []
    for req in requirements:
        try:
            modules.append(import_module(req.module))
        except ImportError:
            raise MissingTrackerPackage(
                f"logging.backends lists {backend} but the {req.package} package is not installed: "
                f"{req.install}, or take {backend} out of logging.backends") from None
    return modules


# --- failures and hangs stay inside the tracker ------------------------------------------------------


class _Worker:
    """A daemon thread that runs calls one at a time; the caller waits at most ``timeout_s`` for each.
    A call still running at the timeout is left behind (daemon: it never keeps the process alive)."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        done = threading.Event()
        box: list[tuple[bool, Any]] = []

        def job() -> None:
            try:
                box.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            done.set()

        self._jobs.put(job)
        if not done.wait(timeout_s):
            raise TimeoutError(f"no answer within {timeout_s:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._jobs.put(None)


class GuardedTracker:
    """A tracker opened by ``opener`` whose calls run on its own thread, each bounded by ``timeout_s``.
    The first failure (an exception or a timeout, opening included) is logged once, as one warning
    line with secrets masked, and every later call is skipped; nothing is raised to the training loop."""

    def __init__(self, name: str, opener: Callable[[], Tracker], timeout_s: float):
        self.name = name
        self.timeout_s = timeout_s
        self.failure: str | None = None
        self._worker = _Worker(name)
        self._tracker: Tracker | None = self._run("opening", opener)

    @property
    def active(self) -> bool:
        return self._tracker is not None and self.failure is None

    def _run(self, what: str, fn: Callable[[], T]) -> T | None:
        if self.failure is not None:
            return None
        try:
            return self._worker.call(fn, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a tracker never stops training
            self._disable(what, exc)
            return None

    def _disable(self, what: str, exc: BaseException) -> None:
        message = (str(exc).strip().splitlines() or [""])[0][:300]
        self.failure = redact_text(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)
        log.warning("tracking: %s failed while %s and is off for the rest of this run (%s)",
                    self.name, what, self.failure)
        self._tracker = None
        self._worker.stop()

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self._tracker is not None:
            tracker = self._tracker
            self._run("logging the config", lambda: tracker.log_params(params))

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._tracker is not None:
            tracker = self._tracker
            self._run(f"logging step {step}", lambda: tracker.log_metrics(step, scalars))

    def log_artifact(self, path: Path, name: str, kind: str) -> None:
        if self._tracker is not None:
            tracker = self._tracker
            self._run(f"logging {path}", lambda: tracker.log_artifact(path, name, kind))

    def finish(self, completed: bool) -> None:
        if self._tracker is not None:
            tracker = self._tracker
            self._run("closing", lambda: tracker.finish(completed))
        self._tracker = None
        self._worker.stop()


# --- TensorBoard -------------------------------------------------------------------------------------


class TensorBoardTracker(Tracker):
    """Scalars as TensorBoard event files in ``folder``; a resumed run purges the events of the steps
    after ``resume_step`` that the crashed part wrote, so each step appears once."""

    name = "tensorboard"

    def __init__(self, folder: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=purge)

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def finish(self, completed: bool) -> None:
        self._writer.close()
