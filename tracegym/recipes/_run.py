"""Scaffolding the recipe loops share: a run folder that is fresh unless resumed; the metrics log, row 0
and the progress bar; the tasks of an env-driven run and the check that a resumed run trains on the same
ones; the row's step times; the early stop tests use. And the run state of the recipes that train on a
fixed dataset (SFT, DPO/KTO): each epoch's seeded order, the next batch in it, the cursor restored from
a checkpoint (refused when the data, seed, batch size or shuffling differ) and saved with one, the
optimizer step, and the start of such a run (resume, row 0, progress bar)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch

from tracegym.memory import release_memory
from tracegym.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from tracegym.train.logging import MetricsLogger, ProgressBar, process_rss_mb
from tracegym.train.lora import count_parameters
from tracegym.train.optim import clip_gradients

__all__ = [
    "EpochRun",
    "check_resumed_tasks",
    "check_run_dir",
    "epoch_order",
    "maybe_checkpoint_epoch",
    "next_in_epoch",
    "optimizer_step",
    "restore_epoch_cursor",
    "split_tasks",
    "start_epoch_run",
    "start_logging",
    "step_times",
    "stops_here",
]

T = TypeVar("T")


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A run folder holding checkpoints is only continued on purpose (``--resume``)."""
    if not resume and list_checkpoints(run_dir):
        raise FileExistsError(f"{run_dir} already holds checkpoints: pass --resume to continue, or pick another output_dir")


def start_logging(run: Any, resume: bool, total_steps: int, label: str, log_start: Callable[[], None]) -> None:
    """Open ``run``'s metrics log (``run.logger``: metrics.jsonl and the trackers of ``cfg.logging.backends``,
    with the config; continued after ``run.step`` when resumed), write row 0 with ``log_start()`` when the
    run starts fresh, and start the progress bar named ``label`` (``run.progress``)."""
    cfg = run.cfg
    run.logger = MetricsLogger(run.run_dir, settings=cfg.logging, config=cfg.model_dump(mode="json"),
                               resume_step=run.step if resume else None)
    if run.step == 0:
        log_start()
    run.progress = ProgressBar(total_steps, label, enabled=cfg.logging.progress, completed=run.step)


def split_tasks(cfg: Any, probe: Any) -> tuple[list[Any], list[Any]]:
    """(train tasks, test tasks) of ``cfg.tasks`` from the env ``probe``, which is closed after."""
    train_tasks = probe.tasks("train", cfg.tasks.train, cfg.tasks.seed)
    test_tasks = probe.tasks("test", cfg.tasks.test, cfg.tasks.seed) if cfg.tasks.test else []
    probe.close()
    return train_tasks, test_tasks


def check_resumed_tasks(restored: Any, cfg: Any, train_tasks: Sequence[Any]) -> None:
    """A checkpoint trained on other tasks (another seed or count) is not resumed on this config."""
    saved = restored.state.get("tasks", {})
    if saved.get("seed") != cfg.tasks.seed or saved.get("train") != len(train_tasks):
        raise ValueError(f"{restored.path} was trained on other tasks (seed or count differ); cannot resume on this config")


def step_times(t_start: float, t_train: float) -> dict[str, float]:
    """The row's times of the update (since ``t_train``) and of the whole step (since ``t_start``), and
    the process RSS."""
    return {"time/train_s": time.perf_counter() - t_train, "time/step_s": time.perf_counter() - t_start,
            "rss_mb": process_rss_mb()}


def stops_here(step: int, stop_at_step: int | None, total_steps: int) -> bool:
    """Whether a loop returns now without saving, as if killed after ``stop_at_step`` (tests use it): that
    step is reached and is not the last."""
    return stop_at_step is not None and step >= stop_at_step and step < total_steps


# --- the recipes on a fixed dataset (SFT, DPO/KTO) ---------------------------------------------------


@dataclass(kw_only=True)
class EpochRun:
    """What a fixed-dataset loop holds from one step to the next; each recipe adds its data."""

    cfg: Any
    run_dir: Path
    device: torch.device
    model: torch.nn.Module
    tokenizer: Any
    pad_id: int
    steps_per_epoch: int
    total_steps: int
    data_digest: str
    optimizer: Any
    scheduler: Any
    logger: MetricsLogger = None  # type: ignore[assignment]  (set by start_epoch_run)
    progress: ProgressBar = None  # type: ignore[assignment]
    step: int = 0
    epoch: int = 0
    position: int = 0  # batches of ``epoch`` already trained
    history: list[dict[str, Any]] = field(default_factory=list)


def epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The example order of one epoch: a pure function of (seed, epoch), so resume needs no RNG state."""
    if not shuffle:
        return np.arange(num_examples)
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def next_in_epoch(run: EpochRun, items: Sequence[T]) -> list[T]:
    """The next ``cfg.batch_size`` items in the epoch's seeded order (a new epoch, a new order); moves
    ``run``'s cursor (``epoch``, ``position``: batches of the epoch done)."""
    cfg = run.cfg
    if run.position == run.steps_per_epoch:  # epoch done: the next one has its own order
        run.epoch, run.position = run.epoch + 1, 0
    order = epoch_order(len(items), cfg.seed, run.epoch, cfg.data.shuffle)
    batch = [items[i] for i in order[run.position * cfg.batch_size:(run.position + 1) * cfg.batch_size]]
    run.position += 1
    return batch


def restore_epoch_cursor(run: EpochRun) -> None:
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


def start_epoch_run(run: EpochRun, resume: bool, counts: dict[str, Any], label: str) -> None:
    """Restore the latest checkpoint (``resume``), open the metrics log, write row 0 of a fresh run
    (parameter counts and ``counts`` as ``data/*``) and start the progress bar named ``label``."""
    if resume:
        restore_epoch_cursor(run)

    def log_start() -> None:
        trainable, total = count_parameters(run.model)
        run.logger.log(0, {"params/trainable": trainable, "params/total": total,
                           **{f"data/{k}": v for k, v in counts.items()}})

    start_logging(run, resume, run.total_steps, label, log_start)


def optimizer_step(run: EpochRun,
                   accumulate: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float, float, float]:
    """One optimizer step: gradients zeroed, ``accumulate()`` (which backpropagates the batch in
    micro-batches), clipped, AdamW step, schedule step. Returns what ``accumulate`` returned, the
    gradient norm, the lr the step used and its seconds."""
    started = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)
    out = accumulate()
    grad_norm = clip_gradients(run.model.parameters(), run.cfg.optim.max_grad_norm)
    lr = run.scheduler.get_last_lr()[0]  # the lr this step uses
    run.optimizer.step()
    run.scheduler.step()
    # the step's activations go back to the system: rows of other lengths every step otherwise leave
    # freed pages behind, and the resident set crept from 4.5 to 5.6 GB over the demo's 96 SFT steps
    release_memory()
    return out, grad_norm, lr, time.perf_counter() - started


def maybe_checkpoint_epoch(run: EpochRun, **data_size: int) -> None:
    """Every ``checkpoint.every`` steps and at the last: weights, optimizer, scheduler and the data
    cursor (epoch, position) with what it is only valid for (seed, shuffling, batch size, the data's
    size, e.g. ``num_examples=...``, and digest)."""
    cfg = run.cfg
    if (cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0) or run.step == run.total_steps:
        state = {"data": {"epoch": run.epoch, "position": run.position, "seed": cfg.seed, "shuffle": cfg.data.shuffle,
                          "batch_size": cfg.batch_size, **data_size, "digest": run.data_digest}}
        save_checkpoint(run.run_dir, run.step, run.model, run.optimizer, run.scheduler, state,
                        keep_last=cfg.checkpoint.keep_last)
