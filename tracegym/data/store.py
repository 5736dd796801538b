"""Trajectory store: JSONL on disk, one ``Trajectory`` per line, flushed per row.

The rollout runner writes each trajectory the moment its episode ends, so a crash loses at most
the episodes still in flight; a line torn by a crash mid-write is skipped by the reader, with a
warning naming ``file:line``. ``read_trajectories_checked`` lets the caller choose between skipping
bad lines (torn, not JSON, or JSON that is not a Trajectory) and failing on the first one.
``export_parquet`` turns a JSONL file into a Parquet table in the fixed columnar schema of
``tracegym.data.parquet`` (one row per trajectory), which other tools load across envs in one call.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import IO, Iterable, Iterator, Literal

import pydantic

from tracegym.closing import ClosesOnExit
from tracegym.types import Trajectory, read_json_rows_numbered

__all__ = ["BadLineError", "TrajectoryWriter", "read_trajectories", "read_trajectories_checked", "export_parquet"]

log = logging.getLogger(__name__)


class BadLineError(ValueError):
    """A line of a trajectory file that is not a Trajectory; the message starts with ``file:line``."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{path}:{line}: {reason}")


class TrajectoryWriter(ClosesOnExit):
    """Append trajectories to a JSONL file, one line each, flushed (and optionally fsynced) per row.

    Thread-safe (a lock around each line). Use as a context manager or call ``close``.
    ``append=False`` truncates an existing file.
    """

    def __init__(self, path: str | Path, append: bool = False, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a" if append else "w", encoding="utf-8")
        self._fsync = fsync
        self._lock = threading.Lock()
        self.count = 0

    def write(self, trajectory: Trajectory) -> None:
        line = trajectory.model_dump_json() + "\n"
        with self._lock:
            if self._file is None:
                raise ValueError(f"TrajectoryWriter({self.path}) is closed")
            self._file.write(line)
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
            self.count += 1

    def write_all(self, trajectories: Iterable[Trajectory]) -> int:
        n = 0
        for t in trajectories:
            self.write(t)
            n += 1
        return n

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __repr__(self) -> str:
        return f"TrajectoryWriter({str(self.path)!r}, count={self.count})"


def _validation_summary(exc: pydantic.ValidationError, most: int = 3) -> str:
    """"not a Trajectory: turns: Field required; reward: ..." (the first ``most`` problems)."""
    errors = exc.errors()
    parts = [f"{'.'.join(str(x) for x in e.get('loc', ())) or '(row)'}: {e.get('msg', 'invalid')}" for e in errors[:most]]
    more = f" (+{len(errors) - most} more)" if len(errors) > most else ""
    return "not a Trajectory: " + "; ".join(parts) + more


def read_trajectories_checked(
    path: str | Path, on_bad_line: Literal["skip", "error"] = "skip"
) -> tuple[list[Trajectory], list[str]]:
    """Every trajectory of a JSONL file, and one ``"file:line: reason"`` per bad line.

    A bad line is a torn one (a crash mid-write), one that is not a JSON object, or a JSON object that
    does not validate as a ``Trajectory``. ``on_bad_line="skip"`` leaves it out and reports it in the
    returned list (the caller warns or counts; nothing is dropped silently); ``"error"`` raises
    :class:`BadLineError` naming the first one (in line order).
    """
    if on_bad_line not in ("skip", "error"):
        raise ValueError(f"on_bad_line must be 'skip' or 'error', got {on_bad_line!r}")
    rows, unreadable = read_json_rows_numbered(path)
    bad: list[tuple[int, str]] = list(unreadable)
    trajectories: list[tuple[int, Trajectory]] = []
    for number, row in rows:
        try:
            trajectories.append((number, Trajectory.model_validate(row)))
        except pydantic.ValidationError as exc:
            bad.append((number, _validation_summary(exc)))
    bad.sort()
    if bad and on_bad_line == "error":
        raise BadLineError(path, *bad[0])
    return [t for _, t in trajectories], [f"{path}:{number}: {reason}" for number, reason in bad]


def read_trajectories(path: str | Path) -> Iterator[Trajectory]:
    """Read a JSONL trajectory file; a torn (partial) line from a crash is skipped with a warning
    naming ``file:line``; a line that is valid JSON but not a Trajectory raises :class:`BadLineError`
    naming ``file:line`` (that is a bug, not a crash artefact)."""
    rows, unreadable = read_json_rows_numbered(path)
    for number, reason in unreadable:
        log.warning("skipping %s:%d: %s", path, number, reason)
    for number, row in rows:
        try:
            trajectory = Trajectory.model_validate(row)
        except pydantic.ValidationError as exc:
            raise BadLineError(path, number, _validation_summary(exc)) from exc
        yield trajectory


def export_parquet(jsonl_path: str | Path, parquet_path: str | Path) -> int:
    """Write a JSONL trajectory file as Parquet in ``tracegym.data.parquet.TRAJECTORY_SCHEMA`` (real
    nested columns, the same schema for every env, written atomically); returns the number of rows."""
    from tracegym.data.parquet import write_trajectories_parquet

    return write_trajectories_parquet(read_trajectories(jsonl_path), parquet_path)
