"""The CLI caps glibc's malloc arenas before torch starts its threads (measured: eval peak RSS 6.25 GB
-> 4.4 GB on the demo adapter); a user's own ``MALLOC_ARENA_MAX`` wins, and other platforms are left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tracegym.memory import limit_malloc_arenas


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_the_cap_is_set_on_glibc_unless_the_user_set_one(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert limit_malloc_arenas() is True
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False  # the user's setting is not overridden


def test_other_platforms_are_left_alone(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert limit_malloc_arenas() is False


def test_the_cli_runs_with_the_cap():
    done = subprocess.run([sys.executable, "-m", "tracegym", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim is Linux-only")
def test_release_memory_hands_freed_heap_pages_back():
    """Many mid-sized blocks (below the mmap threshold: they live in the heap), all but the last
    freed: without a trim the heap keeps those pages resident; release_memory returns them."""
    import ctypes

    from tracegym.memory import release_memory
    from tracegym.train.logging import process_rss_mb

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    release_memory()
    blocks = [libc.malloc(64 * 1024) for _ in range(4000)]  # 250 MB in 64 KB blocks
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)  # touch: make the pages resident
    held = process_rss_mb()
    for b in blocks[:-1]:  # the last block pins the heap's top: only a trim frees the pages below it
        libc.free(b)
    before = process_rss_mb()
    assert release_memory() is True
    after = process_rss_mb()
    libc.free(blocks[-1])
    assert held - before < 50, (held, before)  # free() alone kept them
    assert before - after > 200, (before, after)  # the trim gave back ~250 MB
