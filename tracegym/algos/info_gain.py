"""InfoPO-style fusion of the outcome advantage with an information-gain (intrinsic) advantage.

**Biased.** The intrinsic term rewards turns whose observation changed the policy's next action;
it is not a potential-based shaping, so it changes the optimum of the objective (it is a bonus for
"informative" actions, not an estimate of the outcome advantage). Use it to get signal where the
outcome reward has none (all samples of a task equally good or bad), not as an unbiased estimator.

Source: InfoPO (reference code ``kfq20/InfoPO``: ``verl/trainer/ppo/intrinsic_reward.py``,
``core_algos.py::compute_info_grpo_advantage``), as specified in ``SPECS.md`` section 1. The
per-turn scores ``I_{i,t}`` are ``Turn.metrics["info_gain"]``, written by
``tracegym.train.info_gain.score_info_gain`` before the estimator runs (config
``advantage.intrinsic: info_gain``). For a task group ``G`` with episode rewards ``R`` and a step's
groups ``B`` (all groups given in one call)::

    A_{i,t}  = A_out_i + beta * g_G * m * Â_{i,t}
    A_out_i  = (R_i - mean_G R) / (sigma_G(R) + eps)           GRPO, the same value on every turn
    g_G      = sigmoid(-sigma_G(R) / tau)                       variance gate, per task group
    Â_{i,t}  = (I_{i,t} - mu_G) / (s_G + eps)  if I_{i,t} != 0, else 0
    m        = min(1, max(sigma_out, 1) / sigma_int)            one per call (per step)

Which std, over which set (the spec names the stds but not these choices):

- ``sigma_G(R)``: std of the episode rewards of the task group, the same number in ``A_out`` and in
  the gate; Bessel-corrected (``n - 1``) by default, population with ``unbiased_std=False``. A group
  of one or with all rewards equal has ``sigma_G(R) = 0``: ``A_out = 0`` and ``g = 1/2`` (the
  reference code gives a group of one std 1, i.e. ``g ~ 0``; here a lone sample keeps its
  intrinsic signal, as a group without outcome variance does).
- ``mu_G``, ``s_G``: mean and std (Bessel by default, as ``unbiased_std``) of the **non-zero**
  ``I`` of the task group, pooled over all its trajectories and turns; zeros (last turns,
  observation-free turns) stay 0. One non-zero value, or all equal: ``Â = 0`` there.
  ``normalize_std=False`` only centres (``I - mu_G``), in ``A_out`` too (Dr. GRPO style).
- ``sigma_out``, ``sigma_int``: std (Bessel by default, as ``unbiased_std``) of ``A_out`` and of
  ``Â`` over **every turn of every trajectory of every group given** (one value per turn, zeros
  included). The reference code takes them per token over the batch, which weighs long turns more;
  tracegym's unit is the turn. ``sigma_int = 0`` (no intrinsic signal) gives ``m = 1``. No ``eps``
  in ``m``. ``m`` only shrinks the intrinsic part when it is wider than ``max(sigma_out, 1)``; with
  ``normalize_std`` ``Â`` has std at most about 1, so ``m`` matters mostly without it.
- ``eps`` is added to ``sigma_G(R)`` and ``s_G`` as in ``grpo`` (a zero std gives exactly 0).

Options: ``beta`` (0.1), ``tau`` (0.05), ``normalize_std``, ``eps``, ``unbiased_std`` (as ``grpo``).
Metrics: ``info_gain_abs_mean`` (mean ``|I|`` over the turns that have a next turn),
``gate_mean`` (mean ``g`` over trajectories), ``intrinsic_scale`` (``m``).

A trajectory of two or more turns whose turns (the last excepted) lack ``metrics["info_gain"]`` is
refused: the scores come from the model-aware step, which must run first. A NaN or infinite score is
an error naming the task, sample and turn, with or without ``normalize_std`` (NaN fails every ``std >
0`` test, so it would otherwise zero the group's intrinsic term without a word).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from tracegym.algos._groups import EstimatorResult, group_mean_std
from tracegym.algos.grpo import grpo_advantages
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.types import TrajectoryGroup

METRIC = "info_gain"


def info_gain_scores(group: TrajectoryGroup) -> list[list[float]]:
    """``[trajectory][turn]`` of ``Turn.metrics["info_gain"]`` (the last turn: 0 when absent).

    Raises ``ValueError`` when a trajectory of 2+ turns has a turn without a score, or when a score
    is NaN or infinite (naming the task, sample and turn)."""
    out: list[list[float]] = []
    for i, trajectory in enumerate(group.trajectories):
        values = []
        for t, turn in enumerate(trajectory.turns):
            if METRIC in turn.metrics:
                score = float(turn.metrics[METRIC])
                if not math.isfinite(score):  # NaN would drop out of every std below and zero the group silently
                    raise ValueError(
                        f"estimator 'info_gain': task {group.task_id} sample {trajectory.sample_index} turn {t} has a "
                        f"non-finite Turn.metrics['info_gain'] = {score!r} (a NaN/inf log-prob in the scoring pass?)"
                    )
                values.append(score)
            elif t == len(trajectory.turns) - 1:
                values.append(0.0)
            else:
                raise ValueError(
                    f"estimator 'info_gain': task {group.task_id} sample {trajectory.sample_index} turn {t} has no "
                    f"Turn.metrics['info_gain']; run with advantage.intrinsic: info_gain (it scores every turn with "
                    f"the model before the estimator)"
                )
        out.append(values)
    return out


def _std(values: list[float], unbiased: bool) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1 if unbiased else n))


def _normalise_nonzero(scores: list[list[float]], *, normalize_std: bool, eps: float, unbiased_std: bool) -> list[list[float]]:
    """Â: the group's non-zero scores centred (and scaled) by their own mean (and std); zeros stay 0."""
    flat = [v for row in scores for v in row if v != 0.0]
    if not flat:
        return [[0.0] * len(row) for row in scores]
    values = torch.tensor(flat, dtype=torch.float64)
    mean, std, _ = group_mean_std(values, torch.zeros(len(flat), dtype=torch.long), unbiased=unbiased_std)
    centred = values - mean  # exactly 0 for a single value or all-equal values
    if normalize_std:
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    it = iter(centred.tolist())
    return [[next(it) if v != 0.0 else 0.0 for v in row] for row in scores]


@ADVANTAGE_ESTIMATORS.register("info_gain")
def info_gain(
    groups: Sequence[TrajectoryGroup],
    *,
    beta: float = 0.1,
    tau: float = 0.05,
    normalize_std: bool = True,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> EstimatorResult:
    """GRPO outcome advantage plus the gated, scaled, group-normalised information gain (biased;
    see the module docstring for every std)."""
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    outcome: list[list[float]] = []  # [group][trajectory] episode advantage
    gates: list[float] = []  # per group
    intrinsic: list[list[list[float]]] = []  # [group][trajectory][turn] Â
    abs_scores: list[float] = []
    for group in groups:
        scores = info_gain_scores(group)
        abs_scores.extend(abs(v) for row in scores for v in row[:-1])
        if not group.trajectories:
            outcome.append([])
            gates.append(0.5)
            intrinsic.append([])
            continue
        rewards = torch.tensor(group.rewards, dtype=torch.float64)
        ids = torch.zeros(len(rewards), dtype=torch.long)
        outcome.append(grpo_advantages(rewards, ids, normalize_std=normalize_std, eps=eps, unbiased_std=unbiased_std).tolist())
        sigma = float(group_mean_std(rewards, ids, unbiased=unbiased_std)[1][0])
        decay = math.exp(-sigma / tau)  # sigma >= 0: no overflow
        gates.append(decay / (1.0 + decay))  # sigmoid(-sigma / tau)
        intrinsic.append(_normalise_nonzero(scores, normalize_std=normalize_std, eps=eps, unbiased_std=unbiased_std))
    every_out = [a for g, group in enumerate(groups) for i, traj in enumerate(group.trajectories)
                 for a in [outcome[g][i]] * len(traj.turns)]
    every_int = [a for rows in intrinsic for row in rows for a in row]
    sigma_out, sigma_int = _std(every_out, unbiased_std), _std(every_int, unbiased_std)
    scale = min(1.0, max(sigma_out, 1.0) / sigma_int) if sigma_int > 0 else 1.0
    out: list[list[list[float]]] = []
    for g, group in enumerate(groups):
        weight = beta * gates[g] * scale
        out.append([[outcome[g][i] + weight * a for a in intrinsic[g][i]] for i in range(len(group.trajectories))])
    gate_rows = [gates[g] for g, group in enumerate(groups) for _ in group.trajectories]
    metrics = {"intrinsic_scale": scale}
    if abs_scores:
        metrics["info_gain_abs_mean"] = sum(abs_scores) / len(abs_scores)
    if gate_rows:
        metrics["gate_mean"] = sum(gate_rows) / len(gate_rows)
    return EstimatorResult(out, metrics)


__all__ = ["info_gain", "info_gain_scores"]
