"""GSPO: clipped surrogate on a sequence-level ratio.

Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (Qwen team). The sequence ratio is
the length-normalised geometric mean of token ratios::

    s_i = exp( (1/|y_i|) sum_t (logp_{i,t} - old_logp_{i,t}) )

and the objective is ``(1/G) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)``, i.e. the
clipped surrogate with ``aggregation="sequence_mean"``. It is computed in the paper's "GSPO-token"
form ``s_{i,t} = sg[s_i] * exp(logp_{i,t} - sg[logp_{i,t}])``: every token carries the value
``s_i``; with advantages constant over a sequence and ``sequence_mean`` aggregation the gradient is
exactly GSPO's, and per-token (e.g. per-turn) advantages are allowed. Clip ranges are about three
orders of magnitude smaller than PPO's (the paper: 3e-4 / 4e-4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tracegym.algos.aggregation import LossNormalizers
from tracegym.algos.ppo_clip import check_loss_inputs, clipped_surrogate
from tracegym.algos.registry import POLICY_LOSSES

if TYPE_CHECKING:
    from tracegym.algos.config import PolicyLossConfig


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``(1/|y_i|) sum_t mask * (logp - old_logp)`` per row -> [B] (0 for rows without tokens)."""
    m = mask.to(logprobs.dtype)
    return ((logprobs - old_logprobs) * m).sum(-1) / m.sum(-1).clamp(min=1.0)


@POLICY_LOSSES.register("gspo")
def gspo_loss(
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
    """GSPO(-token) loss; all tensors [B, T], target-aligned. See the module docstring."""
    check_loss_inputs(logprobs, old_logprobs, advantages, mask)
    old = old_logprobs.detach()
    seq = sequence_log_ratio(logprobs, old, mask).detach().clamp(-cfg.log_ratio_limit, cfg.log_ratio_limit)  # [B]
    # value: s_i at every token; gradient: s_i * grad(logp_t) per token
    log_ratio = seq.unsqueeze(-1) + logprobs - logprobs.detach()  # [B, T]
    loss, metrics = clipped_surrogate(
        torch.exp(log_ratio),
        logprobs.detach() - old,
        advantages.detach(),
        mask,
        cfg,
        token_weights=token_weights,
        entropy=entropy,
        normalizers=normalizers,
    )
    return loss, metrics
