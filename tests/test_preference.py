"""Preference learning on trajectories: DPO, DMPO and KTO against hand values, pairs built from
rollouts (grouping, gaps, ties, truncation at the divergent turn, token-exact), sequence log-probs
over sampled tokens only, exact micro-batching, and ``tracegym dpo`` on the tiny random model
(learns, writes inspectable pairs, resumes exactly, rejects bad keys in one line per key)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tracegym.algos import (
    PREFERENCE_LOSSES,
    DMPOOptions,
    DPOOptions,
    KTOOptions,
    LabelledLogps,
    PairLogps,
    dmpo_turn_weights,
    dpo_loss,
    kto_loss,
    kto_reference_point,
    sequence_logps,
)
from tracegym.cli import main
from tracegym.config import ConfigError, DPOConfig, load_config
from tracegym.data.pairs import (
    PreferencePair,
    build_pairs,
    divergent_turn,
    label_trajectories,
    read_pairs,
    write_pairs,
)
from tracegym.data.store import BadLineError, TrajectoryWriter
from tracegym.recipes.dpo import (
    PreferenceItem,
    accumulate_preference_gradients,
    preference_items,
    score_sequences,
    train_dpo,
)
from tracegym.render import get_renderer
from tracegym.render.trajectory_examples import build_examples
from tracegym.train.checkpoint import list_checkpoints
from tracegym.train.logging import read_metrics
from tracegym.types import Message, Trajectory, Turn

LOG2 = math.log(2.0)


# --- the losses against hand values -----------------------------------------------------------------


def test_dmpo_turn_weights_match_the_formula():
    assert [round(w, 4) for w in dmpo_turn_weights(3, 0.7)] == [1.0, 0.5434, 0.2237]
    assert dmpo_turn_weights(3, 1.0) == pytest.approx([1.0, 2 / 3, 1 / 3], abs=1e-12)
    assert dmpo_turn_weights(1, 0.7) == [1.0]  # one turn: DMPO is DPO
    assert dmpo_turn_weights(2, 0.0) == [1.0, 0.0]  # gamma 0: only the first turn counts
    assert DMPOOptions(gamma=0.5).turn_weights(2) == pytest.approx([1.0, 0.5 * 0.5 / 0.75])
    assert DPOOptions().turn_weights(3) == KTOOptions().turn_weights(3) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        dmpo_turn_weights(2, 1.5)


def test_dpo_loss_hand_value_log2_at_the_reference_and_swap_flips_the_logit():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.5))
    # logits = (-1 + 2) - (-3 + 2.5) = 1.5; loss = log(1 + exp(-0.15))
    assert float(dpo_loss(pc, pr, rc, rr, beta=0.1)) == pytest.approx(0.620957, abs=1e-6)
    same = torch.tensor([-4.0, -7.5, 0.0])
    other = torch.tensor([-1.0, -9.0, -3.0])
    assert torch.allclose(dpo_loss(same, other, same, other), torch.full((3,), LOG2))
    pairs = PairLogps(torch.tensor([-1.0, -5.0]), torch.tensor([-3.0, -2.0]), torch.tensor([-2.0, -4.0]), torch.tensor([-2.5, -2.0]))
    swapped = PairLogps(pairs.policy_rejected, pairs.policy_chosen, pairs.reference_rejected, pairs.reference_chosen)
    assert torch.equal(swapped.logits, -pairs.logits)
    # -log sig(z) - (-log sig(-z)) = -z, pair by pair
    loss, _ = PREFERENCE_LOSSES.entry("dpo")(pairs, {"beta": 0.1})
    swapped_loss, _ = PREFERENCE_LOSSES.entry("dpo")(swapped, {"beta": 0.1})
    assert torch.allclose(loss - swapped_loss, -0.1 * pairs.logits, atol=1e-6)
    _, metrics = PREFERENCE_LOSSES.entry("dpo")(pairs, {"beta": 0.1})
    assert metrics["accuracy"] == 0.5  # margins 1.5 and -1.0
    assert metrics["reward_margin"] == pytest.approx(0.1 * (1.5 - 1.0) / 2)
    assert metrics["logratio_chosen"] == pytest.approx((1.0 - 1.0) / 2)


class _TokenRenderer:
    """Enough of a renderer for ``preference_items``: examples from the token ids alone."""

    build_examples = staticmethod(build_examples)


def test_dmpo_on_one_turn_is_dpo():
    pairs = PairLogps(torch.tensor([-1.0, -5.0]), torch.tensor([-3.0, -2.0]), torch.tensor([-2.0, -4.0]), torch.tensor([-2.5, -2.0]))
    dpo, _ = PREFERENCE_LOSSES.entry("dpo")(pairs, {"beta": 0.3})
    dmpo, _ = PREFERENCE_LOSSES.entry("dmpo")(pairs, {"beta": 0.3, "gamma": 0.7})
    assert torch.equal(dpo, dmpo)
    # the only difference is the turn weights on the tokens: none with one turn, phi_j with more
    one_turn = build_pairs([_traj("a", 0, 1.0, [((1, 2), (3, 4))]), _traj("a", 1, 0.0, [((1, 2), (5,))])])
    as_dpo = preference_items(one_turn, _TokenRenderer(), DPOOptions(), 100).items
    assert as_dpo == preference_items(one_turn, _TokenRenderer(), DMPOOptions(), 100).items
    two_turns = build_pairs([_traj("a", 0, 1.0, _two_turns((10,), (11,))), _traj("a", 1, 0.0, _two_turns((12,), (13,)))],
                            truncate_at_divergence=False)
    (item,) = preference_items(two_turns, _TokenRenderer(), DMPOOptions(gamma=0.5), 100).items
    chosen = item.sequences[0].examples[0]
    assert [w for w, m in zip(chosen.weights, chosen.loss_mask) if m] == [1.0, pytest.approx(0.5 * 0.5 / 0.75)]


def test_kto_toy_value_and_reference_point():
    r, zero = torch.tensor([2.0]), torch.tensor([0.0])
    assert float(kto_loss(r, zero, torch.tensor([True]), 0.5, beta=0.1)) == pytest.approx(0.4626, abs=5e-5)
    assert float(kto_loss(r, zero, torch.tensor([False]), 0.5, beta=0.1)) == pytest.approx(1 - 0.4626, abs=5e-5)
    assert float(kto_loss(r, zero, torch.tensor([False]), 0.5, beta=0.1, lambda_u=2.0)) == pytest.approx(2 * 0.5374, abs=1e-4)
    # z0 = max(0, mean(policy - reference)), detached
    policy = torch.tensor([1.0, -3.0, 4.0], requires_grad=True)
    assert float(kto_reference_point(policy, torch.zeros(3))) == pytest.approx(2 / 3)
    assert not kto_reference_point(policy, torch.zeros(3)).requires_grad
    assert float(kto_reference_point(torch.tensor([-1.0, -2.0]), torch.zeros(2))) == 0.0
    inputs = LabelledLogps(torch.tensor([2.0, 0.0]), torch.zeros(2), torch.tensor([True, False]), torch.tensor(0.5))
    _, metrics = PREFERENCE_LOSSES.entry("kto")(inputs, {})
    assert metrics["accuracy"] == 1.0 and metrics["reference_point"] == 0.5
    assert metrics["logratio_desirable"] == 2.0 and metrics["logratio_undesirable"] == 0.0


def test_kto_mismatched_pair_keeps_every_example_of_a_split_continuation():
    from tracegym.recipes.dpo import TrajectoryTokens, mismatched_sequence

    def tokens(trajectory: Trajectory) -> TrajectoryTokens:
        return TrajectoryTokens(tuple(build_examples(trajectory)), trajectory.turns[0].prompt_ids)

    # tokens: 1 system, 2 generation prompt, 8 an empty think block only the generation prompt shows (Qwen3 with
    # enable_thinking false); x = task 40, y' = task 50 51. y''s turn 1 prompt re-renders its history without the
    # think block (60 instead of 8 60 61): the template split y' into two examples
    x = _traj("a", 0, 1.0, [((1, 40, 2, 8), (70, 71))])
    y = _traj("b", 0, 0.0, [((1, 50, 51, 2, 8), (60, 61)), ((1, 50, 51, 2, 60, 7, 2, 8), (62, 63))])
    assert len(tokens(y).examples) == 2
    mismatched = mismatched_sequence(tokens(x), tokens(y))
    # both parts, y''s task 50 51 replaced by x's 40 in each (z0 used to see the first part only: 2 of y''s 4 tokens)
    assert [ex.input_ids for ex in mismatched.examples] == [(1, 40, 2, 8, 60, 61), (1, 40, 2, 60, 7, 2, 8, 62, 63)]
    assert [ex.loss_mask for ex in mismatched.examples] == [(0, 0, 0, 0, 1, 1), (0, 0, 0, 0, 0, 0, 0, 1, 1)]
    assert sum(sum(ex.loss_mask) for ex in mismatched.examples) == sum(sum(ex.loss_mask) for ex in tokens(y).examples)
    assert mismatched.first_prompt == (1, 40, 2, 8)
    # an unsplit continuation: x followed by y''s continuation, as before
    (single,) = mismatched_sequence(tokens(x), tokens(_traj("c", 0, 0.0, [((1, 50, 2, 8), (60,))]))).examples
    assert single.input_ids == (1, 40, 2, 8, 60) and single.loss_mask == (0, 0, 0, 0, 1)
    # a part whose history does not start with its own task cannot take another task: refused by name
    odd = _traj("d", 0, 0.0, [((1, 50, 2, 8), (60,)), ((3, 50, 2, 60, 7, 2, 8), (62,))])
    with pytest.raises(ValueError, match="toy/d/0#1"):
        mismatched_sequence(tokens(x), tokens(odd))


def test_sequence_logps_sum_weighted_sampled_tokens_per_trajectory():
    logps = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.25, -8.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.float32)
    weights = torch.tensor([[0, 1.0, 0, 0.5], [1, 1, 0, 0], [0, 0, 2, 2]])
    # rows 0 and 1 are one trajectory (split by a template), row 2 another
    out = sequence_logps(logps, mask, weights, owner=torch.tensor([0, 0, 1]), num_owners=2)
    assert out.tolist() == [-2.0 - 2.0 - 0.5 - 0.25, -4.0]
    # observation positions (mask 0) may hold anything, NaN included: nothing changes
    edited = logps.clone()
    edited[mask == 0] = torch.tensor(float("nan"))
    assert torch.equal(sequence_logps(edited, mask, weights, owner=torch.tensor([0, 0, 1]), num_owners=2), out)


# --- building pairs ---------------------------------------------------------------------------------


def _turn(prompt: tuple[int, ...], completion: tuple[int, ...]) -> Turn:
    return Turn(prompt_ids=prompt, completion_ids=completion, message=Message(role="assistant", content=str(completion)))


def _traj(task: str, sample: int, reward: float, turns: list[tuple[tuple[int, ...], tuple[int, ...]]], env: str = "toy",
          success: bool | None = None, **extra) -> Trajectory:
    made = tuple(_turn(p, c) for p, c in turns)
    messages = [Message(role="user", content=task)]
    for turn in made:
        messages += [turn.message, Message(role="tool", content="obs")]
    return Trajectory(env=env, task_id=task, sample_index=sample, messages=tuple(messages), turns=made, reward=reward,
                      success=reward >= 1.0 if success is None else success, **extra)


def _two_turns(first: tuple[int, ...], second: tuple[int, ...], obs: tuple[int, ...] = (7, 7)) -> list:
    prompt0 = (1, 2, 3)
    return [(prompt0, first), (prompt0 + first + obs + (4,), second)]


def test_pairs_group_by_task_need_a_gap_and_skip_ties():
    trajectories = [
        _traj("a", 0, 1.0, _two_turns((10,), (11,))),
        _traj("a", 1, 0.0, _two_turns((10,), (12,))),
        _traj("a", 2, 0.8, _two_turns((13,), (11,)), success=False),
        _traj("a", 3, 1.0, _two_turns((14,), (11,))),  # ties with sample 0: never a pair of the two
        _traj("a", 0, 0.0, _two_turns((10,), (15,)), env="other"),  # another env: its own task
        _traj("b", 0, 0.0, [((1,), (5,))], end_reason="env_error", error="boom"),  # unusable
        _traj("b", 1, 1.0, [((1,), (6,))]),
    ]
    counts: dict[str, int] = {}
    pairs = build_pairs(trajectories, min_gap=0.5, truncate_at_divergence=False, counts=counts)
    made = {(p.env, p.task_id, p.chosen.sample_index, p.rejected.sample_index) for p in pairs}
    assert made == {("toy", "a", 0, 1), ("toy", "a", 3, 1), ("toy", "a", 2, 1)}  # 1.0 vs 0.8: gap 0.2 < 0.5
    assert all(p.reward_gap >= 0.5 and p.truncated_at is None for p in pairs)
    assert counts["unusable"] == 1 and counts["tasks"] == 3 and counts["tasks_with_pairs"] == 1 and counts["pairs"] == 3
    # min_gap 0: the 0.2 gap counts, a tie still does not
    loose = build_pairs(trajectories, min_gap=0.0, truncate_at_divergence=False)
    assert {(p.chosen.sample_index, p.rejected.sample_index) for p in loose if p.env == "toy"} == {(0, 1), (3, 1), (2, 1), (0, 2), (3, 2)}
    # a failure is never preferred over a success, whatever the rewards say
    odd = [_traj("c", 0, 2.0, [((1,), (5,))], success=False), _traj("c", 1, 1.0, [((1,), (6,))], success=True)]
    assert build_pairs(odd) == []


def test_truncation_keeps_the_shared_prefix_and_the_divergent_turn_token_exact():
    prompt0, shared, obs = (1, 2, 3), (10, 11), (7, 8, 9)
    prompt1 = prompt0 + shared + obs
    chosen = _traj("t", 0, 1.0, [(prompt0, shared), (prompt1, (20, 21)), (prompt1 + (20, 21, 5), (30,))])
    rejected = _traj("t", 1, 0.0, [(prompt0, shared), (prompt1, (22,)), (prompt1 + (22, 6), (31,)), (prompt1 + (22, 6, 31, 6), (32,))])
    assert divergent_turn(chosen, rejected) == 1
    (pair,) = build_pairs([chosen, rejected])
    assert pair.truncated_at == 1 and len(pair.chosen.turns) == len(pair.rejected.turns) == 2
    assert [m.role for m in pair.chosen.messages] == ["user", "assistant", "tool", "assistant"]
    assert pair.chosen.reward == 1.0 and pair.reward_gap == 1.0
    (ex_w,), (ex_l,) = build_examples(pair.chosen), build_examples(pair.rejected)
    assert ex_w.input_ids == prompt1 + (20, 21) and ex_l.input_ids == prompt1 + (22,)
    trained_w = [t for t, m in zip(ex_w.input_ids, ex_w.loss_mask) if m]
    trained_l = [t for t, m in zip(ex_l.input_ids, ex_l.loss_mask) if m]
    assert trained_w == [10, 11, 20, 21] and trained_l == [10, 11, 22]  # shared turn in both: it cancels
    # without truncation both stay whole
    (whole,) = build_pairs([chosen, rejected], truncate_at_divergence=False)
    assert whole.truncated_at is None and len(whole.rejected.turns) == 4


def test_no_truncation_when_the_env_diverged_first_and_identical_tokens_make_no_pair():
    a = _traj("t", 0, 1.0, [((1,), (10,)), ((1, 10, 7), (11,))])
    b = _traj("t", 1, 0.0, [((1,), (10,)), ((1, 10, 8), (12,))])  # same action, different observation
    assert divergent_turn(a, b) is None
    (pair,) = build_pairs([a, b])
    assert pair.truncated_at is None and len(pair.chosen.turns) == 2
    twin = _traj("t", 2, 0.0, [((1,), (10,)), ((1, 10, 7), (11,))])  # same tokens as a, lower reward
    counts: dict[str, int] = {}
    assert build_pairs([a, twin], counts=counts) == [] and counts["identical"] == 1


def test_max_pairs_per_task_spreads_over_trajectories():
    group = [_traj("t", i, 1.0, [((1,), (10 + i,))]) for i in range(3)] + [_traj("t", 3 + i, 0.0, [((1,), (20 + i,))]) for i in range(3)]
    counts: dict[str, int] = {}
    pairs = build_pairs(group, max_pairs_per_task=3, counts=counts)
    assert len(pairs) == 3 and counts["capped"] == 6
    assert sorted(p.chosen.sample_index for p in pairs) == [0, 1, 2]
    assert sorted(p.rejected.sample_index for p in pairs) == [3, 4, 5]
    assert len(build_pairs(group)) == 9


def test_pairs_file_is_jsonl_that_round_trips_and_bad_lines_are_named(tmp_path):
    pairs = build_pairs([_traj("a", 0, 1.0, [((1,), (2,))]), _traj("a", 1, 0.0, [((1,), (3,))])])
    path = tmp_path / "pairs.jsonl"
    assert write_pairs(path, pairs) == 1
    row = json.loads(path.read_text().splitlines()[0])
    assert row["task_id"] == "a" and row["chosen"]["reward"] == 1.0 and row["rejected"]["turns"][0]["completion_ids"] == [3]
    assert read_pairs(path) == pairs and isinstance(read_pairs(path)[0], PreferencePair)
    path.write_text(path.read_text() + '{"task_id": "x"}\n')
    with pytest.raises(BadLineError, match=r"pairs.jsonl:2: not a PreferencePair"):
        read_pairs(path)


def test_labels_for_kto():
    trajectories = [_traj("a", 0, 1.0, [((1,), (2,))]), _traj("a", 1, 0.6, [((1,), (3,))]), _traj("a", 2, 0.0, [((1,), (4,))]),
                    _traj("a", 3, 0.0, [((1,), (5,))], end_reason="engine_error", error="x")]
    assert [x.desirable for x in label_trajectories(trajectories)] == [True, False, False]
    assert [x.desirable for x in label_trajectories(trajectories, min_reward=0.5)] == [True, True, False]


# --- on the tiny random model ------------------------------------------------------------------------


def _failed_copy(renderer, trajectory: Trajectory, sample_index: int) -> Trajectory:
    """The expert's trajectory with a wrong final answer: same turns, the last one diverges."""
    wrong = Message(role="assistant", content="<answer>-1</answer>")
    last = trajectory.turns[-1].model_copy(update={"completion_ids": tuple(renderer.encode_completion(wrong)),
                                                    "completion_logprobs": None, "message": wrong, "reward": 0.0})
    assert trajectory.messages[-1].role == "assistant"
    return trajectory.model_copy(update={"turns": (*trajectory.turns[:-1], last), "messages": (*trajectory.messages[:-1], wrong),
                                         "reward": 0.0, "success": False, "sample_index": sample_index})


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, tokenizer) -> tuple[Path, list[Trajectory]]:
    """8 calculator tasks (multi-turn tool calls), each: the expert's success and a failed copy."""
    from tracegym.envs import make
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    renderer = get_renderer("tiny-random", tokenizer)
    tasks = make("calculator").tasks("train", 8, seed=0)
    result = run_rollouts_sync("calculator", tasks, "expert", renderer, RolloutConfig(max_turns=8), progress=False)
    expert = [t for t in result.trajectories if t.success]
    assert len(expert) == 8 and max(len(t.turns) for t in expert) > 1
    trajectories = [x for t in expert for x in (t, _failed_copy(renderer, t, 1))]
    path = tmp_path_factory.mktemp("rollouts") / "trajectories.jsonl"
    with TrajectoryWriter(path) as writer:
        writer.write_all(trajectories)
    return path, trajectories


def _config(tmp_path: Path, rollouts_file: Path, *overrides: str) -> DPOConfig:
    data = {
        "model": {"name": "tiny-random"},
        "lora": {"r": 4},
        "data": {"rollouts_files": [str(rollouts_file)]},
        "batch_size": 4, "micro_batch_size": 2, "max_length": 1024, "seed": 3,
        "optim": {"lr": 1e-2},
        "output_dir": str(tmp_path / "run"),
        "logging": {"progress": False, "tensorboard": False},
    }
    return load_config(DPOConfig, data=data, overrides=list(overrides))


def _perturbed_lora(tiny_seed: int = 0):
    """tiny-random with a LoRA adapter whose B is random: the policy differs from the reference."""
    from tracegym.config import LoraConfig
    from tracegym.models import load
    from tracegym.train.lora import prepare_model

    model, tokenizer = load("tiny-random")
    model = prepare_model(model, LoraConfig(r=4))
    generator = torch.Generator().manual_seed(tiny_seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model, tokenizer


def test_sequence_logprob_counts_sampled_tokens_only(rollouts, tokenizer):
    """``l(y)`` of a multi-turn trajectory = the sum over turns of log p(completion | that turn's
    prompt): tool results and template text inside the trajectory are context, never scored."""
    from tracegym.recipes.dpo import TrajectoryTokens
    from tracegym.train.logprobs import token_logprobs

    model, _ = _perturbed_lora()
    model.eval()
    renderer = get_renderer("tiny-random", tokenizer)
    trajectory = max(rollouts[1], key=lambda t: len(t.turns))
    weights = dmpo_turn_weights(len(trajectory.turns), 0.7)
    seq = TrajectoryTokens(tuple(renderer.build_examples(trajectory, weight=weights)), tuple(trajectory.turns[0].prompt_ids))
    with torch.no_grad():
        scored, _ = score_sequences(model, [seq], torch.device("cpu"), tokenizer.eos_token_id)
        expected = 0.0
        for turn, weight in zip(trajectory.turns, weights):
            ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
            logps = token_logprobs(model, ids, torch.ones_like(ids))[0, len(turn.prompt_ids) - 1:]  # the completion's tokens
            expected += weight * float(logps.sum())
    assert float(scored[0]) == pytest.approx(expected, abs=1e-3)
    assert any(m.role == "tool" for m in trajectory.messages) and len(trajectory.turns) > 1


@pytest.mark.parametrize("loss", ["dmpo", "kto"])
def test_micro_batch_size_changes_neither_loss_nor_gradient(rollouts, tokenizer, loss):
    from tracegym.algos import preference_loss_options

    model, _ = _perturbed_lora()
    renderer = get_renderer("tiny-random", tokenizer)
    opts = preference_loss_options(loss, {"beta": 0.5, "gamma": 0.7})
    trajectories = rollouts[1]
    records = build_pairs(trajectories) if loss == "dmpo" else label_trajectories(trajectories)
    items: list[PreferenceItem] = preference_items(records, renderer, opts, 1024).items[:4]

    def run(micro: int) -> tuple[dict, dict]:
        model.zero_grad(set_to_none=True)
        out = accumulate_preference_gradients(model, None, items, loss, opts, micro, torch.device("cpu"), tokenizer.eos_token_id)
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, whole_grads = run(4)
    parts, part_grads = run(1)
    assert whole.keys() == parts.keys() and whole_grads.keys() == part_grads.keys() and whole_grads
    # sequence log-probs are sums of hundreds of float32 terms: padding shapes move them by ~1e-5
    for key in whole:
        if key != "tokens":
            assert parts[key] == pytest.approx(whole[key], rel=1e-4, abs=2e-4), key
    assert abs(whole["loss"] - (LOG2 if loss == "dmpo" else 0.5)) > 1e-4  # the policy is not the reference
    for name in whole_grads:
        difference = (part_grads[name] - whole_grads[name]).norm()
        assert difference <= 1e-4 * whole_grads[name].norm() + 1e-9, (name, float(difference))
    half, _ = run(2)
    assert half["loss"] == pytest.approx(whole["loss"], rel=1e-4)


def test_dpo_command_learns_writes_pairs_and_saves_the_adapter(tmp_path, rollouts, capsys):
    config = tmp_path / "dpo.yaml"
    config.write_text(
        "model: {name: tiny-random}\nlora: {r: 4}\noptim: {lr: 0.02}\n"
        f"data: {{rollouts_files: [{rollouts[0]}], max_pairs_per_task: 2}}\n"
        "loss: {name: dpo, beta: 0.5}\nbatch_size: 4\nmicro_batch_size: 2\nmax_steps: 6\nmax_length: 1024\n"
        f"output_dir: {tmp_path / 'run'}\nlogging: {{progress: false, tensorboard: false}}\n",
        encoding="utf-8",
    )
    assert main(["dpo", "--config", str(config)]) == 0
    assert "dpo done: 6 steps" in capsys.readouterr().out
    run = tmp_path / "run"
    rows = read_metrics(run)
    assert rows[0]["data/pairs"] == 8 and rows[0]["data/truncated"] == 8
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert steps[0]["loss"] == pytest.approx(LOG2, abs=1e-6)  # fresh LoRA: policy == reference
    assert steps[0]["accuracy"] == 0.0 and steps[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    last = steps[-3:]  # a high learning rate on a random model: judge the last steps together
    assert sum(r["loss"] for r in last) / 3 < LOG2 - 0.05 and sum(r["accuracy"] for r in last) / 3 > 0.5, last
    assert all(r["logratio_chosen"] > r["logratio_rejected"] for r in last)
    pairs = read_pairs(run / "pairs.jsonl")  # what it trained on, readable
    assert len(pairs) == 8 and all(p.truncated_at == len(p.chosen.turns) - 1 for p in pairs)
    assert all(json.loads(line)["reward_gap"] == 1.0 for line in (run / "pairs.jsonl").read_text().splitlines())
    assert (run / "final" / "adapter_model.safetensors").is_file()
    assert json.loads((run / "final" / "tracegym.json").read_text())["recipe"] == "dpo"
    assert (run / "config.yaml").is_file() and [s for s, _ in list_checkpoints(run)] == [6]


def test_kto_trains_from_rollouts_and_full_fine_tuning_starts_at_the_reference(tmp_path, rollouts):
    kto = train_dpo(_config(tmp_path / "kto", rollouts[0], "loss.name=kto", "max_steps=2"))
    assert (kto.run_dir / "labelled.jsonl").is_file()
    rows = [r for r in read_metrics(kto.run_dir) if r["step"] > 0]
    assert rows[0]["loss"] == pytest.approx(0.5, abs=1e-6) and rows[0]["reference_point"] == 0.0  # r = z0 = 0
    full = train_dpo(_config(tmp_path / "full", rollouts[0], "lora.enabled=false", "max_steps=1"))
    assert full.history[0]["loss"] == pytest.approx(LOG2, abs=1e-6)  # the frozen copy is the policy at step 0


def test_reference_after_sft_is_the_sft_model(tmp_path, rollouts):
    """Starting from an adapter, the reference is that adapter's model (not the bare base): the
    first loss is log 2 although the adapter changes the outputs."""
    from tracegym.train.lora import save_weights

    model, _ = _perturbed_lora(1)
    save_weights(model, tmp_path / "sft_adapter")
    result = train_dpo(_config(tmp_path, rollouts[0], f"model.adapter={tmp_path / 'sft_adapter'}", "max_steps=1"))
    assert result.history[0]["loss"] == pytest.approx(LOG2, abs=1e-5)


def _final_tensors(final_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(final_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    assert tensors
    return tensors


def test_resume_matches_straight_run_exactly(tmp_path, rollouts):
    # 8 pairs, batch 4: 2 steps per epoch, so 5 steps cross epoch boundaries (new shuffles)
    common = ("max_steps=5", "loss.name=dmpo", "optim.schedule=cosine", "optim.warmup_steps=1")
    straight = train_dpo(_config(tmp_path / "a", rollouts[0], *common))
    cfg = _config(tmp_path / "b", rollouts[0], *common, "checkpoint.every=2")
    interrupted = train_dpo(cfg, stop_at_step=3)  # killed after step 3: the last checkpoint is step 2
    assert interrupted.final_dir is None and [s for s, _ in list_checkpoints(cfg.output_dir)] == [2]
    with pytest.raises(FileExistsError, match="--resume"):
        train_dpo(cfg)
    resumed = train_dpo(cfg, resume=True)
    assert resumed.step == 5 and [r["step"] for r in resumed.history] == [3, 4, 5]
    keys = ("step", "loss", "accuracy", "reward_margin", "logratio_chosen", "logratio_rejected", "grad_norm", "lr", "epoch")

    def table(run_dir: Path) -> list[tuple]:
        return [tuple(r[k] for k in keys) for r in read_metrics(run_dir) if r["step"] > 0]

    assert table(straight.run_dir) == table(resumed.run_dir) and len(table(straight.run_dir)) == 5
    a, b = _final_tensors(straight.final_dir), _final_tensors(resumed.final_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# --- config errors ------------------------------------------------------------------------------------


def test_bad_keys_and_values_name_the_key():
    with pytest.raises(ConfigError) as info:
        load_config(DPOConfig, data={"loss": {"gama": 0.9}})
    (problem,) = info.value.problems
    assert "unknown key 'loss.gama'" in problem and "did you mean 'loss.gamma'?" in problem
    with pytest.raises(ConfigError, match="'loss.gamma'"):
        load_config(DPOConfig, data={"loss": {"gamma": 1.5}})
    with pytest.raises(ConfigError, match="one data source"):
        load_config(DPOConfig, data={"data": {"pairs_file": "p.jsonl", "rollouts_files": ["r.jsonl"]}})
    with pytest.raises(ConfigError, match="multiple of micro_batch_size"):
        load_config(DPOConfig, data={"batch_size": 4, "micro_batch_size": 3})


@pytest.mark.parametrize("override, named", [("loss.name=dpoo", "'loss.name'"), ("loss.bta=0.2", "'loss.bta'"),
                                             ("data.min_gapp=1", "'data.min_gap'")])
def test_cli_config_errors_exit_2_naming_the_key(tmp_path, capsys, override, named):
    config = tmp_path / "dpo.yaml"
    config.write_text("model: {name: tiny-random}\ndata: {pairs_file: nope.jsonl}\n", encoding="utf-8")
    assert main(["dpo", "--config", str(config), override]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1


def test_missing_data_and_wrong_kind_are_one_line_errors(tmp_path, capsys, rollouts):
    config = tmp_path / "dpo.yaml"
    config.write_text(f"model: {{name: tiny-random}}\noutput_dir: {tmp_path / 'run'}\n", encoding="utf-8")
    assert main(["dpo", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no data") and err.count("\n") == 1
    assert main(["dpo", "--config", str(config), f"data.labelled_file={rollouts[0]}"]) == 1
    err = capsys.readouterr().err
    assert "data.labelled_file" in err and err.count("\n") == 1
    assert main(["dpo", "--config", str(config), f"data.pairs_file={tmp_path / 'none.jsonl'}"]) == 1
    assert "not found" in capsys.readouterr().err
