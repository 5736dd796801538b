"""Truncated importance sampling (TIS) for the engine/trainer log-prob mismatch.

Source: Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (blog). The engine (vLLM, another dtype, other kernels) samples from ``pi_engine`` while
the trainer computes gradients under ``pi_old`` (the same weights, recomputed by the trainer). The
per-token correction ``w_t = min(pi_old(y_t) / pi_engine(y_t), C)`` re-weights each token's loss;
the cap ``C`` bounds the variance at the price of a small bias.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tracegym.algos.aggregation import masked_mean, require_one_shape


def truncated_importance_weights(
    old_logprobs: Tensor,
    engine_logprobs: Tensor,
    mask: Tensor,
    cap: float,
    rows_with_engine_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``w = min(exp(old_logprobs - engine_logprobs), cap)`` per token, detached.

    ``old_logprobs``/``engine_logprobs``/``mask`` [B, T]; ``rows_with_engine_logprobs`` [B] bool
    marks rows whose engine log-probs are known (others, e.g. scripted expert turns, get weight 1).
    Returns the weights [B, T] (1 where ``mask`` is 0) and metrics over masked tokens:
    ``tis_truncated_frac`` (how often the cap bites), ``tis_weight_mean``, ``tis_raw_weight_max``,
    ``engine_kl_k3`` (k3 estimate of ``KL(pi_engine || pi_old)``), ``engine_logprob_abs_diff``.
    """
    if cap <= 0:
        raise ValueError(f"the TIS cap must be positive, got {cap}")
    require_one_shape(old_logprobs=old_logprobs, engine_logprobs=engine_logprobs, mask=mask)
    with torch.no_grad():
        valid = mask.bool()
        if rows_with_engine_logprobs is not None:
            valid = valid & rows_with_engine_logprobs.bool().unsqueeze(-1)
        log_w = (old_logprobs - engine_logprobs).clamp(-20.0, 20.0)
        raw = torch.exp(log_w)
        weights = torch.where(valid, raw.clamp(max=cap), torch.ones_like(raw))
        truncated = (raw > cap) & valid
        k3 = torch.expm1(log_w) - log_w  # samples from the engine, r = pi_old / pi_engine
        selected = raw[valid]
        metrics = {
            "tis_truncated_frac": float(masked_mean(truncated.to(raw.dtype), valid)),
            "tis_weight_mean": float(masked_mean(weights, valid)),
            "tis_raw_weight_max": float(selected.max()) if selected.numel() else 0.0,
            "engine_kl_k3": float(masked_mean(k3, valid)),
            "engine_logprob_abs_diff": float(masked_mean(log_w.abs(), valid)),
        }
    return weights, metrics
