"""Dr. GRPO advantage: reward minus the group mean, with no std normalisation.

Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO,
"GRPO Done Right").
"""

from __future__ import annotations

from torch import Tensor

from typing import Sequence

from tracegym.algos._groups import TurnAdvantages, broadcast_to_turns, check_rewards_and_groups, episode_rewards, group_mean_std
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.types import TrajectoryGroup


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """``A_i = r_i - mean_g(r)``: no division by the group std.

    Dividing by the std up-weights groups whose rewards barely differ (too easy or too hard
    tasks), a question-level difficulty bias. Dr. GRPO removes it here, and removes the
    per-response length normalisation ``1/|o_i|`` in the loss as well, which favours long wrong
    answers. Pair this estimator with ``PolicyLossConfig(aggregation="fixed_length_sum")``: each
    sequence's token losses are summed and divided by one constant (the generation budget) instead
    of by its own length (the ``dr_grpo`` preset sets both). ``rewards`` [N], ``group_ids`` [N]; returns [N].
    """
    check_rewards_and_groups(rewards, group_ids)
    mean, _, _ = group_mean_std(rewards, group_ids, unbiased=False)
    return rewards - mean


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(groups: Sequence[TrajectoryGroup]) -> list[TurnAdvantages]:
    """Dr. GRPO on episode rewards; every turn of an episode gets the episode's advantage."""
    rewards, ids = episode_rewards(groups)
    return broadcast_to_turns(groups, dr_grpo_advantages(rewards, ids))
