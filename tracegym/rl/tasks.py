"""Which train tasks each RL step gets: an endless seeded order, epoch by epoch, that a resumed run
reproduces from its cursor alone (no RNG state to save)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["task_order", "tasks_at", "tasks_for_step"]


def task_order(num_tasks: int, seed: int, epoch: int) -> np.ndarray:
    """Train-task order of one epoch: a pure function of (seed, epoch), so resume needs no RNG state."""
    return np.random.default_rng([seed, 7919, epoch]).permutation(num_tasks)


def tasks_at(tasks: Sequence[Any], seed: int, start: int, count: int) -> list[Any]:
    """The tasks of slots ``start .. start+count-1`` of the endless seeded order (epochs wrap)."""
    out = []
    for slot in range(start, start + count):
        epoch, position = divmod(slot, len(tasks))
        out.append(tasks[int(task_order(len(tasks), seed, epoch)[position])])
    return out


def tasks_for_step(tasks: Sequence[Any], per_step: int, seed: int, step: int) -> list[Any]:
    """The ``per_step`` tasks of (0-based) ``step`` when no step draws extra tasks."""
    return tasks_at(tasks, seed, step * per_step, per_step)
