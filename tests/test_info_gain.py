"""InfoPO-style information gain: the model-aware scorer (tracegym.train.info_gain) and the
``info_gain`` estimator (tracegym.algos.info_gain), against hand-computed values."""

import math

import pytest
import torch

from tracegym.algos import estimate, estimator_problems
from tracegym.render import get_renderer
from tracegym.train.info_gain import counterfactual_prompt, placeholder_messages, score_info_gain
from tracegym.types import Message, ToolCall, Trajectory, TrajectoryGroup, Turn

TOOLS = ({"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},)
START = [Message(role="system", content="Solve it."), Message(role="user", content="What is 2+3, then times 4?")]
A0 = Message(role="assistant", tool_calls=(ToolCall(name="add", arguments={"a": 2, "b": 3}, id="call_0"),))
E0 = (Message(role="tool", content="5", tool_call_id="call_0", name="add"),)
A1 = Message(role="assistant", content="Now multiply: 5 * 4 = 20.")
E1 = (Message(role="user", content="Correct. Say it in words."),)
A2 = Message(role="assistant", content="Twenty.")
TEMPERATURE = 0.7


def three_turns(renderer, sample_index=0, reward=1.0):
    """A 3-turn trajectory built token-in, token-out as the rollout runner builds it."""
    p0, c0 = renderer.render_prompt(START, list(TOOLS)), renderer.encode_completion(A0)
    p1, c1 = renderer.continue_prompt(p0, c0, list(E0)), renderer.encode_completion(A1)
    p2, c2 = renderer.continue_prompt(p1, c1, list(E1)), renderer.encode_completion(A2)
    turns = (
        Turn(prompt_ids=tuple(p0), completion_ids=tuple(c0), message=A0, env_messages=E0),
        Turn(prompt_ids=tuple(p1), completion_ids=tuple(c1), message=A1, env_messages=E1),
        Turn(prompt_ids=tuple(p2), completion_ids=tuple(c2), message=A2, reward=reward),
    )
    return Trajectory(env="calc", task_id="t0", sample_index=sample_index, tools=TOOLS,
                      messages=(*START, A0, *E0, A1, *E1, A2), turns=turns, reward=reward)


def direct_gain(model, prompt, counterfactual, action):
    """(1/n) sum_j [log p(a_j | prompt, a_<j) - log p(a_j | counterfactual, a_<j)], one sequence per
    forward pass, log_softmax(logits / T) read at the positions that predict the action tokens."""

    def mean_logp(p):
        ids = torch.tensor([list(p) + list(action)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double() / TEMPERATURE
        logp = torch.log_softmax(logits, dim=-1)
        return sum(float(logp[len(p) - 1 + j, a]) for j, a in enumerate(action)) / len(action)

    return mean_logp(prompt) - mean_logp(counterfactual)


@pytest.fixture(scope="module")
def setup(tiny_model):
    model, tokenizer = tiny_model
    return model, get_renderer("tiny-random", tokenizer)


def scores(group):
    return [[turn.metrics["info_gain"] for turn in t.turns] for t in group.trajectories]


# -- the scorer -----------------------------------------------------------------------------------


def test_placeholder_equal_to_observation_gives_exactly_zero(setup):
    model, renderer = setup
    group = TrajectoryGroup(env="calc", task_id="t0", trajectories=(three_turns(renderer),))
    # turn 0's observation is the tool result "5": replacing it by "5" changes nothing
    out = score_info_gain([group], model, renderer, placeholder="5", temperature=TEMPERATURE)
    values = scores(out[0])[0]
    assert values[0] == 0.0  # exactly
    assert values[1] != 0.0  # turn 1's observation ("Correct. ...") is not "5"
    assert values[2] == 0.0  # last turn


def test_scores_equal_a_direct_teacher_forced_computation(setup):
    model, renderer = setup
    trajectory = three_turns(renderer)
    group = TrajectoryGroup(env="calc", task_id="t0", trajectories=(trajectory, three_turns(renderer, 1)))
    out = score_info_gain([group], model, renderer, temperature=TEMPERATURE, micro_batch_size=3)
    turns = trajectory.turns
    # counterfactual prompts re-rendered from the messages, independently of continue_prompt
    placeholder_tool = Message(role="tool", content="No information found.", tool_call_id="call_0", name="add")
    placeholder_user = Message(role="user", content="No information found.")
    cf1 = renderer.render_prompt([*START, A0, placeholder_tool], list(TOOLS))
    cf2 = renderer.render_prompt([*START, A0, *E0, A1, placeholder_user], list(TOOLS))
    assert cf1 == counterfactual_prompt(turns[0], renderer) and cf1 != list(turns[1].prompt_ids)
    assert cf2 == counterfactual_prompt(turns[1], renderer)
    expected = [direct_gain(model, turns[1].prompt_ids, cf1, turns[1].completion_ids),
                direct_gain(model, turns[2].prompt_ids, cf2, turns[2].completion_ids), 0.0]
    assert all(abs(e) > 1e-4 for e in expected[:2])  # the check below can fail
    for row in scores(out[0]):  # both samples are the same trajectory
        assert row == pytest.approx(expected, abs=1e-5)
        assert row[2] == 0.0
    # the input groups are untouched; other metrics are kept
    assert "info_gain" not in trajectory.turns[0].metrics


def test_micro_batch_size_and_recorded_prompt_mismatch(setup, caplog):
    model, renderer = setup
    trajectory = three_turns(renderer)
    reference = scores(score_info_gain([TrajectoryGroup(env="calc", task_id="t0", trajectories=(trajectory,))],
                                       model, renderer, temperature=TEMPERATURE, micro_batch_size=1)[0])[0]
    # a recorded prompt that is not continue_prompt(...) of the previous turn: re-rendered, warned
    broken = trajectory.turns[1].model_copy(update={"prompt_ids": trajectory.turns[1].prompt_ids + (42,),
                                                    "metrics": {"tool_calls": 1.0}})
    odd = trajectory.model_copy(update={"turns": (trajectory.turns[0], broken, trajectory.turns[2])})
    with caplog.at_level("WARNING"):
        out = score_info_gain([TrajectoryGroup(env="calc", task_id="t0", trajectories=(odd,))], model, renderer,
                              temperature=TEMPERATURE, micro_batch_size=4)
    assert "re-rendered" in caplog.text
    # turn 0's gain is as before (turn 1's prompt re-rendered); turn 1's counterfactual and actual
    # prompts both extend the odd recorded prompt, so only I_0 is comparable
    values = scores(out[0])[0]
    assert values[0] == pytest.approx(reference[0], abs=1e-5) and values[2] == 0.0
    assert out[0].trajectories[0].turns[1].metrics["tool_calls"] == 1.0


def test_model_mode_restored_and_single_turn(setup):
    model, renderer = setup
    single = three_turns(renderer).model_copy(update={"turns": three_turns(renderer).turns[:1]})
    group = TrajectoryGroup(env="calc", task_id="t0", trajectories=(single,))
    try:
        model.train()
        out = score_info_gain([group, TrajectoryGroup(env="calc", task_id="t1", trajectories=(three_turns(renderer),))],
                              model, renderer, temperature=TEMPERATURE)
        assert model.training
    finally:
        model.eval()
    assert scores(out[0]) == [[0.0]]
    assert placeholder_messages(E0)[0] == Message(role="tool", content="No information found.", tool_call_id="call_0", name="add")


# -- the estimator --------------------------------------------------------------------------------


def _trajectory(index, reward, gains):
    """A trajectory whose turns carry the given info_gain scores (no tokens needed by the estimator)."""
    turns = tuple(Turn(prompt_ids=(1,), completion_ids=(2,), message=Message(role="assistant"),
                       metrics={"info_gain": g}, reward=reward if k == len(gains) - 1 else 0.0)
                  for k, g in enumerate(gains))
    return Trajectory(env="e", task_id=f"t{index // 10}", sample_index=index % 10, messages=(), turns=turns, reward=reward)


def test_fusion_hand_values():
    # Group A: rewards [1, 1] -> A_out = 0, sigma(R) = 0, g = sigmoid(0) = 0.5.
    #   I: [0.5, 0.1, 0], [0.3, 0]; non-zero {0.5, 0.1, 0.3}: mean 0.3, Bessel std sqrt((.04+.04+0)/2) = 0.2
    #   -> Â = [1, -1, 0], [0, 0].
    # Group B: rewards [1, 0] -> sigma(R) = sqrt(0.5) = 0.707107 (Bessel), A_out = +-0.5/0.707107 = +-0.707107 (eps=0),
    #   g = sigmoid(-0.707107 / 0.5) = 1 / (1 + e^1.414214) = 0.195570.
    #   I: [0.2, 0], [-0.2, 0]; mean 0, Bessel std sqrt(0.08) = 0.282843 -> Â = [0.707107, 0], [-0.707107, 0].
    # m over all 9 turns: A_out = [0]*5 + [.707107]*2 + [-.707107]*2 -> Bessel std sqrt(2/8) = 0.5;
    #   Â = [1,-1,0,0,0,.707107,0,-.707107,0] -> std sqrt(3/8) = 0.612372; m = min(1, max(0.5,1)/0.612372) = 1.
    # A = A_out + 0.1 * g * m * Â:
    #   A: [0.05, -0.05, 0], [0, 0]
    #   B: [0.707107 + 0.1*0.195570*0.707107, 0.707107] = [0.720936, 0.707107], and the negatives.
    group_a = TrajectoryGroup(env="e", task_id="t0", trajectories=(_trajectory(0, 1.0, [0.5, 0.1, 0.0]),
                                                                    _trajectory(1, 1.0, [0.3, 0.0])))
    group_b = TrajectoryGroup(env="e", task_id="t1", trajectories=(_trajectory(10, 1.0, [0.2, 0.0]),
                                                                    _trajectory(11, 0.0, [-0.2, 0.0])))
    result = estimate("info_gain", [group_a, group_b], {"tau": 0.5, "eps": 0.0})
    gate_b = 1.0 / (1.0 + math.exp(math.sqrt(0.5) / 0.5))
    assert gate_b == pytest.approx(0.195570, abs=1e-6)
    assert result.advantages[0] == [pytest.approx([0.05, -0.05, 0.0], abs=1e-12), pytest.approx([0.0, 0.0], abs=1e-12)]
    assert result.advantages[1][0] == pytest.approx([0.720936, 0.707107], abs=1e-6)
    assert result.advantages[1][1] == pytest.approx([-0.720936, -0.707107], abs=1e-6)
    assert result.metrics["info_gain_abs_mean"] == pytest.approx((0.5 + 0.1 + 0.3 + 0.2 + 0.2) / 5)
    assert result.metrics["gate_mean"] == pytest.approx((0.5 + gate_b) / 2)
    assert result.metrics["intrinsic_scale"] == 1.0
    # the default tau (0.05) all but closes group B's gate: sigmoid(-14.14) = 7.2e-7
    default = estimate("info_gain", [group_a, group_b], {"eps": 0.0})
    closed = 1.0 / (1.0 + math.exp(math.sqrt(0.5) / 0.05))
    assert closed == pytest.approx(7.2135e-7, rel=1e-4)
    assert default.advantages[1][0][0] == pytest.approx(math.sqrt(0.5) * (1 + 0.1 * closed), abs=1e-12)
    # beta = 0 is plain GRPO
    plain = estimate("info_gain", [group_a, group_b], {"beta": 0.0, "eps": 0.0}).advantages
    assert plain == estimate("grpo", [group_a, group_b], {"eps": 0.0}).advantages


def test_magnitude_scale_without_std_normalisation():
    # rewards [1, 1]: A_out = 0, sigma_out = 0, g = 0.5. normalize_std=False: Â = I - mean_nonzero(I) = [4, 0], [-4, 0].
    # sigma_int = Bessel std of [4, 0, -4, 0] = sqrt(32/3) = 3.265986; m = min(1, max(0, 1) / 3.265986) = 0.306186.
    # A = 0.1 * 0.5 * 0.306186 * [4, 0], [-4, 0] = [0.0612372, 0], [-0.0612372, 0].
    group = TrajectoryGroup(env="e", task_id="t0", trajectories=(_trajectory(0, 1.0, [4.0, 0.0]), _trajectory(1, 1.0, [-4.0, 0.0])))
    result = estimate("info_gain", [group], {"normalize_std": False})
    assert result.advantages[0] == [pytest.approx([0.0612372, 0.0], abs=1e-7), pytest.approx([-0.0612372, 0.0], abs=1e-7)]
    assert result.metrics["intrinsic_scale"] == pytest.approx(0.306186, abs=1e-6)
    # a single non-zero score is centred on itself: no intrinsic signal
    lone = TrajectoryGroup(env="e", task_id="t0", trajectories=(_trajectory(0, 1.0, [4.0, 0.0]), _trajectory(1, 1.0, [0.0, 0.0])))
    assert estimate("info_gain", [lone]).advantages[0] == [[0.0, 0.0], [0.0, 0.0]]


def test_estimator_refuses_unscored_groups():
    bare = Turn(prompt_ids=(1,), completion_ids=(2,), message=Message(role="assistant"))
    won = bare.model_copy(update={"reward": 1.0})  # the episode reward is the sum of the turn rewards
    two = Trajectory(env="e", task_id="t0", messages=(), turns=(bare, won), reward=1.0)
    with pytest.raises(ValueError, match=r"turn 0 has no Turn.metrics\['info_gain'\]; run with advantage.intrinsic: info_gain"):
        estimate("info_gain", [TrajectoryGroup(env="e", task_id="t0", trajectories=(two, two))])
    # single-turn trajectories need no score (I = 0): plain GRPO
    one = [TrajectoryGroup(env="e", task_id="t0", trajectories=(two.model_copy(update={"turns": (won,)}),
                                                                 two.model_copy(update={"turns": (bare,), "reward": 0.0})))]
    assert estimate("info_gain", one).advantages == estimate("grpo", one).advantages
    assert estimator_problems("info_gain", {"beta": 0.2, "tau": 0.1}) == []
    assert estimator_problems("info_gain", {"temperature": 1.0})  # not an option of the estimator


@pytest.mark.parametrize("normalize_std", [True, False])
def test_a_nan_score_is_an_error_naming_the_task_and_turn(normalize_std: bool):
    # NaN fails every "std > 0" test: with normalize_std it used to zero the group's whole intrinsic term silently
    bad = TrajectoryGroup(env="e", task_id="t0", trajectories=(_trajectory(0, 1.0, [0.5, 0.0]),
                                                               _trajectory(1, 1.0, [float("nan"), 0.3, 0.0])))
    with pytest.raises(ValueError, match=r"task t0 sample 1 turn 0 has a non-finite Turn.metrics\['info_gain'\] = nan"):
        estimate("info_gain", [bad], {"normalize_std": normalize_std})
    inf = bad.model_copy(update={"trajectories": (_trajectory(0, 1.0, [0.5, float("inf"), 0.0]),)})
    with pytest.raises(ValueError, match="task t0 sample 0 turn 1 .* = inf"):
        estimate("info_gain", [inf], {"normalize_std": normalize_std})


def test_the_scorer_refuses_a_nan_gain(setup, monkeypatch):
    import tracegym.train.info_gain as scorer

    model, renderer = setup
    group = TrajectoryGroup(env="calc", task_id="t0", trajectories=(three_turns(renderer, 0, 1.0),))
    # a NaN log-prob of one scored sequence (e.g. an overflow in the forward pass)
    monkeypatch.setattr(scorer, "mean_completion_logprobs", lambda model, sequences, **kw: [float("nan")] * len(sequences))
    with pytest.raises(ValueError, match="task t0 sample 0 turn 0: .* nan"):
        score_info_gain([group], model, renderer)


def test_scorer_then_estimator(setup):
    model, renderer = setup
    group = TrajectoryGroup(env="calc", task_id="t0", trajectories=(three_turns(renderer, 0, 1.0), three_turns(renderer, 1, 1.0)))
    scored = score_info_gain([group], model, renderer, temperature=TEMPERATURE)
    result = estimate("info_gain", scored, {"eps": 0.0})
    # equal rewards and identical trajectories: two equal non-zero values per turn index -> I_0 and I_1
    # pooled: {I0, I1, I0, I1}, mean (I0+I1)/2; Â = +-0.866025 (Bessel: |I - mean| / sqrt(4 (d/2)^2 / 3))
    row = result.advantages[0][0]
    sign = 1.0 if scores(scored[0])[0][0] > scores(scored[0])[0][1] else -1.0
    assert row == pytest.approx([0.1 * 0.5 * sign * math.sqrt(0.75), -0.1 * 0.5 * sign * math.sqrt(0.75), 0.0], abs=1e-5)
