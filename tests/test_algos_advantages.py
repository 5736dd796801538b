"""Advantage estimators: hand-computed values, loop versions vs the vectorised ones, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.algos import ADVANTAGE_ESTIMATORS, compute_advantages, discounted_turn_returns, turn_level_advantages

# Three groups, interleaved, of sizes 3, 2 and 1:
#   group 7: rewards [1, 0, 0] at positions 0, 2, 4
#   group 3: rewards [2, 4]    at positions 1, 5
#   group 9: rewards [5]       at position 3
REWARDS = torch.tensor([1.0, 2.0, 0.0, 5.0, 0.0, 4.0], dtype=torch.float64)
GROUPS = torch.tensor([7, 3, 7, 9, 7, 3])


def test_grpo_hand_computed():
    # group 7: mean 1/3, deviations [2/3, -1/3, -1/3], Bessel var = (4/9+1/9+1/9)/2 = 1/3, std = 0.577350
    #   -> [0.666667/0.577350, -0.333333/0.577350, ...] = [1.154701, -0.577350, -0.577350]
    # group 3: mean 3, deviations [-1, 1], Bessel var = 2, std = 1.414214 -> [-0.707107, 0.707107]
    # group 9: one sample -> 0
    expected = torch.tensor([1.154701, -0.707107, -0.577350, 0.0, -0.577350, 0.707107], dtype=torch.float64)
    out = compute_advantages("grpo", REWARDS, GROUPS, eps=0.0)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_grpo_population_std_and_eps():
    # group 7 with population std: var = (6/9)/3 = 2/9, std = 0.471405 -> 0.666667/0.471405 = 1.414214
    out = compute_advantages("grpo", REWARDS, GROUPS, eps=0.0, unbiased_std=False)
    assert out[0].item() == pytest.approx(1.414214, abs=1e-6)
    assert out[2].item() == pytest.approx(-0.707107, abs=1e-6)
    # eps is added to the std: group 3 with eps = 0.5 -> 1 / (1.414214 + 0.5) = 0.522407
    out = compute_advantages("grpo", REWARDS, GROUPS, eps=0.5)
    assert out[5].item() == pytest.approx(0.522407, abs=1e-6)


def test_dr_grpo_and_grpo_without_std_hand_computed():
    # r - group mean: group 7 mean 1/3, group 3 mean 3, group 9 mean 5
    expected = torch.tensor([2 / 3, -1.0, -1 / 3, 0.0, -1 / 3, 1.0], dtype=torch.float64)
    torch.testing.assert_close(compute_advantages("dr_grpo", REWARDS, GROUPS), expected)
    torch.testing.assert_close(compute_advantages("grpo", REWARDS, GROUPS, normalize_std=False), expected)


def test_rloo_hand_computed():
    # group 7: 1 - mean(0,0) = 1; 0 - mean(1,0) = -0.5 (twice). group 3: 2 - 4 = -2; 4 - 2 = 2. group 9: 0
    expected = torch.tensor([1.0, -2.0, -0.5, 0.0, -0.5, 2.0], dtype=torch.float64)
    torch.testing.assert_close(compute_advantages("rloo", REWARDS, GROUPS), expected)


def test_reinforce_hand_computed():
    # batch mean = (1+2+0+5+0+4)/6 = 2
    expected = torch.tensor([-1.0, 0.0, -2.0, 3.0, -2.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(compute_advantages("reinforce", REWARDS, GROUPS), expected)
    torch.testing.assert_close(compute_advantages("reinforce", REWARDS, GROUPS, baseline=False), REWARDS)
    # population std: sqrt((1+0+4+9+4+4)/6) = sqrt(22/6) = 1.914854 -> 3 / 1.914854 = 1.566699
    out = compute_advantages("reinforce", REWARDS, GROUPS, normalize_std=True, eps=0.0)
    assert out[3].item() == pytest.approx(1.566699, abs=1e-6)


# --- loop references ------------------------------------------------------------------------


def _members(group_ids: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        out.setdefault(g, []).append(i)
    return out


def loop_grpo(rewards: list[float], groups: list[int], normalize_std: bool, eps: float) -> list[float]:
    out = [0.0] * len(rewards)
    for idx in _members(groups).values():
        values = [rewards[i] for i in idx]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        for i in idx:
            out[i] = (rewards[i] - mean) / (std + eps) if normalize_std else rewards[i] - mean
    return out


def loop_rloo(rewards: list[float], groups: list[int]) -> list[float]:
    out = [0.0] * len(rewards)
    for idx in _members(groups).values():
        for i in idx:
            others = [rewards[j] for j in idx if j != i]
            out[i] = rewards[i] - sum(others) / len(others) if others else 0.0
    return out


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_matches_loop_on_unequal_random_groups(seed: int):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 7, (9,), generator=gen).tolist()  # group sizes 1..6
    groups = [g * 11 - 20 for g, size in enumerate(sizes) for _ in range(size)]  # negative and sparse ids
    perm = torch.randperm(len(groups), generator=gen).tolist()
    groups = [groups[p] for p in perm]
    rewards = torch.randn(len(groups), generator=gen, dtype=torch.float64)
    rewards[torch.rand(len(groups), generator=gen) < 0.3] = 1.0  # ties, as with 0/1 rewards
    group_t = torch.tensor(groups)
    r = rewards.tolist()
    torch.testing.assert_close(
        compute_advantages("grpo", rewards, group_t, eps=1e-6), torch.tensor(loop_grpo(r, groups, True, 1e-6), dtype=torch.float64)
    )
    torch.testing.assert_close(
        compute_advantages("dr_grpo", rewards, group_t), torch.tensor(loop_grpo(r, groups, False, 0.0), dtype=torch.float64)
    )
    torch.testing.assert_close(compute_advantages("rloo", rewards, group_t), torch.tensor(loop_rloo(r, groups), dtype=torch.float64))


def test_group_advantages_sum_to_zero_per_group_and_uniform_groups_get_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    for name in ("grpo", "dr_grpo", "rloo"):
        adv = compute_advantages(name, rewards, groups)
        assert torch.all(adv[:3] == 0), name  # all-equal group: no signal
        assert adv[3:].sum().abs() < 1e-6, name


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages("grpo", torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="entries"):
        compute_advantages("grpo", torch.tensor([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="integer"):
        compute_advantages("rloo", torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
    with pytest.raises(KeyError, match="Did you mean 'grpo'"):
        compute_advantages("grpoo", torch.tensor([1.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="unexpected keyword"):
        compute_advantages("rloo", torch.tensor([1.0]), torch.tensor([0]), normalize_std=True)
    assert set(ADVANTAGE_ESTIMATORS.names()) == {"grpo", "dr_grpo", "rloo", "reinforce"}


# --- turn-level credit ----------------------------------------------------------------------


def test_turn_level_advantages_hand_computed():
    # one group of three episodes with 2, 3 and 1 turns; gamma = 0.5
    rewards = torch.tensor([[0.5, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    # returns: ep0 G1 = 1, G0 = 0.5 + 0.5*1 = 1; ep1 G2 = 1, G1 = 0.5, G0 = 0.25; ep2 G0 = 1
    returns = discounted_turn_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0.0], [0.25, 0.5, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64))
    # turn 0 baseline (1 + 0.25 + 1)/3 = 0.75; turn 1 baseline (1 + 0.5)/2 = 0.75; turn 2: one episode -> 0
    adv = turn_level_advantages(rewards, mask, torch.tensor([4, 4, 4]), gamma=0.5)
    expected = torch.tensor([[0.25, 0.25, 0.0], [-0.5, -0.25, 0.0], [0.25, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


def test_turn_level_reduces_to_dr_grpo_with_terminal_rewards():
    gen = torch.Generator().manual_seed(0)
    final = torch.randn(6, generator=gen, dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = torch.zeros(6, 3, dtype=torch.float64)
    rewards[:, 2] = final  # every episode has 3 turns, reward on the last
    adv = turn_level_advantages(rewards, torch.ones(6, 3), groups, gamma=1.0)
    expected = compute_advantages("dr_grpo", final, groups)
    for k in range(3):
        torch.testing.assert_close(adv[:, k], expected)
    adv_std = turn_level_advantages(rewards, torch.ones(6, 3), groups, gamma=1.0, normalize_std=True, eps=0.0)
    torch.testing.assert_close(adv_std[:, 0], compute_advantages("grpo", final, groups, eps=0.0))
