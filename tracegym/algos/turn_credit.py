"""Turn-level credit assignment for multi-turn episodes: discounted returns per turn, baselined
within the group at the same turn index (registered as the estimator ``turn_rloo``), or against the
group's whole-episode returns (``turn_grpo``).

An episode ``i`` has ``K_i`` assistant turns with rewards ``r_{i,0..K_i-1}`` (``Turn.reward``; the
final reward usually lands on the last turn). The return of turn ``k`` is the discounted sum of
the rewards from that turn on, ``G_{i,k} = sum_{k' >= k} gamma^(k'-k) r_{i,k'}`` (Sutton and Barto,
"Reinforcement Learning: An Introduction", ch. 3; reward-to-go as in REINFORCE). Tokens of turn
``k`` then get advantage ``G_{i,k} - b_{g,k}`` where ``b_{g,k}`` is the mean of ``G_{j,k}`` over
the episodes ``j`` of the same group that reached turn ``k`` (a group baseline taken per turn
index).

Unbiased by default (``leave_one_out=True``): the baseline of episode ``i`` is the mean over the
*other* episodes ``j != i`` that reached turn ``k``. Those episodes are sampled independently of
episode ``i``, so the baseline does not depend on ``i``'s actions and ``E[grad log pi * b] = 0``: the
policy-gradient estimate stays unbiased (the RLOO argument of Kool et al. 2019, per turn index).
With the sample itself in the mean (``leave_one_out=False``, the GRPO-style form) the estimate is
biased by a factor ``(n-1)/n`` on each turn cell and ``normalize_std`` biases it further (it
rescales each cell by a statistic of the samples). With ``gamma = 1``, one terminal reward and
equal episode lengths, ``leave_one_out=False`` equals ``dr_grpo`` on every turn and
``leave_one_out=True`` equals ``rloo``.

The per-turn values feed ``Renderer.build_examples(trajectory, advantage=[A_0, ..., A_{K-1}])``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from tracegym.algos._groups import (TurnAdvantages, group_index, group_mean_std, nearly_equal_span, turn_reward_matrix,
                                   unflatten_turns, values_uniform)
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.types import TrajectoryGroup


def discounted_turn_returns(turn_rewards: Tensor, turn_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G[i, k] = sum_{k' >= k, mask} gamma^(k'-k) * r[i, k']``; 0 where ``turn_mask`` is 0.

    ``turn_rewards`` [N, K] float and ``turn_mask`` [N, K] (1 for a real turn, 0 for padding
    after the episode's last turn). Returns [N, K].
    """
    if turn_rewards.dim() != 2 or turn_rewards.shape != turn_mask.shape:
        raise ValueError(
            f"turn_rewards and turn_mask must both be [N, K], got {tuple(turn_rewards.shape)} and {tuple(turn_mask.shape)}"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    mask = turn_mask.to(turn_rewards.dtype)
    rewards = turn_rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # [N]
    for k in range(rewards.shape[1] - 1, -1, -1):  # K is the number of turns: a short loop
        running = rewards[:, k] + gamma * running
        returns[:, k] = running
    return returns * mask


def turn_level_advantages(
    turn_rewards: Tensor,
    turn_mask: Tensor,
    group_ids: Tensor,
    *,
    gamma: float = 1.0,
    normalize_std: bool = False,
    eps: float = 1e-6,
    leave_one_out: bool = False,
) -> Tensor:
    """Per-turn advantages ``A[i, k] = (G[i, k] - mean_{j in g, turn k exists} G[j, k]) / (std + eps)``.

    ``leave_one_out=True`` takes the mean over ``j != i`` only (``n/(n-1)`` times the centred value,
    unbiased; see the module docstring). The std division only happens with
    ``normalize_std=True`` (Bessel-corrected std over the same set). A turn index that only one
    episode of the group reached gets advantage 0 (it has no comparison). ``turn_rewards`` /
    ``turn_mask`` [N, K], ``group_ids`` [N]; returns [N, K], 0 on padding.
    """
    returns = discounted_turn_returns(turn_rewards, turn_mask, gamma)
    n, k = returns.shape
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must have shape ({n},), got {tuple(group_ids.shape)}")
    present = turn_mask.reshape(-1) > 0  # [N*K]
    # One "group" per (episode group, turn index); only present turns take part.
    dense_groups, _ = group_index(group_ids)  # ids 0..G-1, so g * K + k cannot collide
    cell_ids = (dense_groups.unsqueeze(1) * k + torch.arange(k, device=returns.device)).reshape(-1)  # [N*K]
    flat = returns.reshape(-1)
    advantages = torch.zeros_like(flat)
    if present.any():
        mean, std, count = group_mean_std(flat[present], cell_ids[present], unbiased=True)
        centered = flat[present] - mean
        if leave_one_out:  # r - mean_{j != i} r_j = n/(n-1) (r - mean); cells of one episode stay 0
            centered = torch.where(count > 1, centered * count / (count - 1.0).clamp(min=1.0), torch.zeros_like(centered))
        if normalize_std:
            centered = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
        advantages[present] = centered
    return advantages.reshape(n, k)


@ADVANTAGE_ESTIMATORS.register("turn_rloo")
def turn_rloo(
    groups: Sequence[TrajectoryGroup],
    *,
    gamma: float = 1.0,
    leave_one_out: bool = True,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> list[TurnAdvantages]:
    """Per-turn advantages from per-turn rewards (``Turn.reward``): each turn's discounted
    reward-to-go minus the leave-one-out mean of the other episodes' returns from the same turn
    index. Unbiased with the defaults; see the module docstring."""
    rewards, mask, ids = turn_reward_matrix(groups)
    advantages = turn_level_advantages(
        rewards, mask, ids, gamma=gamma, normalize_std=normalize_std, eps=eps, leave_one_out=leave_one_out
    )
    return unflatten_turns(groups, advantages)


@ADVANTAGE_ESTIMATORS.register("turn_grpo")
def turn_grpo(
    groups: Sequence[TrajectoryGroup],
    *,
    gamma: float = 1.0,
    leave_one_out: bool = True,
    std_norm: bool = False,
    eps: float = 1e-6,
) -> list[TurnAdvantages]:
    """Per-turn GRPO: ``A_{i,t} = (G_{i,t} - b_i) / sigma``, each turn's return-to-go against a
    baseline of whole-episode returns ``G_{j,0}`` of the group (after OpenTinker's per-step GRPO).

    ``leave_one_out=True`` (default, unbiased): ``b_i = mean_{j != i} G_{j,0}``, built from the other
    episodes only, so it does not depend on episode ``i``'s actions. ``False``: ``b_i`` includes
    ``G_{i,0}`` (GRPO's form, biased by ``(n-1)/n`` on the own-episode term). ``std_norm`` divides by
    the std of ``G_{.,0}`` over the group (biased); whole returns equal up to
    ``EQUAL_VALUES_TOLERANCE`` (``0.1 + 0.2`` vs ``0.3``) count as std 0 and give 0 advantages, like
    ``grpo``, instead of a division by a rounding error. With ``gamma=1`` and one terminal reward,
    ``G_{i,t} = R_i`` and this equals ``rloo`` (``grpo`` with ``leave_one_out=False, std_norm=True``).

    A uniform group gets exactly 0 on every turn: a group of one, a group whose returns are all equal,
    and a group of identical episodes (the same per-turn returns, up to the tolerance). Without that
    rule identical episodes with rewards ``[.1, .1, .1]`` would get ``G_t - G_0 = [0, -.1, -.2]``: an
    offset that is the same in every sample, so it compares nothing and only pushes later turns down.
    """
    out: list[TurnAdvantages] = []
    for group in groups:
        rewards, mask, _ = turn_reward_matrix([group])
        returns = discounted_turn_returns(rewards, mask, gamma)  # [N, K]
        n = returns.shape[0]
        start = returns[:, 0]  # [N] whole-episode returns
        if n < 2 or values_uniform(returns[mask > 0]) or _identical_episodes(returns, mask):
            out.append([[0.0] * len(t.turns) for t in group.trajectories])  # exactly 0, whatever the float means say
            continue
        total = start.sum()
        baseline = (total - start) / (n - 1) if leave_one_out else total.expand(n) / n  # [N]
        baseline = baseline.unsqueeze(1).expand_as(returns)  # [N, K]
        # a return equal to its baseline up to rounding (0.1 + 0.2 against 0.3) has advantage exactly 0
        same = nearly_equal_span(torch.maximum(returns, baseline), torch.minimum(returns, baseline))  # [N, K]
        advantages = torch.where(same, torch.zeros_like(returns), returns - baseline) * mask  # [N, K]
        if std_norm:
            _, std, _ = group_mean_std(start, torch.zeros(n, dtype=torch.long), unbiased=True)  # [N], 0 when uniform
            advantages = advantages / (std[0] + eps) if std[0] > 0 else torch.zeros_like(advantages)
        out.append([[float(a) for a in advantages[i, : len(t.turns)]] for i, t in enumerate(group.trajectories)])
    return out


def _identical_episodes(returns: Tensor, mask: Tensor) -> bool:
    """Whether every episode of the group has the same turns and, turn by turn, the same return (up to
    ``EQUAL_VALUES_TOLERANCE``). ``returns``/``mask`` [N, K] of one group."""
    if not bool((mask == mask[0]).all()):
        return False  # episodes of different lengths
    present = mask[0] > 0  # [K]
    return all(values_uniform(returns[:, k]) for k in range(returns.shape[1]) if present[k])
