"""Scaffolding the recipe loops share: a run folder that is fresh unless resumed, and the epoch
cursor of the recipes that train on a fixed dataset (SFT, DPO/KTO): each epoch's seeded order, the
next batch in it, and the cursor restored from a checkpoint (refused when the data, seed, batch size
or shuffling differ)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, TypeVar

import numpy as np

from tracegym.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint

__all__ = ["check_run_dir", "epoch_order", "next_in_epoch", "restore_epoch_cursor"]

T = TypeVar("T")


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A run folder holding checkpoints is only continued on purpose (``--resume``)."""
    if not resume and list_checkpoints(run_dir):
        raise FileExistsError(f"{run_dir} already holds checkpoints: pass --resume to continue, or pick another output_dir")


def epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The example order of one epoch: a pure function of (seed, epoch), so resume needs no RNG state."""
    if not shuffle:
        return np.arange(num_examples)
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def next_in_epoch(run: Any, items: Sequence[T]) -> list[T]:
    """The next ``cfg.batch_size`` items in the epoch's seeded order (a new epoch, a new order);
    ``run`` holds ``cfg``, ``epoch``, ``position`` (batches of the epoch done) and ``steps_per_epoch``."""
    cfg = run.cfg
    if run.position == run.steps_per_epoch:  # epoch done: the next one has its own order
        run.epoch, run.position = run.epoch + 1, 0
    order = epoch_order(len(items), cfg.seed, run.epoch, cfg.data.shuffle)
    batch = [items[i] for i in order[run.position * cfg.batch_size:(run.position + 1) * cfg.batch_size]]
    run.position += 1
    return batch


def restore_epoch_cursor(run: Any) -> None:
    """Weights, optimizer, schedule, step and data cursor from the latest checkpoint of ``run.run_dir``
    (if any); one trained on other data, seed, batch size or shuffling is refused."""
    cfg = run.cfg
    checkpoint = latest_checkpoint(run.run_dir)
    if checkpoint is None:
        return
    restored = load_checkpoint(checkpoint, run.model, run.optimizer, run.scheduler)
    cursor = restored.state["data"]
    same = (cursor["digest"], cursor["seed"], cursor["batch_size"], cursor["shuffle"]) == (
        run.data_digest, cfg.seed, cfg.batch_size, cfg.data.shuffle)
    if not same:
        raise ValueError(f"{checkpoint} was trained on other data, seed, batch size or shuffling; cannot resume")
    run.step, run.epoch, run.position = restored.step, cursor["epoch"], cursor["position"]
    print(f"resumed from {checkpoint} (step {run.step}, epoch {run.epoch}, batch {run.position})")
