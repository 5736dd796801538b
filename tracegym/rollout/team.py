"""Team rollouts: many team episodes at once, every role's turns in the same engine batches.

    result = run_team_rollouts_sync("calc_relay", tasks, engine, renderer, RolloutConfig(max_turns=6),
                                    adapters={"planner": "planner", "solver": "solver"})
    result.trajectories       # one per role per episode, info["role"], info["episode_id"]
    groups = group_by_role(result.trajectories)   # one group per (task, role): MAGRPO's baselines

Each episode is :func:`tracegym.envs.team.play_team_episode` with one policy per role: the rollout
runner's token-in/token-out policy (``tracegym.rollout``) bound to the role's LoRA adapter. All
episodes waiting for the model go into one ``engine.generate`` call, with ``adapters=[...]`` naming
each row's adapter, so a planner's and a solver's turns decode together in one forward pass (the hf
engine passes peft's ``adapter_names``; vLLM serves a ``LoRARequest`` per row). ``adapters`` None
(or a role mapped to None) samples with the model as is: one shared policy for every role.

Failure isolation is the single-agent runner's: a failed episode (env error, hang, engine error)
fails every role of that episode only; with ``on_env_error: exclude`` all its role trajectories go
to ``failed``, with ``zero_reward`` they are kept with reward 0 (episode and turns, ``rollout.zero_reward``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from tracegym.envs.base import Task
from tracegym.envs.episode import FAILED_END_REASONS, Action
from tracegym.envs.team import TeamEnv, play_team_episode, team_episode_id
from tracegym.rollout.runner import (RolloutConfig, RolloutResult, RolloutStats, batching, RenderedPolicy, EpisodeRunner, env_factory,
                              zero_reward)
from tracegym.types import Trajectory, TrajectoryGroup

__all__ = ["CounterfactualStats", "TeamEpisode", "group_by_role", "score_team_counterfactual", "role_of", "run_team_episodes", "run_team_rollouts", "run_team_rollouts_sync",
           "with_adapter"]


def role_of(trajectory: Trajectory) -> str | None:
    """The team role a trajectory was played by (None for a single-agent trajectory)."""
    role = trajectory.info.get("role")
    return role if isinstance(role, str) else None


def group_by_role(trajectories: Sequence[Trajectory]) -> list[TrajectoryGroup]:
    """One group per (task, role), in order of first appearance: the samples a role's group baseline
    compares (MAGRPO). A group's ``task_id`` is ``"<task id>@<role>"``; single-agent trajectories
    keep their task id."""
    groups: dict[tuple[str, str, str | None], list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault((t.env, t.task_id, role_of(t)), []).append(t)
    return [TrajectoryGroup(env=env, task_id=task if role is None else f"{task}@{role}", trajectories=tuple(ts))
            for (env, task, role), ts in groups.items()]


class _RoleView:
    """What a role's runner policy sees of the team env: the scripted expert plays that role."""

    def __init__(self, env: TeamEnv, role: str):
        self._env, self._role = env, role

    def expert_action(self) -> Any:
        return self._env.expert_action(self._role)


async def run_team_rollouts(
    env: str | Callable[[], TeamEnv],
    tasks: Sequence[Task],
    policy: Any,
    renderer: Any,
    config: RolloutConfig | None = None,
    *,
    adapters: Mapping[str, str | None] | None = None,
    env_options: dict[str, Any] | None = None,
    writer: Any | None = None,
    policy_name: str = "policy",
    salt: str = "",
) -> RolloutResult:
    """``len(tasks) * samples_per_task`` team episodes. ``policy``: a token engine (``generate``; with
    ``adapters``, one that takes ``adapters=``), a chat engine or ``"expert"``. ``adapters``: role ->
    LoRA adapter name (None: the model as is). ``config.max_turns`` counts every role's turns.
    ``trajectories``: the kept episodes' role trajectories in (task, sample, role) order."""
    config = config or RolloutConfig()
    episodes = [TeamEpisode(task, k) for task in tasks for k in range(config.samples_per_task)]
    return await _run_team(env, episodes, policy, renderer, config, adapters=adapters, env_options=env_options,
                           writer=writer, policy_name=policy_name, salt=salt)


@dataclass(frozen=True)
class TeamEpisode:
    """One episode of :func:`run_team_episodes`: ``task`` (sample ``sample_index``), whose roles
    first play their ``prefix`` actions verbatim (role -> that role's first actions, token data as
    recorded, no engine call), then sample."""

    task: Task
    sample_index: int = 0
    prefix: Mapping[str, tuple[Action, ...]] = field(default_factory=dict)


async def run_team_episodes(
    env: str | Callable[[], TeamEnv], episodes: Sequence[TeamEpisode], policy: Any, renderer: Any,
    config: RolloutConfig | None = None, *, adapters: Mapping[str, str | None] | None = None,
    env_options: dict[str, Any] | None = None, salt: str = "",
) -> RolloutResult:
    """Play ``episodes`` (each with its forced per-role prefix) through the same batcher as
    :func:`run_team_rollouts`; ``trajectories`` and ``failed`` are in the order given."""
    return await _run_team(env, episodes, policy, renderer, config or RolloutConfig(), adapters=adapters,
                           env_options=env_options, salt=salt)


async def _run_team(
    env: str | Callable[[], TeamEnv], episodes: Sequence[TeamEpisode], policy: Any, renderer: Any,
    config: RolloutConfig, *, adapters: Mapping[str, str | None] | None = None,
    env_options: dict[str, Any] | None = None, writer: Any | None = None, policy_name: str = "policy",
    salt: str = "",
) -> RolloutResult:
    factory, env_name = env_factory(env, env_options)
    assert factory is not None
    runner = EpisodeRunner(factory, env_name, policy, renderer, config, policy_name)  # type: ignore[arg-type]
    adapters = dict(adapters or {})
    if adapters and runner.mode == "token" and not _takes_adapters(policy):
        raise ValueError(f"engine {getattr(policy, 'name', policy)!r} cannot sample per-row LoRA adapters "
                         "(generate(..., adapters=)); use rollout.engine: hf or vllm")
    kept: dict[int, list[Trajectory]] = {}
    failed: dict[int, list[Trajectory]] = {}
    end_reasons: Counter[str] = Counter()
    errors: list[str] = []
    generated = 0
    sem = asyncio.Semaphore(config.concurrency)
    t0 = time.perf_counter()

    def policies(team: TeamEnv, prefix: Mapping[str, tuple[Action, ...]]) -> dict[str, RenderedPolicy]:
        return {role: RenderedPolicy(runner, _RoleView(team, role), prefix=prefix.get(role, ()),  # type: ignore[arg-type]
                                      adapter=adapters.get(role))
                for role in team.roles}

    async def one(index: int, episode: TeamEpisode) -> None:
        nonlocal generated
        task, k = episode.task, episode.sample_index
        async with sem:
            if runner.batcher is not None:
                runner.batcher.episode_started()
            try:
                trajectories = await play_team_episode(
                    factory, task, lambda team: policies(team, episode.prefix), max_turns=config.max_turns,
                    max_tokens=config.max_tokens_per_episode, timeout_s=config.episode_timeout_s, sample_index=k,
                    env_name=env_name, episode_id=team_episode_id(task.id, k, salt))
            finally:
                if runner.batcher is not None:
                    runner.batcher.episode_finished()
        first = trajectories[0]
        end_reasons[first.end_reason] += 1
        generated += sum(t.num_generated_tokens for t in trajectories)
        if first.end_reason in FAILED_END_REASONS:
            if len(errors) < 20:
                errors.append(f"{task.id}/{k}: {first.end_reason}: {first.error}")
            if config.on_env_error == "exclude":
                failed[index] = trajectories
                return
            trajectories = [zero_reward(t) for t in trajectories]
        kept[index] = trajectories
        if writer is not None:
            writer.write_all(trajectories)

    # per-turn batching: the roles' rows carry their own adapters, which one running batch does not mix
    async with batching(runner, policy, config, continuous=False):
        await asyncio.gather(*(one(i, episode) for i, episode in enumerate(episodes)))
    wall = time.perf_counter() - t0
    kept_trajectories = [t for i in sorted(kept) for t in kept[i]]
    firsts = [kept[i][0] for i in sorted(kept)]
    batcher = runner.batcher
    stats = RolloutStats(
        episodes=len(episodes), kept=len(kept), failed=sum(end_reasons[r] for r in FAILED_END_REASONS),
        end_reasons=dict(end_reasons), errors=errors,
        success_rate=sum(t.success for t in firsts) / len(firsts) if firsts else 0.0,
        mean_reward=sum(t.reward for t in firsts) / len(firsts) if firsts else 0.0,
        turns=sum(len(t.turns) for ts in list(kept.values()) + list(failed.values()) for t in ts),
        generated_tokens=generated,
        generate_calls=batcher.calls if batcher else 0,
        mean_batch_size=batcher.mean_batch_size if batcher else 0.0,
        wall_time_s=wall, episodes_per_s=len(episodes) / wall if wall > 0 else 0.0,
        tokens_per_s=generated / wall if wall > 0 else 0.0,
    )
    return RolloutResult(trajectories=kept_trajectories, stats=stats,
                         failed=[t for i in sorted(failed) for t in failed[i]])


class _AdapterBound:
    """An engine that samples every row with one named adapter (see :func:`with_adapter`)."""

    def __init__(self, engine: Any, adapter: str):
        if not _takes_adapters(engine):
            raise ValueError(f"engine {getattr(engine, 'name', engine)!r} cannot sample a named LoRA adapter")
        self.engine, self.adapter = engine, adapter
        self.name = getattr(engine, "name", "engine")

    @property
    def capabilities(self) -> Any:
        return self.engine.capabilities

    @property
    def model(self) -> Any:
        return getattr(self.engine, "model", None)

    def generate(self, prompts: Sequence[Sequence[int]], params: Any) -> Any:
        return self.engine.generate(prompts, params, adapters=[self.adapter] * len(prompts))

    def update_weights(self, model_or_state: Any) -> None:
        self.engine.update_weights(model_or_state)

    def clear_cache(self) -> None:
        clear = getattr(self.engine, "clear_cache", None)
        if callable(clear):
            clear()


def with_adapter(engine: Any, adapter: str) -> Any:
    """``engine`` as a single-policy sampler that uses LoRA adapter ``adapter`` for every row: a
    role of a pool played in an ordinary (single-agent) rollout run, e.g. self-play's solver."""
    return _AdapterBound(engine, adapter)


def _takes_adapters(engine: Any) -> bool:
    import inspect

    try:
        return "adapters" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False


def run_team_rollouts_sync(*args: Any, **kwargs: Any) -> RolloutResult:
    """``asyncio.run(run_team_rollouts(...))`` for callers without an event loop."""
    return asyncio.run(run_team_rollouts(*args, **kwargs))


# --- counterfactual credit per role (C3) -------------------------------------------------------------


@dataclass
class CounterfactualStats:
    """What :func:`score_team_counterfactual` did: decision points scored, episodes it played, tokens
    they sampled (prefixes excluded), and the mean |credit|."""

    decisions: int = 0
    continuations: int = 0
    generated_tokens: int = 0
    credit_abs_mean: float = 0.0

    def metrics(self, prefix: str = "c3_") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in vars(self).items()}


def _decision_turns(order: Sequence[str], which: Any) -> list[int]:
    if which == "all":
        return list(range(len(order)))
    if which == "first":
        return [0] if order else []
    return [t for t in which if 0 <= t < len(order)]


async def score_team_counterfactual(
    env: str | Callable[[], TeamEnv], trajectories: Sequence[Trajectory], tasks: Sequence[Task], policy: Any,
    renderer: Any, config: RolloutConfig, *, adapters: Mapping[str, str | None] | None = None,
    env_options: dict[str, Any] | None = None, k: int = 2, m: int = 2, decision_turns: Any = "all", salt: str = "",
) -> tuple[list[Trajectory], CounterfactualStats]:
    """Per-role counterfactual credit (C3): at each decision turn t of a team episode, the acting
    role's message is kept (its outcome Q(taken): ``m`` continuations of the rest of the episode
    after it) or replaced by ``k - 1`` fresh samples of that role (each with ``m`` continuations),
    the other roles answering as their policies do. ``Turn.metrics["mc_advantage"] = Q(taken) -
    mean Q(replacements)``, with Q the acting role's reward; the ``mc_continuation`` estimator reads
    it. Episodes are reached by replaying their recorded actions (team envs are deterministic given
    the messages). Returns the trajectories with the scores, in the order given."""
    from tracegym.rollout.branches import recorded_action

    by_id = {t.id: t for t in tasks}
    by_episode: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_episode.setdefault(str(t.info.get("episode_id")), []).append(t)
    items: list[TeamEpisode] = []
    owner: list[tuple[str, str, int, bool]] = []  # (episode id, role, role turn, taken?) per item
    for episode_id, team in by_episode.items():
        if any(t.end_reason in FAILED_END_REASONS for t in team):
            continue  # a failed episode cannot be replayed faithfully; its turns keep no score
        roles = {role_of(t): t for t in team}
        order = list(team[0].info.get("team_order", []))
        task = by_id[team[0].task_id]
        done: dict[str, int] = {role: 0 for role in roles}
        for turn_index, role in enumerate(order):
            if turn_index in _decision_turns(order, decision_turns) and done[role] < len(roles[role].turns):
                before = {r: tuple(recorded_action(x) for x in roles[r].turns[:done[r]]) for r in roles}
                taken = {**before, role: before[role] + (recorded_action(roles[role].turns[done[role]]),)}
                for prefix, is_taken, count in ((taken, True, m), (before, False, (k - 1) * m)):
                    for _ in range(count):
                        items.append(TeamEpisode(task, sample_index=len(items), prefix=prefix))
                        owner.append((episode_id, role, done[role], is_taken))
            done[role] += 1
    stats = CounterfactualStats()
    if not items:
        return list(trajectories), stats
    run_config = config.model_copy(update={"on_env_error": "zero_reward", "samples_per_task": 1})
    result = await run_team_episodes(env, items, policy, renderer, run_config, adapters=adapters,
                                     env_options=env_options, salt=f"c3{salt}")
    outcome: dict[int, dict[str, Trajectory]] = {}
    for t in result.trajectories:
        outcome.setdefault(t.sample_index, {})[role_of(t) or ""] = t
    q: dict[tuple[str, str, int], tuple[list[float], list[float]]] = {}
    for index, (episode_id, role, turn, is_taken) in enumerate(owner):
        played = outcome.get(index, {}).get(role)
        value = played.reward if played is not None else 0.0
        q.setdefault((episode_id, role, turn), ([], []))[0 if is_taken else 1].append(value)
        if played is not None:
            stats.generated_tokens += sum(len(x.completion_ids) for x in played.turns[len(items[index].prefix.get(role, ())):])
    stats.decisions, stats.continuations = len(q), len(items)
    credits = {key: sum(taken) / len(taken) - sum(others) / len(others) for key, (taken, others) in q.items()}
    stats.credit_abs_mean = sum(abs(v) for v in credits.values()) / len(credits)
    out = []
    for t in trajectories:
        role, episode_id = role_of(t), str(t.info.get("episode_id"))
        turns = tuple(turn.model_copy(update={"metrics": {**turn.metrics, "mc_advantage": credits[(episode_id, role, j)]}})
                      if (episode_id, role, j) in credits else turn for j, turn in enumerate(t.turns))
        scored = [j for j in range(len(t.turns)) if (episode_id, role, j) in credits]
        # every trajectory is marked, so the estimator tells "nothing could be scored" from "never ran"
        marker = {"scored_turns": scored, "k": k, "m": m, "reach": "replay", "team": True}
        out.append(t.model_copy(update={"turns": turns, "info": {**t.info, "mc_continuation": marker}}))
    return out, stats
