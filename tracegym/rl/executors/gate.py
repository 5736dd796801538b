"""``StalenessGate``: how far rollouts may run ahead of the trainer (bounded staleness).

Pure Python and thread-safe (one lock): the rollout side (a thread, or the driver loop of Ray
workers) and the trainer share one gate. No Ray, no torch.

The unit is whatever the caller counts, the same on both sides: one group (one task's episodes)
with ``batch_size`` = groups per update, or one whole batch with ``batch_size = 1``. The trainer's
policy version ``v`` is the number of updates it has applied; a sample records the version that
sampled it, and its lag when trained is ``trainer_version - sample_version``.

Admission (AReaL's ``StalenessManager``; Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
Reinforcement Learning System for Language Reasoning"): a new rollout may start iff

    accepted + running < (max_staleness + version + 1) * batch_size

where ``accepted`` counts every finished, admissible rollout so far (cumulative: the trainer has
consumed ``version * batch_size`` of them, the rest wait in the caller's buffer) and ``running`` the
started, unfinished ones. So rollouts run at most ``max_staleness + 1`` batches ahead of
consumption: a sample started at version ``s`` is among the first ``(max_staleness + s + 1) *
batch_size`` samples, and the trainer reaches those by version ``max_staleness + s``: its lag is at
most ``max_staleness`` when every update consumes exactly ``batch_size`` units in order. With
``max_staleness = 0`` the next batch can start only once the previous one's update is applied:
synchronous RL. ``capacity()`` is the number of rollouts that may start now.

The lag is checked again where order is not guaranteed (out-of-order finishing, retries):
``finish(sample_version)`` drops a rollout already too stale when it finishes, ``consume
(sample_version)`` one that became too stale while waiting in the buffer; both free its slot (it is
no longer counted as accepted) and count it in ``dropped``. ``consume`` records the lag of every
trained unit in ``lag_histogram`` (lag -> count).

Lifecycle::

    gate = StalenessGate(batch_size=4, max_staleness=1)
    # rollout side                                 # trainer side
    if gate.try_start():                           for each sample taken from the buffer:
        sample with the newest weights (version s)     if gate.consume(sample.version): train on it
        if gate.finish(s): buffer.put(sample)      after the update: gate.on_update(version + 1)
    # on failure instead of finish: gate.reject()

``wait_start(timeout)`` blocks until a rollout may start (``on_update`` and freed slots wake it;
``close()`` releases every waiter). ``state_dict()``/``load_state_dict()`` put the counters in the
trainer's checkpoint; on load, rollouts that were in flight or waiting in the buffer are gone
(``skip_to``), so the gate admits ``(max_staleness + 1) * batch_size`` new ones.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class StalenessGate:
    """Admission of rollouts by version lag (see the module docstring); every method is thread-safe."""

    def __init__(self, batch_size: int, max_staleness: int, *, version: int = 0) -> None:
        """``batch_size``: units the trainer consumes per update (> 0); ``max_staleness``: versions a
        trained sample may lag the trainer (>= 0; 0 is synchronous); ``version``: the trainer's
        version now; a gate made at version ``v > 0`` is a resumed one (``skip_to(v)``: the first
        ``v`` batches were consumed, nothing is running or waiting)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self._batch_size = batch_size
        self._max_staleness = max_staleness
        # a Condition over the one lock: wait_start sleeps on it, every change that can free
        # capacity (on_update, reject, drops, close, load) notifies it
        self._cond = threading.Condition(threading.Lock())
        self._version = 0
        self._running = 0  # started, not finished
        self._accepted = 0  # finished and admissible, cumulative (minus those dropped by consume)
        self._rejected = 0  # finished without a usable sample (failed, filtered by the caller)
        self._dropped = 0  # too stale, at finish or at consume
        self._consumed = 0  # handed to the trainer by consume
        self._lags: dict[int, int] = {}  # lag of consumed units -> count
        self._closed = False
        self.skip_to(int(version))

    # -- read-only properties --------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def max_staleness(self) -> int:
        return self._max_staleness

    @property
    def version(self) -> int:
        """The trainer's policy version (updates applied)."""
        with self._cond:
            return self._version

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    @property
    def accepted(self) -> int:
        """Finished admissible rollouts so far (cumulative; those dropped by ``consume`` taken off)."""
        with self._cond:
            return self._accepted

    @property
    def rejected(self) -> int:
        with self._cond:
            return self._rejected

    @property
    def dropped(self) -> int:
        """Rollouts dropped as too stale (at ``finish`` or ``consume``)."""
        with self._cond:
            return self._dropped

    @property
    def consumed(self) -> int:
        with self._cond:
            return self._consumed

    @property
    def lag_histogram(self) -> dict[int, int]:
        """A copy of ``{lag: count}`` over the units ``consume`` let through."""
        with self._cond:
            return dict(self._lags)

    # -- admission -------------------------------------------------------------------------------
    def _capacity(self) -> int:  # caller holds the lock
        limit = (self._max_staleness + self._version + 1) * self._batch_size
        return max(0, limit - self._accepted - self._running)

    def capacity(self) -> int:
        """Rollouts that may start now: ``(max_staleness + version + 1) * batch_size - accepted -
        running``, at least 0."""
        with self._cond:
            return self._capacity()

    def can_start(self) -> bool:
        """Whether a rollout may start now (``capacity() > 0``; always False once closed)."""
        with self._cond:
            return not self._closed and self._capacity() > 0

    def try_start(self) -> bool:
        """Start a rollout if the gate admits one now (check and count in one step): True if started."""
        with self._cond:
            if self._closed or self._capacity() <= 0:
                return False
            self._running += 1
            return True

    def start(self) -> None:
        """Start a rollout the caller knows is admissible (``can_start()`` under its own lock);
        raises ``RuntimeError`` when the gate is full, so a bookkeeping error cannot pass silently."""
        if not self.try_start():
            with self._cond:
                why = "closed" if self._closed else (
                    f"full: accepted {self._accepted} + running {self._running} >= "
                    f"(max_staleness {self._max_staleness} + version {self._version} + 1) * batch_size {self._batch_size}")
            raise RuntimeError(f"StalenessGate.start(): the gate is {why}; check can_start() or use try_start()")

    def wait_start(self, timeout: float | None = None) -> bool:
        """Block until a rollout may start, then start it: True; False on ``timeout`` (seconds) or
        once the gate is closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed and self._capacity() <= 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            if self._closed:
                return False
            self._running += 1
            return True

    # -- finishing ---------------------------------------------------------------------------------
    def admissible(self, sample_version: int, trainer_version: int | None = None) -> bool:
        """Whether a sample of ``sample_version`` may be trained at ``trainer_version`` (default:
        the gate's): ``0 <= trainer_version - sample_version <= max_staleness``. A sample newer than
        the trainer is a bookkeeping error: ``ValueError``."""
        with self._cond:
            return self._admissible(sample_version, self._version if trainer_version is None else trainer_version)

    def _admissible(self, sample_version: int, trainer_version: int) -> bool:
        lag = trainer_version - sample_version
        if lag < 0:
            raise ValueError(f"sample version {sample_version} is newer than the trainer's version {trainer_version}")
        return lag <= self._max_staleness

    def _take_running(self, what: str) -> None:
        if self._running <= 0:
            raise RuntimeError(f"StalenessGate.{what}() without a running rollout (start() was not called)")
        self._running -= 1

    def finish(self, sample_version: int | None = None) -> bool:
        """A started rollout finished with a sample: ``running -> accepted``, True. Given its
        ``sample_version``, a sample already too stale for the trainer's version is dropped
        instead (``running -> dropped``, its slot freed), False."""
        with self._cond:
            # check everything before changing anything: a bad call leaves the counts as they were
            fresh = sample_version is None or self._admissible(sample_version, self._version)
            self._take_running("finish")
            if not fresh:
                self._dropped += 1
                self._cond.notify_all()
                return False
            self._accepted += 1
            return True

    def reject(self) -> None:
        """A started rollout ended without a usable sample (failed, or filtered out by the caller):
        ``running -> rejected``; its slot is free for another rollout."""
        with self._cond:
            self._take_running("reject")
            self._rejected += 1
            self._cond.notify_all()

    # -- the trainer's side ----------------------------------------------------------------------
    def consume(self, sample_version: int) -> bool:
        """The trainer takes one accepted unit sampled by ``sample_version``: True (its lag is
        counted in ``lag_histogram``) if admissible at the trainer's version; else it is dropped
        (``dropped`` + 1, taken off ``accepted`` so a fresh rollout can replace it), False."""
        with self._cond:
            if self._accepted - self._consumed <= 0:
                raise RuntimeError("StalenessGate.consume() with no accepted sample waiting (finish() was not called)")
            if not self._admissible(sample_version, self._version):
                self._accepted -= 1
                self._dropped += 1
                self._cond.notify_all()
                return False
            self._consumed += 1
            lag = self._version - sample_version
            self._lags[lag] = self._lags.get(lag, 0) + 1
            return True

    def on_update(self, new_version: int | None = None) -> int:
        """The trainer applied an update: its version becomes ``new_version`` (default: one more;
        never lower). Wakes ``wait_start``; returns the version."""
        with self._cond:
            target = self._version + 1 if new_version is None else int(new_version)
            if target < self._version:
                raise ValueError(f"the trainer's version cannot go back from {self._version} to {target}")
            self._version = target
            self._cond.notify_all()
            return target

    def skip_to(self, version: int) -> None:
        """Resume at ``version``: the batches before it were produced and consumed in an earlier
        run; rollouts in flight or waiting then are gone. Sets the version (never lower) and
        ``accepted = consumed = version * batch_size``, ``running = 0``, so ``(max_staleness + 1) *
        batch_size`` rollouts may start."""
        with self._cond:
            if version < self._version:
                raise ValueError(f"cannot skip back from version {self._version} to {version}")
            self._version = int(version)
            self._accepted = self._consumed = self._version * self._batch_size
            self._running = 0
            self._cond.notify_all()

    def close(self) -> None:
        """No rollout starts any more; ``wait_start`` callers return False (shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- metrics and checkpoints -----------------------------------------------------------------
    def metrics(self, prefix: str = "staleness/") -> dict[str, float]:
        """``version``, ``capacity``, ``running``, ``buffered`` (accepted, not yet consumed),
        ``dropped``, ``rejected``, and over the consumed units ``lag_mean``, ``lag_max`` and
        ``lag_<n>`` counts; all cumulative since the start (or the restored checkpoint)."""
        with self._cond:
            out = {
                f"{prefix}version": float(self._version),
                f"{prefix}capacity": float(self._capacity()),
                f"{prefix}running": float(self._running),
                f"{prefix}buffered": float(self._accepted - self._consumed),
                f"{prefix}dropped": float(self._dropped),
                f"{prefix}rejected": float(self._rejected),
            }
            out.update(lag_histogram_metrics(self._lags, prefix))
            return out

    def state_dict(self) -> dict[str, Any]:
        """The gate's state as plain JSON-able values (for the trainer's checkpoint)."""
        with self._cond:
            return {
                "batch_size": self._batch_size,
                "max_staleness": self._max_staleness,
                "version": self._version,
                "accepted": self._accepted,
                "running": self._running,
                "rejected": self._rejected,
                "dropped": self._dropped,
                "consumed": self._consumed,
                # string keys: the state survives a JSON round trip unchanged
                "lag_histogram": {str(lag): n for lag, n in sorted(self._lags.items())},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``: version, counters and lag histogram. Rollouts in flight or
        buffered at save time did not survive the restart, so ``running`` is 0 and ``accepted`` the
        consumed units (as ``skip_to``). ``batch_size`` and ``max_staleness`` stay this gate's own
        (the resumed run's config may change them); the saved ones are not needed."""
        version = int(state["version"])
        if version < 0:
            raise ValueError(f"bad gate state: version {version}")
        lags = {int(lag): int(n) for lag, n in dict(state.get("lag_histogram", {})).items()}
        with self._cond:
            self._version = version
            self._rejected = int(state.get("rejected", 0))
            self._dropped = int(state.get("dropped", 0))
            self._lags = lags
            # the consumed units are the first ``version`` batches (each update consumed one batch)
            self._accepted = self._consumed = version * self._batch_size
            self._running = 0
            self._cond.notify_all()


__all__ = ["StalenessGate"]


def lag_histogram_metrics(lags: dict[int, int], prefix: str) -> dict[str, float]:
    """``{prefix}lag_mean``, ``lag_max`` and one ``lag_<n>`` count per lag of a ``{lag: count}``
    histogram ({} when it is empty)."""
    total = sum(lags.values())
    if not total:
        return {}
    out = {f"{prefix}lag_mean": sum(lag * n for lag, n in lags.items()) / total, f"{prefix}lag_max": float(max(lags))}
    for lag, n in sorted(lags.items()):
        out[f"{prefix}lag_{lag}"] = float(n)
    return out
