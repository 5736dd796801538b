"""Where tracegym keeps its caches (models, search indexes): one function every layer may use."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of tracegym's caches (``$TRACEGYM_CACHE`` or ``~/.cache/tracegym``)."""
    return Path(os.environ.get("TRACEGYM_CACHE") or Path.home() / ".cache" / "tracegym").expanduser()
