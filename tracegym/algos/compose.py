"""``compute_policy_loss``: the one entry point the RL recipe calls per micro-batch.

It composes, as ``PolicyLossConfig`` selects::

    loss = policy_loss(logprobs, old, A, mask; ratio type, clip / clip-higher / dual clip,
                       entropy-aware clip, TIS weights, aggregation)
         + kl_coef * aggregate(kl_estimator(logprobs, ref_logprobs))      [kl_penalty == "loss"]
         - entropy_coef * aggregate(entropy)

Every term uses the same aggregation and the batch's full-batch normalizers, so summing the
micro-batch losses gives the full-batch loss. ``old`` is the trainer's recomputed
``batch.old_logprobs`` when present, else the engine's ``batch.engine_logprobs``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from tracegym.algos.aggregation import aggregate, masked_mean
from tracegym.algos.config import PolicyLossConfig
from tracegym.algos.kl import kl_per_token
from tracegym.algos.registry import POLICY_LOSSES
from tracegym.algos.tis import truncated_importance_weights

if TYPE_CHECKING:
    from tracegym.batch import Batch


def compute_policy_loss(
    batch_part: "Batch",
    logprobs: Tensor,
    entropy: Tensor | None,
    cfg: PolicyLossConfig,
) -> tuple[Tensor, dict[str, float]]:
    """Total RL loss of one (micro-)batch and its metrics.

    ``logprobs`` [B, T]: the current policy's log-probs of the target tokens (with gradient), from
    ``token_logprobs``; ``entropy`` [B, T] from the same logits, needed when ``entropy_coef > 0``
    or ``entropy_clip`` (else may be None). Metrics are plain floats over this part's tokens.
    """
    mask = batch_part.loss_mask
    if logprobs.shape != mask.shape:
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)} but the batch's loss mask is {tuple(mask.shape)}")
    if entropy is not None and entropy.shape != mask.shape:
        raise ValueError(f"entropy has shape {tuple(entropy.shape)} but the batch's loss mask is {tuple(mask.shape)}")
    if (cfg.entropy_coef > 0 or cfg.entropy_clip) and entropy is None:
        raise ValueError("entropy_coef > 0 or entropy_clip needs the token entropy; pass it from token_logprobs_and_entropy")

    if batch_part.old_logprobs is not None:
        old = batch_part.old_logprobs
    else:
        trained_rows = mask.sum(dim=-1) > 0
        if not bool(batch_part.has_engine_logprobs[trained_rows].all()):
            raise ValueError(
                "batch.old_logprobs is None and some rows have no engine log-probs (e.g. scripted expert "
                "turns): recompute old_logprobs with the trainer before the update"
            )
        old = batch_part.engine_logprobs
    metrics: dict[str, float] = {"num_tokens": float(mask.sum())}

    token_weights = None
    if cfg.tis_cap is not None:
        if batch_part.old_logprobs is None:
            raise ValueError(
                "tis_cap is set but batch.old_logprobs is None: recompute the old log-probs with the "
                "trainer before the update (TIS compares them with the engine's)"
            )
        token_weights, tis_metrics = truncated_importance_weights(
            batch_part.old_logprobs, batch_part.engine_logprobs, mask, cfg.tis_cap, batch_part.has_engine_logprobs
        )
        metrics.update(tis_metrics)

    policy_loss_fn = POLICY_LOSSES.get(cfg.loss)
    loss, policy_metrics = policy_loss_fn(
        logprobs,
        old,
        batch_part.advantages,
        mask,
        cfg,
        token_weights=token_weights,
        entropy=entropy,
        normalizers=batch_part.normalizers,
    )
    metrics.update(policy_metrics)

    def reduce(per_token: Tensor) -> Tensor:
        return aggregate(
            per_token, mask, cfg.aggregation, normalizers=batch_part.normalizers, fixed_length=cfg.fixed_length
        )

    if cfg.kl_coef > 0 and cfg.kl_penalty == "loss":
        if batch_part.ref_logprobs is None:
            raise ValueError("kl_coef > 0 with kl_penalty='loss' needs batch.ref_logprobs (reference model log-probs)")
        kl = kl_per_token(logprobs, batch_part.ref_logprobs, cfg.kl_estimator)  # [B, T]
        kl_loss = reduce(kl)
        loss = loss + cfg.kl_coef * kl_loss
        metrics["kl_ref"] = float(masked_mean(kl.detach(), mask))
        metrics["kl_loss"] = float(kl_loss.detach())

    if entropy is not None:
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if cfg.entropy_coef > 0:
            entropy_term = reduce(entropy)
            loss = loss - cfg.entropy_coef * entropy_term
            metrics["entropy_loss"] = float(-entropy_term.detach())

    metrics["loss"] = float(loss.detach())
    return loss, metrics
