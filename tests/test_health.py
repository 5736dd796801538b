"""tracegym.train.health: RL health signals (reward spread, MI proxy), warnings and their config."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from tracegym.train.health import (
    HealthConfig,
    HealthMonitor,
    cross_logprob_matrix,
    first_turn_pairs,
    group_health,
    mi_from_cross_logprobs,
    mutual_information_proxy,
)
from tracegym.types import Message, Trajectory, TrajectoryGroup, Turn


def trajectory(task: str, reward: float = 0.0, turns: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
               index: int = 0) -> Trajectory:
    """A trajectory whose turns have the given (prompt ids, completion ids)."""
    return Trajectory(
        env="toy", task_id=task, sample_index=index, messages=(Message(role="user", content=task),),
        turns=tuple(Turn(prompt_ids=p, completion_ids=c, message=Message(role="assistant", content="x"))
                    for p, c in (turns or [((1,), (2,))])),
        reward=reward)


def group(task: str, trajectories: list[Trajectory]) -> TrajectoryGroup:
    return TrajectoryGroup(env="toy", task_id=task, trajectories=tuple(trajectories))


# --- group_health ------------------------------------------------------------------------------------


def test_group_health_reward_std_and_informative_groups() -> None:
    groups = [
        group("a", [trajectory("a", r, index=i) for i, r in enumerate([1.0, 0.0, 1.0, 0.0])]),  # population std 0.5
        group("b", [trajectory("b", 1.0, index=i) for i in range(4)]),  # std 0: the echo trap
        group("c", [trajectory("c", r, index=i) for i, r in enumerate([0.2, 0.8])]),  # std 0.3 (sample std would be 0.424)
        group("d", [trajectory("d", 0.7)]),  # one sample: std 0
    ]
    advantages = [
        [[0.5], [-0.5], [0.5], [-0.5]],
        [[0.0], [0.0], [0.0], [0.0]],  # no signal
        [[0.0, -0.3], [0.3]],  # signal in a later turn only still counts
        [[0.0]],
    ]
    health = group_health(groups, advantages)
    assert health["health/reward_std"] == pytest.approx((0.5 + 0.0 + 0.3 + 0.0) / 4)
    assert health["health/informative_groups"] == 2.0
    assert health["health/informative_share"] == pytest.approx(0.5)
    assert group_health([], []) == {"health/reward_std": 0.0, "health/informative_groups": 0.0,
                                    "health/informative_share": 0.0}
    with pytest.raises(ValueError, match="4 groups but advantages for 3"):
        group_health(groups, advantages[:3])


# --- the MI proxy on a given matrix ----------------------------------------------------------------


def test_mi_from_cross_logprobs_hand_values() -> None:
    # each response likelier under every prompt by the same amount: rows constant -> exactly 0
    assert mi_from_cross_logprobs([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0], [-0.5, -0.5, -0.5]]) == 0.0
    # responses that only fit their own prompt: log B
    assert mi_from_cross_logprobs([[0.0, -math.inf], [-math.inf, 0.0]]) == pytest.approx(math.log(2), abs=1e-12)
    identity_like = torch.full((8, 8), -50.0).fill_diagonal_(0.0)
    assert mi_from_cross_logprobs(identity_like) == pytest.approx(math.log(8), abs=1e-12)  # 7 e^-50 is negligible
    # row 0: p = [1, 1/3] -> ln 1 - ln((1 + 1/3) / 2) = ln 1.5, same for row 1
    third = math.log(1 / 3)
    assert mi_from_cross_logprobs([[0.0, third], [third, 0.0]]) == pytest.approx(math.log(1.5), abs=1e-12)
    # asymmetric: row 0 ln(0.5 / 0.375) = ln(4/3) = 0.287682, row 1 ln(0.3 / 0.2) = ln 1.5 = 0.405465
    matrix = [[math.log(0.5), math.log(0.25)], [math.log(0.1), math.log(0.3)]]
    assert mi_from_cross_logprobs(matrix) == pytest.approx(0.346574, abs=1e-6)
    # a response likelier under the other prompt than its own: ln(0.2 / 0.4) = -ln 2 (row 1 constant: 0)
    assert mi_from_cross_logprobs([[math.log(0.2), math.log(0.6)], [-1.0, -1.0]]) == pytest.approx(-math.log(2) / 2)
    with pytest.raises(ValueError, match="square"):
        mi_from_cross_logprobs([[0.0, 1.0]])
    with pytest.raises(ValueError, match="square"):
        mi_from_cross_logprobs(torch.empty(0, 0))


# --- scoring with a model --------------------------------------------------------------------------


class PromptCopyModel(torch.nn.Module):
    """A toy LM over 16 tokens that puts logit 10 on the first token of its row at every position
    and 0 elsewhere: its responses depend entirely on the prompt (the first prompt token)."""

    vocab = 16

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # gives the model a device
        self.modes_seen: list[bool] = []

    def forward(self, input_ids, attention_mask=None, **_):
        self.modes_seen.append(self.training)
        logits = torch.zeros(*input_ids.shape, self.vocab) + self.anchor
        logits.scatter_(-1, input_ids[:, :1, None].expand(-1, input_ids.shape[1], 1), 10.0)  # [B, L, V]
        return SimpleNamespace(logits=logits)


class BigramModel(torch.nn.Module):
    """A toy LM whose next-token logits depend on the current token only: it ignores the prompt
    except for its last token."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids, attention_mask=None, **_):
        return SimpleNamespace(logits=self.table[input_ids])  # [B, L, V]


def copy_pairs(size: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    # prompt j starts with token j + 1 (its "task"); response j repeats that token twice
    return [((j + 1, 9, 9), (j + 1, j + 1)) for j in range(size)]


def test_prompt_dependent_model_gives_closed_form_matrix_and_mi() -> None:
    model = PromptCopyModel()
    matrix = cross_logprob_matrix(model, copy_pairs(4), micro_batch_size=3)
    # p(token | row starts with it) = e^10 / (e^10 + 15), any other token 1 / (e^10 + 15)
    log_match = 10.0 - math.log(math.exp(10.0) + 15)  # -6.81e-4
    log_other = -math.log(math.exp(10.0) + 15)  # -10.000681
    expected = torch.full((4, 4), log_other, dtype=torch.float64).fill_diagonal_(log_match)
    torch.testing.assert_close(matrix, expected, atol=1e-5, rtol=0)
    # MI = log 4 - log(1 + 3 e^-10) = 1.3862944 - 0.0001362 = 1.3861582, just under the log B ceiling
    assert mi_from_cross_logprobs(matrix) == pytest.approx(1.3861582, abs=1e-5)


def test_mutual_information_proxy_uses_first_turns_and_restores_the_mode() -> None:
    model = PromptCopyModel()
    model.train()
    groups = [group(f"t{j}", [trajectory(f"t{j}", turns=[(p, c), ((5, 5), (7,))], index=i) for i in range(2)])
              for j, (p, c) in enumerate(copy_pairs(4))]
    out = mutual_information_proxy(model, groups, max_pairs=8, micro_batch_size=4)
    assert out["health/mi_pairs"] == 4.0
    assert out["health/mi"] == pytest.approx(1.3861582, abs=1e-5)
    assert model.training and model.modes_seen and not any(model.modes_seen)  # scored in eval mode, mode restored
    # capped at 2 pairs: log 2 - log(1 + e^-10) = 0.6931472 - 0.0000454
    assert mutual_information_proxy(model, groups, max_pairs=2) == pytest.approx(
        {"health/mi": 0.6931018, "health/mi_pairs": 2.0}, abs=1e-5)
    # one distinct prompt: no measurement
    same_task = [group("t0", [trajectory("t0", turns=[copy_pairs(1)[0]])]), group("t0b", [trajectory("t0b", turns=[copy_pairs(1)[0]])])]
    assert mutual_information_proxy(model, same_task) == {}


def test_a_model_that_ignores_the_prompt_gives_zero_mi() -> None:
    # the prompts differ but all end with token 3 (as every rendered prompt ends with the generation
    # prompt): a bigram model's scores of a response are the same under every prompt
    pairs = [((1, 2, 3), (4, 5, 6)), ((7, 8, 9, 3), (10, 11)), ((12, 3), (13, 14, 15, 4))]
    matrix = cross_logprob_matrix(BigramModel(), pairs, micro_batch_size=2)
    torch.testing.assert_close(matrix, matrix[:, :1].expand(-1, 3), atol=1e-6, rtol=0)  # columns equal
    assert abs(mi_from_cross_logprobs(matrix)) < 1e-6
    # the same model after prompts with different last tokens: the matrix is the bigram table's own
    # mean log-prob (the first response token follows the prompt's last token), whose columns differ,
    # so the zero above comes from the prompts being ignored, not from the computation
    model = BigramModel()
    ends = [((1, 2, 3), (4, 5, 6)), ((7, 8, 9, 1), (10, 11)), ((12, 5), (13, 14, 15, 4))]
    table = torch.log_softmax(model.table.detach().double(), dim=-1)  # [V, V]: log p(next | current)

    def by_table(prompt, response) -> float:
        previous = (prompt[-1],) + response[:-1]
        return sum(float(table[a, b]) for a, b in zip(previous, response)) / len(response)

    expected = torch.tensor([[by_table(ends[j][0], ends[i][1]) for j in range(3)] for i in range(3)], dtype=torch.float64)
    matrix = cross_logprob_matrix(model, ends)
    torch.testing.assert_close(matrix, expected, atol=1e-5, rtol=0)
    assert abs(mi_from_cross_logprobs(matrix)) > 0.05


def direct_mean_logprob(model, prompt, response) -> float:
    """Mean log p(response token | everything before) from one unbatched forward and log_softmax."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0], dim=-1)  # [L, V]
    positions = range(len(prompt) - 1, len(prompt) + len(response) - 1)
    return sum(float(logp[t, ids[0, t + 1]]) for t in positions) / len(response)


def test_cross_logprob_matrix_on_a_tiny_llama(tiny_model) -> None:
    model, _ = tiny_model
    system = list(range(100, 114))  # 14 shared tokens, so each prompt's rows share >= 16 (prefix path)
    pairs = [(tuple(system + [200, 201, 202, 203]), (300, 301, 302)),
             (tuple(system + [210, 211, 212, 213, 214, 215]), (310, 311, 312, 313, 314, 315)),
             (tuple(system + [220, 221, 222]), (320, 321, 322, 323))]
    matrix = cross_logprob_matrix(model, pairs, micro_batch_size=2, pad_token_id=0)
    expected = torch.tensor([[direct_mean_logprob(model, pairs[j][0], pairs[i][1]) for j in range(3)] for i in range(3)],
                            dtype=torch.float64)
    torch.testing.assert_close(matrix, expected, atol=1e-4, rtol=0)
    # random weights: responses barely depend on the prompt, and the proxy is bounded by log B
    mi = mi_from_cross_logprobs(matrix)
    assert abs(mi - mi_from_cross_logprobs(expected)) < 1e-4 and mi <= math.log(3)
    # an identical-prompt batch: every column is the same prompt, so MI is 0 up to float rounding
    same = [(pairs[0][0], response) for _, response in pairs]
    assert abs(mi_from_cross_logprobs(cross_logprob_matrix(model, same, micro_batch_size=2))) < 1e-5


def test_first_turn_pairs_picks_one_usable_first_turn_per_distinct_prompt() -> None:
    no_turns = Trajectory(env="toy", task_id="a", messages=(Message(role="user", content="a"),))
    empty = trajectory("a", turns=[((1, 2), ())])
    groups = [
        group("a", [no_turns, empty, trajectory("a", turns=[((1, 2), (3,)), ((9,), (9,))]), trajectory("a", turns=[((1, 2), (4,))])]),
        group("b", [trajectory("b", turns=[((1, 2), (5,))])]),  # the same prompt as "a": skipped
        group("c", [trajectory("c", turns=[((6,), (7, 8))])]),
        group("d", [trajectory("d", turns=[((10,), (11,))])]),
    ]
    assert first_turn_pairs(groups) == [((1, 2), (3,)), ((6,), (7, 8)), ((10,), (11,))]
    assert first_turn_pairs(groups, max_pairs=2) == [((1, 2), (3,)), ((6,), (7, 8))]
    with pytest.raises(ValueError, match="max_pairs"):
        first_turn_pairs(groups, max_pairs=0)


# --- warnings ----------------------------------------------------------------------------------------


def test_monitor_warns_once_per_streak_and_again_after_recovery() -> None:
    monitor = HealthMonitor(min_reward_std=0.05, min_mutual_information=0.05, patience=3)
    stds = {1: 0.01, 2: 0.02, 3: 0.03, 4: 0.01, 5: 0.2, 6: 0.04, 7: 0.05, 8: 0.0, 9: 0.0, 10: 0.0}
    warned = {step: monitor.update(step, {"health/reward_std": value}) for step, value in stds.items()}
    assert [step for step, lines in warned.items() if lines] == [3, 10]  # 0.05 itself is not below 0.05
    assert warned[3] == ["health warning at step 3: health/reward_std = 0.03 has been below 0.05 for 3 consecutive "
                         "steps (since step 1); the samples of each task get the same reward, so advantages vanish "
                         "(RAGEN's echo trap; see health/informative_groups)"]
    assert "since step 8" in warned[10][0] and "\n" not in warned[10][0]


def test_monitor_skips_missing_values_and_watches_each_metric() -> None:
    monitor = HealthMonitor(min_reward_std=0.05, min_mutual_information=0.1, patience=2)
    assert monitor.update(1, {"health/mi": 0.02, "health/reward_std": 0.3}) == []
    assert monitor.update(2, {"health/reward_std": 0.3}) == []  # MI not measured: its streak waits
    assert monitor.update(3, {"health/mi": float("nan")}) == []  # neither does a non-finite value count
    lines = monitor.update(4, {"health/mi": 0.08, "health/reward_std": 0.3})
    assert len(lines) == 1 and "health/mi = 0.08 has been below 0.1 for 2 consecutive steps (since step 1)" in lines[0]
    assert "template collapse" in lines[0]
    assert HealthMonitor(min_mutual_information=None).thresholds == {"health/reward_std": 0.05}
    with pytest.raises(ValueError, match="patience"):
        HealthMonitor(patience=0)


def test_monitor_state_dict_continues_a_streak_after_resume() -> None:
    before = HealthMonitor(patience=3)
    before.update(4, {"health/reward_std": 0.0})
    before.update(5, {"health/reward_std": 0.0})
    state = before.state_dict()
    assert state == {"streaks": {"health/reward_std": {"length": 2, "first_step": 4, "warned": False}}}
    resumed = HealthMonitor(patience=3)
    resumed.load_state_dict(state)
    lines = resumed.update(6, {"health/reward_std": 0.01})
    assert len(lines) == 1 and "for 3 consecutive steps (since step 4)" in lines[0]
    fresh = HealthMonitor(patience=3)  # without the state, step 6 would only start a streak
    assert fresh.update(6, {"health/reward_std": 0.01}) == []
    resumed.load_state_dict(resumed.state_dict())
    assert resumed.update(7, {"health/reward_std": 0.01}) == []  # already warned: the streak stays quiet


def test_health_config_defaults_validation_and_monitor() -> None:
    cfg = HealthConfig()
    assert (cfg.mutual_information, cfg.mi_max_pairs, cfg.min_reward_std, cfg.min_mutual_information, cfg.patience) == (
        True, 8, 0.05, 0.05, 3)
    assert all(field.description for field in HealthConfig.model_fields.values())  # documented like every section
    with pytest.raises(ValidationError):
        HealthConfig(patience=0)
    with pytest.raises(ValidationError):
        HealthConfig(mi_max_pairs=1)
    with pytest.raises(ValidationError):
        HealthConfig(min_reward_stdev=0.1)  # unknown keys are errors
    monitor = HealthMonitor.from_config(HealthConfig(min_reward_std=0.1, patience=5))
    assert monitor.thresholds == {"health/reward_std": 0.1, "health/mi": 0.05} and monitor.patience == 5
    assert HealthMonitor.from_config(HealthConfig(mutual_information=False)).thresholds == {"health/reward_std": 0.05}
