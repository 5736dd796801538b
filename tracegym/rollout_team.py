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
to ``failed``, with ``zero_reward`` they are kept with reward 0.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

from tracegym.envs.base import Task
from tracegym.envs.episode import FAILED_END_REASONS
from tracegym.envs.team import TeamEnv, play_team_episode, team_episode_id
from tracegym.rollout import RolloutConfig, RolloutResult, RolloutStats, _batching, _RenderedPolicy, _Runner, env_factory
from tracegym.types import Trajectory, TrajectoryGroup

__all__ = ["group_by_role", "role_of", "run_team_rollouts", "run_team_rollouts_sync", "with_adapter"]


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
    factory, env_name = env_factory(env, env_options)
    assert factory is not None
    runner = _Runner(factory, env_name, policy, renderer, config, policy_name)  # type: ignore[arg-type]
    adapters = dict(adapters or {})
    if adapters and runner.mode == "token" and not _takes_adapters(policy):
        raise ValueError(f"engine {getattr(policy, 'name', policy)!r} cannot sample per-row LoRA adapters "
                         "(generate(..., adapters=)); use rollout.engine: hf or vllm")
    episodes = [(task, k) for task in tasks for k in range(config.samples_per_task)]
    kept: dict[int, list[Trajectory]] = {}
    failed: dict[int, list[Trajectory]] = {}
    end_reasons: Counter[str] = Counter()
    errors: list[str] = []
    generated = 0
    sem = asyncio.Semaphore(config.concurrency)
    t0 = time.perf_counter()

    def policies(team: TeamEnv) -> dict[str, _RenderedPolicy]:
        return {role: _RenderedPolicy(runner, _RoleView(team, role), adapter=adapters.get(role))  # type: ignore[arg-type]
                for role in team.roles}

    async def one(index: int, task: Task, k: int) -> None:
        nonlocal generated
        async with sem:
            if runner.batcher is not None:
                runner.batcher.episode_started()
            try:
                trajectories = await play_team_episode(
                    factory, task, policies, max_turns=config.max_turns, max_tokens=config.max_tokens_per_episode,
                    timeout_s=config.episode_timeout_s, sample_index=k, env_name=env_name,
                    episode_id=team_episode_id(task.id, k, salt))
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
            trajectories = [t.model_copy(update={"reward": 0.0}) for t in trajectories]
        kept[index] = trajectories
        if writer is not None:
            writer.write_all(trajectories)

    async with _batching(runner, policy, config):
        await asyncio.gather(*(one(i, task, k) for i, (task, k) in enumerate(episodes)))
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
        mean_batch_size=(batcher.rows / batcher.calls) if batcher and batcher.calls else 0.0,
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
