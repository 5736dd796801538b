"""Vectorised per-group statistics over a flat vector of samples, and the glue between
``TrajectoryGroup``s and those vectors (shared by the estimators)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from tracegym.types import TrajectoryGroup

TurnAdvantages = list[list[float]]
"""The advantages of one group: ``[trajectory][turn]``, one value per assistant turn."""


@dataclass
class EstimatorResult:
    """What an estimator may return instead of the bare list: the advantages (``[group]`` of
    ``TurnAdvantages``), metrics to log (e.g. GiGPO's mean step-group size) and optional per-turn
    token weights."""

    advantages: list[TurnAdvantages]
    metrics: dict[str, float] = field(default_factory=dict)
    weights: list[TurnAdvantages] | None = None
    """Optional per-turn token weights, same shape as ``advantages`` (None: 1 on every turn). The loss
    multiplies each sampled token's term by its turn's weight, e.g. ``1/|L(n)|`` for a tree node
    repeated in ``|L(n)|`` flattened leaves."""


def check_rewards_and_groups(rewards: Tensor, group_ids: Tensor) -> None:
    """Raise ``ValueError`` with a readable message on malformed estimator inputs."""
    if not isinstance(rewards, Tensor) or not isinstance(group_ids, Tensor):
        raise TypeError("rewards and group_ids must be torch tensors")
    if rewards.dim() != 1 or group_ids.dim() != 1:
        raise ValueError(f"rewards and group_ids must be 1-D, got shapes {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards has {rewards.numel()} entries but group_ids has {group_ids.numel()}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating tensor, got {rewards.dtype}")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        raise ValueError(f"rewards contain non-finite values at positions {bad[:10]}")


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids to ``0..G-1``: returns (inverse [N] long, G)."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(unique.numel())


def group_sum(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Sum of ``values`` [N] per group -> [G]."""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)


def group_count(inverse: Tensor, num_groups: int, dtype: torch.dtype) -> Tensor:
    """Number of members per group -> [G] in ``dtype``."""
    ones = torch.ones(inverse.numel(), dtype=dtype, device=inverse.device)
    return group_sum(ones, inverse, num_groups)


EQUAL_VALUES_TOLERANCE = 1e-9
"""Values closer than this (relative to ``max(1, |value|)``) count as equal: a group of them carries no
signal. Sums of the same rewards in another order differ in the last bits (``0.1 + 0.2`` is not
``0.3``), around 1e-16 per term; a real reward difference is many orders of magnitude above 1e-9."""


def nearly_equal_span(high: Tensor, low: Tensor) -> Tensor:
    """Elementwise: ``high - low`` is within ``EQUAL_VALUES_TOLERANCE`` of 0 (scaled by the values'
    magnitude, at least 1). ``high``/``low`` any shape (e.g. [G] per-group max and min)."""
    scale = torch.maximum(high.abs(), low.abs()).clamp(min=1.0)
    return (high - low) <= EQUAL_VALUES_TOLERANCE * scale


def values_uniform(values: Sequence[float] | Tensor) -> bool:
    """Whether all ``values`` (a flat list or tensor) are equal up to ``EQUAL_VALUES_TOLERANCE``; True
    when empty. NaN is never uniform (raise on it before calling, where it can reach)."""
    flat = values.detach().reshape(-1).tolist() if isinstance(values, Tensor) else [float(v) for v in values]
    if not flat:
        return True
    if not all(math.isfinite(v) for v in flat):
        return False
    high, low = max(flat), min(flat)
    return high - low <= EQUAL_VALUES_TOLERANCE * max(abs(high), abs(low), 1.0)  # as nearly_equal_span


def group_uniform(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """[N] bool: the sample's group (``inverse`` from ``group_index``) has all values equal up to
    ``EQUAL_VALUES_TOLERANCE``.

    Such a group carries no learning signal. Its mean computed in floating point need not equal the
    values (ten rewards of 0.1 average to 0.09999999...), and returns summed in another order differ
    in the last bits, so ``r - mean`` is a tiny non-zero number that std normalisation would blow
    up; estimators zero these groups explicitly.
    """
    high = torch.full((num_groups,), -torch.inf, dtype=values.dtype, device=values.device).scatter_reduce(0, inverse, values, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=values.dtype, device=values.device).scatter_reduce(0, inverse, values, "amin")
    return nearly_equal_span(high, low)[inverse]


def group_mean_std(values: Tensor, group_ids: Tensor, unbiased: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, group std and group size, each [N].

    The std of a group of one is 0 (no spread; the Bessel-corrected formula would divide by zero).
    A group whose values are all equal (up to ``EQUAL_VALUES_TOLERANCE``, see ``group_uniform``)
    gets std 0 and each sample's own value as its mean, so ``value - mean`` is exactly 0 there.
    """
    inverse, g = group_index(group_ids)
    count = group_count(inverse, g, values.dtype)  # [G]
    mean = group_sum(values, inverse, g) / count  # [G]
    uniform = group_uniform(values, inverse, g)  # [N]
    centered = torch.where(uniform, torch.zeros_like(values), values - mean[inverse])  # [N]
    denom = (count - 1.0) if unbiased else count
    var = group_sum(centered * centered, inverse, g) / denom.clamp(min=1.0)
    var = torch.where(count > 1, var, torch.zeros_like(var))
    per_sample_mean = torch.where(uniform, values, mean[inverse])
    return per_sample_mean, var.sqrt()[inverse], count[inverse]


# --- groups <-> flat vectors -------------------------------------------------------------------


def episode_reward_problems(groups: Sequence[TrajectoryGroup]) -> list[str]:
    """Trajectories whose episode reward is not the sum of their turns' rewards (up to
    ``EQUAL_VALUES_TOLERANCE``), one readable line each ([] when all agree).

    Episode estimators read ``Trajectory.reward`` and per-turn ones ``Turn.reward``: when the two
    disagree (a failed episode zeroed on one side only), estimators disagree on the same episode.
    A trajectory without turns (message-level, nothing to train) is not checked."""
    problems = []
    for group in groups:
        for trajectory in group.trajectories:
            if not trajectory.turns:
                continue
            turn_sum = sum(turn.reward for turn in trajectory.turns)
            if not math.isclose(trajectory.reward, turn_sum, rel_tol=EQUAL_VALUES_TOLERANCE, abs_tol=EQUAL_VALUES_TOLERANCE):
                problems.append(
                    f"task {group.task_id} sample {trajectory.sample_index} ({trajectory.end_reason}): episode reward "
                    f"{trajectory.reward!r} but its {len(trajectory.turns)} turn rewards sum to {turn_sum!r}"
                )
    return problems


def check_episode_rewards(groups: Sequence[TrajectoryGroup]) -> None:
    """Raise ``ValueError`` unless every trajectory's episode reward is the sum of its turn rewards
    (``episode_reward_problems``)."""
    problems = episode_reward_problems(groups)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(
            "episode reward != sum of turn rewards, so episode and per-turn estimators would disagree: "
            + "; ".join(problems[:3]) + more
        )


def episode_rewards(groups: Sequence[TrajectoryGroup]) -> tuple[Tensor, Tensor]:
    """Flatten groups: (episode rewards [N] float64, group ids [N] long), trajectories in order."""
    rewards = [r for g in groups for r in g.rewards]
    ids = [i for i, g in enumerate(groups) for _ in g.trajectories]
    return torch.tensor(rewards, dtype=torch.float64), torch.tensor(ids, dtype=torch.long)


def broadcast_to_turns(groups: Sequence[TrajectoryGroup], episode_advantages: Tensor) -> list[TurnAdvantages]:
    """One advantage per episode [N] -> the same value on every turn of that episode, per group."""
    values = episode_advantages.tolist()
    out: list[TurnAdvantages] = []
    position = 0
    for g in groups:
        out.append([[float(values[position + j])] * len(t.turns) for j, t in enumerate(g.trajectories)])
        position += len(g.trajectories)
    return out


def turn_reward_matrix(groups: Sequence[TrajectoryGroup]) -> tuple[Tensor, Tensor, Tensor]:
    """Per-turn rewards padded to the longest episode: (rewards [N, K] float64, mask [N, K], group ids [N])."""
    episodes = [t for g in groups for t in g.trajectories]
    k = max((len(t.turns) for t in episodes), default=0)
    rewards = torch.zeros((len(episodes), max(k, 1)), dtype=torch.float64)
    mask = torch.zeros_like(rewards)
    for i, t in enumerate(episodes):
        for j, turn in enumerate(t.turns):
            rewards[i, j] = turn.reward
            mask[i, j] = 1.0
    ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
    return rewards, mask, ids


def unflatten_turns(groups: Sequence[TrajectoryGroup], per_turn: Tensor) -> list[TurnAdvantages]:
    """[N, K] per-turn values (padded) -> ``[group][trajectory][turn]`` lists, padding dropped."""
    rows = per_turn.tolist()
    out: list[TurnAdvantages] = []
    position = 0
    for g in groups:
        out.append([[float(x) for x in rows[position + j][: len(t.turns)]] for j, t in enumerate(g.trajectories)])
        position += len(g.trajectories)
    return out
