"""Monte-Carlo continuation scores (VinePPO / C3 style): branch recorded trajectories at decision turns.

For a trajectory and a chosen decision turn ``t`` (``decision_turns``: ``"all"``, ``"first"`` or a
list of turn indices)::

    a_0            = the recorded action of turn t (its exact tokens)
    a_1 .. a_{K-1} ~ pi(. | prompt of turn t)               K-1 alternatives, one batched generate call
    Q_k            = (1/M) sum_m  sum_{turns u >= t} r_u      M continuations after a_k, played with pi
    A_k            = Q_k - mean_{l != k} Q_l                  leave-one-out baseline

and ``Turn.metrics["mc_advantage"] = A_0`` on turn ``t`` (plus ``mc_q = Q_0`` and
``mc_baseline = mean_{l != 0} Q_l``); turns not chosen get nothing. The rewards before ``t`` are the
same for every branch and left out. ``A_0`` is an unbiased estimate of the advantage of the taken
action: ``Q_0`` is an unbiased estimate of ``Q(h_t, a_0)``, and the baseline is built from
alternatives sampled independently of ``a_0`` from the same ``pi(. | h_t)``, an unbiased estimate of
``V(h_t)`` that does not depend on ``a_0`` (the RLOO argument of Kool et al. 2019 at the turn level).

Reaching the branch point (``reach``):

- ``"snapshot"``: the recorded actions ``0..t-1`` are replayed once per trajectory on a fresh env
  (``reset(task)`` then ``step`` with each recorded assistant message), checked against the
  recording, and ``Env.snapshot()`` is taken before each decision turn; every continuation restores
  it on a fresh env of the same options. Needs ``env.can_branch`` (every built-in env).
- ``"replay"``: every continuation replays the prefix on its own fresh env (checked). For envs
  that cannot branch but are deterministic; an env declares that with a class attribute
  ``deterministic_replay = True``. Forcing ``reach="replay"`` on another env asserts it.
- ``"auto"`` (default): snapshot when the env can branch, else replay when it declares
  ``deterministic_replay``, else refused (:class:`BranchingUnsupported`, naming the env).

Every replay compares the reset messages, and after each recorded action the env's messages, reward
and termination, with the recording; a difference raises :class:`ReplayMismatch` naming the env,
task, sample and turn (the env is not deterministic, or the trajectory came from other options).

The continuations go through the one episode loop and the rollout batcher
(``tracegym.rollout.run_prefixed_episodes``): each episode's policy plays the recorded prefix
verbatim (recorded token data; the env wrapper answers those turns with the recorded observations,
so the prefix costs no env step and no engine call), then the forced action ``a_k`` (prompt = turn
``t``'s ``prompt_ids``, the sampled ids as they came), then samples from the engine, all episodes
of all branches in the same batched ``generate`` calls. Turn and token limits count from the
episode's start as in the original rollout. Failed continuations (env error, timeout, engine
error) are left out of ``Q`` with ``on_env_error="exclude"`` and count 0 with ``"zero_reward"``;
a decision turn whose actual action or all alternatives have no continuation left is not scored.

Cost: ``(K - 1)`` sampled actions and ``K * M`` continuation episodes per decision turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from tracegym.envs.base import Env, EnvSnapshot, Task
from tracegym.envs.episode import FAILED_END_REASONS, Action, TokenData
from tracegym.rollout.runner import PrefixedEpisode, RolloutConfig, cut_generation, env_factory, run_prefixed_episodes, zero_reward
from tracegym.types import Message, SamplingParams, StepResult, Trajectory, TrajectoryGroup, Turn

log = logging.getLogger(__name__)

METRIC = "mc_advantage"
INFO_KEY = "mc_continuation"

DecisionTurns = Literal["all", "first"] | Sequence[int]
Reach = Literal["auto", "snapshot", "replay"]


class BranchingUnsupported(ValueError):
    """The env can neither branch (snapshot/restore) nor be replayed deterministically."""


class ReplayMismatch(RuntimeError):
    """Replaying a trajectory's recorded actions did not reproduce its recorded observations."""


@dataclass
class MCStats:
    """What one ``score_mc_continuation`` call did."""

    reach: str = ""
    decision_points: int = 0  # (trajectory, turn) pairs chosen
    scored: int = 0  # of them, with an mc_advantage written
    alternatives: int = 0  # actions sampled (K-1 per decision point)
    identical_alternatives: int = 0  # alternatives whose tokens equal the actual action's
    continuations: int = 0  # episodes played (K*M per decision point)
    failed_continuations: int = 0
    sampled_tokens: int = 0  # alternatives + continuations
    generate_calls: int = 0
    mean_batch_size: float = 0.0
    advantage_abs_mean: float = 0.0  # mean |mc_advantage| over the scored turns
    wall_time_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def metrics(self, prefix: str = "mc/") -> dict[str, float]:
        """The numeric fields, for a metrics row (``mc/decision_points``, ...)."""
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items() if isinstance(v, (int, float))}


# --- pieces --------------------------------------------------------------------------------------


def decision_turn_indices(num_turns: int, decision_turns: DecisionTurns) -> list[int]:
    """The turns of a trajectory of ``num_turns`` turns to branch at (indices past the end dropped)."""
    if decision_turns == "all":
        return list(range(num_turns))
    if decision_turns == "first":
        return [0] if num_turns else []
    if isinstance(decision_turns, str):
        raise ValueError(f"decision_turns must be 'all', 'first' or a list of turn indices, got {decision_turns!r}")
    out = sorted({int(t) for t in decision_turns})
    if any(t < 0 for t in out):
        raise ValueError(f"decision turn indices must be >= 0, got {list(decision_turns)}")
    return [t for t in out if t < num_turns]


def initial_messages(trajectory: Trajectory) -> tuple[Message, ...]:
    """The messages ``reset`` returned: the conversation minus each turn's message and env answer."""
    used = sum(1 + len(turn.env_messages) for turn in trajectory.turns)
    n = len(trajectory.messages) - used
    if n < 0 or (trajectory.turns and trajectory.messages[n] != trajectory.turns[0].message):
        raise ValueError(
            f"mc_continuation: task {trajectory.task_id} sample {trajectory.sample_index}: the messages do not "
            f"match the turns (a failed or hand-edited trajectory?)"
        )
    return tuple(trajectory.messages[:n])


def recorded_action(turn: Turn) -> Action:
    """Turn -> the Action that reproduces it exactly (message, parse errors, token data)."""
    tokens = TokenData(turn.prompt_ids, turn.completion_ids, turn.completion_logprobs, turn.finish_reason)
    return Action(message=turn.message, parse_errors=tuple(turn.parse_errors), tokens=tokens)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 300 else text[:300] + "..."


async def replay_prefix(
    env: Env, task: Task, trajectory: Trajectory, upto: int,
    on_point: Callable[[int], None] | None = None,
) -> None:
    """``env.reset(task)`` then ``env.step`` with the recorded actions ``0..upto-1``, checking every
    observation, reward and termination against the recording (:class:`ReplayMismatch` otherwise).
    ``on_point(i)`` is called before action ``i`` and after the last (``i = upto``)."""
    where = f"env {getattr(env, 'name', type(env).__name__)!r} task {trajectory.task_id} sample {trajectory.sample_index}"
    hint = ("the env is not deterministic under replay (or the trajectory came from other env options); "
            "give it snapshot()/restore() (branchable = True) to use mc_continuation")
    got = tuple(await env.reset(task))
    want = initial_messages(trajectory)
    if got != want:
        raise ReplayMismatch(f"mc_continuation: replaying {where}: reset returned {_short(got)}, recorded "
                             f"{_short(want)}; {hint}")
    for i in range(upto):
        if on_point is not None:
            on_point(i)
        turn = trajectory.turns[i]
        step = await env.step(turn.message, tuple(turn.parse_errors))
        problems = []
        if tuple(step.messages) != tuple(turn.env_messages):
            problems.append(f"observation {_short(tuple(step.messages))}, recorded {_short(turn.env_messages)}")
        if float(step.reward) != float(turn.reward):
            problems.append(f"reward {step.reward!r}, recorded {turn.reward!r}")
        if step.terminated or step.truncated:
            problems.append("the episode ended, recorded it went on")
        if problems:
            raise ReplayMismatch(f"mc_continuation: replaying {where} turn {i}: " + "; ".join(problems) + f"; {hint}")
    if on_point is not None:
        on_point(upto)


async def snapshots_before(
    make_env: Callable[[], Env], task: Task, trajectory: Trajectory, turns: Sequence[int]
) -> dict[int, EnvSnapshot]:
    """``Env.snapshot()`` just before each of ``turns`` (the env state turn ``t`` acted in), from one
    checked replay of ``trajectory``'s recorded actions on a fresh env (closed afterwards)."""
    wanted = set(turns)
    taken: dict[int, EnvSnapshot] = {}
    env = make_env()

    def on_point(turn_index: int) -> None:
        if turn_index in wanted:
            taken[turn_index] = env.snapshot()

    try:
        if wanted:
            await replay_prefix(env, task, trajectory, max(wanted), on_point)
    finally:
        env.close()
    return taken


def branch_mode(env: Env, reach: Reach = "auto", who: str = "mc_continuation") -> Literal["snapshot", "replay"]:
    """How the branch points of ``env`` are reached (see the module docstring), or
    :class:`BranchingUnsupported` naming the env (and ``who`` asked: mc_continuation, tree rollouts)."""
    name = getattr(env, "name", type(env).__name__)
    refusal = env.branch_refusal()
    if reach not in ("auto", "snapshot", "replay"):
        raise ValueError(f"reach must be 'auto', 'snapshot' or 'replay', got {reach!r}")
    if reach != "replay" and refusal is None:
        return "snapshot"
    if reach == "snapshot":
        raise BranchingUnsupported(f"{who}: env {name!r} cannot branch: {refusal}")
    if reach == "replay" or getattr(env, "deterministic_replay", False) is True:
        return "replay"
    raise BranchingUnsupported(
        f"{who}: env {name!r} ({type(env).__name__}) cannot branch ({refusal}) and does not declare "
        f"deterministic_replay = True; implement snapshot/restore (branchable = True) or, if the env is "
        f"deterministic, declare it (or pass reach='replay')"
    )


class BranchEnv(Env):
    """One continuation's env: answers the first ``t`` turns with the recorded observations (no env
    step) and plays turns ``>= t`` on a fresh env put at the branch point by ``restore(snapshot)``
    or, without a snapshot, by a checked replay of the prefix at reset."""

    def __init__(self, make_inner: Callable[[], Env], trajectory: Trajectory, t: int,
                 snapshot: EnvSnapshot | None, mismatches: list[ReplayMismatch]):
        self.inner = make_inner()
        self.name = getattr(self.inner, "name", type(self.inner).__name__)  # type: ignore[misc]
        self.trajectory, self.t, self.snap, self.mismatches = trajectory, t, snapshot, mismatches
        self.turn = 0

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return self.inner.tasks(split, n, seed)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.inner.tool_schemas()

    async def reset(self, task: Task) -> list[Message]:
        self.turn = 0
        if self.snap is not None:
            self.inner.restore(self.snap)
        else:
            try:
                await replay_prefix(self.inner, task, self.trajectory, self.t)
            except ReplayMismatch as exc:
                self.mismatches.append(exc)
                raise
        return list(initial_messages(self.trajectory))

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        i, self.turn = self.turn, self.turn + 1
        if i < self.t:
            turn = self.trajectory.turns[i]
            return StepResult(messages=turn.env_messages, reward=turn.reward, info=dict(turn.metrics))
        return await self.inner.step(message, parse_errors)

    def state_key(self) -> str | None:
        if self.turn < self.t:
            return self.trajectory.turns[self.turn].state_key
        return self.inner.state_key()

    def expert_action(self) -> Message:
        return self.inner.expert_action()

    def close(self) -> None:
        self.inner.close()


@dataclass
class _Point:
    """One decision point: trajectory ``(g, i)``, turn ``t``, its K actions and their Q estimates."""

    g: int
    i: int
    t: int
    trajectory: Trajectory
    task: Task
    actions: list[Action] = field(default_factory=list)  # [0] = the recorded one
    snapshot: EnvSnapshot | None = None
    returns: list[list[float]] = field(default_factory=list)  # [k] -> continuation returns


def _turn_budget(trajectory: Trajectory, t: int, config: RolloutConfig) -> int:
    """Tokens an action at turn ``t`` may have: as ``RenderedPolicy`` computes it in the rollout."""
    budget = config.max_tokens_per_turn
    if config.max_tokens_per_episode is not None:
        budget = min(budget, config.max_tokens_per_episode - sum(len(u.completion_ids) for u in trajectory.turns[:t]))
    if config.max_context is not None:
        budget = min(budget, config.max_context - len(trajectory.turns[t].prompt_ids))
    return budget


def _task_lookup(tasks: Sequence[Task] | Mapping[str, Task]) -> dict[str, Task]:
    if isinstance(tasks, Mapping):
        return dict(tasks)
    return {task.id: task for task in tasks}


# --- the step ------------------------------------------------------------------------------------


async def score_mc_continuation_async(
    groups: Sequence[TrajectoryGroup],
    sampler: Any,
    renderer: Any,
    env: str | Callable[[], Env],
    env_options: dict[str, Any] | None,
    tasks: Sequence[Task] | Mapping[str, Task],
    *,
    decision_turns: DecisionTurns = "all",
    k: int = 4,
    m: int = 2,
    config: RolloutConfig | None = None,
    temperature: float | None = None,
    max_turns: int | None = None,
    seed: int | None = 0,
    reach: Reach = "auto",
) -> tuple[list[TrajectoryGroup], MCStats]:
    """New groups whose decision turns carry ``Turn.metrics["mc_advantage"]`` (see the module docstring),
    and what it cost.

    Args:
        groups: the step's groups (token-exact trajectories from the rollout runner).
        sampler: the token engine of the rollouts (``generate``), i.e. the current policy.
        renderer: the renderer the trajectories were sampled with.
        env, env_options: the env name and options of the rollouts (or a zero-argument factory).
        tasks: the tasks of the trajectories (``Task`` objects, by ``task_id``), to ``reset`` with.
        decision_turns: ``"all"``, ``"first"`` or a list of turn indices (those past a trajectory's
            end are skipped).
        k: actions per decision turn, the recorded one included (>= 2); m: continuations per action.
        config: limits and sampling of the continuations (the rollout's ``RolloutConfig``; its
            ``seed`` is replaced); ``temperature``/``max_turns`` override it when given.
        seed: seeds the alternatives' sampling and (as ``seed + 1``) the continuations'.
        reach: ``"auto"``, ``"snapshot"`` or ``"replay"`` (module docstring).

    Reads as its steps: pick the decision points, snapshot them (``reach="snapshot"``), sample K-1
    alternatives, play M continuations per action, score each point leave-one-out and write the
    scores on the turns.

    Raises :class:`BranchingUnsupported` for an env that can neither branch nor be replayed and
    :class:`ReplayMismatch` when a replay does not reproduce the recording.
    """
    _check_k_m(k, m)
    config = _continuation_config(config, temperature, max_turns, seed)
    make_env, _ = env_factory(env, env_options)
    stats = MCStats()
    t0 = time.perf_counter()
    mode = stats.reach = _probe_branch_mode(make_env, reach)
    points, chosen = _decision_points(groups, decision_turns, _task_lookup(tasks))  # 1. (trajectory, turn) pairs
    stats.decision_points = len(points)
    if mode == "snapshot" and points:
        await _take_snapshots(points, chosen, make_env)  # 2. one checked replay per trajectory
    await _sample_alternatives(points, k, sampler, renderer, config, seed, stats)  # 3. K-1 alternatives per point
    await _play_continuations(points, m, make_env, sampler, renderer, config, stats)  # 4. M continuations per action
    scores = _leave_one_out_scores(points, stats)  # 5. Q_k and the advantage of the actual action
    out = _marked_groups(groups, scores, chosen, k, m, mode)
    stats.wall_time_s = time.perf_counter() - t0
    _warn_unscored(stats)
    return out, stats


def score_mc_continuation(*args: Any, **kwargs: Any) -> tuple[list[TrajectoryGroup], MCStats]:
    """``asyncio.run(score_mc_continuation_async(...))`` for callers without an event loop: new groups
    whose decision turns carry ``Turn.metrics["mc_advantage"]``, and what it cost (the arguments:
    :func:`score_mc_continuation_async`)."""
    return asyncio.run(score_mc_continuation_async(*args, **kwargs))


# --- the steps of score_mc_continuation_async, in order ------------------------------------------


def _check_k_m(k: int, m: int) -> None:
    if k < 2:
        raise ValueError(f"mc_continuation needs k >= 2 actions per decision turn (a leave-one-out baseline), got {k}")
    if m < 1:
        raise ValueError(f"mc_continuation needs m >= 1 continuations per action, got {m}")


def _continuation_config(config: RolloutConfig | None, temperature: float | None, max_turns: int | None,
                         seed: int | None) -> RolloutConfig:
    """The rollout config of the continuations: ``config`` (default: ``RolloutConfig()``) with seed
    ``seed + 1`` (the alternatives use ``seed`` itself) and the ``temperature``/``max_turns`` overrides."""
    config = config or RolloutConfig()
    update: dict[str, Any] = {"seed": None if seed is None else seed + 1}
    if temperature is not None:
        update["temperature"] = temperature
    if max_turns is not None:
        update["max_turns"] = max_turns
    return config.model_copy(update=update)


def _probe_branch_mode(make_env: Callable[[], Env], reach: Reach) -> Literal["snapshot", "replay"]:
    """How the branch points are reached, decided on one env built (and closed) for that."""
    probe = make_env()
    try:
        return branch_mode(probe, reach)
    finally:
        probe.close()


def _decision_points(groups: Sequence[TrajectoryGroup], decision_turns: DecisionTurns,
                     by_id: dict[str, Task]) -> tuple[list[_Point], dict[tuple[int, int], list[int]]]:
    """The decision points, each holding its recorded action, and the turns chosen per trajectory
    ``(g, i)``; failed trajectories and those with no turns are not branched."""
    points: list[_Point] = []
    chosen: dict[tuple[int, int], list[int]] = {}
    for g, group in enumerate(groups):
        for i, trajectory in enumerate(group.trajectories):
            if trajectory.end_reason in FAILED_END_REASONS or not trajectory.turns:
                continue
            turns = decision_turn_indices(len(trajectory.turns), decision_turns)
            if not turns:
                continue
            if trajectory.task_id not in by_id:
                raise ValueError(f"mc_continuation: no Task with id {trajectory.task_id!r} among the tasks given")
            chosen[(g, i)] = turns
            for t in turns:
                points.append(_Point(g, i, t, trajectory, by_id[trajectory.task_id],
                                     actions=[recorded_action(trajectory.turns[t])]))
    return points, chosen


async def _take_snapshots(points: list[_Point], chosen: dict[tuple[int, int], list[int]],
                          make_env: Callable[[], Env]) -> None:
    """Set every point's snapshot: one checked replay per trajectory, a snapshot before each of its
    decision turns (the trajectories concurrently)."""
    async def snap(g: int, i: int) -> None:
        mine = {p.t: p for p in points if (p.g, p.i) == (g, i)}
        first = next(iter(mine.values()))
        taken = await snapshots_before(make_env, first.task, first.trajectory, sorted(mine))
        for t, snapshot in taken.items():
            mine[t].snapshot = snapshot

    await asyncio.gather(*(snap(g, i) for g, i in chosen))


async def _sample_alternatives(points: list[_Point], k: int, sampler: Any, renderer: Any, config: RolloutConfig,
                               seed: int | None, stats: MCStats) -> None:
    """Append K-1 sampled actions to every point: prompt = turn t's ``prompt_ids``, in batched
    ``generate`` calls of at most ``config.concurrency`` prompts."""
    rows = [(p, _turn_budget(p.trajectory, p.t, config)) for p in points for _ in range(k - 1)]
    rows = [(p, b) for p, b in rows if b > 0]
    width = max(config.concurrency, 1)
    for call, start in enumerate(range(0, len(rows), width)):
        chunk = rows[start : start + width]
        params = SamplingParams(
            temperature=config.temperature, top_p=config.top_p, max_tokens=max(b for _, b in chunk),
            stop_token_ids=tuple(renderer.stop_token_ids),
            seed=None if seed is None else (seed * 1_000_003 + call) % (2**63),
        )
        prompts = [list(p.trajectory.turns[p.t].prompt_ids) for p, _ in chunk]
        outs = await asyncio.to_thread(sampler.generate, prompts, params)
        if len(outs) != len(chunk):
            raise RuntimeError(f"engine returned {len(outs)} results for {len(chunk)} prompts")
        stats.generate_calls += 1
        for (p, budget), gens in zip(chunk, outs):
            gen = cut_generation(gens[0], budget)
            parsed = renderer.parse_completion(gen.token_ids)
            tokens = TokenData(tuple(p.trajectory.turns[p.t].prompt_ids), tuple(gen.token_ids), gen.logprobs,
                               gen.finish_reason)
            p.actions.append(Action(message=parsed.message, parse_errors=tuple(parsed.errors), tokens=tokens))
            stats.alternatives += 1
            stats.sampled_tokens += len(gen.token_ids)
            stats.identical_alternatives += int(tuple(gen.token_ids) == tuple(p.trajectory.turns[p.t].completion_ids))


async def _play_continuations(points: list[_Point], m: int, make_env: Callable[[], Env], sampler: Any, renderer: Any,
                              config: RolloutConfig, stats: MCStats) -> None:
    """Fill every point's ``returns``: M continuations per action, all through the episode loop and the
    batcher at once. Raises the first :class:`ReplayMismatch` any of them met."""
    mismatches: list[ReplayMismatch] = []
    episodes, index = _continuation_episodes(points, m, make_env, mismatches)
    if not episodes:
        if stats.generate_calls:
            stats.mean_batch_size = stats.alternatives / stats.generate_calls
        return
    result = await run_prefixed_episodes(None, episodes, sampler, renderer, config, policy_name="mc_continuation")
    if mismatches:
        raise mismatches[0]
    _add_continuation_stats(stats, len(episodes), result.stats)
    for (n, a), trajectory in zip(index, result.trajectories):
        p = points[n]
        if trajectory.end_reason in FAILED_END_REASONS:
            if config.on_env_error != "zero_reward":
                continue  # excluded: left out of Q
            trajectory = zero_reward(trajectory)  # counts 0, as every other zero-rewarded episode
        p.returns[a].append(sum(turn.reward for turn in trajectory.turns[p.t:]))


def _continuation_episodes(points: list[_Point], m: int, make_env: Callable[[], Env],
                           mismatches: list[ReplayMismatch]) -> tuple[list[PrefixedEpisode], list[tuple[int, int]]]:
    """M episodes per action of every point (recorded prefix, then the action), each on a
    :class:`BranchEnv` that appends to ``mismatches``, and the ``(point, action)`` of each; empties
    every point's ``returns``."""
    episodes: list[PrefixedEpisode] = []
    index: list[tuple[int, int]] = []  # (point, action)
    for n, p in enumerate(points):
        prefix = tuple(recorded_action(turn) for turn in p.trajectory.turns[: p.t])
        p.returns = [[] for _ in p.actions]
        for a, action in enumerate(p.actions):
            factory = (lambda p=p: BranchEnv(make_env, p.trajectory, p.t, p.snapshot, mismatches))
            for j in range(m):
                episodes.append(PrefixedEpisode(p.task, prefix + (action,), factory, sample_index=j))
                index.append((n, a))
    return episodes, index


def _add_continuation_stats(stats: MCStats, episodes: int, run: Any) -> None:
    """Add the continuations' run stats (``run``, the batcher's) to those of the alternatives."""
    stats.continuations = episodes
    stats.failed_continuations = run.failed
    stats.errors = list(run.errors)
    stats.sampled_tokens += run.generated_tokens
    # one row per alternative in the sampling calls, then the batcher's rows
    calls = stats.generate_calls + run.generate_calls
    rows = stats.alternatives + round(run.mean_batch_size * run.generate_calls)
    stats.generate_calls = calls
    stats.mean_batch_size = rows / calls if calls else 0.0


def _leave_one_out_scores(points: list[_Point], stats: MCStats) -> dict[tuple[int, int, int], dict[str, float]]:
    """The turn metrics of every scored point, by ``(g, i, t)``: ``Q_k`` as the mean continuation return,
    ``A_0 = Q_0 - mean_{l != 0} Q_l``. A point is not scored when its actual action or all its
    alternatives have no continuation left."""
    scores: dict[tuple[int, int, int], dict[str, float]] = {}
    for p in points:
        q = [sum(r) / len(r) if r else None for r in p.returns]
        others = [v for v in q[1:] if v is not None]
        if q[0] is None or not others:
            continue
        baseline = sum(others) / len(others)
        scores[(p.g, p.i, p.t)] = {METRIC: q[0] - baseline, "mc_q": q[0], "mc_baseline": baseline}
    stats.scored = len(scores)
    if scores:
        stats.advantage_abs_mean = sum(abs(s[METRIC]) for s in scores.values()) / len(scores)
    return scores


def _marked_groups(groups: Sequence[TrajectoryGroup], scores: dict[tuple[int, int, int], dict[str, float]],
                   chosen: dict[tuple[int, int], list[int]], k: int, m: int, mode: str) -> list[TrajectoryGroup]:
    """Copies of ``groups`` with the scores on their turns and the ``INFO_KEY`` marker on every trajectory."""
    out: list[TrajectoryGroup] = []
    for g, group in enumerate(groups):
        trajectories = []
        for i, trajectory in enumerate(group.trajectories):
            # every trajectory is marked (failed ones, not branched, with no decision turns): the
            # estimator tells "the step ran, nothing could be scored" from "the step did not run"
            turns = tuple(
                turn.model_copy(update={"metrics": {**turn.metrics, **scores[(g, i, t)]}}) if (g, i, t) in scores else turn
                for t, turn in enumerate(trajectory.turns)
            )
            decided = chosen.get((g, i), [])
            marker = {"decision_turns": decided, "scored_turns": [t for t in decided if (g, i, t) in scores],
                      "k": k, "m": m, "reach": mode}
            trajectories.append(trajectory.model_copy(update={"turns": turns, "info": {**trajectory.info, INFO_KEY: marker}}))
        out.append(group.model_copy(update={"trajectories": tuple(trajectories)}))
    return out


def _warn_unscored(stats: MCStats) -> None:
    if stats.decision_points and stats.scored < stats.decision_points:
        log.warning("mc_continuation: %d of %d decision turns not scored (their continuations failed: %s)",
                    stats.decision_points - stats.scored, stats.decision_points, "; ".join(stats.errors[:3]))


__all__ = [
    "BranchingUnsupported",
    "INFO_KEY",
    "METRIC",
    "MCStats",
    "ReplayMismatch",
    "branch_mode",
    "decision_turn_indices",
    "initial_messages",
    "recorded_action",
    "replay_prefix",
    "score_mc_continuation",
    "score_mc_continuation_async",
    "snapshots_before",
    "BranchEnv",
]
