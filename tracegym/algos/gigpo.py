"""GiGPO: an episode-level group advantage plus a step-level one over turns that faced the same state.

Source: Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training" (GiGPO); the
anchor-state grouping follows the paper's description (turns of one task whose environment state is
identical form a step group). In tracegym the anchor is ``Turn.state_key`` (``Env.state_key()``
before the action: the board of a gridworld; otherwise a hash of the observations so far).

For trajectory ``i`` of a task group ``E`` with episode reward ``R_i`` and per-turn rewards ``r``::

    G_{i,t}  = sum_{k >= t} gamma^(k-t) r_{i,k}                        (discounted return of turn t)
    A^E_i    = R_i - mean_{j in E} R_j                                  (episode part)
    A^S_{i,t} = G_{i,t} - mean_{(j,k) in S(i,t)} G_{j,k}                 (step part)
    A_{i,t}  = A^E_i + omega * A^S_{i,t}

``S(i,t)`` is the step group: every turn ``(j, k)`` of the same task whose state key equals that of
``(i, t)``. A step group of one (a state only this turn saw) gets step part 0; so does a turn without
a state key. ``std_norm`` divides each centred part by ``std + eps``, ``std`` the Bessel-corrected
(sample, ``n - 1``) std of its group: of the episode rewards of ``E`` for the episode part, of the
returns of ``S(i,t)`` for the step part. That is ``torch.std`` as verl-agent's GiGPO code takes it
(its ``mean_std_norm``) and the std ``grpo`` uses by default (``R = [1, 0]`` gives ``+-0.7071``, not
the population std's ``+-1``). A group whose values are all equal (up to
``EQUAL_VALUES_TOLERANCE``) gets 0. The default (``std_norm=False``, verl-agent's ``mean_norm``)
only centres.

Bias. With the sample inside its own baseline (the paper's form) and with ``std_norm`` the estimate
is biased (the baseline depends on the sample; std scaling rescales per group). ``leave_one_out``
takes both means over the *other* members only (``R_i - mean_{j != i} R_j`` and the step mean over
``S(i,t)`` without ``(i,t)`` itself); with ``std_norm=False`` the episode part is then unbiased.
The step part compares a turn with other visits of the same state, which may include other turns of
the same trajectory (a revisited board); those share the trajectory's later actions, so a
leave-one-out step baseline is unbiased only when each trajectory visits a state at most once.

Metrics: ``step_group_size`` (mean size of the step group a turn belongs to: 1 means no state was
shared and GiGPO reduces to its episode part) and ``step_group_shared`` (fraction of turns whose
step group has at least two members).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tracegym.algos._groups import EstimatorResult, group_mean_std, turn_reward_matrix
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.algos.turn_credit import discounted_turn_returns
from tracegym.types import TrajectoryGroup


def _centre(values: torch.Tensor, ids: torch.Tensor, *, leave_one_out: bool, std_norm: bool, eps: float) -> torch.Tensor:
    """``values - group mean`` (leave-one-out: mean of the others), optionally / (group sample std +
    eps); groups of one and all-equal groups get 0. ``values``/``ids`` [M]; returns [M]."""
    mean, std, count = group_mean_std(values, ids, unbiased=True)  # std only used with std_norm
    centred = values - mean
    if leave_one_out:  # v - mean_{others} = n/(n-1) (v - mean)
        centred = centred * count / (count - 1.0).clamp(min=1.0)
    if std_norm:
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return torch.where(count > 1, centred, torch.zeros_like(centred))


@ADVANTAGE_ESTIMATORS.register("gigpo")
def gigpo(
    groups: Sequence[TrajectoryGroup],
    *,
    gamma: float = 0.95,
    omega: float = 1.0,
    std_norm: bool = False,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> EstimatorResult:
    """GiGPO advantages, one per turn (see the module docstring)."""
    out: list[list[list[float]]] = []
    sizes: list[float] = []
    for group in groups:
        if not group.trajectories:
            out.append([])
            continue
        rewards, mask, _ = turn_reward_matrix([group])  # [N, K]
        returns = discounted_turn_returns(rewards, mask, gamma)  # [N, K]
        episode = torch.tensor(group.rewards, dtype=torch.float64)
        episode_adv = _centre(episode, torch.zeros(len(episode), dtype=torch.long), leave_one_out=leave_one_out,
                              std_norm=std_norm, eps=eps)  # [N]
        # step groups: every turn of this task, keyed by its state; a turn without a key is alone
        cells = [(i, t) for i, traj in enumerate(group.trajectories) for t in range(len(traj.turns))]
        key_ids: dict[object, int] = {}
        ids = []
        for i, t in cells:
            key = group.trajectories[i].turns[t].state_key
            ids.append(key_ids.setdefault(key if key is not None else ("__alone__", i, t), len(key_ids)))
        step = torch.zeros_like(returns)
        if cells:
            id_tensor = torch.tensor(ids, dtype=torch.long)
            values = torch.stack([returns[i, t] for i, t in cells])
            centred = _centre(values, id_tensor, leave_one_out=leave_one_out, std_norm=std_norm, eps=eps)
            counts = torch.bincount(id_tensor)[id_tensor]
            sizes.extend(float(c) for c in counts)
            for (i, t), value in zip(cells, centred.tolist()):
                step[i, t] = value
        advantages = episode_adv.unsqueeze(1) + omega * step  # [N, K]
        out.append([[float(a) for a in advantages[i, : len(traj.turns)]] for i, traj in enumerate(group.trajectories)])
    metrics = {}
    if sizes:
        metrics = {"step_group_size": sum(sizes) / len(sizes), "step_group_shared": sum(s > 1 for s in sizes) / len(sizes)}
    return EstimatorResult(out, metrics)
