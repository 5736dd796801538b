"""Supervised fine-tuning on recorded trajectories (``tracegym sft``).

What it does, top to bottom:

1. Load the model (``tracegym.models.load``) and make it trainable: a LoRA adapter or every weight.
2. Read trajectory JSONL files (written by the rollout runner, e.g. scripted expert runs), keep the
   successful ones (optional reward floor), and turn each into ``TrainingExample``s with the
   renderer: the exact token ids the engine saw and sampled, loss mask 1 only on generated tokens.
   A bad line (torn, not JSON, not a trajectory) is skipped with a warning naming ``file:line`` and
   counted (``data/bad_lines``), or stops the run naming it (``data.on_bad_line: error``).
3. Each optimizer step takes ``batch_size`` examples in a seeded order (a pure function of the seed
   and the epoch), splits them into micro-batches, and accumulates gradients of the masked,
   weighted negative log-likelihood normalised by the loss tokens of the whole batch::

       loss = sum_i sum_t w_it * m_it * -log p(x_it | x_i,<t)  /  sum_i sum_t m_it

   so the gradient is the same whatever the micro-batch size.
4. Clip the gradient norm, AdamW step, learning-rate schedule step; log loss, tokens/s, grad norm,
   lr and process RSS to metrics.jsonl / TensorBoard / W&B.
5. Every ``checkpoint.every`` steps (and at the end) save an atomic checkpoint: weights or adapter,
   optimizer, scheduler, RNG states, step and data cursor. ``resume=True`` restores all of it, so
   N/2 steps + resume + N/2 steps give exactly the weights and metrics of N steps straight.
6. Save the model (full fine-tuning) or the adapter (LoRA) with the tokenizer to ``output_dir/final``.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from tracegym.algos.sft import sft_loss
from tracegym.batch import make_batch, split_microbatches
from tracegym.config import SFTConfig, dump_config
from tracegym.data.store import read_trajectories_checked
from tracegym.recipes._run import EpochRun, check_run_dir, epoch_order  # noqa: F401  (epoch_order re-exported)
from tracegym.recipes._run import maybe_checkpoint_epoch, next_in_epoch, optimizer_step, start_epoch_run, stops_here
from tracegym.render import BuildStats, get_renderer
from tracegym.rl.policy import load_policy
from tracegym.train.checkpoint import save_final
from tracegym.train.logging import process_rss_mb
from tracegym.train.logprobs import token_logprobs
from tracegym.train.optim import build_optimizer, build_scheduler
from tracegym.train.result import TrainResult
from tracegym.train.seed import seed_everything
from tracegym.train.step_prefix import step_prefix
from tracegym.types import TrainingExample

log = logging.getLogger(__name__)

_MAX_LISTED_BAD_LINES = 20  # per file; the summary warning gives the total


@dataclass
class SFTData:
    """Training examples and the counts of how they were selected."""

    examples: list[TrainingExample]
    counts: dict[str, int] = field(default_factory=dict)


class SFTResult(TrainResult):
    """What ``train_sft`` returns."""


def load_sft_examples(
    files: Sequence[str | Path],
    renderer: Any,
    max_length: int,
    only_successful: bool = True,
    min_reward: float | None = None,
    on_bad_line: str = "skip",
) -> SFTData:
    """Read trajectories, filter them, build examples; examples longer than ``max_length`` are dropped.

    A bad line of a file (torn, not JSON, or not a trajectory) is left out with a warning naming
    ``file:line`` and counted in ``counts["bad_lines"]`` (``on_bad_line="skip"``), or raises
    ``tracegym.data.store.BadLineError`` naming ``file:line`` (``"error"``).
    """
    counts = {"trajectories": 0, "kept_trajectories": 0, "examples": 0, "dropped_too_long": 0, "loss_tokens": 0,
              "bad_lines": 0}
    stats = BuildStats()
    examples: list[TrainingExample] = []
    for file in files:
        if not Path(file).is_file():
            raise FileNotFoundError(f"trajectory file not found: {file}")
        trajectories, bad_lines = read_trajectories_checked(file, on_bad_line)  # type: ignore[arg-type]
        for problem in bad_lines[:_MAX_LISTED_BAD_LINES]:
            log.warning("skipping bad line %s", problem)
        if bad_lines:
            log.warning("%s: skipped %d bad line(s) of %d (data.on_bad_line: error stops at the first instead)",
                        file, len(bad_lines), len(bad_lines) + len(trajectories))
        counts["bad_lines"] += len(bad_lines)
        for trajectory in trajectories:
            counts["trajectories"] += 1
            if only_successful and not trajectory.success:
                continue
            if min_reward is not None and trajectory.reward < min_reward:
                continue
            if not trajectory.turns:
                continue
            counts["kept_trajectories"] += 1
            for example in renderer.build_examples(trajectory, weight=1.0, stats=stats):
                if len(example) > max_length:
                    counts["dropped_too_long"] += 1
                    continue
                examples.append(example)
                counts["loss_tokens"] += sum(example.loss_mask)
    counts["examples"] = len(examples)
    counts["template_splits"] = stats.splits
    return SFTData(examples, counts)


def _digest(examples: Sequence[TrainingExample]) -> str:
    """Fingerprint of the training data, checked on resume (the cursor is meaningless on other data)."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(np.asarray(ex.input_ids, dtype=np.int64).tobytes())
        h.update(np.asarray(ex.loss_mask, dtype=np.int8).tobytes())
    return h.hexdigest()[:16]


def accumulate_sft_gradients(
    model: torch.nn.Module,
    examples: Sequence[TrainingExample],
    micro_batch_size: int,
    device: torch.device,
    pad_id: int,
) -> dict[str, float]:
    """Forward (and, when grad is enabled, backward) ``examples`` as one batch in micro-batches.

    Every micro-batch loss is normalised by the whole batch's weighted token count
    (``Batch.normalizers``), so the accumulated gradient equals the full-batch gradient.
    Returns the batch loss, its trained tokens and its real (unpadded) tokens.
    """
    batch = make_batch(examples, pad_token_id=pad_id)
    loss_sum = 0.0
    # the system prompt and tool schemas every row starts with run once for the whole batch, not once
    # per micro-batch (tracegym/train/step_prefix.py; None in train mode or without such a prefix)
    prefix = step_prefix(model, [(batch.input_ids, batch.attention_mask, batch.first_loss_column)])
    # rows of similar length share a micro-batch (each part is trimmed to its longest row), so little
    # padding is computed; the sum over parts is the same gradient, whichever rows go together. The
    # token-level SFT loss needs no whole trajectories per part (only sequence-level RL losses do).
    for micro in split_microbatches(batch, micro_batch_size, sort_by_length=True, keep_trajectories=False):
        micro = micro.to(device)
        # [b, T], target-aligned; the output layer runs only from the first trained column on
        logprobs = token_logprobs(model, micro.input_ids, micro.attention_mask, first_column=micro.first_loss_column,
                                  prefix=prefix)
        loss, _ = sft_loss(logprobs, micro.loss_mask, micro.weights, normalizers=micro.normalizers)
        if torch.is_grad_enabled():
            loss.backward()
        loss_sum += float(loss.detach())
    if prefix is not None:
        prefix.backward()  # the micro-batches' gradients w.r.t. the prefix, through its forward once
    return {"loss": loss_sum, "loss_tokens": batch.num_loss_tokens, "tokens": int(batch.attention_mask.sum())}


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, examples: Sequence[TrainingExample], micro_batch_size: int,
                  device: torch.device, pad_id: int) -> dict[str, float]:
    """Weighted mean NLL per trained token over all held-out examples (one batch, micro-batched)."""
    was_training = model.training
    model.eval()
    out = accumulate_sft_gradients(model, examples, micro_batch_size, device, pad_id)
    model.train(was_training)
    return {"eval/loss": out["loss"], "eval/loss_tokens": float(out["loss_tokens"])}


@dataclass(kw_only=True)
class SFTRun(EpochRun):
    """What the SFT loop holds from one step to the next (built by ``prepare_run``): the run state of
    ``EpochRun`` and the data."""

    cfg: SFTConfig
    data: SFTData  # the training files' examples and counts (``examples``: at most ``max_examples`` of them)
    examples: list[TrainingExample]
    eval_examples: list[TrainingExample]


# --- the loop --------------------------------------------------------------------------------------


def train_sft(cfg: SFTConfig, resume: bool = False, stop_at_step: int | None = None) -> SFTResult:
    """Run SFT as ``cfg`` says. ``resume`` continues from the latest checkpoint in ``cfg.output_dir``.

    ``stop_at_step`` returns right after that step with no further save, as if the process had been
    killed there (tests use it; a later ``resume=True`` run continues from the last checkpoint).
    """
    run = prepare_run(cfg, resume)                  # 1-2. model, data, optimizer, schedule, resume
    final_dir = None
    try:
        while run.step < run.total_steps:
            batch = next_in_epoch(run, run.examples)                 # 3. the epoch's seeded order; moves the data cursor
            run.step += 1
            metrics = train_step(run, batch)        # 3-4. accumulate, clip, AdamW step, schedule step
            end_of_step(run, metrics)               # evaluate when due, log
            if stops_here(run.step, stop_at_step, run.total_steps):
                return SFTResult(run.run_dir, None, run.step, run.history)
            maybe_checkpoint(run)                   # 5.
        final_dir = save_final(run.model, run.tokenizer, run.run_dir, {
            "base_model": cfg.model.name, "lora": cfg.lora.enabled, "renderer": cfg.model.renderer or cfg.model.name,
            "recipe": "sft"})
    finally:
        run.progress.close()
        run.logger.close(final_dir)
    return SFTResult(run.run_dir, final_dir, run.step, run.history)


# --- the steps of the loop -------------------------------------------------------------------------


def load_data(cfg: SFTConfig, renderer: Any) -> tuple[SFTData, list[TrainingExample], list[TrainingExample]]:
    """(the training files' data, the examples to train on, the held-out examples)."""
    d = cfg.data
    train = load_sft_examples(d.train_files, renderer, cfg.max_length, d.only_successful, d.min_reward, d.on_bad_line)
    examples = train.examples[: d.max_examples] if d.max_examples else train.examples
    if len(examples) < cfg.batch_size:
        raise ValueError(
            f"{len(examples)} training examples (from {train.counts}) is fewer than batch_size={cfg.batch_size}"
        )
    eval_examples = []
    if d.eval_files:
        eval_examples = load_sft_examples(d.eval_files, renderer, cfg.max_length, d.only_successful, d.min_reward,
                                          d.on_bad_line).examples
    return train, examples, eval_examples


def prepare_run(cfg: SFTConfig, resume: bool) -> SFTRun:
    """Check the files, load the model and the data, build the optimizer and schedule, restore the
    latest checkpoint (``resume``) and log step 0."""
    run_dir = Path(cfg.output_dir)
    missing = [f for f in [*cfg.data.train_files, *cfg.data.eval_files] if not Path(f).is_file()]
    if not cfg.data.train_files or missing:
        raise FileNotFoundError(f"trajectory file(s) not found: {missing}" if missing else "data.train_files is empty")
    check_run_dir(run_dir, resume)
    dump_config(cfg, run_dir)
    seed_everything(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, _ = load_policy(cfg, None, device, train=True)  # no reference: the loss has no KL term
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    renderer = get_renderer(cfg.model.renderer or cfg.model.name, tokenizer)
    train, examples, eval_examples = load_data(cfg, renderer)
    steps_per_epoch = len(examples) // cfg.batch_size  # the last partial batch of an epoch is skipped
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    run = SFTRun(cfg=cfg, run_dir=run_dir, device=device, model=model, tokenizer=tokenizer, pad_id=pad_id, data=train,
                 examples=examples, eval_examples=eval_examples, steps_per_epoch=steps_per_epoch,
                 total_steps=total_steps, data_digest=_digest(examples), optimizer=optimizer, scheduler=scheduler)
    start_epoch_run(run, resume, train.counts, "sft")  # restore the latest checkpoint, row 0, progress bar
    return run


def train_step(run: SFTRun, batch: list[TrainingExample]) -> dict[str, Any]:
    """One optimizer step on ``batch``: gradients accumulated over micro-batches, clipped, AdamW
    step, schedule step; the row's training figures."""
    cfg = run.cfg
    out, grad_norm, lr, elapsed = optimizer_step(
        run, lambda: accumulate_sft_gradients(run.model, batch, cfg.micro_batch_size, run.device, run.pad_id))
    return {"loss": out["loss"], "grad_norm": grad_norm, "lr": lr, "epoch": run.epoch,
            "loss_tokens": out["loss_tokens"], "tokens": out["tokens"],
            "micro_batches": cfg.batch_size // cfg.micro_batch_size,
            "tokens_per_s": out["tokens"] / elapsed, "step_time_s": elapsed, "rss_mb": process_rss_mb()}


def end_of_step(run: SFTRun, metrics: dict[str, Any]) -> None:
    """The held-out loss when due, the logged row, the progress bar."""
    cfg = run.cfg
    if run.eval_examples and ((cfg.eval_every and run.step % cfg.eval_every == 0) or run.step == run.total_steps):
        metrics.update(evaluate_loss(run.model, run.eval_examples, cfg.eval_batch_size, run.device, run.pad_id))
    if run.step % cfg.logging.log_every == 0 or run.step == run.total_steps:
        run.history.append(run.logger.log(run.step, metrics))
    run.progress.update(1, info=f"loss {metrics['loss']:.4f}", tokens=metrics["tokens"])


def maybe_checkpoint(run: SFTRun) -> None:
    """Every ``checkpoint.every`` steps and at the last: weights, optimizer, scheduler and the data
    cursor with what it is only valid for (seed, shuffling, batch size, number of examples, digest)."""
    maybe_checkpoint_epoch(run, num_examples=len(run.examples))
