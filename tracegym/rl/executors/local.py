"""``executor.kind: local``: rollouts in the trainer's own loop, with the trainer's own model.

The hf engine holds the very model object the optimizer updates, so a batch is always sampled by
the weights being trained (version lag 0) and weight sync costs nothing. This is the synchronous
loop tracegym has always run, and the only one whose resume is exact to the bit.

With ``tasks.curriculum`` the step's tasks are drawn by estimated pass rate
(``tracegym.rl.executors.curriculum``) instead of the seeded order, and every batch's outcomes update
the estimates at once: a later dynamic-sampling round of the same step already sees them. Only this
executor has the outcomes of step s before it draws step s+1's tasks.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from tracegym.rl.executors.base import Executor, RolloutBatch, collect_batch
from tracegym.rl.executors.curriculum import CurriculumStats, curriculum_rng, make_curriculum

log = logging.getLogger(__name__)


class LocalExecutor(Executor):
    kind = "local"

    def __init__(self, cfg: Any, sampler: Any, renderer: Any, train_tasks: Sequence[Any], version: int,
                 gap_model: torch.nn.Module | None = None) -> None:
        from tracegym.rl.tasks import task_order

        self.cfg, self.sampler, self.renderer, self.train_tasks = cfg, sampler, renderer, list(train_tasks)
        self.version = version
        self.gap_model = gap_model  # measures the engine/trainer log-prob gap on the same weights
        # unseen tasks are met in the plain run's first-epoch order
        self.curriculum = make_curriculum(cfg.tasks.curriculum, len(self.train_tasks),
                                          task_order(len(self.train_tasks), cfg.seed, 0))
        self.curriculum_stats = CurriculumStats()
        self._task_index = {task.id: i for i, task in enumerate(self.train_tasks)}
        self._drawn_step, self._drawn = -1, []  # tasks drawn so far in the current step (its rounds)

    def next_batch(self, step: int, cursor: int, round_index: int) -> RolloutBatch:
        from tracegym.rl.tasks import tasks_at

        if self.curriculum is None:
            tasks = tasks_at(self.train_tasks, self.cfg.seed, cursor, self.cfg.tasks_per_step)
            return collect_batch(self.sampler, self.cfg, self.renderer, tasks, step, self.version, "local",
                                 round_index=round_index, gap_model=self.gap_model)
        if step != self._drawn_step:
            self._drawn_step, self._drawn = step, []
        picked = self.curriculum.pick(self.cfg.tasks_per_step, curriculum_rng(self.cfg.seed, step, round_index),
                                      exclude=self._drawn)
        self._drawn += picked
        self.curriculum_stats.add(self.curriculum, picked)
        batch = collect_batch(self.sampler, self.cfg, self.renderer, [self.train_tasks[i] for i in picked], step,
                              self.version, "local", round_index=round_index, gap_model=self.gap_model)
        outcomes: dict[int, tuple[int, int]] = {}
        for group in batch.groups:  # episodes that failed in the env are not in a group: not attempts
            index = self._task_index[group.task_id]
            successes, attempts = outcomes.get(index, (0, 0))
            outcomes[index] = (successes + sum(t.success for t in group.trajectories), attempts + len(group))
        for index in dict.fromkeys(picked):
            self.curriculum.record(index, *outcomes.get(index, (0, 0)), step=step)
        return batch

    def publish(self, model: torch.nn.Module, version: int) -> None:
        # The sampler is the trainer's own engine on this very model: the recipe has synced it already.
        self.version = version

    def metrics(self) -> dict[str, float]:
        if self.curriculum is None:
            return {}
        out = self.curriculum_stats.metrics(self.curriculum)
        self.curriculum_stats = CurriculumStats()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {} if self.curriculum is None else {"curriculum": self.curriculum.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.curriculum is None:
            return  # turned off since the checkpoint: the seeded order needs no state
        if "curriculum" not in state:
            log.warning("the checkpoint holds no curriculum state (the run had tasks.curriculum off): "
                        "the curriculum starts with every task unseen")
            return
        self.curriculum.load_state_dict(state["curriculum"])
