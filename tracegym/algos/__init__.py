"""Advantage estimators and losses: pure functions of tensors, registered by name.

No environment, engine or file I/O here (see DESIGN.md). Conventions:

- Advantage estimators: ``ADVANTAGE_ESTIMATORS.get(name)(rewards [N], group_ids [N], **options)
  -> advantages [N]``; registered: ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce``. Turn-level
  credit: ``turn_level_advantages`` ([N, K] per-turn rewards -> [N, K]).
- Policy losses: ``POLICY_LOSSES.get(name)(logprobs, old_logprobs, advantages, mask, cfg, *,
  token_weights, entropy, normalizers) -> (loss, metrics)`` on target-aligned ``[B, T]`` tensors;
  registered: ``ppo_clip``, ``gspo``, ``policy_gradient``. The recipe calls
  ``compute_policy_loss(batch_part, logprobs, entropy, PolicyLossConfig)``.
- SFT: ``sft_loss``; KL: ``kl_per_token``, ``kl_penalized_rewards``, ``kl_penalized_advantages``;
  TIS: ``truncated_importance_weights``.

``docs/algorithms.md`` lists every formula with its source.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

# importing each module registers it
from tracegym.algos import dr_grpo, gspo, grpo, policy_gradient, ppo_clip, reinforce, rloo  # noqa: F401
from tracegym.algos.aggregation import AGGREGATIONS, LossNormalizers, aggregate, masked_mean
from tracegym.algos.compose import compute_policy_loss
from tracegym.algos.config import PolicyLossConfig
from tracegym.algos.entropy_clip import entropy_clip_scale
from tracegym.algos.kl import KL_ESTIMATORS, kl_penalized_advantages, kl_penalized_rewards, kl_per_token
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, Registry
from tracegym.algos.sft import sft_loss
from tracegym.algos.tis import truncated_importance_weights
from tracegym.algos.turn_credit import discounted_turn_returns, turn_level_advantages


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor, **options: Any) -> Tensor:
    """Run the advantage estimator registered as ``name`` (unknown names and options raise with the
    valid choices)."""
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    try:
        return estimator(rewards, group_ids, **options)
    except TypeError as error:
        if "unexpected keyword" in str(error):
            raise ValueError(f"advantage estimator {name!r}: {error}") from None
        raise


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "LossNormalizers",
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "Registry",
    "aggregate",
    "compute_advantages",
    "compute_policy_loss",
    "discounted_turn_returns",
    "entropy_clip_scale",
    "kl_penalized_advantages",
    "kl_penalized_rewards",
    "kl_per_token",
    "masked_mean",
    "sft_loss",
    "truncated_importance_weights",
    "turn_level_advantages",
]
