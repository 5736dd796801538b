"""Metrics sinks shared by the recipes: metrics.jsonl, TensorBoard, W&B, and a progress bar.

``MetricsLogger(run_dir)`` writes one JSON line per logged step to ``<run_dir>/metrics.jsonl``
(flushed at once, so a crash loses nothing already logged), scalars to TensorBoard event files in
``<run_dir>/tensorboard`` and, when asked, to Weights & Biases. A resumed run passes
``resume_step``: lines for later steps (logged after the checkpoint, before the crash) are dropped
from metrics.jsonl and purged from TensorBoard, so every step appears exactly once.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from tracegym.closing import ClosesOnExit
from tracegym.types import read_json_rows

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def process_rss_mb() -> float:
    """Resident memory of this process in MiB (current, from /proc; peak where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports KiB, macOS bytes.
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All lines of a run's metrics.jsonl (a torn last line is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    return read_json_rows(path)[0] if path.is_file() else []


def _as_number(value: Any) -> float | int | None:
    """A metric value as a plain number, or None when it is not one."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    item = getattr(value, "item", None)  # torch / numpy scalars
    if callable(item):
        try:
            out = item()
        except (ValueError, RuntimeError):
            return None
        return out if isinstance(out, (int, float)) else None
    return None


class MetricsLogger(ClosesOnExit):
    """Log scalar metrics per step to metrics.jsonl, TensorBoard and (optionally) W&B."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "tracegym",
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ):
        wandb_module = None
        if wandb:  # fail before anything is opened or truncated
            try:
                import wandb as wandb_module
            except ImportError:
                raise RuntimeError(
                    "logging.wandb is true but the wandb package is not installed: "
                    "pip install wandb, or set logging.wandb=false"
                ) from None
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file
        self._file = open(self.path, "a", encoding="utf-8")

        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events of steps >= it written by the crashed part of a resumed run.
            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=purge)

        self._wandb = None
        if wandb_module is not None:
            self._wandb = wandb_module.init(
                project=wandb_project,
                dir=str(self.run_dir),
                config=dict(config or {}),
                resume="allow",
                id=self._wandb_run_id(),
            )

    def _wandb_run_id(self) -> str:
        """A W&B run id kept in the run dir, so a resumed run continues the same W&B run."""
        id_file = self.run_dir / "wandb_run_id"
        if id_file.is_file():
            return id_file.read_text(encoding="utf-8").strip()
        run_id = os.urandom(8).hex()
        id_file.write_text(run_id, encoding="utf-8")
        return run_id

    def _truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = [row for row in read_metrics(self.run_dir) if row.get("step", -1) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for row in kept:
                f.write(json.dumps(row) + "\n")
        tmp.replace(self.path)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record ``metrics`` for ``step``. Non-numeric values go to metrics.jsonl only.

        Returns the row written (with ``step`` and wall-clock ``time``).
        """
        row: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        for key, value in metrics.items():
            number = _as_number(value)
            if number is not None and isinstance(number, float) and not math.isfinite(number):
                row[key] = str(number)  # JSON has no NaN/inf; keep them visible as text
            else:
                row[key] = number if number is not None else value
        self._file.write(json.dumps(row, default=str) + "\n")
        self._file.flush()
        scalars = {k: _as_number(v) for k, v in metrics.items()}
        scalars = {k: v for k, v in scalars.items() if v is not None}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        return row

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class ProgressBar(ClosesOnExit):
    """A rich progress bar with rate and ETA; a no-op when disabled (tests, non-interactive logs)."""

    def __init__(self, total: int, description: str = "train", enabled: bool = True, completed: int = 0):
        self._progress = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self._task = self._progress.add_task(description, total=total, completed=completed, info="")
        self._progress.start()

    def update(self, advance: int = 1, info: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=advance, info=info)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
