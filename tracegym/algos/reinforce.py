"""REINFORCE with a batch-mean baseline (groups are ignored).

Source: Williams 1992, "Simple Statistical Gradient-Following Algorithms for Connectionist
Reinforcement Learning" (REINFORCE with a constant baseline).
"""

from __future__ import annotations

import torch
from torch import Tensor

from typing import Sequence

from tracegym.algos._groups import TurnAdvantages, broadcast_to_turns, check_rewards_and_groups, episode_rewards, values_uniform
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.types import TrajectoryGroup


def reinforce_advantages(
    rewards: Tensor, group_ids: Tensor, *, baseline: bool = True, normalize_std: bool = False, eps: float = 1e-6
) -> Tensor:
    """``A_i = r_i - mean(r)`` over the whole batch (``baseline=False``: ``A_i = r_i``).

    ``normalize_std=True`` divides by ``std(r) + eps`` over the batch (population std), the
    "whitening" common in REINFORCE-style RLHF code. With the baseline, a batch of equal rewards (up
    to ``EQUAL_VALUES_TOLERANCE``) gets exactly 0; without it every ``r_i`` is kept (plain REINFORCE:
    the one estimator option that does not zero a uniform group). ``group_ids`` is accepted for the
    common signature and only checked for shape. ``rewards`` [N]; returns [N].
    """
    check_rewards_and_groups(rewards, group_ids)
    if baseline and values_uniform(rewards):
        return torch.zeros_like(rewards)  # all equal (up to rounding): exactly no signal, whatever the float mean
    advantages = rewards - rewards.mean() if baseline else rewards.clone()
    if normalize_std:
        std = rewards.std(correction=0)
        advantages = advantages / (std + eps) if std > 0 and not values_uniform(rewards) else torch.zeros_like(advantages)
    return advantages


@ADVANTAGE_ESTIMATORS.register("reinforce")
def reinforce(
    groups: Sequence[TrajectoryGroup], *, baseline: bool = True, normalize_std: bool = False, eps: float = 1e-6
) -> list[TurnAdvantages]:
    """REINFORCE (batch-mean baseline, optional whitening) on episode rewards, same value per turn."""
    rewards, ids = episode_rewards(groups)
    return broadcast_to_turns(groups, reinforce_advantages(rewards, ids, baseline=baseline, normalize_std=normalize_std, eps=eps))
