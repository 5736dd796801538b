"""Turn-level credit assignment for multi-turn episodes: discounted returns per turn, baselined
within the group at the same turn index.

An episode ``i`` has ``K_i`` assistant turns with rewards ``r_{i,0..K_i-1}`` (``Turn.reward``; the
final reward usually lands on the last turn). The return of turn ``k`` is the discounted sum of
the rewards from that turn on, ``G_{i,k} = sum_{k' >= k} gamma^(k'-k) r_{i,k'}`` (Sutton and Barto,
"Reinforcement Learning: An Introduction", ch. 3; reward-to-go as in REINFORCE). Tokens of turn
``k`` then get advantage ``G_{i,k} - b_{g,k}`` where ``b_{g,k}`` is the mean of ``G_{j,k}`` over
the episodes ``j`` of the same group that reached turn ``k`` (a GRPO-style group baseline taken
per turn index). With ``gamma = 1`` and a single terminal reward, every turn of an episode gets
the same value and, when all episodes of a group have the same number of turns, the result equals
the ``dr_grpo`` advantage (``grpo`` with ``normalize_std=True``).

The per-turn values feed ``Renderer.build_examples(trajectory, advantage=[A_0, ..., A_{K-1}])``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tracegym.algos._groups import group_index, group_mean_std


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
) -> Tensor:
    """Per-turn advantages ``A[i, k] = (G[i, k] - mean_{j in g, turn k exists} G[j, k]) / (std + eps)``.

    The std division only happens with ``normalize_std=True`` (Bessel-corrected std over the same
    set). A turn index that only one episode of the group reached gets advantage 0 (it has no
    comparison). ``turn_rewards``/``turn_mask`` [N, K], ``group_ids`` [N]; returns [N, K], 0 on
    padding.
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
        mean, std, _ = group_mean_std(flat[present], cell_ids[present], unbiased=True)
        centered = flat[present] - mean
        if normalize_std:
            centered = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
        advantages[present] = centered
    return advantages.reshape(n, k)
