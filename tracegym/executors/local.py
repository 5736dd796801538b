"""``executor.kind: local``: rollouts in the trainer's own loop, with the trainer's own model.

The hf engine holds the very model object the optimizer updates, so a batch is always sampled by
the weights being trained (version lag 0) and weight sync costs nothing. This is the synchronous
loop tracegym has always run, and the only one whose resume is exact to the bit.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tracegym.executors.base import Executor, RolloutBatch, collect_batch


class LocalExecutor(Executor):
    kind = "local"

    def __init__(self, cfg: Any, sampler: Any, renderer: Any, train_tasks: Sequence[Any], version: int,
                 gap_model: torch.nn.Module | None = None) -> None:
        self.cfg, self.sampler, self.renderer, self.train_tasks = cfg, sampler, renderer, list(train_tasks)
        self.version = version
        self.gap_model = gap_model  # measures the engine/trainer log-prob gap on the same weights

    def next_batch(self, step: int, cursor: int, round_index: int) -> RolloutBatch:
        from tracegym.recipes.rl import tasks_at

        tasks = tasks_at(self.train_tasks, self.cfg.seed, cursor, self.cfg.tasks_per_step)
        return collect_batch(self.sampler, self.cfg, self.renderer, tasks, step, self.version, "local",
                             round_index=round_index, gap_model=self.gap_model)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        # The sampler is the trainer's own engine on this very model: the recipe has synced it already.
        self.version = version
