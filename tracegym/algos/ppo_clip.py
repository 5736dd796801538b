"""PPO clipped surrogate with token-level ratios, clip-higher and dual clip.

Sources: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (clipped surrogate);
Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (clip-higher:
separate ``eps_low``/``eps_high``); Ye et al. 2020, "Mastering Complex Control in MOBA Games with
Deep Reinforcement Learning" (dual clip).

Per token (target-aligned, ``r_t = exp(logp_t - old_logp_t)``)::

    l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
    dual clip, A_t < 0:  l_t = min(l_t, -c A_t)      (c > 1)

then ``aggregate`` reduces ``l`` under the mask. Clipped tokens get zero gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tracegym.algos.aggregation import LossNormalizers, aggregate, masked_mean, masked_min_max
from tracegym.algos.entropy_clip import entropy_clip_scale
from tracegym.algos.registry import POLICY_LOSSES

if TYPE_CHECKING:
    from tracegym.algos.config import PolicyLossConfig


def check_loss_inputs(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> None:
    shapes = {t.shape for t in (logprobs, old_logprobs, advantages, mask)}
    if len(shapes) != 1 or logprobs.dim() != 2:
        raise ValueError(
            "logprobs, old_logprobs, advantages and mask must all be [B, T]; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )


def clipped_surrogate(
    ratio: Tensor,
    token_log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: "PolicyLossConfig",
    *,
    token_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    normalizers: LossNormalizers | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped objective for any ratio tensor [B, T] (token ratios for PPO, sequence ratios for GSPO).

    ``token_log_ratio`` [B, T] (``logp - old_logp`` per token) is used for the ``approx_kl`` metric only.
    """
    if cfg.entropy_clip:
        if entropy is None:
            raise ValueError("entropy_clip is on but no token entropy was given")
        scale = entropy_clip_scale(
            entropy, cfg.entropy_clip_reference, cfg.entropy_clip_min_scale, cfg.entropy_clip_max_scale
        )
    else:
        scale = torch.ones_like(ratio).detach()
    lower_t = (1.0 - cfg.clip_eps_low * scale).clamp(min=0.0)  # [B, T]
    upper_t = 1.0 + cfg.eps_high * scale  # [B, T]
    clipped_ratio = torch.clamp(ratio, lower_t, upper_t)

    unclipped_loss = -advantages * ratio  # [B, T]
    clipped_loss = -advantages * clipped_ratio  # [B, T]
    per_token = torch.maximum(unclipped_loss, clipped_loss)
    if cfg.dual_clip_c is not None:
        cap = -advantages * cfg.dual_clip_c  # positive where A < 0
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)

    loss = aggregate(
        per_token, mask, cfg.aggregation, normalizers=normalizers, fixed_length=cfg.fixed_length, token_weights=token_weights
    )

    with torch.no_grad():
        r = ratio.detach()
        low = (advantages < 0) & (r < lower_t)
        high = (advantages > 0) & (r > upper_t)
        ratio_min, ratio_max = masked_min_max(r, mask)
        lr = token_log_ratio.detach()
        metrics = {
            "clip_frac_low": float(masked_mean(low.to(r.dtype), mask)),
            "clip_frac_high": float(masked_mean(high.to(r.dtype), mask)),
            "ratio_mean": float(masked_mean(r, mask)),
            "ratio_min": ratio_min,
            "ratio_max": ratio_max,
            # k3 estimate of KL(pi_old || pi_new) from tokens sampled by pi_old: E[(r - 1) - log r]
            "approx_kl": float(masked_mean(torch.expm1(lr) - lr, mask)),
            "policy_loss": float(loss.detach()),
        }
        if cfg.dual_clip_c is not None:
            dual = (advantages < 0) & (r > cfg.dual_clip_c)
            metrics["dual_clip_frac"] = float(masked_mean(dual.to(r.dtype), mask))
    return loss, metrics


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
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
    """PPO-clip with token ratios ``r_t = exp(logp_t - old_logp_t)`` (see the module docstring).

    All tensors [B, T], target-aligned; ``old_logprobs`` and ``advantages`` are treated as constants.
    """
    check_loss_inputs(logprobs, old_logprobs, advantages, mask)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-cfg.log_ratio_limit, cfg.log_ratio_limit)
    return clipped_surrogate(
        torch.exp(log_ratio),
        log_ratio,
        advantages.detach(),
        mask,
        cfg,
        token_weights=token_weights,
        entropy=entropy,
        normalizers=normalizers,
    )
