"""Scoring passes between sampling and the estimator, then the estimator, one advantage per turn.

A scoring pass reads a step's groups and returns them with something added: turn scores in
``Turn.metrics`` that an estimator reads, or reward offsets. Passes are plugins like estimators and
losses: ``advantage.intrinsic`` names one of ``SCORING_PASSES`` (``none``: no pass) and
``advantage.intrinsic_options`` are its options, validated by its options model (nearest-name
errors for unknown names). Built in:

- ``mc_continuation``: Monte Carlo continuation (VinePPO/C3), branching at decision turns
  (Q(taken) - mean Q(others) in ``Turn.metrics``); its options are ``advantage.mc_*``;
- ``info_gain``: InfoPO's information gain of each observation (``advantage.placeholder``).

Then, with ``policy_loss.kl_penalty: reward``, ``beta * KL`` to the reference comes off each
episode's last turn, and the estimator runs. A user's pass in a plain module, loaded with
``--plugin FILE`` (``examples/plugins/overlong_penalty.py`` is a whole one)::

    @SCORING_PASSES.register("my_pass")
    def my_pass(job: ScoringJob, *, weight: float = 1.0) -> tuple[list[TrajectoryGroup], dict[str, float]]:
        return [...groups with rewards or turn metrics changed...], {"my_pass/mean": ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tracegym.algos import EstimatorResult, estimate
from tracegym.algos.config import PolicyLossConfig
from tracegym.algos.kl import kl_per_token
from tracegym.algos.registry import Registry
from tracegym.batch import examples_from_groups, make_batch
from tracegym.config import RLConfig
from tracegym.envs.injection import env_source
from tracegym.rollout import RolloutConfig
from tracegym.rollout.branches import score_mc_continuation
from tracegym.train.guidance import is_guidance
from tracegym.train.info_gain import score_info_gain
from tracegym.train.policy_update import batch_logprobs, reference_logprobs
from tracegym.types import Trajectory, TrajectoryGroup

__all__ = ["NO_PASS", "SCORING_PASSES", "ScoringJob", "kl_in_reward", "score_and_estimate", "scoring_problems",
           "with_reward_offset"]

NO_PASS = "none"  # ``advantage.intrinsic`` value that runs no scoring pass

SCORING_PASSES: Registry = Registry(
    "scoring pass", "fn(job: ScoringJob, options) -> (groups, metrics: dict[str, float])")
"""``fn(job, options) -> (groups, metrics)``: the step's groups with scores or reward offsets added."""


@dataclass(frozen=True)
class ScoringJob:
    """What a scoring pass gets: the step's groups (guides included) and the tasks they came from,
    the run's config, the policy (``sampler`` to play continuations with, ``model`` to score
    tokens with) and its renderer."""

    groups: list[TrajectoryGroup]
    tasks: Sequence[Any]
    cfg: RLConfig
    sampler: Any
    model: torch.nn.Module
    renderer: Any
    pad_token_id: int
    temperature: float
    seed: int


@SCORING_PASSES.register("mc_continuation")
def mc_continuation_pass(job: ScoringJob) -> tuple[list[TrajectoryGroup], dict[str, float]]:
    """Branch at decision turns (``advantage.mc_k`` actions x ``mc_m`` continuations each)."""
    adv = job.cfg.advantage
    env, env_options = env_source(job.cfg.env.name, job.cfg.env.options, job.cfg.env.injection)
    groups, stats = score_mc_continuation(
        job.groups, job.sampler, job.renderer, env, env_options, job.tasks, decision_turns=adv.mc_decision_turns,
        k=adv.mc_k, m=adv.mc_m, config=RolloutConfig(**job.cfg.rollout.settings()), seed=job.seed, reach=adv.mc_reach)
    return groups, stats.metrics(prefix="mc_")


@SCORING_PASSES.register("info_gain")
def info_gain_pass(job: ScoringJob) -> tuple[list[TrajectoryGroup], dict[str, float]]:
    """InfoPO: score every turn by how much its observation changes the next action's log-prob."""
    groups = score_info_gain(job.groups, job.model, job.renderer, placeholder=job.cfg.advantage.placeholder,
                             temperature=job.temperature, micro_batch_size=job.cfg.micro_batch_size,
                             pad_token_id=job.pad_token_id)
    return groups, {}


def scoring_problems(name: str, options: dict[str, Any] | None) -> list[str]:
    """One line per problem with ``advantage.intrinsic`` or its options ([] when both are fine)."""
    if name == NO_PASS:
        return [f"advantage.intrinsic_options: {sorted(options)} given but no scoring pass is set"] if options else []
    return SCORING_PASSES.problems(name, options, "advantage.intrinsic", "advantage.intrinsic_options")


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
    """The scoring pass the config names (``advantage.intrinsic``), KL in the reward (``beta * KL``
    off each episode's last turn), then the estimator. Returns the scored groups, one advantage per
    turn (with the estimator's and the pass's metrics) and the mean KL penalty per episode (0
    without KL in the reward). A pass and KL in the reward commute (the built-in passes read
    tokens, not rewards), so the pass runs first: branching then plays from unpenalised episodes."""
    groups = list(groups)
    extra: dict[str, float] = {}
    if cfg.advantage.intrinsic != NO_PASS:
        job = ScoringJob(groups, tasks, cfg, sampler, model, renderer, pad_token_id, temperature, seed)
        groups, extra = SCORING_PASSES.entry(cfg.advantage.intrinsic)(job, cfg.advantage.intrinsic_options)
        groups = list(groups)
    kl_penalty = 0.0
    if loss_cfg.kl_coef > 0 and loss_cfg.kl_penalty == "reward":
        groups, kl_penalty = kl_in_reward(groups, model, reference, renderer, loss_cfg, pad_token_id=pad_token_id,
                                          micro_batch_size=cfg.micro_batch_size, temperature=temperature)
    estimated = estimate(cfg.advantage.estimator, groups, cfg.advantage.options)
    return groups, EstimatorResult(estimated.advantages, {**extra, **estimated.metrics}, estimated.weights), kl_penalty


def with_reward_offset(trajectory: Trajectory, offset: float) -> Trajectory:
    """``trajectory`` with ``offset`` added to its last turn's reward and to its episode reward."""
    if not trajectory.turns or offset == 0.0:
        return trajectory
    last = trajectory.turns[-1].model_copy(update={"reward": trajectory.turns[-1].reward + offset})
    return trajectory.model_copy(update={"turns": (*trajectory.turns[:-1], last), "reward": trajectory.reward + offset})
