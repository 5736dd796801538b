"""Advantages over a rollout tree (TreeRL / ARPO), one per turn, with per-turn token weights.

Input: a group whose trajectories are the leaves of one tree (``rollout.strategy: tree``), each
turn labelled with its node (``Trajectory.info["tree"]["nodes"]``, see ``tracegym.rollout.tree``);
a trajectory without tree info is a chain of its own from the root (so on ordinary rollouts the tree
is N independent chains of depth 1).

Segments. ``L(n)`` is the set of leaves below turn node ``n``. Consecutive turns of a leaf with the
same ``L(n)`` (no fork between them) form one segment, the tree's node in TreeRL's sense; its parent
is the segment before the last fork above it, or the root (``L(root)`` = every leaf). With ``R_i``
the leaf rewards (with ``leaf_loo``: ``R_i - mean_{j != i} R_j`` first, TreeRL's leaf
normalisation) and ``V(s) = mean_{i in L(s)} R_i``::

    treerl:       A(s) = [(V(s) - V(root)) + (V(s) - V(parent(s)))] / sqrt(|L(s)|)     (TreeRL)
    local:        A(s) = V(s) - V(parent(s))        (Monte-Carlo advantage of the segment's actions)
    grpo_leaves:  A    = R_i - V(root) on every turn of leaf i                          (ARPO "soft")

Every turn gets the advantage of its segment. Token weights (``weight``), per turn, for the loss:
``1/L`` gives a turn in segment ``s`` weight ``1/|L(s)|``, so the copies of a shared prefix in the
``|L(s)|`` flattened leaves weigh 1 together (the prefix counts once, not once per leaf: exact
de-duplication); ``1/sqrtL`` is TreeRL's softer scaling; ``none`` weighs every copy 1.

Bias. For uniform branching, ``local`` is an unbiased Monte-Carlo estimate of the advantage of the
segment's actions (``V(s)`` estimates the value after them, ``V(parent)`` the value before, from
leaves sampled under the same prefix). ``treerl`` adds a root-relative term and the 1/sqrt scaling
(TreeRL's choice, biased); ``grpo_leaves`` ignores the tree. Entropy-guided branching over-samples
uncertain prefixes, which changes how often a segment appears, not the estimate at each segment.

Spec check (SPECS.md section 2): root -> a {leaves 1, 0}, b {0, 0}, ``treerl``, no leaf LOO:
``A(a) = 0.3536, A(b) = -0.3536``; leaves under a ``1.25, -0.75``; under b ``-0.25, -0.25``. A depth-1
tree (N independent chains): ``local`` equals mean-centred GRPO, ``treerl`` twice that.

Metrics: ``tree_segments`` (mean distinct segments per tree), ``tree_shared_turns`` (fraction of
turns in a segment of more than one leaf).
"""

from __future__ import annotations

import math
from typing import Collection, Literal, Sequence

from pydantic import BaseModel, ConfigDict

from tracegym.algos._groups import EstimatorResult, values_uniform
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.types import Trajectory, TrajectoryGroup

TREE_KEY = "tree"
"""``Trajectory.info[TREE_KEY]``: a leaf's place in its tree (``nodes`` per turn, ``parent``, ``fork_turn``)."""

TreeMode = Literal["treerl", "local", "grpo_leaves"]
TreeWeight = Literal["1/L", "1/sqrtL", "none"]


class TreeOptions(BaseModel):
    """Options of the ``tree`` estimator."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: TreeMode = "treerl"
    """treerl: TreeRL's (V(s)-V(root)) + (V(s)-V(parent)), / sqrt|L(s)|; local: V(s)-V(parent);
    grpo_leaves: leaf reward minus the tree's mean on every turn."""

    weight: TreeWeight = "1/L"
    """Per-turn token weight: 1/|L(s)| (a shared prefix weighs 1 in total), 1/sqrt|L(s)|, or none (1)."""

    leaf_loo: bool = False
    """Replace each leaf reward by R_i - mean of the other leaves first (TreeRL's leaf normalisation)."""


def leaf_nodes(trajectory: Trajectory, leaf: int) -> list[str]:
    """The turn-node ids of a leaf: its tree info's, or its own (``"<leaf>:<turn>"``) when it has none."""
    info = trajectory.info.get(TREE_KEY)
    if isinstance(info, dict) and isinstance(info.get("nodes"), list):
        return [str(n) for n in info["nodes"]]
    return [f"{leaf}:{k}" for k in range(len(trajectory.turns))]


def _leaf_nodes(group: TrajectoryGroup) -> list[list[str]]:
    out = []
    for i, trajectory in enumerate(group.trajectories):
        nodes = leaf_nodes(trajectory, i)
        if len(nodes) != len(trajectory.turns):
            raise ValueError(
                f"tree estimator: task {group.task_id} leaf {i}: {len(nodes)} tree nodes for {len(trajectory.turns)} turns"
            )
        out.append(nodes)
    return out


def tree_turn_values(
    rewards: Sequence[float], nodes: Sequence[Sequence[str]], mode: TreeMode = "treerl", weight: TreeWeight = "1/L",
    leaf_loo: bool = False,
) -> tuple[list[list[float]], list[list[float]], int]:
    """Per-turn advantages and weights of one tree (module docstring): ``rewards[i]`` of leaf ``i``
    whose turn ``k`` is node ``nodes[i][k]``. Returns ``(advantages, weights, segments)``, the first
    two ``[leaf][turn]``. Leaves of equal reward (up to ``EQUAL_VALUES_TOLERANCE``) give exactly 0 on
    every turn (weights unchanged)."""
    n = len(rewards)
    values = [float(r) for r in rewards]
    if leaf_loo and n > 1:
        total = sum(values)
        values = [r - (total - r) / (n - 1) for r in values]
    below: dict[str, set[int]] = {}
    for i, path in enumerate(nodes):
        for node in path:
            below.setdefault(node, set()).add(i)
    # every leaf equally good (up to rounding): no segment beats another, exactly 0 everywhere
    uniform = values_uniform([float(r) for r in rewards])

    def value(leaves: Collection[int]) -> float:
        """Mean leaf value; exactly the common value when the leaves' values are equal (up to
        rounding), so two segments of equal leaves differ by exactly 0, not by float noise."""
        picked = [values[i] for i in leaves]
        return picked[0] if values_uniform(picked) else sum(picked) / len(picked)

    root_value = value(range(n)) if n else 0.0

    advantages: list[list[float]] = []
    weights: list[list[float]] = []
    segments: set[frozenset[int]] = set()
    for i, path in enumerate(nodes):
        parent_value = root_value
        current: frozenset[int] | None = None
        leaf_adv: list[float] = []
        leaf_w: list[float] = []
        for node in path:
            leaves = frozenset(below[node])
            if leaves != current:  # a new segment starts at a fork: its parent is the one before
                if current is not None:
                    parent_value = value(current)
                current = leaves
                segments.add(leaves)
            size, v = len(leaves), value(leaves)
            if mode == "treerl":
                adv = ((v - root_value) + (v - parent_value)) / math.sqrt(size)
            elif mode == "local":
                adv = v - parent_value
            elif mode == "grpo_leaves":
                adv = values[i] - root_value
            else:
                raise ValueError(f"tree mode must be treerl, local or grpo_leaves, got {mode!r}")
            leaf_adv.append(0.0 if uniform else adv)
            leaf_w.append(1.0 / size if weight == "1/L" else 1.0 / math.sqrt(size) if weight == "1/sqrtL" else 1.0)
        advantages.append(leaf_adv)
        weights.append(leaf_w)
    return advantages, weights, len(segments)


@ADVANTAGE_ESTIMATORS.register("tree", options=TreeOptions)
def tree(groups: Sequence[TrajectoryGroup], opts: TreeOptions) -> EstimatorResult:
    """Advantages and token weights over each group's rollout tree (see the module docstring)."""
    advantages, weights = [], []
    segments: list[int] = []
    shared = total = 0
    for group in groups:
        nodes = _leaf_nodes(group)
        adv, w, count = tree_turn_values(group.rewards, nodes, opts.mode, opts.weight, opts.leaf_loo)
        advantages.append(adv)
        weights.append(w)
        segments.append(count)
        below: dict[str, int] = {}
        for path in nodes:
            for node in path:
                below[node] = below.get(node, 0) + 1
        shared += sum(below[node] > 1 for path in nodes for node in path)
        total += sum(len(path) for path in nodes)
    metrics = {"tree_segments": sum(segments) / len(segments) if segments else 0.0,
               "tree_shared_turns": shared / total if total else 0.0}
    return EstimatorResult(advantages, metrics, weights=weights)


__all__ = ["TREE_KEY", "TreeOptions", "leaf_nodes", "tree", "tree_turn_values"]
