"""Monte-Carlo continuation advantages (VinePPO / C3 style), from scores written before the estimator.

``tracegym.rollout.branches.score_mc_continuation`` (config ``advantage.intrinsic: mc_continuation``)
branches each trajectory at its decision turns: the taken action and K-1 alternatives sampled from
the same prompt, M continuations each, and writes on decision turn ``t``::

    Turn.metrics["mc_advantage"] = Q_0 - mean_{l != 0} Q_l      Q_k: mean return from turn t on after action k

This estimator puts that value on its turn. Turns without a score (not chosen as decision turns, or
whose continuations all failed) get, with ``fill``:

- ``"zero"`` (default): 0. The score of an earlier turn estimates the advantage of the *earlier*
  action; it does not depend on the later action, so as a weight on the later action's log-prob it
  has expected gradient 0: copying it forward adds variance and no signal. 0 keeps the same expected
  gradient with less variance.
- ``"previous"``: the value of the nearest earlier scored turn of the trajectory (0 before the first
  one), i.e. a decision turn and the turns after it form one segment with one advantage, as
  VinePPO does for the steps between its branch points. Still unbiased (the argument above), noisier.

``add_rloo=True`` adds the episode-level RLOO advantage (``R_i - mean_{j != i} R_j`` over the task
group; 0 for a group of one) to every unscored turn, so turns outside the decision points still
learn from the outcome; both parts are unbiased, so the sum is too.

Unbiased: ``Q_0`` is an unbiased estimate of ``Q(h_t, a_t)`` and the baseline comes from
alternatives sampled independently of ``a_t`` from ``pi(. | h_t)`` (leave-one-out), an unbiased
estimate of ``V(h_t)`` that does not depend on ``a_t``.

A group none of whose trajectories went through the scoring step (no turn scored and no
``Trajectory.info["mc_continuation"]`` marker) is refused: run with ``advantage.intrinsic:
mc_continuation``. Metrics: ``mc_scored_frac`` (scored turns / turns), ``mc_advantage_abs_mean``
(mean ``|A|`` over the scored turns).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from tracegym.algos._groups import EstimatorResult
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.algos.rloo import rloo_advantages
from tracegym.types import TrajectoryGroup

METRIC = "mc_advantage"
INFO_KEY = "mc_continuation"


def mc_scores(group: TrajectoryGroup) -> list[list[float | None]]:
    """``[trajectory][turn]`` of ``Turn.metrics["mc_advantage"]`` (None where the turn has none).

    Raises ``ValueError`` when no trajectory of a group with turns went through the scoring step."""
    scores = [[turn.metrics.get(METRIC) for turn in trajectory.turns] for trajectory in group.trajectories]
    has_turns = any(trajectory.turns for trajectory in group.trajectories)
    ran = any(v is not None for row in scores for v in row) or any(
        INFO_KEY in trajectory.info for trajectory in group.trajectories)
    if has_turns and not ran:
        raise ValueError(
            f"estimator 'mc_continuation': no turn of task {group.task_id} has Turn.metrics['mc_advantage']; run with "
            f"advantage.intrinsic: mc_continuation (it branches each trajectory at its decision turns before the "
            f"estimator)"
        )
    return [[None if v is None else float(v) for v in row] for row in scores]


@ADVANTAGE_ESTIMATORS.register("mc_continuation")
def mc_continuation(
    groups: Sequence[TrajectoryGroup],
    *,
    fill: Literal["zero", "previous"] = "zero",
    add_rloo: bool = False,
) -> EstimatorResult:
    """The MC continuation advantage on each scored turn; ``fill`` (+ RLOO with ``add_rloo``) elsewhere."""
    out: list[list[list[float]]] = []
    scored: list[float] = []
    total = 0
    for group in groups:
        scores = mc_scores(group)
        if add_rloo and group.trajectories:
            rewards = torch.tensor(group.rewards, dtype=torch.float64)
            episode = rloo_advantages(rewards, torch.zeros(len(rewards), dtype=torch.long)).tolist()
        else:
            episode = [0.0] * len(group.trajectories)
        rows: list[list[float]] = []
        for i, row in enumerate(scores):
            values, last = [], 0.0
            for v in row:
                total += 1
                if v is not None:
                    values.append(v)
                    scored.append(v)
                    last = v
                else:
                    values.append((last if fill == "previous" else 0.0) + episode[i])
            rows.append(values)
        out.append(rows)
    metrics = {"mc_scored_frac": len(scored) / total if total else 0.0}
    if scored:
        metrics["mc_advantage_abs_mean"] = sum(abs(v) for v in scored) / len(scored)
    return EstimatorResult(out, metrics)


__all__ = ["mc_continuation", "mc_scores"]
