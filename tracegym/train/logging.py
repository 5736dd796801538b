"""Metrics sinks shared by the recipes: metrics.jsonl, the experiment trackers, and progress output.

``MetricsLogger(run_dir, settings=cfg.logging, config=...)`` writes one JSON line per logged step to
``<run_dir>/metrics.jsonl`` (flushed at once, so a crash loses nothing already logged) and hands the
run's config (secrets masked), each step's scalars and, at ``close(final_dir)``, the final model and
``report.html`` to the trackers ``logging.backends`` lists: TensorBoard event files in
``<run_dir>/tensorboard``, MLflow, W&B (``tracegym.train.tracking``; docs/tracking.md). A tracker
that fails or hangs is reported once and switched off; training goes on. A missing tracker package
is an error before anything is opened. A resumed run passes ``resume_step``: lines for later steps
(logged after the checkpoint, before the crash) are dropped from metrics.jsonl and purged from
TensorBoard, so every step appears exactly once there.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

from tracegym.closing import ClosesOnExit
from tracegym.config.shared import LoggingConfig
from tracegym.train.tracking import (
    GuardedTracker,
    Requirement,
    TensorBoardTracker,
    Tracker,
    redact,
    require_packages,
)
from tracegym.train.tracking_mlflow import mlflow_requirements, mlflow_uri, open_mlflow
from tracegym.train.tracking_wandb import WANDB_REQUIREMENTS, open_wandb
from tracegym.types import read_json_rows

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
REPORT_FILE = "report.html"  # the HTML report a recipe may write into its run dir (tracegym.eval.report)
_TENSORBOARD_NEEDS = [Requirement("tensorboard", "tensorboard", "pip install tensorboard")]


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


def tracker_openers(run_dir: Path, settings: LoggingConfig, resume_step: int | None,
                    params: Mapping[str, Any] | None = None) -> list[tuple[str, Callable[[], Tracker]]]:
    """(name, opener) of each backend of ``settings.backends``, in order; a backend whose package is
    missing raises ``MissingTrackerPackage`` here, before anything is opened."""
    openers: list[tuple[str, Callable[[], Tracker]]] = []
    for name in settings.backends:
        if name == "tensorboard":
            require_packages(name, _TENSORBOARD_NEEDS)
            openers.append((name, partial(TensorBoardTracker, run_dir / TENSORBOARD_DIR, resume_step)))
        elif name == "mlflow":
            uri = mlflow_uri(run_dir, settings, os.environ)
            require_packages(name, mlflow_requirements(uri))
            openers.append((name, partial(open_mlflow, run_dir, settings, resume_step, uri)))
        elif name == "wandb":
            require_packages(name, WANDB_REQUIREMENTS)
            openers.append((name, partial(open_wandb, run_dir, settings, resume_step, params)))
    return openers


class MetricsLogger(ClosesOnExit):
    """Log scalar metrics per step to metrics.jsonl and the trackers of ``settings.backends``.

    ``settings`` is the recipe's ``logging`` section; without it the older arguments ``tensorboard``,
    ``wandb`` and ``wandb_project`` build one (as the old config keys do).
    """

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "tracegym",
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
        *,
        settings: LoggingConfig | None = None,
    ):
        if settings is None:
            settings = LoggingConfig(tensorboard=tensorboard, wandb=wandb, wandb_project=wandb_project)
        self.run_dir = Path(run_dir)
        params = redact(dict(config or {}))
        openers = tracker_openers(self.run_dir, settings, resume_step, params)  # fails before anything is opened or truncated
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file
        self._file = open(self.path, "a", encoding="utf-8")
        self.trackers = [GuardedTracker(name, opener, settings.timeout_s) for name, opener in openers]
        self.artifacts = settings.artifacts
        for tracker in self.trackers:
            tracker.log_params(params)

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
        if scalars:
            for tracker in self.trackers:
                tracker.log_metrics(step, scalars)
        return row

    def close(self, final_dir: str | Path | None = None) -> None:
        """Close metrics.jsonl and end each tracker's run: with ``final_dir`` (the saved final model)
        the run completed, and that folder and ``report.html`` (when the run dir has one) are logged
        as artifacts first (``logging.artifacts``); without it the run ended early (a crash, a stop: ``--resume`` continues it)."""
        if not self._file.closed:
            self._file.close()
        logs_outputs = final_dir is not None and self.artifacts
        outputs = [(Path(final_dir), "final", "model")] if logs_outputs else []
        if logs_outputs and (self.run_dir / REPORT_FILE).is_file():
            outputs.append((self.run_dir / REPORT_FILE, "report", "report"))
        for tracker in self.trackers:
            for path, name, kind in outputs:
                tracker.log_artifact(path, name, kind)
            tracker.finish(completed=final_dir is not None)
        self.trackers = []


def _duration_text(seconds: float) -> str:
    """A duration short enough for a log line: ``45s``, ``1m02s``, ``2h05m``."""
    total = max(int(round(seconds)), 0)
    if total < 60:
        return f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _rate_text(units: float, seconds: float, unit: str) -> str:
    """Throughput as whichever reads better: ``12.3 s/step`` for slow units, ``4.20 step/s`` for fast."""
    if units <= 0 or seconds <= 0:
        return ""
    if seconds / units >= 1.0:
        return f"{seconds / units:.1f} s/{unit}"
    return f"{units / seconds:.2f} {unit}/s"


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream is no terminal
        return False


class ProgressBar(ClosesOnExit):
    """Progress of a long stage: a rich bar on a terminal, plain lines in a log; a no-op when disabled.

    On a terminal (``stream.isatty()``) it is a rich progress bar with rate and ETA. Anywhere else
    (nohup, CI, output redirected to a file) a rich bar either draws nothing or floods the file, so
    instead one plain line is printed (and flushed) at the first update, then whenever at least
    ``interval_s`` seconds passed since the last line, and at the last step::

        rl step 3/8 | reward 0.420 | 12.3 s/step | eta 1m02s

    A step longer than ``interval_s`` would still leave the log silent, so a daemon thread prints
    ``rl step 4/8 still running (45s)`` whenever ``interval_s`` passed without a line; ``close()``
    stops it. ``update(tokens=n)`` adds generated or trained tokens, shown as ``tok/s``.

    ``stream`` (default ``sys.stdout`` at construction) and ``clock`` (default ``time.monotonic``)
    are there for tests; so is ``heartbeat=False``, since the thread sleeps in real seconds and a
    test moving a fake clock would race it.
    """

    def __init__(
        self,
        total: int,
        description: str = "train",
        enabled: bool = True,
        completed: int = 0,
        *,
        interval_s: float = 30.0,
        unit: str = "step",
        heartbeat: bool = True,
        stream: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._progress = None
        self._plain = False
        self._heartbeat: threading.Thread | None = None
        self._stop = threading.Event()
        # Update (caller's thread) and heartbeat (own thread) both print and read the counters.
        self._lock = threading.Lock()
        self.total = total
        self.description = description
        self.unit = unit
        self.interval_s = interval_s
        self._stream = sys.stdout if stream is None else stream
        self._clock = clock
        self._done = completed
        self._started_done = completed  # rates and ETA count only the steps run by this process
        self._tokens: int | None = None  # None until an update brings a token count: no tok/s shown
        self._started_at = clock()
        self._step_started_at = self._started_at
        self._last_line_at = self._started_at  # no line yet: the heartbeat counts from the start
        self._reported_update = False  # the first update always prints, whatever the heartbeat did
        self._info = ""
        self._done_at_last_line = completed
        if not enabled:
            return
        if not _is_terminal(self._stream):
            self._plain = True
            if heartbeat and interval_s > 0:
                self._heartbeat = threading.Thread(
                    target=self._heartbeat_loop, name=f"{description}-progress-heartbeat", daemon=True)
                self._heartbeat.start()
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        console = None
        if stream is not None:  # by default rich finds stdout itself, as it always did
            from rich.console import Console

            console = Console(file=stream)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
        )
        self._task = self._progress.add_task(description, total=total, completed=completed, info="")
        self._progress.start()

    def update(self, advance: int = 1, info: str = "", tokens: int | None = None) -> None:
        """Count ``advance`` more steps; ``info`` (e.g. ``"loss 0.123"``) is shown as given."""
        if self._progress is None and not self._plain:
            return
        with self._lock:
            now = self._clock()
            self._done += advance
            if tokens is not None:
                self._tokens = (self._tokens or 0) + tokens
            if advance:
                self._step_started_at = now
            self._info = info
            if self._progress is not None:
                shown = "  ".join(part for part in (info, self._rates_text(now)) if part)
                self._progress.update(self._task, advance=advance, info=shown)
                return
            due = not self._reported_update or now - self._last_line_at >= self.interval_s
            if due or self._finished:
                self._emit(self._progress_line(now), now)
                self._reported_update = True

    @property
    def _finished(self) -> bool:
        return self.total > 0 and self._done >= self.total

    def _progress_line(self, now: float) -> str:
        parts = [f"{self.description} {self.unit} {self._done}/{self.total}"]
        if self._info:
            parts.append(self._info)
        rates = self._rates_text(now)
        if rates:
            parts.append(rates)
        if self._finished:
            parts.append(f"took {_duration_text(now - self._started_at)}")
        elif self._done > self._started_done:
            per_step = (now - self._started_at) / (self._done - self._started_done)
            parts.append(f"eta {_duration_text(per_step * (self.total - self._done))}")
        return " | ".join(parts)

    def _rates_text(self, now: float) -> str:
        elapsed = now - self._started_at
        parts = [_rate_text(self._done - self._started_done, elapsed, self.unit)]
        if self._tokens is not None and elapsed > 0:
            parts.append(f"{self._tokens / elapsed:.1f} tok/s")
        return " ".join(part for part in parts if part)

    def _emit(self, line: str, now: float) -> None:
        """Print one line (the lock is held). A broken stdout turns the lines off, never the run."""
        try:
            print(line, file=self._stream, flush=True)
        except (OSError, ValueError):
            self._plain = False
            self._stop.set()
            return
        self._last_line_at = now
        self._done_at_last_line = self._done

    def _heartbeat_loop(self) -> None:
        while True:
            with self._lock:
                if not self._plain:
                    return
                now = self._clock()
                wait = self._last_line_at + self.interval_s - now
                if wait <= 0:
                    self._emit(self._heartbeat_line(now), now)
                    wait = self.interval_s
            if self._stop.wait(wait):
                return

    def _heartbeat_line(self, now: float) -> str:
        if self._done > self._done_at_last_line:
            # Steps finished since the last line, each too soon after it to print: report them now.
            return self._progress_line(now)
        silent_for = _duration_text(now - self._step_started_at)
        if self._finished:  # after the last step, e.g. while the final model is saved
            return f"{self.description} {self.unit} {self._done}/{self.total} done, finishing ({silent_for})"
        return f"{self.description} {self.unit} {self._done + 1}/{self.total} still running ({silent_for})"

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self._stop.set()
        if self._heartbeat is not None:
            # The thread wakes at once; the bound only matters if a print to a stuck stdout hangs.
            self._heartbeat.join(timeout=1.0)
            self._heartbeat = None
        self._plain = False
