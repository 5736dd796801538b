"""Process memory on glibc: fewer malloc arenas, and freed heap pages handed back to the system.

torch frees a tensor's memory to the C allocator, not to the system. glibc keeps freed chunks inside
its heaps (one per arena) for reuse, and returns pages to the system only from the top of a heap or
when asked (``malloc_trim``). A rollout phase frees gigabytes of keys/values and logits in pieces of
many sizes, an update frees its activations; without a trim those pages stay resident (RSS) while
the next phase allocates differently shaped tensors elsewhere. Both helpers are no-ops off glibc.
"""

from __future__ import annotations

import gc
import os
import sys
from functools import lru_cache
from typing import Any


def _libc() -> Any | None:
    """glibc, or None (another platform or C library)."""
    return _load_glibc() if sys.platform.startswith("linux") else None


@lru_cache(maxsize=1)
def _load_glibc() -> Any | None:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - musl has no malloc_trim: treat it as no glibc
        return libc
    except (OSError, AttributeError):
        return None


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (``mallopt(M_ARENA_MAX)``) unless ``MALLOC_ARENA_MAX`` is set.

    glibc gives threads that allocate their own arenas (up to 8 per core); torch's OpenMP threads
    and the episode threads free large tensors into them and the freed memory stays resident.
    Measured on the demo's RL adapter (``tracegym eval``, calculator, 40 tasks x 4 samples,
    concurrency 64): peak RSS 6.25 GB with glibc's default, 4.51 GB with 2 arenas, and 9% faster.
    Call it before torch starts its threads. Returns whether the cap was set (glibc only)."""
    libc = _libc()
    if libc is None or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    m_arena_max = -8  # from glibc's malloc.h
    return bool(libc.mallopt(m_arena_max, arenas))


def release_memory() -> bool:
    """Collect Python garbage, then hand the allocator's free pages back to the system
    (``malloc_trim(0)``: every arena, whole free pages anywhere in a heap, not only at its top).
    Called where a phase has just freed a lot: the end of a rollout run, after a policy update.
    Costs a walk over the heaps (milliseconds). Returns whether glibc released anything."""
    gc.collect()
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


__all__ = ["limit_malloc_arenas", "release_memory"]
