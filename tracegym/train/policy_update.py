"""The policy-gradient update of one RL step: score, then ``epochs`` optimizer passes over a batch.

    batch = score_batch(model, reference, batch, loss_cfg, micro_batch_size=4, temperature=1.0, ...)
    metrics = policy_update(model, batch, loss_cfg, optimizer, scheduler, epochs=1, micro_batch_size=4, ...)

``score_batch`` fills what the loss needs beyond the sampled tokens: the trainer's own log-probs of
the old policy (the PPO ratio's denominator and TIS's numerator; skipped when the engine's sampled
log-probs already are the old policy's) and the reference policy's (KL in the loss). The reference
is the LoRA base with the adapter disabled (no second copy) or a frozen copy for full fine-tuning.

``old_from_forward`` (one pass, ``epochs=1``): the old policy is the very weights the single pass
starts from, so its log-probs are the update forward's own, detached (the ratio is exactly 1 in
the trainer's numerics), and re-scoring the whole batch first is a forward pass computed twice.
TRL's GRPOTrainer takes the same shortcut when it makes one pass over a batch. ``score_batch`` then
scores only rows without engine log-probs (LUFFY's shaping reads their probabilities before the
update) and ``policy_update`` sets each micro-batch's ``old_logprobs`` from its forward. Exact
unless a dropout is active in the update (train mode with dropout): ``old_from_forward_is_exact``.

``policy_update`` runs every micro-batch through ``compute_policy_loss`` (the registered loss, then
masks, importance weights, aggregation, KL and entropy terms applied once) with the full batch's
normalisers, so gradient accumulation equals one big batch; then clips gradients and steps the
optimizer and schedule. Every metric a loss returns is logged: token-weighted means over the
micro-batches, except keys ending in ``_min``/``_max`` (reduced with min/max) and ``loss``
(the sum of the micro-batch shares, i.e. the full-batch loss), averaged over the passes.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from tracegym.algos.compose import compute_policy_loss
from tracegym.batch import Batch, merge_microbatch_rows, split_by_computed_tokens, split_microbatches
from tracegym.memory import release_memory
from tracegym.train.logprobs import token_logprobs, token_logprobs_and_entropy
from tracegym.train.optim import clip_gradients
from tracegym.train.precision import needs_train_mode, training_autocast
from tracegym.train.step_prefix import StepPrefix, step_prefix


def batch_logprobs(
    model: torch.nn.Module, batch: Batch, micro_batch_size: int, *, temperature: float = 1.0, disable_adapter: bool = False
) -> torch.Tensor:
    """Log-probs of the batch's target tokens under ``model``, no grad, [B, T]; with
    ``disable_adapter`` those of the LoRA base model (the reference policy)."""
    # scoring needs no whole trajectories (only GSPO's sequence ratio does): plain row parts
    parts = split_microbatches(batch, micro_batch_size, keep_trajectories=False)
    device = next(model.parameters()).device
    context = model.disable_adapter() if disable_adapter else nullcontext()  # type: ignore[operator]
    values = []
    with torch.no_grad(), context:
        # the system prompt every row starts with: once for all parts (tracegym/train/step_prefix.py)
        whole = [(batch.input_ids, batch.attention_mask, batch.first_loss_column)]
        prefix = step_prefix(model, whole) if len(parts) > 1 else None
        for part in parts:
            values.append(token_logprobs(model, part.input_ids.to(device), part.attention_mask.to(device), temperature,
                                         first_column=part.first_loss_column, prefix=prefix))
    return merge_microbatch_rows(batch, parts, values)


def reference_logprobs(
    model: torch.nn.Module, reference: torch.nn.Module | None, batch: Batch, micro_batch_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """Reference-policy log-probs [B, T]: the frozen copy (full fine-tuning) or the LoRA base."""
    if reference is not None:
        return batch_logprobs(reference, batch, micro_batch_size, temperature=temperature)
    return batch_logprobs(model, batch, micro_batch_size, temperature=temperature, disable_adapter=True)


def needs_old_logprobs(batch: Batch, loss_cfg: Any, *, epochs: int, top_p: float, stale: bool = False,
                       mixed_precision: bool = False) -> bool:
    """Whether the trainer must re-score the old policy instead of using the engine's log-probs:
    several passes (the ratio drifts from 1), a loss that compares the two (TIS, decoupled PPO's
    proximal policy), top-p (the engine renormalised over the nucleus, the trainer's softmax does
    not), rows without engine log-probs, a ``stale`` batch (sampled by an older policy version:
    the ratio must start from the weights being updated, not from the sampler's), or a trainer whose
    forward runs under ``model.autocast`` (``mixed_precision``: its log-probs differ from the
    engine's by bfloat16 rounding, which the ratio would read as an update)."""
    return every_row_needs_rescoring(loss_cfg, epochs=epochs, top_p=top_p, stale=stale, mixed_precision=mixed_precision) \
        or not bool(batch.has_engine_logprobs.all())


def every_row_needs_rescoring(loss_cfg: Any, *, epochs: int, top_p: float, stale: bool = False,
                              mixed_precision: bool = False) -> bool:
    """The reasons of ``needs_old_logprobs`` that hold for every row, not only those without engine log-probs."""
    return epochs > 1 or loss_cfg.needs_old_logprobs or top_p < 1.0 or stale or mixed_precision


def score_batch(
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
    batch: Batch,
    loss_cfg: Any,
    *,
    micro_batch_size: int,
    temperature: float,
    epochs: int = 1,
    top_p: float = 1.0,
    stale: bool = False,
    old_from_forward: bool = False,
    sampler_differs: bool = False,
) -> Batch:
    """``batch`` with ``old_logprobs`` (when ``needs_old_logprobs``) and ``ref_logprobs`` (KL in the loss).

    ``sampler_differs``: the engine sampled in other numerics than the trainer's (a bfloat16
    sampling copy, ``HFEngine.sample_dtype_differs``), so its log-probs are not the old policy's.

    ``old_from_forward``: ``policy_update`` takes the old log-probs from its own forward (module doc);
    only rows without engine log-probs are scored here (None when every row has them)."""
    if old_from_forward and epochs != 1:
        raise ValueError(f"old_from_forward needs one pass over the batch (epochs=1), got epochs={epochs}: "
                         "later passes must start from the first pass's log-probs")
    old = None
    # model.autocast or a sampling copy in another dtype: the engine's numerics are not the trainer's
    mixed = sampler_differs or training_autocast(model) is not None
    missing = ~batch.has_engine_logprobs.bool()
    if old_from_forward:
        if bool(missing.any()):
            old = _score_rows(model, batch, torch.nonzero(missing).flatten(), micro_batch_size, temperature)
    elif needs_old_logprobs(batch, loss_cfg, epochs=epochs, top_p=top_p, stale=stale, mixed_precision=mixed):
        if bool(missing.all()) or every_row_needs_rescoring(loss_cfg, epochs=epochs, top_p=top_p, stale=stale,
                                                            mixed_precision=mixed):
            old = batch_logprobs(model, batch, micro_batch_size, temperature=temperature)
        else:  # only some rows lack engine log-probs (e.g. guidance rows): score those alone
            old = _score_rows(model, batch, torch.nonzero(missing).flatten(), micro_batch_size, temperature)
    ref = None
    if loss_cfg.kl_coef > 0 and loss_cfg.kl_penalty == "loss":
        ref = reference_logprobs(model, reference, batch, micro_batch_size, temperature)
    return batch.with_logprobs(old=old, ref=ref)


def _score_rows(model: torch.nn.Module, batch: Batch, rows: torch.Tensor, micro_batch_size: int,
                temperature: float) -> torch.Tensor:
    """[B, T] old log-probs: the trainer's for ``rows`` (scored alone), the engine's elsewhere."""
    if rows.numel() == batch.size:
        return batch_logprobs(model, batch, micro_batch_size, temperature=temperature)
    scored = batch_logprobs(model, batch.select(rows), micro_batch_size, temperature=temperature)
    old = batch.engine_logprobs.clone()
    old[rows] = 0.0
    old[rows, : scored.shape[1]] = scored.to(old.dtype)
    return old


def old_from_forward_is_exact(model: torch.nn.Module, *, epochs: int, train_mode: bool) -> bool:
    """Whether ``policy_update`` may take the old log-probs from its own forward: one pass, and no
    dropout active in it (in train mode a dropout would make the forward's log-probs noisy, not the
    old policy's)."""
    return epochs == 1 and not (train_mode and needs_train_mode(model, False))


def reduce_part_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Micro-batch metrics -> one value each: token-weighted mean (by ``num_tokens``); ``*_min`` /
    ``*_max`` by min / max; ``loss`` summed (each part holds its share of the full-batch loss)."""
    keys = sorted({k for part in parts for k in part if k != "num_tokens"})
    out: dict[str, float] = {}
    for key in keys:
        present = [(p[key], p.get("num_tokens", 1.0)) for p in parts if key in p]
        if key.endswith("_min"):
            out[key] = min(v for v, _ in present)
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in present)
        elif key == "loss":
            out[key] = sum(v for v, _ in present)
        else:
            total = sum(w for _, w in present)
            out[key] = sum(v * w for v, w in present) / total if total else sum(v for v, _ in present) / len(present)
    return out


def replay_nll_backward(model: torch.nn.Module, batch: Batch, coef: float, micro_batch_size: int,
                        prefix: StepPrefix | None = None) -> dict[str, float]:
    """Add ``coef`` x the mean NLL per loss-masked token of ``batch`` to the gradients (backward per
    micro-batch, each part's sum over the whole batch's token count, so the sum is the mean) and
    return ``{"replay_nll": mean NLL}``. The expert-replay term of ``RLConfig.expert_replay``.
    ``prefix``: the step's shared prefix (its ``backward()`` is the caller's, after this)."""
    device = next(model.parameters()).device
    tokens = float(batch.loss_mask.sum().clamp(min=1.0))
    total = 0.0
    for part in split_microbatches(batch, micro_batch_size, keep_trajectories=False):
        part = part.to(device)
        logprobs = token_logprobs(model, part.input_ids, part.attention_mask, 1.0, first_column=part.first_loss_column,
                                  prefix=prefix)
        nll = -(logprobs * part.loss_mask).sum()  # [B, T] -> summed over the part's assistant tokens
        (coef * nll / tokens).backward()
        total += float(nll.detach())
    return {"replay_nll": total / tokens}


def policy_update(
    model: torch.nn.Module,
    batch: Batch,
    loss_cfg: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    epochs: int,
    micro_batch_size: int,
    temperature: float,
    max_grad_norm: float | None,
    train_mode: bool = False,
    micro_batch_tokens: int | None = None,
    replay: tuple[Batch, float] | None = None,
    policy_gradient: bool = True,
    old_from_forward: bool = False,
) -> dict[str, float]:
    """``epochs`` optimizer passes over ``batch``; returns ``train/<metric>`` values (see module doc).

    ``replay``: ``(expert batch, coef)``; each pass adds ``coef`` x its mean NLL per assistant token to
    the gradients before the step (``replay_nll_backward``; PPO-ptx's mix). ``policy_gradient=False``
    skips the policy loss (its forward too): the replay-only ablation of ``expert_replay``.

    ``micro_batch_tokens``: cut micro-batches by the tokens the forward computes (a prefix the rows
    share counted once, ``split_by_computed_tokens``) instead of ``micro_batch_size`` rows.
    ``train_mode``: run the forward passes in train mode (gradient checkpointing recomputes
    activations only there); dropout stays at its configured probability (0 for the built-in models).
    The model is left in eval mode, the mode the engine samples in.
    ``old_from_forward`` (``epochs=1``): each micro-batch's old log-probs are its forward's own,
    detached (module doc), replacing any ``batch.old_logprobs``.
    """
    if old_from_forward and epochs != 1:
        raise ValueError(f"old_from_forward needs epochs=1, got {epochs}")
    device = next(model.parameters()).device
    per_epoch: list[dict[str, float]] = []
    grad_norms: list[float] = []
    lrs: list[float] = []
    model.train(train_mode)
    try:
        for _ in range(epochs):
            optimizer.zero_grad(set_to_none=True)
            parts: list[dict[str, float]] = []
            parts_of_batch = (split_by_computed_tokens(batch, micro_batch_tokens) if micro_batch_tokens
                              else split_microbatches(batch, micro_batch_size,
                                                      keep_trajectories=getattr(loss_cfg, "loss", "") == "gspo"))
            if not policy_gradient:
                parts_of_batch = []
            # the system prompt every row (policy and replay alike) starts with runs once per pass,
            # forward and backward, not once per micro-batch (tracegym/train/step_prefix.py)
            sources = [(batch.input_ids, batch.attention_mask, batch.first_loss_column)] if parts_of_batch else []
            if replay is not None:
                sources.append((replay[0].input_ids, replay[0].attention_mask, replay[0].first_loss_column))
            prefix = step_prefix(model, sources)  # None without sources (no rows that share a prefix)
            for part in parts_of_batch:
                part = part.to(device)
                # entropy comes from the same logits: logged every step, used by entropy bonus / clip
                logprobs, entropy = token_logprobs_and_entropy(model, part.input_ids, part.attention_mask, temperature,
                                                               first_column=part.first_loss_column, prefix=prefix)
                if old_from_forward:  # the weights this pass starts from are the old policy: ratio 1
                    part = part.with_logprobs(old=logprobs.detach())
                loss, metrics = compute_policy_loss(part, logprobs, entropy, loss_cfg)
                loss.backward()
                parts.append(metrics)
            per_epoch.append(reduce_part_metrics(parts) if parts else {})
            if replay is not None:
                per_epoch[-1].update(replay_nll_backward(model, replay[0], replay[1], micro_batch_size, prefix))
            if prefix is not None:
                prefix.backward()  # every part's gradient w.r.t. the prefix, through its forward once
            grad_norms.append(clip_gradients(model.parameters(), max_grad_norm))
            lrs.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
    finally:
        model.eval()
        release_memory()  # the activations just freed go back to the system, not kept for the rollouts
    out: dict[str, float] = {}
    for key in per_epoch[0] if per_epoch else []:
        values = [m[key] for m in per_epoch if key in m]
        reduce = min if key.endswith("_min") else max if key.endswith("_max") else (lambda v: sum(v) / len(v))
        out[f"train/{key}"] = reduce(values)
    if "train/clip_frac_low" in out and "train/clip_frac_high" in out:
        out["train/clip_frac"] = out["train/clip_frac_low"] + out["train/clip_frac_high"]
    if grad_norms:
        out["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["lr"] = lrs[-1]
    return out


__all__ = ["batch_logprobs", "needs_old_logprobs", "old_from_forward_is_exact", "policy_update", "reduce_part_metrics", "reference_logprobs", "replay_nll_backward",
           "score_batch"]
