"""What every executor shares: the batch it hands the trainer, the versioned weights it samples
with, and the one function that samples a batch (the same on every executor, so a batch's tokens
depend only on its index, its tasks and the weights of its version).

An executor answers one question for the RL recipe: "the rollouts for step ``s``". ``local`` samples
them then and there with the trainer's own model; ``threads`` and ``ray`` sample ahead, with weights
that may be a few updates old, within ``executor.max_staleness`` (docs/scale.md).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tracegym.rl.executors.gate import lag_histogram_metrics
from tracegym.rollout import RolloutResult
from tracegym.types import Trajectory, TrajectoryGroup, group_trajectories

#: ``Trajectory.info`` key of the policy version that sampled an episode (0: the initial weights,
#: n: the weights after n updates).
VERSION_KEY = "policy_version"


@dataclass
class RolloutBatch:
    """The groups of one step's tasks, sampled by one policy version."""

    index: int  # the step (0-based) whose tasks and seed these are
    version: int  # policy version of the weights that sampled every episode of it
    tasks: list[Any]
    groups: list[TrajectoryGroup]
    result: RolloutResult
    worker: str = "local"
    sample_s: float = 0.0  # wall time the worker spent sampling it


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights an update changes (the LoRA adapter, or every weight with full fine-tuning), as
    detached CPU copies: what a sampler needs to follow the trainer."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (from :func:`trainable_state`) into ``model``'s parameters of the same names.
    Every name must exist: a silent partial load would sample with weights nobody trained."""
    params = dict(model.named_parameters())
    missing = [name for name in state if name not in params]
    if missing:
        raise KeyError(f"weights for {len(missing)} parameters the sampler's model does not have, e.g. {missing[0]!r}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


class ParamStore:
    """The newest published weights and their version, shared by the trainer and rollout threads."""

    def __init__(self, state: dict[str, torch.Tensor], version: int) -> None:
        self._lock = threading.Lock()
        self._state, self._version = state, version

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def put(self, state: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            if version < self._version:
                raise ValueError(f"weights of version {version} published after version {self._version}")
            self._state, self._version = state, version

    def newer_than(self, version: int) -> tuple[dict[str, torch.Tensor], int] | None:
        """(state, version) when the store holds a version above ``version``, else None."""
        with self._lock:
            return (self._state, self._version) if self._version > version else None


def tag_version(groups: Sequence[TrajectoryGroup], version: int) -> list[TrajectoryGroup]:
    """The groups with every trajectory's ``info[VERSION_KEY]`` set to ``version``."""
    tagged: list[Trajectory] = [t.model_copy(update={"info": {**t.info, VERSION_KEY: version}})
                                for g in groups for t in g.trajectories]
    return group_trajectories(tagged)


def batch_seed(base_seed: int, index: int, round_index: int = 0) -> int:
    """The sampling seed of step ``index``'s rollouts (``round_index``: a dynamic-sampling round of
    further tasks): the one the synchronous loop has always used, so every executor samples the
    same batch from the same weights."""
    return base_seed * 1_000_003 + index + round_index * 7_919_007


def collect_batch(
    sampler: Any, cfg: Any, renderer: Any, tasks: Sequence[Any], index: int, version: int, worker: str,
    round_index: int = 0, gap_model: torch.nn.Module | None = None,
) -> RolloutBatch:
    """Sample the groups of ``tasks`` for step ``index`` with ``sampler`` (holding the weights of
    ``version``), every trajectory tagged with that version."""
    from tracegym.rl.collect import collect_groups

    started = time.perf_counter()
    groups, result = collect_groups(sampler, cfg, tasks, renderer, gap_model=gap_model,
                                    seed=batch_seed(cfg.seed, index, round_index))
    groups = tag_version(groups, version)
    result = RolloutResult(trajectories=[t for g in groups for t in g.trajectories], stats=result.stats,
                           failed=result.failed)
    return RolloutBatch(index=index, version=version, tasks=list(tasks), groups=groups, result=result,
                        worker=worker, sample_s=time.perf_counter() - started)


def sample_batch(
    sampler: Any, cfg: Any, renderer: Any, train_tasks: Sequence[Any], index: int, version: int, worker: str,
) -> RolloutBatch:
    """Step ``index``'s batch as the asynchronous executors sample it: the tasks of slots
    ``index * tasks_per_step ...`` (no dynamic sampling there)."""
    from tracegym.rl.tasks import tasks_at

    tasks = tasks_at(train_tasks, cfg.seed, index * cfg.tasks_per_step, cfg.tasks_per_step)
    return collect_batch(sampler, cfg, renderer, tasks, index, version, worker)


@dataclass
class ExecutorStats:
    """What the executor measured since the trainer last asked (``Executor.metrics``)."""

    lags: dict[int, int] = field(default_factory=dict)  # version lag of trained batches -> count
    dropped_episodes: int = 0  # in flight on workers that died or stalled
    worker_failures: int = 0  # workers that died or stalled and were restarted
    wait_s: float = 0.0  # trainer time spent waiting for a batch

    def record_trained(self, batch: RolloutBatch, trainer_version: int, waited_s: float) -> None:
        """The trainer took ``batch`` at ``trainer_version`` after waiting ``waited_s``."""
        self.wait_s += waited_s
        lag = trainer_version - batch.version
        self.lags[lag] = self.lags.get(lag, 0) + 1

    def clear(self) -> None:
        self.lags.clear()
        self.dropped_episodes = self.worker_failures = 0
        self.wait_s = 0.0


class Executor(ABC):
    """Where the RL recipe gets its rollouts from (``executor.kind``)."""

    kind: str = "base"

    @abstractmethod
    def next_batch(self, step: int, cursor: int, round_index: int) -> RolloutBatch:
        """The rollouts the trainer trains on at ``step`` (0-based). ``cursor`` (task slots consumed
        so far) and ``round_index`` (dynamic-sampling round) matter only to ``local``; the
        asynchronous executors serve step ``s`` the tasks of slots ``s * tasks_per_step ...``."""

    @abstractmethod
    def publish(self, model: torch.nn.Module, version: int) -> None:
        """The trainer updated ``model`` to ``version``: samplers follow (at once for ``local``,
        before their next batch for the others)."""

    def metrics(self) -> dict[str, float]:
        """``async/*`` figures since the last call (``local``: ``curriculum/*`` with ``tasks.curriculum``, else none)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the executor (the staleness state; ``local``: the curriculum's estimates)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` on resume."""

    def close(self) -> None:
        """Stop workers and threads (idempotent)."""


def lag_metrics(stats: ExecutorStats, prefix: str = "async/") -> dict[str, float]:
    """``async/lag_mean``, ``lag_max``, ``lag_<n>`` counts, drops, failures and wait time."""
    out = lag_histogram_metrics(stats.lags, prefix)
    out[f"{prefix}dropped_episodes"] = float(stats.dropped_episodes)
    out[f"{prefix}worker_failures"] = float(stats.worker_failures)
    out[f"{prefix}wait_s"] = stats.wait_s
    return out
