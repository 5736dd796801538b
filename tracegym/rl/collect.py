"""A step's groups and what happens to them before advantages: sampling through the rollout
strategy, leaving out over-long episodes, LUFFY guides for all-failure groups, the expert probe set,
and the rows' rollout metrics (also the held-out evaluation of the current policy)."""

from __future__ import annotations

import logging
import statistics
from typing import Any, Sequence

import numpy as np

from tracegym.config import RLConfig
from tracegym.envs.injection import env_source
from tracegym.eval.metrics import injection_figures
from tracegym.eval.toolcalls import call_failure_stats
from tracegym.render.call_errors import failure_metrics
from tracegym.rollout import RolloutConfig, RolloutResult, run_rollouts_sync
from tracegym.rollout.strategies import RolloutJob, run_strategy_sync
from tracegym.train.guidance import add_guidance, is_guidance, needs_guidance
from tracegym.types import Trajectory, TrajectoryGroup, group_trajectories

log = logging.getLogger(__name__)

__all__ = ["call_failure_metrics", "collect_groups", "drop_overlong", "evaluate_policy", "expert_episodes", "guide_groups", "injection_metrics",
           "reward_part_metrics", "rollout_metrics", "starting_probe"]


def collect_groups(
    sampler: Any, cfg: RLConfig, tasks: Sequence[Any], renderer: Any, *, seed: int, writer: Any | None = None,
    gap_model: Any | None = None,
) -> tuple[list[TrajectoryGroup], RolloutResult]:
    """``group_size`` episodes of every task with the current policy -> one group per task, sampled
    by the rollout strategy ``rollout.strategy`` (independent chains, a tree's leaves, a plugin's)."""
    rollout_cfg = RolloutConfig(**cfg.rollout.settings(), samples_per_task=cfg.group_size, seed=seed)
    env, env_options = env_source(cfg.env.name, cfg.env.options, cfg.env.injection)
    job = RolloutJob(env, tasks, sampler, renderer, rollout_cfg, env_options=env_options, writer=writer,
                     policy_name="policy", gap_model=gap_model)
    result = run_strategy_sync(cfg.rollout.strategy, job, cfg.rollout.strategy_settings())
    return group_trajectories(result.trajectories), result


def injection_metrics(trajectories: Sequence[Trajectory], prefix: str) -> dict[str, float]:
    """``{prefix}asr`` (attack success rate of the injected episodes), ``{prefix}utility_clean`` /
    ``{prefix}utility_injected`` (their success rates) and ``{prefix}injected`` (the injected share);
    {} for episodes without injections."""
    figures = injection_figures(trajectories, n_resamples=1)  # rows log the rates, not intervals
    if figures is None:
        return {}
    total = figures["injected_episodes"] + figures["clean_episodes"]
    out = {f"{prefix}injected": figures["injected_episodes"] / max(total, 1)}
    for key in ("asr", "utility_clean", "utility_injected"):
        if figures[key] is not None:
            out[f"{prefix}{key}"] = float(figures[key])
    return out


def rollout_metrics(groups: Sequence[TrajectoryGroup], results: Sequence[RolloutResult]) -> dict[str, float]:
    """Rewards, episode shape, env failures and sampling speed of this step's rollouts (the policy's
    own episodes: guidance trajectories are counted in ``guidance/groups``, not here)."""
    episodes: list[Trajectory] = [t for g in groups for t in g.trajectories if not is_guidance(t)]
    rewards = [t.reward for t in episodes]
    mean = lambda values: float(statistics.fmean(values)) if values else 0.0  # noqa: E731
    metrics = {
        "reward/mean": mean(rewards),
        "reward/std": float(np.std(rewards)) if rewards else 0.0,
        "success_rate": mean([float(t.success) for t in episodes]),
        "episode/turns": mean([sum(1 for u in t.turns if u.kind == "action") for t in episodes]),  # env steps
        "episode/generated_tokens": mean([t.num_generated_tokens for t in episodes]),
        "env/errors": float(sum(r.stats.failed for r in results)),
        **reward_part_metrics(episodes),
        "rollout/tokens_per_s": mean([r.stats.tokens_per_s for r in results]),
        "rollout/generated_tokens": float(sum(r.stats.generated_tokens for r in results)),  # what the engine sampled
        **injection_metrics(episodes, "attack/"),
        **call_failure_metrics(episodes),
    }
    summaries = [sum(1 for u in t.turns if u.kind == "summary") for t in episodes]
    if any(summaries):  # rollout.context: summarize
        metrics["episode/summaries"] = mean(summaries)
    for r in results:
        for reason, count in r.stats.end_reasons.items():
            metrics[f"end/{reason}"] = metrics.get(f"end/{reason}", 0.0) + float(count)
        for key, value in r.stats.extra.items():  # e.g. the tree rollouts' tree/leaves, tree/generated_tokens
            metrics[key] = metrics.get(key, 0.0) + value
        if r.stats.logprob_gap is not None:
            metrics["logprob_gap/mean"] = r.stats.logprob_gap.mean
            metrics["logprob_gap/max"] = max(metrics.get("logprob_gap/max", 0.0), r.stats.logprob_gap.max)
    return metrics


def call_failure_metrics(episodes: Sequence[Trajectory]) -> dict[str, float]:
    """Why this step's tool calls failed (the eval report's table, per RL step): ``calls/attempted``,
    ``calls/failure_rate`` (per attempt) and ``parse_errors/<reason>`` counts; {} when no episode
    declared tools or failed a call."""
    stats = call_failure_stats(episodes)
    if not stats.attempted_calls and not stats.failed_calls:
        return {}
    return {"calls/attempted": float(stats.attempted_calls), "calls/failure_rate": stats.rate(stats.failed_calls),
            **failure_metrics(stats.counts)}


def drop_overlong(
    groups: Sequence[TrajectoryGroup], tasks: Sequence[Any], renderer: Any, max_length: int,
) -> tuple[list[TrajectoryGroup], list[Any], int]:
    """Leave out, before any advantage exists, every episode with a training example longer than
    ``max_length`` tokens; returns the kept groups, their tasks and the number of episodes left out.

    Why before: dropped after estimation, a group's kept advantages no longer sum to 0, and the
    episodes that run long are mostly failures, so the kept rows would be biased upwards. A group
    left with no episode goes, with its task."""
    kept_groups, dropped = [], 0
    for group in groups:
        kept = tuple(t for t in group.trajectories
                     if all(len(e) <= max_length for e in renderer.build_examples(t)))
        dropped += len(group.trajectories) - len(kept)
        if kept:
            kept_groups.append(group if len(kept) == len(group.trajectories)
                               else group.model_copy(update={"trajectories": kept}))
    present = {g.task_id for g in kept_groups}
    return kept_groups, [t for t in tasks if t.id in present], dropped


def reward_part_metrics(episodes: Sequence[Trajectory]) -> dict[str, float]:
    """Mean of every named reward part (``reward/<part>`` in ``Trajectory.metrics``, unweighted,
    summed over the episode; docs/environments.md, "Reward parts") over the episodes that have it."""
    sums: dict[str, list[float]] = {}
    for t in episodes:
        for key, value in t.reward_parts.items():
            sums.setdefault(f"reward/{key}", []).append(float(value))
    return {key: float(statistics.fmean(values)) for key, values in sorted(sums.items())}


def guide_groups(
    groups: Sequence[TrajectoryGroup], tasks: Sequence[Any], cfg: RLConfig, renderer: Any, seed: int,
) -> tuple[list[TrajectoryGroup], int]:
    """With ``guidance``: the env's expert trajectory joins each group whose samples all failed
    (before advantages: the group then carries signal and still sums to 0). Returns the groups and
    the number guided. A group whose expert episode failed too (or an env without an expert) stays
    unguided and is counted in ``guidance/unsolved`` (the groups needing guidance minus those guided)."""
    if cfg.guidance is None:
        return list(groups), 0
    chosen = needs_guidance(groups, cfg.guidance)
    if not chosen:
        return list(groups), 0
    wanted = {groups[g].task_id for g in chosen}
    guides = expert_episodes(cfg, [t for t in tasks if t.id in wanted], renderer, seed=seed, injection=True)
    return add_guidance(groups, guides, chosen)


def expert_episodes(cfg: RLConfig, tasks: Sequence[Any], renderer: Any, *, seed: int,
                    injection: bool = False) -> dict[str, Trajectory]:
    """The env's expert on ``tasks`` (greedy, on the policy's token path): ``{task_id: trajectory}`` of
    the episodes it solved whose examples fit ``max_length`` (a guide dropped for length after
    advantages would leave its group's failures with negative advantages alone). The runner records
    an expert that raises as a failed episode, so an env without one gives {}."""
    if not tasks:
        return {}
    env, env_options = env_source(cfg.env.name, cfg.env.options, cfg.env.injection if injection else None)
    config = RolloutConfig(**cfg.rollout.settings(temperature=0.0), samples_per_task=1, seed=seed)
    result = run_rollouts_sync(env, list(tasks), "expert", renderer, config, progress=False, env_options=env_options,
                               policy_name="expert")
    return {t.task_id: t for t in result.trajectories
            if t.success and all(len(e) <= cfg.max_length for e in renderer.build_examples(t))}


def starting_probe(cfg: RLConfig, train_tasks: Sequence[Any], renderer: Any) -> list[Any]:
    """Before training, one expert pass over the first train tasks serves two ends: the fixed probe
    set of ``drift/probe_nll`` (``health.probe_tasks`` tasks, as training examples; [] when off or
    when the expert solves none), and with ``guidance`` the check that the env's expert solves a
    task at all, so an env without a working expert fails here instead of never guiding."""
    wanted = max(cfg.health.probe_tasks, 1 if cfg.guidance is not None else 0)
    solved = expert_episodes(cfg, list(train_tasks)[:wanted], renderer, seed=cfg.seed + 31)
    if cfg.guidance is not None and not solved:
        raise ValueError(f"guidance: the expert of env {cfg.env.name!r} did not solve a train task within the rollout "
                         "limits (rollout.max_turns, max_tokens_per_turn); guidance needs an env with a working "
                         "expert_action, or drop the guidance section")
    probe_ids = [t.id for t in list(train_tasks)[: cfg.health.probe_tasks]]
    examples = [e for task_id in probe_ids if task_id in solved for e in renderer.build_examples(solved[task_id])]
    if cfg.health.probe_tasks and not examples:
        log.info("no probe set: the expert of env %r solved none of %d train tasks (drift/probe_nll off)",
                 cfg.env.name, cfg.health.probe_tasks)
    return examples


def expert_replay_pool(cfg: RLConfig, train_tasks: Sequence[Any], renderer: Any) -> list[list[Any]]:
    """``expert_replay``'s pool: per train task the expert solved (of the first ``tasks``), its
    training examples. [] when off; ValueError when the expert solves none (a mix of nothing)."""
    if cfg.expert_replay is None:
        return []
    tasks = list(train_tasks)[: cfg.expert_replay.tasks]
    solved = expert_episodes(cfg, tasks, renderer, seed=cfg.seed + 37)
    pool = [renderer.build_examples(solved[task.id]) for task in tasks if task.id in solved]
    if not pool:
        raise ValueError(f"expert_replay: the expert of env {cfg.env.name!r} solved none of {len(tasks)} train tasks "
                         "within the rollout limits; it needs an env with a working expert_action")
    log.info("expert_replay: %d of %d train tasks solved by the expert form the pool", len(pool), len(tasks))
    return pool


def replay_examples(pool: Sequence[Sequence[Any]], step: int, per_step: int) -> list[Any]:
    """The examples of step ``step`` (1-based): ``per_step`` pool entries from ``(step - 1) *
    per_step`` on, around the pool's end; a function of the step alone, so resuming replays alike."""
    if not pool:
        return []
    start = (step - 1) * per_step
    return [example for i in range(start, start + per_step) for example in pool[i % len(pool)]]


def evaluate_policy(cfg: RLConfig, sampler: Any, renderer: Any, tasks: Sequence[Any], seed: int) -> dict[str, float]:
    """pass@1 and success rate of the current policy on held-out tasks (as many samples as configured)."""
    from tracegym.eval import summarize

    rollout_cfg = RolloutConfig(
        **cfg.rollout.settings(temperature=cfg.eval.temperature, measure_logprob_gap=False),
        samples_per_task=cfg.eval.samples_per_task, seed=seed,
    )
    env, env_options = env_source(cfg.env.name, cfg.env.options, cfg.env.injection)
    if cfg.rollout.strategy == "harness":  # the agent is what is evaluated: its episodes, through its gateway
        job = RolloutJob(env, tasks, sampler, renderer, rollout_cfg, env_options=env_options, policy_name="policy")
        result = run_strategy_sync("harness", job, cfg.rollout.strategy_settings())
    else:
        result = run_rollouts_sync(env, tasks, sampler, renderer, rollout_cfg, progress=False,
                                   env_options=env_options, policy_name="policy")
    summary = summarize(result.trajectories + result.failed, ks=[1], turns=[cfg.rollout.max_turns], env=cfg.env.name,
                        n_bootstrap=200)  # failed episodes count as unsolved
    return {"eval/pass@1": summary["pass_at"][str(cfg.rollout.max_turns)]["1"], "eval/success_rate": summary["success_rate"],
            "eval/turns": summary["cost"]["turns"], "eval/env_errors": float(result.stats.failed),
            **injection_metrics(result.trajectories + result.failed, "eval/")}
