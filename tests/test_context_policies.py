"""Context policies (``rollout.context``): ``window`` and ``observation_masking`` rewrite what a
long episode's prompt shows; the trajectory becomes segments, each trained on exactly the prompt
the model saw and the tokens it sampled, and the episode's advantages reach every segment."""

from __future__ import annotations

import pytest

from tracegym.config.shared import ContextConfig
from tracegym.rollout import RolloutConfig, run_rollouts_sync
from tracegym.rollout.context import apply_context, rewrites_history
from tracegym.types import Generation, Message, ToolCall

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "%d + 1"}}\n</tool_call>'


def _history(turns: int) -> list[Message]:
    messages = [Message(role="system", content="sys"), Message(role="user", content="task")]
    for i in range(turns):
        messages.append(Message(role="assistant", tool_calls=(ToolCall(name="calculate", arguments={"expression": f"{i} + 1"},
                                                                       id=f"c{i}"),)))
        messages.append(Message(role="tool", content=f"result {i}", tool_call_id=f"c{i}", name="calculate"))
    return messages


def test_window_and_masking_show_the_opening_and_the_last_turns():
    history = _history(4)
    window = apply_context(history, ContextConfig(policy="window", keep_turns=2))
    assert [m.content for m in window if m.role != "assistant"] == ["sys", "task", "result 2", "result 3"]
    assert [m.tool_calls[0].arguments["expression"] for m in window if m.role == "assistant"] == ["2 + 1", "3 + 1"]
    masked = apply_context(history, ContextConfig(policy="observation_masking", keep_turns=1, placeholder="[gone]"))
    assert len(masked) == len(history)
    assert [m.content for m in masked if m.role == "tool"] == ["[gone]", "[gone]", "[gone]", "result 3"]
    assert all(a.tool_calls == b.tool_calls for a, b in zip(masked, history))  # the model's own calls stay
    assert apply_context(history, ContextConfig()) == history
    assert not rewrites_history(_history(2), ContextConfig(policy="window", keep_turns=2))
    assert rewrites_history(_history(3), ContextConfig(policy="window", keep_turns=2))


class Counting:
    """A token engine that always calls the calculator (so episodes run to ``max_turns``)."""

    name = "scripted"
    returns_logprobs = True

    def __init__(self, renderer):
        self.renderer, self.turn = renderer, 0

    def generate(self, prompts, params):
        out = []
        for _ in prompts:
            ids = self.renderer.encode_text(CALL % self.turn) + [self.renderer.stop_token_ids[0]]
            self.turn += 1
            out.append([Generation(token_ids=tuple(ids), logprobs=tuple(-0.25 for _ in ids))])
        return out


@pytest.fixture(scope="module")
def renderer():
    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer

    return get_renderer("tiny-random", load_tokenizer("tiny-random"))


def _episode(renderer, context: dict):
    from tracegym.envs import make

    env_factory = lambda: make("calculator", num_calls=1)  # noqa: E731
    task = env_factory().tasks("train", 1)[0]
    config = RolloutConfig(samples_per_task=1, max_turns=5, max_context=None, concurrency=1, context=context)
    result = run_rollouts_sync(env_factory, [task], Counting(renderer), renderer, config, progress=False)
    (trajectory,) = result.trajectories
    return trajectory


@pytest.mark.parametrize("policy", ["window", "observation_masking"])
def test_a_rewritten_history_becomes_token_exact_segments(renderer, policy):
    full = _episode(renderer, {})
    trajectory = _episode(renderer, {"policy": policy, "keep_turns": 2})
    assert len(trajectory.turns) == len(full.turns) == 5
    context = ContextConfig(policy=policy, keep_turns=2)
    messages = list(trajectory.messages)
    starts = [i for i, m in enumerate(messages) if m.role == "assistant"]
    for n, turn in enumerate(trajectory.turns):
        seen = messages[:starts[n]]  # the history before turn n
        if n <= 2:  # up to keep_turns earlier turns: the full prompt, extended token by token
            assert turn.prompt_ids == full.turns[n].prompt_ids
        else:  # rewritten: the policy's view rendered afresh, shorter than the full prompt
            assert list(turn.prompt_ids) == renderer.render_prompt(apply_context(seen, context), list(trajectory.tools))
            if policy == "window":  # (a calculator result is shorter than the masking placeholder)
                assert len(turn.prompt_ids) < len(full.turns[n].prompt_ids)
    text = renderer.tokenizer.decode(trajectory.turns[4].prompt_ids)
    if policy == "window":
        assert '"0 + 1"' not in text and '"1 + 1"' not in text and '"3 + 1"' in text
    else:
        assert '"0 + 1"' in text and "[earlier tool output omitted]" in text
    # segments: turns 0-2 extend each other; 3 and 4 each start a new one
    examples = renderer.build_examples(trajectory, advantage=[0.1, 0.2, 0.3, 0.4, 0.5])
    assert len(examples) == 3 and len(renderer.build_examples(full)) == 1
    for example, turns in zip(examples, [trajectory.turns[:3], trajectory.turns[3:4], trajectory.turns[4:]]):
        trained = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
        assert trained == [i for turn in turns for i in turn.completion_ids]  # exactly the sampled tokens
        assert list(example.input_ids[:len(turns[0].prompt_ids)]) == list(turns[0].prompt_ids)  # exactly what it saw
    assert sorted({a for a, m in zip(examples[2].advantages, examples[2].loss_mask) if m}) == [0.5]
    assert sorted({a for a, m in zip(examples[0].advantages, examples[0].loss_mask) if m}) == [0.1, 0.2, 0.3]


def test_the_context_flag_is_checked():
    from tracegym.commands._policy import UsageError, context_arg

    assert context_arg("full") == {"policy": "full"}
    assert context_arg("window:3") == {"policy": "window", "keep_turns": 3}
    assert context_arg("observation_masking") == {"policy": "observation_masking"}
    for bad in ("summary", "window:0", "window:x"):
        with pytest.raises(UsageError, match="--context"):
            context_arg(bad)
    with pytest.raises(ValueError, match="keep_turns"):
        RolloutConfig(context={"policy": "window", "keep_turns": 0})
