"""Tree-search rollouts: a task's group is the leaves of a tree of turns, branched at turn boundaries.

One tree per task, built in rounds::

    round 0:  init_chains independent episodes (the ordinary rollout runner)      -> leaves
    round r:  pick fork points among the turn boundaries of the leaves so far; from each, play
              ``branches`` new episodes that repeat the prefix verbatim and sample from there on
              (the env restored to that point: ``Env.snapshot()/restore()``, or a checked replay)
    until:    the tree has ``leaves`` leaves, or ``rounds`` rounds ran, or it generated
              ``max_tokens_per_tree`` tokens (checked before each round)

A fork point is "after turn ``t - 1`` of a leaf" (``t >= 1``): the branch keeps the leaf's turns
``0..t-1`` (their tokens, observations and rewards as recorded) and samples a new turn ``t``. Fork
points are chosen ``uniform``ly at random, or by ``entropy`` (ARPO / TreeRL): the boundaries where
the policy was least sure of its next move, scored by the mean ``-log p`` of the first
``entropy_tokens`` tokens it sampled there (the engine's own log-probs: no extra forward pass;
TreeRL uses the same ``-log p`` proxy for entropy). Forking at the root (no prefix) is an
independent chain; it is the fallback when no leaf has a boundary to fork at (one-turn episodes).

Prefix sharing: the branches of one fork point ask the engine for the same prompt in the same
batched ``generate`` call; the hf engine prefills a repeated prompt once and copies its KV cache to
every row (``HFEngine.prefix_cache``), and the prefix's turns cost no generation at all. The stats
report the generated tokens next to what the same leaves cost as independent chains.

Every leaf is a complete ``Trajectory`` (prefix turns included) with
``info["tree"] = {"nodes": [node id per turn], "parent": leaf forked from or None, "fork_turn": t}``;
two leaves share a turn node exactly when they share that turn's prefix. ``sample_index`` is the
leaf's index in its tree. The ``tree`` estimator (``tracegym.algos.tree``) turns this into per-turn
advantages and per-turn weights (``1/|L(n)|``: a node's tokens weigh 1 in total, however many leaves
repeat them).

Selection bias: ``entropy`` branching chooses *where* to fork from the samples, not *what* to
sample; every sampled token is still drawn from pi, so the leaves under a fork point are ~pi given
that prefix. The leaves as a set are not i.i.d. episodes of pi (fork points are over-represented);
the tree estimator's ``V(n) - V(parent)`` compares leaves under the same prefix, which is what keeps
it an unbiased Monte-Carlo advantage for uniform branching.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from tracegym.algos.tree import TREE_KEY, leaf_nodes
from tracegym.config import TreeConfig
from tracegym.envs.base import Env, EnvSnapshot, Task
from tracegym.envs.episode import FAILED_END_REASONS
from tracegym.rollout.runner import (PrefixedEpisode, RolloutConfig, RolloutResult, RolloutStats, env_factory, run_prefixed_episodes,
                              run_rollouts, zero_reward)
from tracegym.rollout.branches import BranchEnv, ReplayMismatch, branch_mode, recorded_action, snapshots_before
from tracegym.types import Trajectory

log = logging.getLogger(__name__)

__all__ = ["TREE_KEY", "TreeStats", "fork_points", "leaf_nodes", "run_tree_rollouts", "run_tree_rollouts_sync"]


@dataclass
class TreeStats:
    """What one ``run_tree_rollouts`` call did (summed over its trees)."""

    trees: int = 0
    leaves: int = 0  # kept leaves
    failed: int = 0  # leaves whose episode failed (env error, timeout, engine error)
    rounds: int = 0  # forking rounds that ran
    forks: int = 0  # fork points branched from (root forks included)
    root_forks: int = 0  # of them, at the root (no boundary to fork at)
    generated_tokens: int = 0  # tokens the engine sampled for these trees
    chain_tokens: int = 0  # tokens the kept leaves hold, shared prefixes counted per leaf
    prefill_tokens: int = 0  # prompt tokens the hf engine computed (0 for other engines)
    prefix_tokens_reused: int = 0  # prompt tokens the hf engine copied from a shared prefill
    mean_depth: float = 0.0  # mean fork turn of the branched leaves (0 for the first chains)
    wall_time_s: float = 0.0

    def metrics(self, prefix: str = "tree/") -> dict[str, float]:
        """The numeric fields, for a metrics row (``tree/leaves``, ...)."""
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}


def _uncertainty(trajectory: Trajectory, t: int, tokens: int) -> float:
    """Mean ``-log p`` of the first ``tokens`` tokens sampled in turn ``t`` (0 without log-probs)."""
    logprobs = trajectory.turns[t].completion_logprobs
    if not logprobs:
        return 0.0
    head = logprobs[:tokens]
    return -sum(head) / len(head)


def fork_points(leaves: Sequence[Trajectory], entropy_tokens: int = 16) -> list[tuple[int, int, float]]:
    """Distinct fork points of a tree's leaves as ``(leaf, t, score)``: after turn ``t - 1`` of leaf
    ``leaf`` (the first leaf through that prefix), for every ``t >= 1`` where the leaf has a turn ``t``;
    ``score`` = the mean over the leaves through that prefix of their turn ``t``'s first-token
    uncertainty (mean ``-log p``). Failed leaves are not forked."""
    seen: dict[str, int] = {}
    points: list[tuple[int, int, list[float]]] = []
    for index, leaf in enumerate(leaves):
        if leaf.end_reason in FAILED_END_REASONS:
            continue
        nodes = leaf_nodes(leaf, index)
        for t in range(1, len(leaf.turns)):
            key = nodes[t - 1]
            if key not in seen:
                seen[key] = len(points)
                points.append((index, t, []))
            points[seen[key]][2].append(_uncertainty(leaf, t, entropy_tokens))
    return [(leaf, t, sum(s) / len(s)) for leaf, t, s in points]


def _choose(points: list[tuple[int, int, float]], forks: int, how: str, rng: random.Random) -> list[tuple[int, int]]:
    """``forks`` fork points (repeats allowed when there are fewer points than forks)."""
    if how == "entropy":
        ranked = sorted(points, key=lambda p: -p[2])  # stable: ties keep leaf/turn order
        return [(ranked[i % len(ranked)][0], ranked[i % len(ranked)][1]) for i in range(forks)]
    if how == "uniform":
        picked = rng.sample(points, min(forks, len(points))) + [rng.choice(points) for _ in range(forks - len(points))]
        return [(p[0], p[1]) for p in picked]
    raise ValueError(f"tree branch must be 'uniform' or 'entropy', got {how!r}")


@dataclass
class _Tree:
    task: Task
    leaves: list[Trajectory] = field(default_factory=list)  # every leaf, failed ones included, by leaf index
    tokens: int = 0  # generated for this tree


def _with_tree_info(trajectory: Trajectory, leaf: int, nodes: list[str], parent: int | None, fork_turn: int) -> Trajectory:
    info = {**trajectory.info, TREE_KEY: {"nodes": nodes, "parent": parent, "fork_turn": fork_turn}}
    return trajectory.model_copy(update={"info": info, "sample_index": leaf})


async def run_tree_rollouts(
    env: str | Callable[[], Env],
    tasks: Sequence[Task],
    policy: Any,
    renderer: Any,
    config: RolloutConfig,
    tree: TreeConfig,
    leaves: int,
    *,
    env_options: dict[str, Any] | None = None,
    writer: Any | None = None,
    policy_name: str = "policy",
) -> tuple[RolloutResult, TreeStats]:
    """One tree of ``leaves`` leaves per task (module docstring). Returns a ``RolloutResult`` whose
    ``trajectories`` are the kept leaves, by task then leaf index (``failed`` the excluded ones), and
    the trees' stats. ``config.samples_per_task`` is ignored (the tree config says how many)."""
    if leaves < 2:
        raise ValueError(f"a tree needs at least 2 leaves (group_size), got {leaves}")
    init_chains = tree.init_chains if tree.init_chains is not None else math.ceil(leaves / 2)
    if init_chains > leaves:
        raise ValueError(f"rollout.tree.init_chains ({init_chains}) is more than the leaves per tree (group_size {leaves})")
    make_env, _ = env_factory(env, env_options)
    probe = make_env()
    try:
        mode = branch_mode(probe, tree.reach, who="tree rollouts") if init_chains < leaves else "snapshot"
    finally:
        probe.close()
    stats = TreeStats(trees=len(tasks))
    t0 = time.perf_counter()
    engine_before = (getattr(policy, "prefill_tokens", 0), getattr(policy, "prefix_tokens_reused", 0))
    rng = random.Random(config.seed)
    calls = rows = 0

    # round 0: independent chains
    first = await run_rollouts(make_env, tasks, policy, renderer, config.model_copy(update={"samples_per_task": init_chains}),
                               progress=False, policy_name=policy_name)
    calls, rows = first.stats.generate_calls, round(first.stats.mean_batch_size * first.stats.generate_calls)
    trees = [_Tree(task) for task in tasks]
    by_task = {task.id: n for n, task in enumerate(tasks)}
    for trajectory in sorted(first.trajectories + first.failed, key=lambda t: t.sample_index):
        n = by_task[trajectory.task_id]
        leaf = trajectory.sample_index
        trees[n].leaves.append(_with_tree_info(trajectory, leaf, leaf_nodes(trajectory, leaf), None, 0))
        trees[n].tokens += trajectory.num_generated_tokens
    stats.generated_tokens = first.stats.generated_tokens

    # forking rounds: plan where to fork, reach those points, play the branches, add them as leaves
    for round_index in range(tree.rounds):
        planned = _plan_round(trees, tree, leaves, tree.rounds - round_index, rng)
        if not planned:
            break
        stats.rounds += 1
        stats.forks += len(planned)
        stats.root_forks += sum(parent is None for _, parent, _, _ in planned)
        mismatches: list[ReplayMismatch] = []
        episodes, origin = await _fork_episodes(trees, planned, make_env, mode, mismatches)
        round_config = config.model_copy(update={"seed": None if config.seed is None else config.seed + 7919 * (round_index + 1)})
        result = await run_prefixed_episodes(None, episodes, policy, renderer, round_config, policy_name=policy_name)
        if mismatches:
            raise mismatches[0]
        calls += result.stats.generate_calls
        rows += round(result.stats.mean_batch_size * result.stats.generate_calls)
        stats.generated_tokens += result.stats.generated_tokens
        _add_leaves(trees, origin, episodes, result.trajectories)

    stats.prefill_tokens = getattr(policy, "prefill_tokens", 0) - engine_before[0]
    stats.prefix_tokens_reused = getattr(policy, "prefix_tokens_reused", 0) - engine_before[1]
    stats.wall_time_s = time.perf_counter() - t0
    result = _tree_result(trees, config, stats, calls, rows)
    if writer is not None:
        for trajectory in result.trajectories:
            writer.write(trajectory)
    return result, stats


Plan = list[tuple[int, int | None, int, int]]
"""A round's forks: (tree, parent leaf or None for the root, fork turn, branches to play)."""


def _plan_round(trees: list[_Tree], tree: TreeConfig, leaves: int, remaining_rounds: int, rng: random.Random) -> Plan:
    """The forks of one round: each tree short of ``leaves`` (and within its token budget) gets an even
    share of its missing leaves, ``tree.branches`` per fork point chosen by ``tree.branch``."""
    planned: Plan = []
    for n, tr in enumerate(trees):
        missing = leaves - len(tr.leaves)
        if missing <= 0 or (tree.max_tokens_per_tree is not None and tr.tokens >= tree.max_tokens_per_tree):
            continue
        add = math.ceil(missing / remaining_rounds)
        forks = math.ceil(add / tree.branches)
        points = fork_points(tr.leaves, tree.entropy_tokens)
        chosen: list[tuple[int | None, int]] = list(_choose(points, forks, tree.branch, rng)) if points else [(None, 0)] * forks
        for j, (parent, t) in enumerate(chosen):
            planned.append((n, parent, t, min(tree.branches, add - j * tree.branches)))
    return planned


async def _fork_episodes(
    trees: list[_Tree], planned: Plan, make_env: Callable[[], Env], mode: str, mismatches: list[ReplayMismatch]
) -> tuple[list[PrefixedEpisode], list[tuple[int, int | None, int]]]:
    """The episodes of a plan, each repeating its parent's first ``t`` turns; with snapshots, one
    checked replay per parent leaf takes the snapshot before every turn forked there. Returns the
    episodes and, per episode, (tree, parent leaf, fork turn)."""
    wanted: dict[tuple[int, int], set[int]] = {}
    for n, parent, t, _ in planned:
        if parent is not None and mode == "snapshot":
            wanted.setdefault((n, parent), set()).add(t)
    jobs = [(n, leaf, sorted(ts)) for (n, leaf), ts in wanted.items()]
    taken = await asyncio.gather(*(snapshots_before(make_env, trees[n].task, trees[n].leaves[leaf], turns)
                                   for n, leaf, turns in jobs))
    snapshots: dict[tuple[int, int, int], EnvSnapshot] = {
        (n, leaf, t): snap for (n, leaf, _), got in zip(jobs, taken) for t, snap in got.items()
    }
    episodes: list[PrefixedEpisode] = []
    origin: list[tuple[int, int | None, int]] = []
    next_index = [len(tr.leaves) for tr in trees]
    for n, parent, t, copies in planned:
        tr = trees[n]
        prefix: tuple = ()
        factory: Callable[[], Env] = make_env
        if parent is not None:
            source = tr.leaves[parent]
            prefix = tuple(recorded_action(turn) for turn in source.turns[:t])
            snap = snapshots.get((n, parent, t))
            factory = (lambda source=source, t=t, snap=snap: BranchEnv(make_env, source, t, snap, mismatches))
        for _ in range(copies):
            episodes.append(PrefixedEpisode(tr.task, prefix, factory, sample_index=next_index[n]))
            origin.append((n, parent, t))
            next_index[n] += 1
    return episodes, origin


def _add_leaves(trees: list[_Tree], origin: list[tuple[int, int | None, int]], episodes: list[PrefixedEpisode],
                trajectories: list[Trajectory]) -> None:
    """Append the played branches as leaves: turns before the fork keep their parent's nodes."""
    for (n, parent, t), episode, trajectory in zip(origin, episodes, trajectories):
        tr = trees[n]
        leaf = episode.sample_index
        own = [f"{leaf}:{k}" for k in range(len(trajectory.turns))]
        nodes = own if parent is None else leaf_nodes(tr.leaves[parent], parent)[:t] + own[t:]
        tr.leaves.append(_with_tree_info(trajectory, leaf, nodes, parent, t))
        tr.tokens += sum(len(turn.completion_ids) for turn in trajectory.turns[len(episode.prefix):])


def _tree_result(trees: list[_Tree], config: RolloutConfig, stats: TreeStats, calls: int, rows: int) -> RolloutResult:
    """Every tree's leaves as one rollout result (failed leaves excluded or zero-rewarded, as the
    rollout config says); fills the leaf counts of ``stats``."""
    kept: list[Trajectory] = []
    failed: list[Trajectory] = []
    depths: list[int] = []
    for tr in trees:
        for trajectory in tr.leaves:
            is_failed = trajectory.end_reason in FAILED_END_REASONS
            if is_failed and config.on_env_error == "zero_reward":
                trajectory = zero_reward(trajectory)
            (failed if is_failed and config.on_env_error == "exclude" else kept).append(trajectory)
            stats.failed += int(is_failed)
            depths.append(int(trajectory.info[TREE_KEY]["fork_turn"]))
    stats.leaves = len(kept)
    stats.chain_tokens = sum(t.num_generated_tokens for t in kept)
    stats.mean_depth = sum(depths) / len(depths) if depths else 0.0
    wall = stats.wall_time_s
    everything = kept + failed
    rollout_stats = RolloutStats(
        episodes=len(everything), kept=len(kept), failed=stats.failed,
        end_reasons=dict(Counter(t.end_reason for tr in trees for t in tr.leaves)),
        errors=[f"{t.task_id}/{t.sample_index}: {t.end_reason}: {t.error}" for t in everything if t.error][:20],
        success_rate=sum(t.success for t in kept) / len(kept) if kept else 0.0,
        mean_reward=sum(t.reward for t in kept) / len(kept) if kept else 0.0,
        turns=sum(len(t.turns) for t in kept), generated_tokens=stats.generated_tokens,
        generate_calls=calls, mean_batch_size=rows / calls if calls else 0.0, wall_time_s=wall,
        episodes_per_s=len(everything) / wall if wall > 0 else 0.0,
        tokens_per_s=stats.generated_tokens / wall if wall > 0 else 0.0,
    )
    return RolloutResult(trajectories=kept, stats=rollout_stats, failed=failed)


def run_tree_rollouts_sync(*args: Any, **kwargs: Any) -> tuple[RolloutResult, TreeStats]:
    """``asyncio.run(run_tree_rollouts(...))`` for callers without an event loop."""
    return asyncio.run(run_tree_rollouts(*args, **kwargs))
