"""GRPO advantage: reward minus the group mean, divided by the group std.

Source: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
Language Models" (Group Relative Policy Optimization).
"""

from __future__ import annotations

import torch
from torch import Tensor

from typing import Sequence

from tracegym.algos._groups import TurnAdvantages, broadcast_to_turns, check_rewards_and_groups, episode_rewards, group_mean_std
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.types import TrajectoryGroup


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> Tensor:
    """``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` for sample ``i`` in group ``g``.

    - ``rewards`` [N] float, ``group_ids`` [N] integer (samples of the same task share an id; groups
      may have different sizes). Returns [N].
    - ``normalize_std=False`` gives ``A_i = r_i - mean_g(r)`` (the Dr. GRPO estimator, also
      registered as ``dr_grpo``).
    - ``unbiased_std``: Bessel-corrected std (divide by ``n-1``), as ``torch.std`` in most GRPO code.
    - A group of one sample gets advantage 0 (its own mean is its reward); a group whose rewards
      are all equal gets exactly 0 too (std 0, numerator 0), even when the rewards are not exactly
      representable (ten rewards of 0.1).
    """
    check_rewards_and_groups(rewards, group_ids)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    mean, std, _ = group_mean_std(rewards, group_ids, unbiased=unbiased_std)
    centered = rewards - mean
    if not normalize_std:
        return centered
    # std == 0 means every reward of the group is equal: centered is 0 there, and stays 0 even with eps = 0
    return torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(
    groups: Sequence[TrajectoryGroup], *, normalize_std: bool = True, eps: float = 1e-6, unbiased_std: bool = True
) -> list[TurnAdvantages]:
    """GRPO on episode rewards; every turn of an episode gets the episode's advantage."""
    rewards, ids = episode_rewards(groups)
    return broadcast_to_turns(groups, grpo_advantages(rewards, ids, normalize_std=normalize_std, eps=eps, unbiased_std=unbiased_std))
