"""Advantage estimators and losses: pure functions of tensors, registered by name.

No environment, engine or file I/O here (see DESIGN.md). Conventions:

- Advantage estimators: ``compute_advantages(name, groups, options) -> [group][trajectory][turn]``:
  one advantage per assistant turn of every trajectory of every ``TrajectoryGroup``; registered:
  ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce`` (the episode's value on every turn) and
  ``turn_rloo`` (per-turn rewards-to-go, leave-one-out baseline per turn index), ``magrpo`` (teams:
  a group baseline per (task, role)). A group of identical trajectories gets exactly 0 (values equal
  up to ``EQUAL_VALUES_TOLERANCE`` count as equal), and ``estimate`` refuses trajectories whose episode
  reward is not the sum of their turn rewards (``check_episode_rewards``). Self-play's
  ``hierarchical_advantages`` (each level baselined in its own groups) and ``learnability_reward`` (``valid * 4p(1-p)``) are plain functions. The tensor math
  behind them (``grpo_advantages(rewards [N], group_ids [N])`` ...) is exported too.
- Policy losses: ``fn(inputs: LossInputs, opts) -> (per_token_loss [B, T], metrics)`` on
  target-aligned tensors (unmasked, unweighted, not aggregated), registered with their options
  model: ``POLICY_LOSSES.register(name, options=Model)``; built in: ``ppo_clip``, ``gspo``,
  ``policy_gradient``, ``decoupled_ppo`` (AReaL, for stale asynchronous batches: PPO-clip against the
  trainer's start-of-step policy times ``pi_prox / pi_behav``). The recipe calls
  ``compute_policy_loss(batch_part, logprobs, entropy, PolicyLossConfig)``, which applies mask, TIS
  weights, aggregation, KL and entropy once.
- Preference losses: ``fn(inputs: PairLogps | LabelledLogps, opts) -> (per_item_loss, metrics)`` on
  sequence log-probs of whole trajectories, registered in ``PREFERENCE_LOSSES``: ``dpo``, ``dmpo``
  (per-turn discount weights ``dmpo_turn_weights``), ``kto`` (labelled single trajectories).
- SFT: ``sft_loss``; KL: ``kl_per_token`` (in the loss via ``compute_policy_loss``; in the reward the
  RL recipe's ``kl_in_reward`` sums it per episode); TIS: ``truncated_importance_weights``.

``docs/algorithms.md`` lists every formula with its source.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

# importing each module registers it
from tracegym.algos import dmpo, dpo, kto  # noqa: F401  (preference losses)
from tracegym.algos import decoupled_ppo, dr_grpo, gigpo, gspo, grpo, magrpo, policy_gradient, ppo_clip, reinforce, rloo, tree, turn_credit  # noqa: F401
from tracegym.algos.hierarchical import hierarchical_advantages, learnability_reward
from tracegym.algos._groups import EQUAL_VALUES_TOLERANCE, check_episode_rewards, episode_reward_problems
from tracegym.algos.advantages import (
    EstimatorResult,
    TurnAdvantages,
    compute_advantages,
    estimate,
    estimator_problems,
    has_signal,
)
from tracegym.algos.dr_grpo import dr_grpo_advantages
from tracegym.algos.info_gain import info_gain_scores  # registers the "info_gain" estimator
from tracegym.algos.mc_continuation import mc_scores  # registers the "mc_continuation" estimator
from tracegym.algos.grpo import grpo_advantages
from tracegym.algos.reinforce import reinforce_advantages
from tracegym.algos.rloo import rloo_advantages
from tracegym.algos.aggregation import AGGREGATIONS, LossNormalizers, aggregate, masked_mean
from tracegym.algos.compose import PolicyLossBatch, compute_policy_loss
from tracegym.algos.config import PolicyLossConfig, policy_loss_problems
from tracegym.algos.decoupled_ppo import DecoupledPPOOptions, behaviour_weights
from tracegym.algos.entropy_clip import entropy_clip_scale
from tracegym.algos.gspo import GSPOOptions
from tracegym.algos.kl import KL_ESTIMATORS, kl_per_token
from tracegym.algos.loss_inputs import LossInputs
from tracegym.algos.ppo_clip import PPOClipOptions
from tracegym.algos.dmpo import DMPOOptions, dmpo_turn_weights
from tracegym.algos.dpo import DPOOptions, dpo_loss
from tracegym.algos.kto import KTOOptions, kto_loss, kto_reference_point
from tracegym.algos.preference_inputs import (
    LabelledLogps,
    PairLogps,
    PreferenceOptions,
    preference_loss_options,
    sequence_logps,
)
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, PREFERENCE_LOSSES, Registry
from tracegym.algos.sft import sft_loss
from tracegym.algos.tis import truncated_importance_weights
from tracegym.algos.turn_credit import discounted_turn_returns, turn_level_advantages


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "EQUAL_VALUES_TOLERANCE",
    "check_episode_rewards",
    "episode_reward_problems",
    "hierarchical_advantages",
    "learnability_reward",
    "DMPOOptions",
    "DecoupledPPOOptions",
    "DPOOptions",
    "KTOOptions",
    "LabelledLogps",
    "PREFERENCE_LOSSES",
    "PairLogps",
    "PreferenceOptions",
    "dmpo_turn_weights",
    "dpo_loss",
    "kto_loss",
    "kto_reference_point",
    "preference_loss_options",
    "sequence_logps",
    "AGGREGATIONS",
    "GSPOOptions",
    "KL_ESTIMATORS",
    "LossInputs",
    "LossNormalizers",
    "POLICY_LOSSES",
    "PPOClipOptions",
    "PolicyLossBatch",
    "PolicyLossConfig",
    "Registry",
    "aggregate",
    "behaviour_weights",
    "EstimatorResult",
    "TurnAdvantages",
    "compute_advantages",
    "estimate",
    "dr_grpo_advantages",
    "estimator_problems",
    "grpo_advantages",
    "has_signal",
    "info_gain_scores",
    "reinforce_advantages",
    "rloo_advantages",
    "compute_policy_loss",
    "discounted_turn_returns",
    "entropy_clip_scale",
    "kl_per_token",
    "masked_mean",
    "mc_scores",
    "policy_loss_problems",
    "sft_loss",
    "truncated_importance_weights",
    "turn_level_advantages",
]
