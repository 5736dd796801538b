"""Advantage estimators: hand-computed values, loop versions vs the vectorised ones, edge cases; the
group API (one advantage per turn of every trajectory) and how per-turn values reach the tokens."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.algos import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_turn_returns,
    dr_grpo_advantages,
    grpo_advantages,
    has_signal,
    reinforce_advantages,
    rloo_advantages,
    turn_level_advantages,
)
from tracegym.batch import examples_from_groups, make_batch
from tracegym.render.trajectory_examples import build_examples
from tracegym.types import Message, Trajectory, TrajectoryGroup, Turn, group_trajectories

TENSOR_ESTIMATORS = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages,
                     "reinforce": reinforce_advantages}


def adv(name: str, rewards: torch.Tensor, groups: torch.Tensor, **options) -> torch.Tensor:
    """The tensor form of an estimator (episode rewards [N], group ids [N] -> [N])."""
    return TENSOR_ESTIMATORS[name](rewards, groups, **options)

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
    out = adv("grpo", REWARDS, GROUPS, eps=0.0)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_grpo_population_std_and_eps():
    # group 7 with population std: var = (6/9)/3 = 2/9, std = 0.471405 -> 0.666667/0.471405 = 1.414214
    out = adv("grpo", REWARDS, GROUPS, eps=0.0, unbiased_std=False)
    assert out[0].item() == pytest.approx(1.414214, abs=1e-6)
    assert out[2].item() == pytest.approx(-0.707107, abs=1e-6)
    # eps is added to the std: group 3 with eps = 0.5 -> 1 / (1.414214 + 0.5) = 0.522407
    out = adv("grpo", REWARDS, GROUPS, eps=0.5)
    assert out[5].item() == pytest.approx(0.522407, abs=1e-6)


def test_dr_grpo_and_grpo_without_std_hand_computed():
    # r - group mean: group 7 mean 1/3, group 3 mean 3, group 9 mean 5
    expected = torch.tensor([2 / 3, -1.0, -1 / 3, 0.0, -1 / 3, 1.0], dtype=torch.float64)
    torch.testing.assert_close(adv("dr_grpo", REWARDS, GROUPS), expected)
    torch.testing.assert_close(adv("grpo", REWARDS, GROUPS, normalize_std=False), expected)


def test_rloo_hand_computed():
    # group 7: 1 - mean(0,0) = 1; 0 - mean(1,0) = -0.5 (twice). group 3: 2 - 4 = -2; 4 - 2 = 2. group 9: 0
    expected = torch.tensor([1.0, -2.0, -0.5, 0.0, -0.5, 2.0], dtype=torch.float64)
    torch.testing.assert_close(adv("rloo", REWARDS, GROUPS), expected)


def test_reinforce_hand_computed():
    # batch mean = (1+2+0+5+0+4)/6 = 2
    expected = torch.tensor([-1.0, 0.0, -2.0, 3.0, -2.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(adv("reinforce", REWARDS, GROUPS), expected)
    torch.testing.assert_close(adv("reinforce", REWARDS, GROUPS, baseline=False), REWARDS)
    # population std: sqrt((1+0+4+9+4+4)/6) = sqrt(22/6) = 1.914854 -> 3 / 1.914854 = 1.566699
    out = adv("reinforce", REWARDS, GROUPS, normalize_std=True, eps=0.0)
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
        adv("grpo", rewards, group_t, eps=1e-6), torch.tensor(loop_grpo(r, groups, True, 1e-6), dtype=torch.float64)
    )
    torch.testing.assert_close(
        adv("dr_grpo", rewards, group_t), torch.tensor(loop_grpo(r, groups, False, 0.0), dtype=torch.float64)
    )
    torch.testing.assert_close(adv("rloo", rewards, group_t), torch.tensor(loop_rloo(r, groups), dtype=torch.float64))


def test_group_advantages_sum_to_zero_per_group_and_uniform_groups_get_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    for name in ("grpo", "dr_grpo", "rloo"):
        out = adv(name, rewards, groups)
        assert torch.all(out[:3] == 0), name  # all-equal group: no signal
        assert out[3:].sum().abs() < 1e-6, name


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="non-finite"):
        adv("grpo", torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="entries"):
        adv("grpo", torch.tensor([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="integer"):
        adv("rloo", torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
    groups = group_trajectories([_traj("t", 0, [1.0])])
    with pytest.raises(KeyError, match="Did you mean 'grpo'"):
        compute_advantages("grpoo", groups)
    with pytest.raises(ValueError, match="unknown key 'normalize_std'.*rloo"):
        compute_advantages("rloo", groups, {"normalize_std": True})
    with pytest.raises(ValueError, match="did you mean 'gamma'"):
        compute_advantages("turn_rloo", groups, {"gamm": 0.9})
    assert {"grpo", "dr_grpo", "rloo", "reinforce", "turn_rloo"} <= set(ADVANTAGE_ESTIMATORS.names())


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
    per_turn = turn_level_advantages(rewards, torch.ones(6, 3), groups, gamma=1.0)
    expected = adv("dr_grpo", final, groups)
    for k in range(3):
        torch.testing.assert_close(per_turn[:, k], expected)
    adv_std = turn_level_advantages(rewards, torch.ones(6, 3), groups, gamma=1.0, normalize_std=True, eps=0.0)
    torch.testing.assert_close(adv_std[:, 0], adv("grpo", final, groups, eps=0.0))


# --- the group API ----------------------------------------------------------------------------


def _traj(task: str, sample: int, turn_rewards: list[float]) -> Trajectory:
    """A token-exact trajectory: prompt [1, 2, 3]; turn k samples [10+k, 20+k]; the env answers [5, 6]."""
    turns, prompt = [], [1, 2, 3]
    for k, reward in enumerate(turn_rewards):
        completion = (10 + k, 20 + k)
        turns.append(Turn(prompt_ids=tuple(prompt), completion_ids=completion, completion_logprobs=(-0.5, -0.25),
                          message=Message(role="assistant", content=f"turn {k}"), reward=reward))
        prompt = prompt + list(completion) + [5, 6]
    return Trajectory(env="toy", task_id=task, sample_index=sample, messages=(Message(role="user", content="q"),),
                      turns=tuple(turns), reward=sum(turn_rewards))


class _Renderer:
    build_examples = staticmethod(build_examples)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce"])
def test_episode_estimators_put_the_tensor_value_on_every_turn(name: str):
    gen = torch.Generator().manual_seed(3)
    trajs = []
    for task in range(3):
        for sample in range(4):
            turns = int(torch.randint(1, 4, (1,), generator=gen))
            rewards = [0.0] * (turns - 1) + [float(torch.randint(0, 3, (1,), generator=gen))]
            trajs.append(_traj(f"t{task}", sample, rewards))
    groups = group_trajectories(trajs)
    assert [len(g) for g in groups] == [4, 4, 4]
    out = compute_advantages(name, groups)
    flat = adv(name, torch.tensor([t.reward for t in trajs], dtype=torch.float64), torch.tensor([i // 4 for i in range(12)]))
    for g, group in enumerate(groups):
        for i, traj in enumerate(group.trajectories):
            assert out[g][i] == pytest.approx([float(flat[g * 4 + i])] * len(traj.turns), abs=1e-12)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce", "turn_rloo", "turn_grpo", "gigpo"])
def test_equal_but_inexact_rewards_give_exactly_zero_and_no_signal(name: str):
    # 0.1 is not representable: the float mean of equal 0.1s differs from 0.1 in the last bits, which
    # GRPO's std division used to blow up (-0.0074 with eps=1e-6, -0.935 with eps=0).
    for reward in (0.1, 0.3, 1 / 3):
        groups = group_trajectories([_traj("t", k, [0.0, reward]) for k in range(7)])
        for options in ({}, {"eps": 0.0}) if name in ("grpo", "reinforce", "turn_rloo", "turn_grpo", "gigpo") else ({},):
            out = compute_advantages(name, groups, options)
            assert all(a == 0.0 for turns in out[0] for a in turns), (name, reward, options, out)
            assert not has_signal(out[0])
    assert torch.equal(grpo_advantages(torch.full((10,), 0.1), torch.zeros(10, dtype=torch.long), eps=0.0), torch.zeros(10))


def test_turn_rloo_is_leave_one_out_per_turn_index_hand_computed():
    # task t: three episodes, per-turn rewards; gamma = 1 -> returns-to-go
    #   e0: [0, 1]  G = [1, 1]     e1: [0, 0]  G = [0, 0]     e2: [1]  G = [1]
    # turn 0 cell {1, 0, 1}: LOO means e0: (0+1)/2 = .5, e1: (1+1)/2 = 1, e2: (1+0)/2 = .5
    # turn 1 cell {1, 0} (e2 has no turn 1): e0: 1 - 0 = 1, e1: 0 - 1 = -1
    groups = group_trajectories([_traj("t", 0, [0.0, 1.0]), _traj("t", 1, [0.0, 0.0]), _traj("t", 2, [1.0])])
    out = compute_advantages("turn_rloo", groups)
    assert out == [[[0.5, 1.0], [-1.0, -1.0], [0.5]]]
    # the biased GRPO-style variant keeps the sample in its own baseline: turn 0 mean 2/3, turn 1 mean 1/2
    biased = compute_advantages("turn_rloo", groups, {"leave_one_out": False})
    assert biased[0][0] == pytest.approx([1 / 3, 0.5]) and biased[0][2] == pytest.approx([1 / 3])
    # discounting: gamma = 0.5 -> e0 G = [0.5, 1], e1 [0, 0], e2 [1]; turn 0 LOO: e0 0.5 - 0.5 = 0
    assert compute_advantages("turn_rloo", groups, {"gamma": 0.5})[0][0] == pytest.approx([0.0, 1.0])


def test_turn_rloo_equals_rloo_with_terminal_rewards_and_equal_lengths():
    gen = torch.Generator().manual_seed(1)
    trajs = [_traj(f"t{i // 5}", i % 5, [0.0, 0.0, float(torch.rand(1, generator=gen))]) for i in range(10)]
    groups = group_trajectories(trajs)
    per_turn = compute_advantages("turn_rloo", groups)
    episode = compute_advantages("rloo", groups)
    for g in range(2):
        for i in range(5):
            assert per_turn[g][i] == pytest.approx(episode[g][i], abs=1e-12)


def test_a_buggy_estimator_is_caught_with_its_name():
    from tracegym.algos import ADVANTAGE_ESTIMATORS

    @ADVANTAGE_ESTIMATORS.register("test_wrong_shape")
    def wrong_shape(groups):
        return [[[1.0]] for _ in groups]  # one turn, whatever the trajectory has

    @ADVANTAGE_ESTIMATORS.register("test_nan")
    def nan(groups):
        return [[[float("nan")] * len(t.turns) for t in g.trajectories] for g in groups]

    try:
        groups = group_trajectories([_traj("t", 0, [0.0, 1.0]), _traj("t", 1, [1.0])])
        with pytest.raises(ValueError, match="test_wrong_shape.*2 trajectories but 1"):
            compute_advantages("test_wrong_shape", groups)
        with pytest.raises(ValueError, match="test_nan.*advantage nan"):
            compute_advantages("test_nan", groups)
        # registering the same function again (a module imported twice) is fine; another function is not
        ADVANTAGE_ESTIMATORS.register("test_nan")(nan)
        with pytest.raises(ValueError, match="already registered"):
            ADVANTAGE_ESTIMATORS.register("test_nan")(lambda groups: [])
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test_wrong_shape")
        ADVANTAGE_ESTIMATORS.unregister("test_nan")


def test_per_turn_advantages_reach_the_tokens_of_their_turn():
    # one group of two 2-turn trajectories; give the turns different advantages by hand
    groups = [TrajectoryGroup(env="toy", task_id="t", trajectories=(_traj("t", 0, [0.0, 1.0]), _traj("t", 1, [0.0, 0.0])))]
    advantages = [[[0.75, -0.5], [0.25, 2.0]]]
    data = examples_from_groups(groups, _Renderer(), advantages)
    assert len(data.examples) == 2 and data.group_index == [0, 0] and data.trajectory_index == [0, 1]
    ex = data.examples[0]
    # tokens: prompt 1 2 3 | turn 0: 10 20 | env 5 6 | turn 1: 11 21
    assert ex.input_ids == (1, 2, 3, 10, 20, 5, 6, 11, 21)
    assert ex.loss_mask == (0, 0, 0, 1, 1, 0, 0, 1, 1)
    assert ex.advantages == (0, 0, 0, 0.75, 0.75, 0, 0, -0.5, -0.5)
    batch = make_batch(data.examples, pad_token_id=0, group_ids=data.group_index)
    # target-aligned: column t belongs to token t + 1
    assert batch.advantages[1].tolist() == [0, 0, 0.25, 0.25, 0, 0, 2.0, 2.0]
    assert batch.advantages[batch.loss_mask == 0].abs().sum() == 0  # nothing off the sampled tokens
    # a group without signal is skipped and counted
    skipped = examples_from_groups(groups, _Renderer(), advantages, skip_groups=[True])
    assert skipped.examples == [] and skipped.skipped_no_signal_groups == 1
    # the whole path: a real estimator's per-turn values, then tokens
    per_turn = compute_advantages("turn_rloo", groups)  # e0 G = [1, 1], e1 G = [0, 0] -> LOO [1, 1], [-1, -1]
    tokens = examples_from_groups(groups, _Renderer(), per_turn).examples[1].advantages
    assert tokens == (0, 0, 0, -1, -1, 0, 0, -1, -1)



# --- GiGPO and per-turn GRPO (spec values: ../shared/SPECS.md section 1) ------------------------


def _keyed(task: str, sample: int, turn_rewards: list[float], keys: list[str | None]) -> Trajectory:
    traj = _traj(task, sample, turn_rewards)
    turns = tuple(t.model_copy(update={"state_key": k}) for t, k in zip(traj.turns, keys))
    return traj.model_copy(update={"turns": turns})


def test_gigpo_spec_values_and_step_group_metrics():
    from tracegym.algos import estimate

    # two trajectories of one task, states [s0, s1] / [s0, s2], rewards [0, 1] / [0, 0]
    groups = group_trajectories([_keyed("t", 0, [0.0, 1.0], ["s0", "s1"]), _keyed("t", 1, [0.0, 0.0], ["s0", "s2"])])
    result = estimate("gigpo", groups, {"gamma": 1.0})
    assert result.advantages == [[[1.0, 0.5], [-1.0, -0.5]]]
    assert estimate("gigpo", groups).advantages[0] == [pytest.approx([0.975, 0.5]), pytest.approx([-0.975, -0.5])]
    # two of the four turns share a state: sizes 2, 1, 2, 1
    assert result.metrics == {"step_group_size": 1.5, "step_group_shared": 0.5}
    # one trajectory per task: nothing to compare, all zeros
    assert compute_advantages("gigpo", group_trajectories([_keyed("a", 0, [0.0, 1.0], ["s0", "s1"])])) == [[[0.0, 0.0]]]
    # leave-one-out: episode part R_i - R_other = +-1, step part at s0 G - G_other = +-1 (gamma 1)
    assert compute_advantages("gigpo", groups, {"gamma": 1.0, "leave_one_out": True}) == [[[2.0, 1.0], [-2.0, -1.0]]]
    # omega weighs the step part: omega 0 leaves Dr. GRPO's episode advantage on every turn
    assert compute_advantages("gigpo", groups, {"omega": 0.0}) == [[[0.5, 0.5], [-0.5, -0.5]]]
    # std_norm: each part over its group's sample (Bessel) std, as verl-agent's torch.std and grpo: episode R = [1, 0],
    # centred +-0.5, std sqrt(0.5) -> +-0.7071 (the population std 0.5 gave +-1); s0 returns [1, 0] likewise
    out = compute_advantages("gigpo", groups, {"gamma": 1.0, "std_norm": True, "eps": 0.0})
    assert out[0] == [pytest.approx([2 ** 0.5, 0.5 ** 0.5]), pytest.approx([-(2 ** 0.5), -(0.5 ** 0.5)])]
    # without the step part it is grpo's advantage, eps and all
    assert compute_advantages("gigpo", groups, {"std_norm": True, "omega": 0.0}) == compute_advantages("grpo", groups)


def test_gigpo_groups_turns_by_state_across_trajectories_and_turn_indices():
    # the same state s reached at turn 1 of one trajectory and turn 0 of another forms one step group
    groups = group_trajectories([_keyed("t", 0, [0.0, 0.0, 1.0], ["a", "s", "b"]), _keyed("t", 1, [0.0, 0.0], ["s", "c"]),
                                 _keyed("t", 2, [0.0], [None])])
    out = compute_advantages("gigpo", groups, {"gamma": 1.0})
    # episode part: R = [1, 0, 0], mean 1/3 -> [2/3, -1/3, -1/3]; step group s = {G(0,1) = 1, G(1,0) = 0}, mean 1/2
    assert out[0][0] == pytest.approx([2 / 3, 2 / 3 + 0.5, 2 / 3])
    assert out[0][1] == pytest.approx([-1 / 3 - 0.5, -1 / 3])
    assert out[0][2] == pytest.approx([-1 / 3])  # a turn without a state key is a step group of its own


def test_turn_grpo_per_turn_returns_against_a_leave_one_out_episode_baseline():
    # e0: turn rewards [1, 0] (G = [1, 0]); e1: [0, 0] (G = [0, 0]); e2: [0, 2] (G = [2, 2]); gamma 1
    groups = group_trajectories([_traj("t", 0, [1.0, 0.0]), _traj("t", 1, [0.0, 0.0]), _traj("t", 2, [0.0, 2.0])])
    # baselines: mean of the others' G_0: e0 (0+2)/2 = 1, e1 (1+2)/2 = 1.5, e2 (1+0)/2 = 0.5
    assert compute_advantages("turn_grpo", groups) == [[[0.0, -1.0], [-1.5, -1.5], [1.5, 1.5]]]
    # GRPO's form: the baseline is the mean of all G_0 (= 1) and std_norm divides by std(G_0) = 1
    assert compute_advantages("turn_grpo", groups, {"leave_one_out": False, "std_norm": True, "eps": 0.0}) == [
        [[0.0, -1.0], [-1.0, -1.0], [1.0, 1.0]]]
    # terminal rewards, gamma 1: every turn carries R_i - mean_{j != i} R_j, i.e. RLOO
    terminal = group_trajectories([_traj("u", k, [0.0, float(k % 3)]) for k in range(5)])
    for mine, rloo in zip(compute_advantages("turn_grpo", terminal)[0], compute_advantages("rloo", terminal)[0]):
        assert mine == pytest.approx(rloo, abs=1e-12)


# --- uniform groups, rounding, and the episode-reward invariant ----------------------------------


def test_turn_grpo_std_norm_treats_returns_equal_up_to_rounding_as_equal():
    # whole returns 0.3, 0.1 + 0.2 (= 0.30000000000000004) and 0.3: their std is ~3e-17, which std_norm used to
    # divide by (with eps 1e-6: -100000.0 on the short episode's turn 1); they are equal, so std 0 -> 0
    groups = group_trajectories([_traj("t", 0, [0.3]), _traj("t", 1, [0.1, 0.2]), _traj("t", 2, [0.3])])
    assert compute_advantages("turn_grpo", groups, {"std_norm": True}) == [[[0.0], [0.0, 0.0], [0.0]]]
    # without std_norm: turn 1 of the two-turn episode has return 0.2 against a baseline of 0.3; the rest are 0
    # exactly (0.1 + 0.2 against 0.3 is not a difference)
    plain = compute_advantages("turn_grpo", groups)
    assert plain[0][0] == [0.0] and plain[0][2] == [0.0]
    assert plain[0][1][0] == 0.0 and plain[0][1][1] == pytest.approx(-0.1)
    # the episode estimators read the same rewards the same way
    assert compute_advantages("grpo", groups) == [[[0.0], [0.0, 0.0], [0.0]]]


def test_turn_grpo_gives_identical_episodes_exactly_zero():
    # ten identical episodes with rewards .1 per turn used to get G_t - G_0 = [0, -0.1, -0.2]: an offset shared by
    # every sample that compares nothing; identical episodes carry no signal
    groups = group_trajectories([_traj("t", k, [0.1, 0.1, 0.1]) for k in range(10)])
    for options in ({}, {"leave_one_out": False}, {"std_norm": True}, {"gamma": 0.9}):
        out = compute_advantages("turn_grpo", groups, options)
        assert out == [[[0.0, 0.0, 0.0]] * 10], options
        assert not has_signal(out[0])


# estimators that need scores of a model-aware step before they run on a group (skipped below):
# info_gain reads Turn.metrics["info_gain"] (tracegym.train.info_gain.score_info_gain) and adds an intrinsic
# term exactly where the outcome rewards are equal; mc_continuation reads Turn.metrics["mc_advantage"]
# (tracegym.rollout.branches.score_mc_continuation).
NEEDS_SCORES = {"info_gain", "mc_continuation"}


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS.names()))
def test_every_estimator_gives_a_group_of_identical_trajectories_exactly_zero(name: str):
    if name in NEEDS_SCORES:
        pytest.skip(f"{name} needs per-turn scores from a model-aware step before it runs")
    for turn_rewards, size in (([0.1, 0.1, 0.1], 10), ([0.0, 1 / 3], 7), ([0.7], 3), ([0.2, 0.0, 0.1], 6)):
        # identical trajectories visit the same states (same key per turn index), as identical episodes do
        keys = [f"s{k}" for k in range(len(turn_rewards))]
        group = group_trajectories([_keyed("t", k, turn_rewards, keys) for k in range(size)])
        out = compute_advantages(name, group)
        assert out == [[[0.0] * len(turn_rewards)] * size], (name, turn_rewards, out)
        assert not has_signal(out[0])


def test_episode_reward_must_be_the_sum_of_the_turn_rewards():
    from tracegym.algos import check_episode_rewards, episode_reward_problems

    # a failed episode zeroed on Trajectory.reward only (the old on_env_error: zero_reward): the estimators
    # disagreed on it (grpo -1.5, turn_rloo 0, gigpo -0.225)
    good = [_traj("t", k, [0.0, 1.0]) for k in range(3)]
    half_zeroed = good[2].model_copy(update={"reward": 0.0, "end_reason": "env_error"})
    groups = group_trajectories(good[:2] + [half_zeroed])
    (problem,) = episode_reward_problems(groups)
    assert "task t sample 2 (env_error): episode reward 0.0 but its 2 turn rewards sum to 1.0" in problem
    for name in ("grpo", "turn_rloo", "gigpo"):
        with pytest.raises(ValueError, match="episode reward != sum of turn rewards"):
            compute_advantages(name, groups)
    # rounding is not a mismatch; trajectories without turns (message-level) are not checked
    check_episode_rewards(group_trajectories([_traj("u", 0, [0.1, 0.2]).model_copy(update={"reward": 0.3})]))
    check_episode_rewards(group_trajectories([good[0].model_copy(update={"turns": (), "reward": 5.0})]))
    assert episode_reward_problems(group_trajectories(good)) == []
