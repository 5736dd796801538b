"""RLOO advantage: reward minus the mean reward of the *other* samples of the same group.

Sources: Kool, van Hoof and Welling 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
Human Feedback in LLMs".
"""

from __future__ import annotations

import torch
from torch import Tensor

from typing import Sequence

from tracegym.algos._groups import TurnAdvantages, broadcast_to_turns, check_rewards_and_groups, episode_rewards, group_mean_std
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.types import TrajectoryGroup


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """``A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1)``, equivalently
    ``n_g / (n_g - 1) * (r_i - mean_g(r))``.

    The baseline does not depend on sample ``i``, so the gradient estimate stays unbiased. A
    group of one sample has no other sample to compare with: its advantage is 0.
    ``rewards`` [N], ``group_ids`` [N]; returns [N].
    """
    check_rewards_and_groups(rewards, group_ids)
    mean, _, count = group_mean_std(rewards, group_ids, unbiased=False)
    scale = count / (count - 1.0).clamp(min=1.0)  # n / (n - 1); groups of one are zeroed below
    advantages = scale * (rewards - mean)
    return torch.where(count > 1, advantages, torch.zeros_like(advantages))


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(groups: Sequence[TrajectoryGroup]) -> list[TurnAdvantages]:
    """RLOO on episode rewards; every turn of an episode gets the episode's advantage."""
    rewards, ids = episode_rewards(groups)
    return broadcast_to_turns(groups, rloo_advantages(rewards, ids))
