"""``executor.kind: local``: rollouts in the trainer's own loop, with the trainer's own model.

The hf engine holds the very model object the optimizer updates, so a batch is always sampled by
the weights being trained (version lag 0) and weight sync costs nothing. This is the synchronous
loop tracegym has always run, and the only one whose resume is exact to the bit.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tracegym.executors.base import Executor, RolloutBatch, tag_version
from tracegym.rollout import RolloutResult


class LocalExecutor(Executor):
    kind = "local"

    def __init__(self, cfg: Any, sampler: Any, renderer: Any, train_tasks: Sequence[Any], version: int,
                 gap_model: torch.nn.Module | None = None) -> None:
        self.cfg, self.sampler, self.renderer, self.train_tasks = cfg, sampler, renderer, list(train_tasks)
        self.version = version
        self.gap_model = gap_model  # measures the engine/trainer log-prob gap on the same weights

    def next_batch(self, step: int, cursor: int, round_index: int) -> RolloutBatch:
        from tracegym.recipes.rl import collect_groups, tasks_at

        tasks = tasks_at(self.train_tasks, self.cfg.seed, cursor, self.cfg.tasks_per_step)
        # A dynamic-sampling round draws further tasks with a seed of its own.
        seed = self.cfg.seed * 1_000_003 + step + round_index * 7_919_007
        groups, result = collect_groups(self.sampler, self.cfg, tasks, self.renderer, gap_model=self.gap_model, seed=seed)
        groups = tag_version(groups, self.version)
        result = RolloutResult(trajectories=[t for g in groups for t in g.trajectories], stats=result.stats,
                               failed=result.failed)
        return RolloutBatch(index=step, version=self.version, tasks=list(tasks), groups=groups, result=result)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self.sampler.update_weights(model)  # the same object: this drops the engine's caches
        self.version = version
