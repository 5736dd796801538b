"""Preference learning on recorded trajectories (``tracegym dpo``): DPO, DMPO or KTO.

What it does, top to bottom:

1. Resolve the loss (``loss.name`` in ``tracegym.algos.PREFERENCE_LOSSES``) and its options; they say
   whether it trains on pairs (dpo, dmpo) or on labelled single trajectories (kto), and give the
   per-turn weights of the sequence log-probs (DMPO's ``phi_j``; 1 otherwise).
2. Load the policy and the reference: LoRA's base with the adapter disabled (no second copy); a
   frozen copy for full fine-tuning; with ``model.adapter`` (DPO after SFT) a frozen copy with that
   adapter merged, so the reference is the SFT model the policy starts from.
3. Data: pairs or labelled trajectories from a file, or built from rollouts (``build_pairs`` /
   ``label_trajectories``) and written to ``output_dir/pairs.jsonl`` / ``labelled.jsonl``. Every
   trajectory becomes token-exact examples (``build_examples``): loss mask 1 only on sampled tokens,
   the turn's weight on them.
4. Each optimizer step takes ``batch_size`` items in a seeded order (a pure function of the seed and
   the epoch). For KTO the reference point ``z0`` is estimated once on the whole batch (mismatched
   prompt/continuation pairs, no grad). Then per micro-batch: sequence log-probs
   ``l(y) = sum_t m_t w_t log pi(y_t | y_<t)`` under the policy (with grad) and the reference (no
   grad), summed per trajectory; the loss's per-item values, summed and divided by the items of the
   *full* batch, so the accumulated gradient is the full-batch gradient whatever the micro-batch size.
5. Clip, AdamW step, schedule step; log loss, accuracy, reward margin, log-ratios, grad norm, lr.
6. Checkpoints (``checkpoint.every`` and the last step) with the data cursor: ``resume=True`` gives
   exactly the weights and metrics of an uninterrupted run. The adapter (or model) goes to ``final/``.
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from tracegym.algos import PREFERENCE_LOSSES, kto_reference_point, preference_loss_options, sequence_logps
from tracegym.algos.preference_inputs import LabelledLogps, PairLogps, PreferenceOptions
from tracegym.batch import make_batch
from tracegym.config import DPOConfig, dump_config
from tracegym.data.pairs import (
    LabelledTrajectory,
    PreferencePair,
    build_pairs,
    label_trajectories,
    pairs_to_labelled,
    read_labelled,
    read_pairs,
    write_labelled,
    write_pairs,
)
from tracegym.data.store import read_trajectories_checked
from tracegym.recipes._run import EpochRun, check_run_dir, maybe_checkpoint_epoch, next_in_epoch, optimizer_step
from tracegym.recipes._run import start_epoch_run, stops_here
from tracegym.render import get_renderer
from tracegym.rl.policy import load_policy
from tracegym.train.checkpoint import save_final
from tracegym.train.logging import process_rss_mb
from tracegym.train.logprobs import token_logprobs
from tracegym.train.optim import build_optimizer, build_scheduler
from tracegym.train.result import TrainResult
from tracegym.train.seed import seed_everything
from tracegym.types import Trajectory, TrainingExample

log = logging.getLogger(__name__)


class DPOResult(TrainResult):
    """What ``train_dpo`` returns."""


@dataclass(frozen=True)
class TrajectoryTokens:
    """One trajectory as the model scores it: its examples (several when the template rewrote
    history) and its first prompt (KTO's mismatched pairs swap it)."""

    examples: tuple[TrainingExample, ...]
    first_prompt: tuple[int, ...]


@dataclass(frozen=True)
class PreferenceItem:
    """One training item: a pair (``sequences`` = chosen, rejected) or a labelled trajectory (one)."""

    sequences: tuple[TrajectoryTokens, ...]
    desirable: bool = True


@dataclass
class PreferenceData:
    """Training items and the counts of how they were made."""

    items: list[PreferenceItem]
    counts: dict[str, int] = field(default_factory=dict)


# --- loss and data ---------------------------------------------------------------------------------


def resolve_loss(cfg: DPOConfig) -> PreferenceOptions:
    """The options of ``cfg.loss.name`` from the loss section (``ValueError`` naming ``loss.name`` or
    the bad option when the name is unknown or a value is invalid)."""
    import pydantic

    values = cfg.loss.model_dump()
    try:
        return preference_loss_options(cfg.loss.name, values)
    except KeyError as exc:
        raise ValueError(f"bad value for 'loss.name': {exc.args[0]}") from None
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"bad value for 'loss.{'.'.join(map(str, first['loc']))}': {first['msg']}") from None


def _read_rollouts(files: Sequence[str]) -> list[Trajectory]:
    trajectories: list[Trajectory] = []
    for file in files:
        if not Path(file).is_file():
            raise FileNotFoundError(f"rollouts file not found: {file}")
        found, bad_lines = read_trajectories_checked(file, "skip")
        if bad_lines:
            log.warning("%s: skipped %d bad line(s), the first: %s", file, len(bad_lines), bad_lines[0])
        trajectories.extend(found)
    return trajectories


def load_preference_records(cfg: DPOConfig, opts: PreferenceOptions, run_dir: Path) -> tuple[list[Any], dict[str, int]]:
    """Pairs (``opts.data == "pairs"``) or labelled trajectories, from the configured source; what was
    built from rollouts is written into ``run_dir`` for inspection. Returns them and their counts."""
    d, counts = cfg.data, {}
    if not (d.pairs_file or d.labelled_file or d.rollouts_files):
        raise ValueError("no data: set data.pairs_file, data.labelled_file (kto) or data.rollouts_files")
    if opts.data == "pairs":
        if d.labelled_file:
            raise ValueError(f"loss {cfg.loss.name} trains on pairs; data.labelled_file holds labelled trajectories "
                             "(kto): give data.pairs_file or data.rollouts_files")
        if d.pairs_file:
            return read_pairs(d.pairs_file), counts
        pairs = build_pairs(_read_rollouts(d.rollouts_files), d.min_gap, d.truncate_at_divergence, d.max_pairs_per_task,
                            counts=counts)
        write_pairs(run_dir / "pairs.jsonl", pairs)
        return pairs, counts
    if d.labelled_file:
        return read_labelled(d.labelled_file), counts
    if d.pairs_file:
        return pairs_to_labelled(read_pairs(d.pairs_file)), counts
    labelled = label_trajectories(_read_rollouts(d.rollouts_files), d.desirable_min_reward)
    write_labelled(run_dir / "labelled.jsonl", labelled)
    return labelled, counts


def _sequence(trajectory: Trajectory, renderer: Any, opts: PreferenceOptions) -> TrajectoryTokens:
    weights = opts.turn_weights(len(trajectory.turns))  # DMPO's phi_j per turn; 1 otherwise
    return TrajectoryTokens(tuple(renderer.build_examples(trajectory, weight=weights)), tuple(trajectory.turns[0].prompt_ids))


def preference_items(records: Sequence[Any], renderer: Any, opts: PreferenceOptions, max_length: int) -> PreferenceData:
    """Records (``PreferencePair`` / ``LabelledTrajectory``) -> token-exact items; an item with an
    example longer than ``max_length`` tokens, or a trajectory without turns, is dropped and counted."""
    counts = {"items": 0, "dropped_too_long": 0, "dropped_no_turns": 0, "desirable": 0, "undesirable": 0, "loss_tokens": 0}
    items: list[PreferenceItem] = []
    for record in records:
        if isinstance(record, PreferencePair):
            trajectories, desirable = [record.chosen, record.rejected], True
        elif isinstance(record, LabelledTrajectory):
            trajectories, desirable = [record.trajectory], record.desirable
        else:
            raise TypeError(f"not a PreferencePair or LabelledTrajectory: {type(record).__name__}")
        if not all(t.turns for t in trajectories):
            counts["dropped_no_turns"] += 1
            continue
        item = PreferenceItem(tuple(_sequence(t, renderer, opts) for t in trajectories), desirable=desirable)
        if any(len(ex) > max_length for seq in item.sequences for ex in seq.examples):
            counts["dropped_too_long"] += 1
            continue
        items.append(item)
        counts["desirable" if item.desirable else "undesirable"] += 1
        counts["loss_tokens"] += sum(sum(ex.loss_mask) for seq in item.sequences for ex in seq.examples)
    counts["items"] = len(items)
    return PreferenceData(items, counts)


def _digest(items: Sequence[PreferenceItem]) -> str:
    """Fingerprint of the training data (tokens, masks, turn weights, labels), checked on resume."""
    h = hashlib.sha256()
    for item in items:
        h.update(b"+" if item.desirable else b"-")
        for seq in item.sequences:
            h.update(b"|")
            for ex in seq.examples:
                h.update(np.asarray(ex.input_ids, dtype=np.int64).tobytes())
                h.update(np.asarray(ex.loss_mask, dtype=np.int8).tobytes())
                h.update(np.asarray(ex.weights, dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


# --- sequence log-probs ------------------------------------------------------------------------------


def _examples_and_owners(sequences: Sequence[TrajectoryTokens]) -> tuple[list[TrainingExample], list[int]]:
    examples, owners = [], []
    for index, seq in enumerate(sequences):
        examples.extend(seq.examples)
        owners.extend([index] * len(seq.examples))
    return examples, owners


def score_sequences(
    model: torch.nn.Module, sequences: Sequence[TrajectoryTokens], device: torch.device, pad_id: int
) -> tuple[torch.Tensor, int]:
    """Sequence log-probs ``sum_t m_t w_t log pi(y_t | y_<t)`` [S] of ``sequences`` in one forward
    pass (gradient when enabled), and the real tokens of that pass."""
    examples, owners = _examples_and_owners(sequences)
    batch = make_batch(examples, pad_token_id=pad_id).to(device)
    # [B, T] target-aligned; the output layer runs only from the first trained column on
    logps = token_logprobs(model, batch.input_ids, batch.attention_mask, first_column=batch.first_loss_column)
    owner = torch.tensor(owners, dtype=torch.long, device=device)[batch.example_ids]  # [B] trajectory of each row
    scores = sequence_logps(logps, batch.loss_mask, batch.weights, owner, num_owners=len(sequences))  # [S]
    return scores, int(batch.attention_mask.sum())


@contextmanager
def reference_policy(model: torch.nn.Module, reference: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The reference to score with, under ``no_grad``: ``reference`` (a frozen copy), else ``model``
    with its LoRA adapter disabled (the base)."""
    with torch.no_grad():
        if reference is not None:
            yield reference
        else:
            with model.disable_adapter():  # type: ignore[operator]
                yield model


def _task_part(prompt: tuple[int, ...], other: tuple[int, ...]) -> int:
    """Length of ``prompt`` without the suffix it shares with ``other`` (the generation prompt and
    whatever else both end with): ``prompt[:n]`` is the system text plus this trajectory's task."""
    shared_prefix = 0
    for a, b in zip(prompt, other):
        if a != b:
            break
        shared_prefix += 1
    suffix = 0
    limit = min(len(prompt), len(other)) - shared_prefix  # the suffix never overlaps the shared prefix
    while suffix < limit and prompt[-1 - suffix] == other[-1 - suffix]:
        suffix += 1
    return len(prompt) - suffix


def mismatched_sequence(prompt_from: TrajectoryTokens, continuation_from: TrajectoryTokens) -> TrajectoryTokens:
    """KTO's ``(x, y')``: the task of one trajectory (``x``, from its first prompt) followed by another
    trajectory's whole continuation ``y'`` (every example of it, masks and weights kept).

    A template that rewrote history (Qwen3's) splits ``y'`` into several examples, each starting with
    its own re-rendered history; all of them count, else ``z0`` would come from a truncated ``y'``.
    In each, the task part of ``y'``'s first prompt (its first prompt minus the suffix the two first
    prompts share, e.g. the generation prompt, which a re-rendered history may show differently) is
    replaced by ``x``'s. For the first example this is ``x + y'[len(x'):]``.

    Raises ``ValueError`` when an example of ``y'`` does not start with that task part, or trains on a
    token inside it (a renderer whose history rewrites the task itself)."""
    old_prompt, new_prompt = continuation_from.first_prompt, prompt_from.first_prompt
    old_task = old_prompt[: _task_part(old_prompt, new_prompt)]
    new_task = new_prompt[: _task_part(new_prompt, old_prompt)]
    cut, added = len(old_task), len(new_task)
    examples = []
    for example in continuation_from.examples:
        if example.input_ids[:cut] != old_task or any(example.loss_mask[:cut]):
            raise ValueError(
                f"KTO mismatched pair: example {example.source!r} does not start with its trajectory's first prompt "
                "(up to the generation prompt) as untrained context, so the other task cannot be swapped in"
            )
        ids = new_task + example.input_ids[cut:]
        examples.append(TrainingExample(
            input_ids=ids, loss_mask=(0,) * added + example.loss_mask[cut:],
            weights=(0.0,) * added + example.weights[cut:], advantages=(0.0,) * len(ids), logprobs=(0.0,) * len(ids),
            source=f"{example.source}:mismatched",
        ))
    return TrajectoryTokens(tuple(examples), new_prompt)


def batch_reference_point(model: torch.nn.Module, reference: torch.nn.Module | None, items: Sequence[PreferenceItem],
                          micro_batch_size: int, device: torch.device, pad_id: int) -> torch.Tensor:
    """KTO's ``z0`` for a batch: ``max(0, mean(l_pi - l_ref))`` over the mismatched pairs
    (prompt of item ``i``, continuation of item ``i - 1``), no grad, micro-batched."""
    sequences = [mismatched_sequence(items[i].sequences[0], items[i - 1].sequences[0]) for i in range(len(items))]
    policy, ref = [], []
    with torch.no_grad():
        for start in range(0, len(sequences), micro_batch_size):
            part = sequences[start:start + micro_batch_size]
            policy.append(score_sequences(model, part, device, pad_id)[0])
            with reference_policy(model, reference) as scorer:
                ref.append(score_sequences(scorer, part, device, pad_id)[0])
    return kto_reference_point(torch.cat(policy), torch.cat(ref))


def accumulate_preference_gradients(
    model: torch.nn.Module, reference: torch.nn.Module | None, items: Sequence[PreferenceItem], loss_name: str,
    opts: PreferenceOptions, micro_batch_size: int, device: torch.device, pad_id: int,
) -> dict[str, float]:
    """Forward (and, with grad enabled, backward) ``items`` as one batch in micro-batches.

    Each micro-batch adds ``sum(per-item loss) / len(items)``: the parts sum to the full-batch mean
    and so do their gradients. Metrics come from one call of the loss on the whole batch's
    (detached) log-probs, so they do not depend on the micro-batch size either.
    """
    entry = PREFERENCE_LOSSES.entry(loss_name)
    z0 = batch_reference_point(model, reference, items, micro_batch_size, device, pad_id) if opts.data == "labelled" else None
    parts: list[Any] = []
    loss_sum, tokens = 0.0, 0
    for start in range(0, len(items), micro_batch_size):
        chunk = items[start:start + micro_batch_size]
        sequences = [seq for item in chunk for seq in item.sequences]  # pairs: chosen, rejected, chosen, ...
        policy, n_tokens = score_sequences(model, sequences, device, pad_id)  # [S], with grad
        with reference_policy(model, reference) as scorer:
            ref, _ = score_sequences(scorer, sequences, device, pad_id)  # [S]
        if opts.data == "pairs":
            inputs: Any = PairLogps(policy[0::2], policy[1::2], ref[0::2], ref[1::2])  # each [P]
        else:
            desirable = torch.tensor([item.desirable for item in chunk], dtype=torch.bool, device=device)
            inputs = LabelledLogps(policy, ref, desirable, z0)  # type: ignore[arg-type]
        per_item, _ = entry(inputs, opts)  # [P] or [N]
        loss = per_item.sum() / len(items)
        if torch.is_grad_enabled():
            loss.backward()
        loss_sum += float(loss.detach())
        tokens += n_tokens
        parts.append(type(inputs).cat([inputs]))  # detached: the graph is freed after backward
    with torch.no_grad():
        _, metrics = entry(type(parts[0]).cat(parts), opts)
    return {"loss": loss_sum, **metrics, "tokens": tokens}


# --- the loop -------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class DPORun(EpochRun):
    """What the preference loop holds from one step to the next (built by ``prepare_run``): the run
    state of ``EpochRun``, the loss's options, the reference and the items."""

    cfg: DPOConfig
    opts: PreferenceOptions
    reference: torch.nn.Module | None  # None: the LoRA base with the adapter disabled
    items: list[PreferenceItem]


def train_dpo(cfg: DPOConfig, resume: bool = False, stop_at_step: int | None = None) -> DPOResult:
    """Run preference learning as ``cfg`` says; ``resume`` continues from the latest checkpoint.

    ``stop_at_step`` returns right after that step with no further save, as if killed there (tests).
    """
    run = prepare_run(cfg, resume)                  # 1-3. loss, policy and reference, data, resume
    final_dir = None
    try:
        while run.step < run.total_steps:
            batch = next_in_epoch(run, run.items)                 # 4. the epoch's seeded order; moves the data cursor
            run.step += 1
            metrics = train_step(run, batch)        # 4-5. (KTO's z0,) accumulate, clip, AdamW, schedule
            if run.step % cfg.logging.log_every == 0 or run.step == run.total_steps:
                run.history.append(run.logger.log(run.step, metrics))
            run.progress.update(1, info=f"loss {metrics['loss']:.4f} acc {metrics.get('accuracy', float('nan')):.2f}",
                                tokens=metrics["tokens"])
            if stops_here(run.step, stop_at_step, run.total_steps):
                return DPOResult(run.run_dir, None, run.step, run.history)
            maybe_checkpoint(run)                   # 6.
        final_dir = save_final(run.model, run.tokenizer, run.run_dir, {
            "base_model": cfg.model.name, "lora": cfg.lora.enabled, "renderer": cfg.model.renderer or cfg.model.name,
            "recipe": "dpo", "loss": cfg.loss.name})
    finally:
        run.progress.close()
        run.logger.close(final_dir)
    return DPOResult(run.run_dir, final_dir, run.step, run.history)


# --- the steps of the loop -------------------------------------------------------------------------


def check_kto_balance(opts: PreferenceOptions, counts: dict[str, int]) -> None:
    """Warn when ``lambda_d * n_desirable / (lambda_u * n_undesirable)`` is outside the KTO paper's [1, 4/3]."""
    n_d, n_u = counts["desirable"], counts["undesirable"]
    lam_d, lam_u = getattr(opts, "lambda_d", 1.0), getattr(opts, "lambda_u", 1.0)
    balance = lam_d * n_d / (lam_u * n_u) if n_u else float("inf")
    if not 1.0 <= balance <= 4 / 3:
        log.warning("KTO: lambda_d * n_desirable / (lambda_u * n_undesirable) = %.3g (%d desirable, %d undesirable); "
                    "the KTO paper advises [1, 4/3]: adjust loss.lambda_d / loss.lambda_u", balance, n_d, n_u)


def prepare_run(cfg: DPOConfig, resume: bool) -> DPORun:
    """Resolve the loss, read or build the records, load the policy and reference, make the items,
    build the optimizer and schedule, restore the latest checkpoint (``resume``) and log step 0."""
    run_dir = Path(cfg.output_dir)
    opts = resolve_loss(cfg)  # a bad loss name or option fails before anything loads
    check_run_dir(run_dir, resume)
    records, build_counts = load_preference_records(cfg, opts, run_dir)
    dump_config(cfg, run_dir)
    seed_everything(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # the reference is the policy at step 0 (so the first loss is log 2): after SFT the SFT model, not the
    # bare base; None: the LoRA base with the adapter disabled
    model, tokenizer, reference = load_policy(cfg, None, device, reference=True, train=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    renderer = get_renderer(cfg.model.renderer or cfg.model.name, tokenizer)
    data = preference_items(records, renderer, opts, cfg.max_length)
    items = data.items
    unit = "pairs" if opts.data == "pairs" else "labelled trajectories"
    if len(items) < cfg.batch_size:
        raise ValueError(f"{len(items)} {unit} (from {build_counts or len(records)}, {data.counts}) is fewer than "
                         f"batch_size={cfg.batch_size}")
    if opts.data == "labelled":
        check_kto_balance(opts, data.counts)
    steps_per_epoch = len(items) // cfg.batch_size  # the last partial batch of an epoch is skipped
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    run = DPORun(cfg=cfg, opts=opts, run_dir=run_dir, device=device, model=model, tokenizer=tokenizer,
                 reference=reference, pad_id=pad_id, items=items, steps_per_epoch=steps_per_epoch,
                 total_steps=total_steps, data_digest=_digest(items), optimizer=optimizer, scheduler=scheduler)
    # restore the latest checkpoint, row 0, progress bar
    start_epoch_run(run, resume, {**build_counts, **data.counts}, cfg.loss.name)
    return run


def train_step(run: DPORun, batch: list[PreferenceItem]) -> dict[str, Any]:
    """One optimizer step on ``batch``: the loss's gradients accumulated over micro-batches, clipped,
    AdamW step, schedule step; the row's training figures."""
    cfg = run.cfg
    out, grad_norm, lr, elapsed = optimizer_step(run, lambda: accumulate_preference_gradients(
        run.model, run.reference, batch, cfg.loss.name, run.opts, cfg.micro_batch_size, run.device, run.pad_id))
    return {**out, "grad_norm": grad_norm, "lr": lr, "epoch": run.epoch, "items": len(batch),
            "micro_batches": cfg.batch_size // cfg.micro_batch_size, "tokens_per_s": out["tokens"] / elapsed,
            "step_time_s": elapsed, "rss_mb": process_rss_mb()}


def maybe_checkpoint(run: DPORun) -> None:
    """Every ``checkpoint.every`` steps and at the last: weights, optimizer, scheduler and the data
    cursor with what it is only valid for (seed, shuffling, batch size, number of items, digest)."""
    maybe_checkpoint_epoch(run, num_items=len(run.items))
