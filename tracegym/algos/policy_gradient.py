"""Unclipped (importance-weighted) policy gradient.

Source: Williams 1992 (REINFORCE); the importance ratio makes the same loss usable for a slightly
stale policy. Per token: ``l_t = -A_t * exp(logp_t - old_logp_t)``. At ``logp == old_logp`` the
value is ``-A_t`` and the gradient is ``-A_t * grad(logp_t)``, the REINFORCE gradient. No clipping:
use it on-policy (one optimizer pass per batch of rollouts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tracegym.algos.aggregation import LossNormalizers, aggregate, masked_mean, masked_min_max
from tracegym.algos.ppo_clip import check_loss_inputs
from tracegym.algos.registry import POLICY_LOSSES

if TYPE_CHECKING:
    from tracegym.algos.config import PolicyLossConfig


@POLICY_LOSSES.register("policy_gradient")
def policy_gradient_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: "PolicyLossConfig",
    *,
    token_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    normalizers: LossNormalizers | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``-A_t * r_t`` aggregated under the mask; all tensors [B, T]. ``entropy`` is unused."""
    check_loss_inputs(logprobs, old_logprobs, advantages, mask)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-cfg.log_ratio_limit, cfg.log_ratio_limit)
    ratio = torch.exp(log_ratio)
    per_token = -advantages.detach() * ratio
    loss = aggregate(
        per_token, mask, cfg.aggregation, normalizers=normalizers, fixed_length=cfg.fixed_length, token_weights=token_weights
    )
    with torch.no_grad():
        ratio_min, ratio_max = masked_min_max(ratio, mask)
        lr = log_ratio.detach()
        metrics = {
            "ratio_mean": float(masked_mean(ratio.detach(), mask)),
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            "approx_kl": float(masked_mean(torch.expm1(lr) - lr, mask)),
            "policy_loss": float(loss.detach()),
        }
    return loss, metrics
