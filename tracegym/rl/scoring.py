"""Scoring passes between sampling and the estimator, in the order the config asks: Monte Carlo
continuation (branching at decision turns), KL to the reference in the reward, InfoPO's information
gain; then the advantage estimator, one advantage per turn."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tracegym.algos import EstimatorResult, estimate
from tracegym.algos.config import PolicyLossConfig
from tracegym.algos.kl import kl_per_token
from tracegym.batch import examples_from_groups, make_batch
from tracegym.config import RLConfig
from tracegym.envs.injection import env_source
from tracegym.rollout import RolloutConfig
from tracegym.rollout.branches import score_mc_continuation
from tracegym.train.guidance import is_guidance
from tracegym.train.info_gain import score_info_gain
from tracegym.train.policy_update import batch_logprobs, reference_logprobs
from tracegym.types import Trajectory, TrajectoryGroup

__all__ = ["kl_in_reward", "score_and_estimate", "with_reward_offset"]


def kl_in_reward(
    groups: Sequence[TrajectoryGroup], model: torch.nn.Module, reference: torch.nn.Module | None, renderer: Any,
    loss_cfg: PolicyLossConfig, *, pad_token_id: int, micro_batch_size: int, temperature: float,
) -> tuple[list[TrajectoryGroup], float]:
    """Each episode's reward minus ``beta * sum_t kl_t`` over its sampled tokens (PPO-RLHF style),
    taken off its last turn's reward; returns the new groups and the mean penalty per episode."""
    scored = examples_from_groups(groups, renderer)
    if not scored.examples:
        return list(groups), 0.0
    guide = [is_guidance(groups[g].trajectories[i]) for g, i in zip(scored.group_index, scored.trajectory_index)]
    batch = make_batch(scored.examples, pad_token_id=pad_token_id)
    kl = kl_per_token(batch_logprobs(model, batch, micro_batch_size, temperature=temperature),
                      reference_logprobs(model, reference, batch, micro_batch_size, temperature), loss_cfg.kl_estimator)
    per_example = (kl * batch.loss_mask).sum(-1) * loss_cfg.kl_coef  # [E]
    penalty: dict[tuple[int, int], float] = {}
    for e, (g, i) in enumerate(zip(scored.group_index, scored.trajectory_index)):
        if not guide[e]:  # the expert's tokens were not sampled by the policy: no KL estimate on them
            penalty[(g, i)] = penalty.get((g, i), 0.0) + float(per_example[e])
    out = [
        group.model_copy(update={"trajectories": tuple(
            with_reward_offset(t, -penalty.get((g, i), 0.0)) for i, t in enumerate(group.trajectories))})
        for g, group in enumerate(groups)
    ]
    return out, sum(penalty.values()) / max(sum(len(g) for g in groups), 1)


def score_and_estimate(
    groups: Sequence[TrajectoryGroup], tasks: Sequence[Any], cfg: RLConfig, loss_cfg: PolicyLossConfig, *,
    sampler: Any, model: torch.nn.Module, reference: torch.nn.Module | None, renderer: Any, pad_token_id: int,
    temperature: float, seed: int,
) -> tuple[list[TrajectoryGroup], EstimatorResult, float]:
    """The scoring steps the config asks for, in order, then the estimator: ``mc_continuation``
    branches at decision turns (Q(taken) - mean Q(others) in ``Turn.metrics``), KL in the reward
    takes ``beta * KL`` off each episode's last turn, ``info_gain`` scores turns (InfoPO). Returns the
    scored groups, one advantage per turn (with the estimator's and the branching step's metrics) and
    the mean KL penalty per episode (0 without KL in the reward)."""
    groups = list(groups)
    extra: dict[str, float] = {}
    if cfg.advantage.intrinsic == "mc_continuation":
        env, env_options = env_source(cfg.env.name, cfg.env.options, cfg.env.injection)
        groups, mc_stats = score_mc_continuation(
            groups, sampler, renderer, env, env_options, tasks,
            decision_turns=cfg.advantage.mc_decision_turns, k=cfg.advantage.mc_k, m=cfg.advantage.mc_m,
            config=RolloutConfig(**cfg.rollout.settings()), seed=seed,
            reach=cfg.advantage.mc_reach)
        extra = mc_stats.metrics(prefix="mc_")
    kl_penalty = 0.0
    if loss_cfg.kl_coef > 0 and loss_cfg.kl_penalty == "reward":
        groups, kl_penalty = kl_in_reward(groups, model, reference, renderer, loss_cfg, pad_token_id=pad_token_id,
                                          micro_batch_size=cfg.micro_batch_size, temperature=temperature)
    if cfg.advantage.intrinsic == "info_gain":
        groups = score_info_gain(groups, model, renderer, placeholder=cfg.advantage.placeholder, temperature=temperature,
                                 micro_batch_size=cfg.micro_batch_size, pad_token_id=pad_token_id)
    estimated = estimate(cfg.advantage.estimator, groups, cfg.advantage.options)
    return groups, EstimatorResult(estimated.advantages, {**extra, **estimated.metrics}, estimated.weights), kl_penalty


def with_reward_offset(trajectory: Trajectory, offset: float) -> Trajectory:
    """``trajectory`` with ``offset`` added to its last turn's reward and to its episode reward."""
    if not trajectory.turns or offset == 0.0:
        return trajectory
    last = trajectory.turns[-1].model_copy(update={"reward": trajectory.turns[-1].reward + offset})
    return trajectory.model_copy(update={"turns": (*trajectory.turns[:-1], last), "reward": trajectory.reward + offset})
