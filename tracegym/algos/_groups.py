"""Vectorised per-group statistics over a flat vector of samples (shared by the estimators)."""

from __future__ import annotations

import torch
from torch import Tensor


def check_rewards_and_groups(rewards: Tensor, group_ids: Tensor) -> None:
    """Raise ``ValueError`` with a readable message on malformed estimator inputs."""
    if not isinstance(rewards, Tensor) or not isinstance(group_ids, Tensor):
        raise TypeError("rewards and group_ids must be torch tensors")
    if rewards.dim() != 1 or group_ids.dim() != 1:
        raise ValueError(f"rewards and group_ids must be 1-D, got shapes {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards has {rewards.numel()} entries but group_ids has {group_ids.numel()}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating tensor, got {rewards.dtype}")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        raise ValueError(f"rewards contain non-finite values at positions {bad[:10]}")


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids to ``0..G-1``: returns (inverse [N] long, G)."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(unique.numel())


def group_sum(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Sum of ``values`` [N] per group -> [G]."""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)


def group_count(inverse: Tensor, num_groups: int, dtype: torch.dtype) -> Tensor:
    """Number of members per group -> [G] in ``dtype``."""
    ones = torch.ones(inverse.numel(), dtype=dtype, device=inverse.device)
    return group_sum(ones, inverse, num_groups)


def group_mean_std(values: Tensor, group_ids: Tensor, unbiased: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, group std and group size, each [N].

    The std of a group of one is 0 (no spread; the Bessel-corrected formula would divide by zero).
    """
    inverse, g = group_index(group_ids)
    count = group_count(inverse, g, values.dtype)  # [G]
    mean = group_sum(values, inverse, g) / count  # [G]
    centered = values - mean[inverse]  # [N]
    denom = (count - 1.0) if unbiased else count
    var = group_sum(centered * centered, inverse, g) / denom.clamp(min=1.0)
    var = torch.where(count > 1, var, torch.zeros_like(var))
    return mean[inverse], var.sqrt()[inverse], count[inverse]
