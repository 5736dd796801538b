"""``LossInputs``: what every registered policy loss receives.

A policy loss is ``fn(inputs: LossInputs, opts) -> (per_token_loss [B, T], metrics)``: the loss of
every token, **unmasked, unweighted and not aggregated**. ``compose.compute_policy_loss`` does the
rest once for every loss (mask, truncated importance weights, aggregation with full-batch
normalizers, KL and entropy terms), so a new loss cannot forget any of it.

All tensors are ``[B, T]`` and target-aligned (column ``t`` belongs to token ``t + 1``), except
``has_behaviour_logprobs`` ([B], one flag per row).

Three policies can appear in a loss: the current one (``logprobs``, with gradient), the one the
update starts from (``old_logprobs``: recomputed by the trainer at the start of the step, the
proximal policy of decoupled PPO) and the one that sampled the tokens (``behaviour_logprobs``: the
engine's log-probs recorded with the trajectory; in asynchronous training it may be several updates
older). ``compute_policy_loss`` fills all three from the batch; a loss that needs the behaviour
policy (``decoupled_ppo``) reads ``behaviour_logprobs`` and refuses to run without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tracegym.algos.aggregation import masked_mean, masked_min_max


@dataclass(frozen=True)
class LossInputs:
    """The tensors of one (micro-)batch a policy loss computes its per-token loss from."""

    logprobs: Tensor
    """[B, T] log-probs of the target tokens under the current policy, with gradient."""
    old_logprobs: Tensor
    """[B, T] log-probs under the policy that produced the batch (trainer-recomputed, else the
    engine's); detached."""
    advantages: Tensor
    """[B, T] per-token advantages; detached."""
    mask: Tensor
    """[B, T] loss mask (1 on trained tokens). For sequence-level quantities and metrics only: the
    composition applies it to the per-token loss."""
    entropy: Tensor | None = None
    """[B, T] token entropy of the current policy (detached), or None when not computed."""
    log_ratio_limit: float = 20.0
    """Clamp of ``logprobs - old_logprobs`` before ``exp`` (``PolicyLossConfig.log_ratio_limit``)."""
    behaviour_logprobs: Tensor | None = None
    """[B, T] log-probs of the target tokens under the policy that sampled them (the engine's,
    ``Batch.engine_logprobs``; 0 where unknown), detached; None when the caller has none."""
    has_behaviour_logprobs: Tensor | None = None
    """[B] bool: rows whose ``behaviour_logprobs`` are known (``Batch.has_engine_logprobs``; False for
    scripted expert turns); None means every row."""
    trajectory_ids: Tensor | None = None
    """[B] long: rows sharing an id are parts of one trajectory (a template that rewrote history
    splits it), one sequence for sequence-level quantities (GSPO's ratio); None: a sequence per row.
    The micro-batch splitters keep a trajectory's rows in one part."""

    def __post_init__(self) -> None:
        tensors = {"logprobs": self.logprobs, "old_logprobs": self.old_logprobs, "advantages": self.advantages, "mask": self.mask}
        if self.entropy is not None:
            tensors["entropy"] = self.entropy
        if self.behaviour_logprobs is not None:
            tensors["behaviour_logprobs"] = self.behaviour_logprobs
        if self.logprobs.dim() != 2 or len({tuple(t.shape) for t in tensors.values()}) != 1:
            shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items())
            raise ValueError(f"loss inputs must all be [B, T] of one shape; got {shapes}")
        rows = self.has_behaviour_logprobs
        if rows is not None and tuple(rows.shape) != (self.logprobs.shape[0],):
            raise ValueError(
                f"has_behaviour_logprobs must be [B] = ({self.logprobs.shape[0]},), one flag per row; got {tuple(rows.shape)}"
            )
        ids = self.trajectory_ids
        if ids is not None and tuple(ids.shape) != (self.logprobs.shape[0],):
            raise ValueError(f"trajectory_ids must be [B] = ({self.logprobs.shape[0]},), one id per row; got {tuple(ids.shape)}")
        if self.log_ratio_limit <= 0:
            raise ValueError(f"log_ratio_limit must be positive, got {self.log_ratio_limit}")

    def log_ratio(self) -> Tensor:
        """``logp - old_logp`` per token, clamped to ``+-log_ratio_limit`` (gradient through ``logp``)."""
        return (self.logprobs - self.old_logprobs.detach()).clamp(-self.log_ratio_limit, self.log_ratio_limit)

    def masked_mean(self, values: Tensor) -> float:
        """Mean of ``values`` [B, T] over the trained tokens (0 when there are none); for metrics."""
        return float(masked_mean(values.detach(), self.mask))

    def ratio_metrics(self, ratio: Tensor, token_log_ratio: Tensor | None = None) -> dict[str, float]:
        """``ratio_mean``/``ratio_min``/``ratio_max`` of ``ratio`` [B, T] over the trained tokens, and
        ``approx_kl``: the k3 estimate ``mean(r - 1 - log r)`` of ``KL(pi_old || pi)`` from the token
        log-ratios (default: ``self.log_ratio()``)."""
        with torch.no_grad():
            r = ratio.detach()
            lr = (self.log_ratio() if token_log_ratio is None else token_log_ratio).detach()
            low, high = masked_min_max(r, self.mask)
            return {
                "ratio_mean": self.masked_mean(r),
                "ratio_min": low,
                "ratio_max": high,
                "approx_kl": self.masked_mean(torch.expm1(lr) - lr),
            }


__all__ = ["LossInputs"]
