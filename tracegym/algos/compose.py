"""``compute_policy_loss``: the one entry point the RL recipe calls per micro-batch.

A registered policy loss only computes its per-token loss ``l`` [B, T] (``LossInputs`` in,
unmasked, unweighted, not aggregated). This composition does the shared work once, for every loss::

    old  = batch.old_logprobs, else batch.engine_logprobs
    w    = min(exp(old - engine), tis_cap)                     [tis_cap set; else 1]
    l    = loss(LossInputs(logprobs, old, advantages, ..., behaviour_logprobs=batch.engine_logprobs))
    loss = aggregate(m * s * w * l)
         + kl_coef * aggregate(m * s * kl_estimator(logprobs, ref_logprobs))     [kl_penalty == "loss"]
         - entropy_coef * aggregate(m * s * entropy)                             [entropy_coef > 0]

Every term uses ``cfg.aggregation`` with the batch's full-batch ``LossNormalizers``, so the
micro-batch losses (and gradients) add up to the full-batch ones. Every loss also receives the
sampler's log-probs (``LossInputs.behaviour_logprobs``, with the rows that have them): a loss that
corrects for the sampling policy itself (``decoupled_ppo``, ``pi_prox / pi_behav``) reads them
there, and its options model says so with class flags read here and by ``PolicyLossConfig``:
``needs_old_logprobs`` (trainer-recomputed ``old_logprobs`` are required, never the engine's
fallback) and ``applies_behaviour_weights`` (``tis_cap`` would weigh by the same ratio twice, so the
config refuses it). TIS weights ``w`` multiply the policy term only; the batch's sample weights
``s`` (``batch.weights``: 1 on every sampled token, or an estimator's per-turn weights such as a
tree's ``1/|L(n)|``) weigh every term as data, counts included (``tracegym.algos.aggregation``).
This module knows the batch only through ``PolicyLossBatch`` (the fields it reads), so
``tracegym.batch`` can import ``tracegym.algos`` without a cycle.
"""

from __future__ import annotations

from typing import Callable, Protocol

from torch import Tensor

from tracegym.algos.aggregation import LossNormalizers, aggregate, masked_mean
from tracegym.algos.config import PolicyLossConfig
from tracegym.algos.kl import kl_per_token
from tracegym.algos.loss_inputs import LossInputs
from tracegym.algos.registry import POLICY_LOSSES
from tracegym.algos.tis import truncated_importance_weights


class PolicyLossBatch(Protocol):
    """The fields of a (micro-)batch ``compute_policy_loss`` reads (``tracegym.batch.Batch`` has them);
    all tensors [B, T] target-aligned unless said otherwise."""

    loss_mask: Tensor
    """1 on trained tokens."""
    advantages: Tensor
    """Per-token advantages."""
    engine_logprobs: Tensor
    """The sampling engine's log-probs (0 where unknown); also handed to the loss as
    ``LossInputs.behaviour_logprobs``."""
    has_engine_logprobs: Tensor
    """[B] bool: rows whose engine log-probs are known."""
    normalizers: LossNormalizers
    """Denominators of the full batch. (Optional, read with ``getattr``: ``weights`` [B, T], the
    per-token sample weights, 1 on sampled tokens unless the estimator set per-turn weights;
    ``trajectory_ids`` [B], rows of one trajectory share it and form one sequence of the sequence
    aggregations and of GSPO's ratio; ``trajectory_rest_sizes`` [B], ``sum m * weights`` of the
    row's trajectory outside the row in the full batch. ``tracegym.batch.Batch`` has all three.)"""
    old_logprobs: Tensor | None
    """The trainer's log-probs before the update, or None."""
    ref_logprobs: Tensor | None
    """The reference policy's log-probs (for the KL term), or None."""


def _check_shapes(mask: Tensor, logprobs: Tensor, entropy: Tensor | None, cfg: PolicyLossConfig) -> None:
    """Refuse ``logprobs`` / ``entropy`` not shaped like the loss mask, and a missing entropy that
    ``entropy_coef`` needs."""
    if logprobs.shape != mask.shape:
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)} but the batch's loss mask is {tuple(mask.shape)}")
    if entropy is not None and entropy.shape != mask.shape:
        raise ValueError(f"entropy has shape {tuple(entropy.shape)} but the batch's loss mask is {tuple(mask.shape)}")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the token entropy; pass it from token_logprobs_and_entropy")


def _reducer(batch_part: PolicyLossBatch, cfg: PolicyLossConfig) -> Callable[..., Tensor]:
    """``reduce(per_token, token_weights=None)``: a per-token term aggregated with ``cfg.aggregation``
    over the batch's full-batch normalizers, sample weights and trajectories."""
    mask = batch_part.loss_mask
    normalizers = batch_part.normalizers
    sample_weights = getattr(batch_part, "weights", None)
    trajectory_ids: Tensor | None = getattr(batch_part, "trajectory_ids", None)  # [B] or None: a row per sequence
    # [B] counted with the batch's weights, so only meaningful together with them as sample weights
    rest_sizes: Tensor | None = getattr(batch_part, "trajectory_rest_sizes", None) if sample_weights is not None else None

    def reduce(per_token: Tensor, token_weights: Tensor | None = None) -> Tensor:
        return aggregate(
            per_token, mask, cfg.aggregation, normalizers=normalizers, fixed_length=cfg.fixed_length,
            token_weights=token_weights, sample_weights=sample_weights, trajectory_ids=trajectory_ids,
            trajectory_rest_sizes=rest_sizes,
        )

    return reduce


def _old_logprobs(batch_part: PolicyLossBatch, mask: Tensor, cfg: PolicyLossConfig) -> Tensor:
    """The log-probs the loss's ratio starts from: the trainer's ``old_logprobs``, else the engine's,
    where the loss allows that and every trained row has them."""
    if batch_part.old_logprobs is None and cfg.loss_needs_old_logprobs:
        raise ValueError(
            f"policy loss {cfg.loss!r} needs batch.old_logprobs (the trainer's log-probs at the start of the "
            "step, its proximal policy) but they are None: recompute them before the update, e.g. "
            "batch.with_logprobs(old=batch_logprobs(model, batch, ...)), whenever PolicyLossConfig.needs_old_logprobs "
            "is true; the engine's log-probs in their place would silently drop the off-policy correction"
        )
    if batch_part.old_logprobs is not None:
        return batch_part.old_logprobs
    trained_rows = mask.sum(dim=-1) > 0
    if not bool(batch_part.has_engine_logprobs[trained_rows].all()):
        raise ValueError(
            "batch.old_logprobs is None and some rows have no engine log-probs (e.g. scripted expert "
            "turns): recompute old_logprobs with the trainer before the update"
        )
    return batch_part.engine_logprobs


def _tis_weights(batch_part: PolicyLossBatch, mask: Tensor, cfg: PolicyLossConfig) -> tuple[Tensor | None, dict[str, float]]:
    """The truncated importance weights ``w`` [B, T] and their metrics; (None, {}) without ``tis_cap``."""
    if cfg.tis_cap is None:
        return None, {}
    if batch_part.old_logprobs is None:
        raise ValueError(
            "tis_cap is set but batch.old_logprobs is None: recompute the old log-probs with the "
            "trainer before the update (TIS compares them with the engine's)"
        )
    return truncated_importance_weights(
        batch_part.old_logprobs, batch_part.engine_logprobs, mask, cfg.tis_cap, batch_part.has_engine_logprobs
    )


def _loss_inputs(batch_part: PolicyLossBatch, logprobs: Tensor, old: Tensor, entropy: Tensor | None,
                 cfg: PolicyLossConfig) -> LossInputs:
    """What the registered loss reads: the batch's tensors, all detached but ``logprobs``."""
    behaviour: Tensor | None = getattr(batch_part, "engine_logprobs", None)
    return LossInputs(
        logprobs=logprobs,
        old_logprobs=old.detach(),
        advantages=batch_part.advantages.detach(),
        mask=batch_part.loss_mask,
        entropy=None if entropy is None else entropy.detach(),
        log_ratio_limit=cfg.log_ratio_limit,
        # the sampler's log-probs [B, T] and their rows [B]; read with getattr so a batch-like
        # object without them still serves every loss that does not need them
        behaviour_logprobs=None if behaviour is None else behaviour.detach(),
        has_behaviour_logprobs=getattr(batch_part, "has_engine_logprobs", None) if behaviour is not None else None,
        trajectory_ids=getattr(batch_part, "trajectory_ids", None),
    )


def _per_token_policy_loss(inputs: LossInputs, cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """The registered loss's per-token loss ``l`` [B, T], checked for shape, and its metrics as floats."""
    per_token, loss_metrics = POLICY_LOSSES.entry(cfg.loss)(inputs, cfg.loss_options)
    if not isinstance(per_token, Tensor) or per_token.shape != inputs.mask.shape:
        got = tuple(per_token.shape) if isinstance(per_token, Tensor) else type(per_token).__name__
        raise ValueError(
            f"policy loss {cfg.loss!r} must return a per-token loss of shape {tuple(inputs.mask.shape)} "
            f"(unmasked, not aggregated), got {got}"
        )
    return per_token, {k: float(v) for k, v in loss_metrics.items()}


def _kl_term(batch_part: PolicyLossBatch, logprobs: Tensor, cfg: PolicyLossConfig,
             reduce: Callable[..., Tensor]) -> tuple[Tensor, dict[str, float]]:
    """The aggregated KL to the reference policy (before ``kl_coef``) and its metrics ``kl_ref``
    (the mean per-token KL) and ``kl_loss``."""
    if batch_part.ref_logprobs is None:
        raise ValueError("kl_coef > 0 with kl_penalty='loss' needs batch.ref_logprobs (reference model log-probs)")
    kl = kl_per_token(logprobs, batch_part.ref_logprobs, cfg.kl_estimator)  # [B, T]
    kl_loss = reduce(kl)
    return kl_loss, {"kl_ref": float(masked_mean(kl.detach(), batch_part.loss_mask)), "kl_loss": float(kl_loss.detach())}


def compute_policy_loss(
    batch_part: PolicyLossBatch,
    logprobs: Tensor,
    entropy: Tensor | None,
    cfg: PolicyLossConfig,
) -> tuple[Tensor, dict[str, float]]:
    """Total RL loss of one (micro-)batch and its metrics.

    ``logprobs`` [B, T]: the current policy's log-probs of the target tokens (with gradient), from
    ``token_logprobs``; ``entropy`` [B, T] from the same logits, needed when ``entropy_coef > 0``
    or the loss uses it (e.g. ``ppo_clip`` with ``entropy_clip``), else may be None.

    Metrics, plain floats over this part's trained tokens: every metric the loss returns (names
    unchanged), ``policy_loss`` (the aggregated, weighted policy term), ``loss`` (the total),
    ``num_tokens``; with ``tis_cap`` the TIS metrics; with the KL term ``kl_ref`` and ``kl_loss``;
    with entropy given ``entropy`` (and ``entropy_loss`` when ``entropy_coef > 0``).
    """
    mask = batch_part.loss_mask
    _check_shapes(mask, logprobs, entropy, cfg)
    reduce = _reducer(batch_part, cfg)
    old = _old_logprobs(batch_part, mask, cfg)
    token_weights, tis_metrics = _tis_weights(batch_part, mask, cfg)

    per_token, metrics = _per_token_policy_loss(_loss_inputs(batch_part, logprobs, old, entropy, cfg), cfg)
    loss = reduce(per_token, token_weights)
    metrics["policy_loss"] = float(loss.detach())
    metrics.update(tis_metrics)

    if cfg.kl_coef > 0 and cfg.kl_penalty == "loss":
        kl_loss, kl_metrics = _kl_term(batch_part, logprobs, cfg, reduce)
        loss = loss + cfg.kl_coef * kl_loss
        metrics.update(kl_metrics)

    if entropy is not None:
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if cfg.entropy_coef > 0:
            entropy_term = reduce(entropy)
            loss = loss - cfg.entropy_coef * entropy_term
            metrics["entropy_loss"] = float(-entropy_term.detach())

    metrics["num_tokens"] = float(mask.sum())
    metrics["loss"] = float(loss.detach())
    return loss, metrics


__all__ = ["PolicyLossBatch", "compute_policy_loss"]
