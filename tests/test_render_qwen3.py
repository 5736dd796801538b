"""Golden tests of the ``qwen3`` renderer against Qwen3's real tokenizer and chat template.

The tokenizer is a test fixture fetched at test/CI time (tests/fetch_tokenizers.py), never
committed. Checked: ids equal ``apply_chat_template`` (tools, calls, results, ``<think>`` blocks kept
and dropped); parse(encode(message)) round-trips and malformed calls are errors; each prompt extends
the previous one where the template keeps history, and where it drops ``<think>`` blocks the
renderer rewrites the prompt as the template does and ``build_examples`` counts the split.
"""

from __future__ import annotations

import pytest
from fetch_tokenizers import load_for_test
from test_render import CONV_CHAT, CONV_NO_SYSTEM, CONV_TOOLS, TOOLS, ADD_TOOL

from tracegym.render import BuildStats, Qwen3Renderer, get_renderer, renderer_name_for
from tracegym.render.toolcalls import to_openai_messages
from tracegym.types import Message, ToolCall, Trajectory, Turn


@pytest.fixture(scope="module")
def qtok():
    return load_for_test("qwen3")


@pytest.fixture(scope="module")
def r(qtok):
    return get_renderer("qwen3", qtok)


def _call(name, **arguments):
    return ToolCall(name=name, arguments=arguments)


# A tool loop with reasoning, then a new user query (the template drops the earlier blocks).
CONV_THINK = (
    Message(role="system", content="Solve. Answer as <answer>N</answer>."),
    Message(role="user", content="What is 2+3, looked up?"),
    Message(role="assistant", content="<think>\nI add first.\n</think>\n\nAdding.", tool_calls=(_call("add", a=2, b=3),)),
    Message(role="tool", content="5"),
    Message(role="assistant", content="<think>\nNow search «5».\n</think>", tool_calls=(_call("search", query="5 — five"),)),
    Message(role="tool", content='{"text": "five"}'),
    Message(role="assistant", content="<think>\nDone.\n</think>\n\n<answer>5</answer>"),
    Message(role="user", content="And doubled?"),
    Message(role="assistant", content="<think>\n5*2\n</think>\n\n<answer>10</answer>"),
)
CONVERSATIONS = [(CONV_TOOLS, TOOLS), (CONV_NO_SYSTEM, [ADD_TOOL]), (CONV_CHAT, None), (CONV_THINK, TOOLS), (CONV_THINK, None)]
IDS = ["tools", "no_system", "chat", "think_tools", "think_chat"]


def _template_ids(qtok, messages, tools, generation_prompt, **kwargs):
    out = qtok.apply_chat_template(
        to_openai_messages(messages), tools=tools or None, tokenize=True, add_generation_prompt=generation_prompt, **kwargs
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("conversation,tools", CONVERSATIONS, ids=IDS)
def test_ids_equal_the_real_template(r, qtok, conversation, tools):
    for end in range(1, len(conversation) + 1):
        for generation_prompt in (True, False):
            expected_text = qtok.apply_chat_template(
                to_openai_messages(conversation[:end]), tools=tools or None, tokenize=False,
                add_generation_prompt=generation_prompt,
            )
            assert r.render_text(conversation[:end], tools, add_generation_prompt=generation_prompt) == expected_text
            assert r.render_ids(conversation[:end], tools, add_generation_prompt=generation_prompt) == _template_ids(
                qtok, conversation[:end], tools, generation_prompt
            )


def test_think_blocks_kept_and_dropped_as_the_template_does(r):
    text = r.render_text(CONV_THINK[:8], TOOLS)
    # the new user query drops every earlier block; the tools wording comes from the template
    assert "<think>" not in text and "<tools>" in text and "You can call the functions below" not in text
    text = r.render_text(CONV_THINK[:6], TOOLS)
    assert text.count("<think>") == 2  # within the tool loop both blocks stay
    assert r.render_text(CONV_THINK, TOOLS, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\n5*2\n</think>\n\n<answer>10</answer><|im_end|>\n"
    )


def test_no_thinking_generation_prompt(qtok):
    r = Qwen3Renderer(qtok, enable_thinking=False)
    messages = CONV_TOOLS[:2]
    assert r.render_prompt(messages, TOOLS) == _template_ids(qtok, messages, TOOLS, True, enable_thinking=False)
    assert r.render_text(messages, TOOLS).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    completion = r.encode_completion(CONV_TOOLS[2])
    assert qtok.convert_tokens_to_ids("<think>") not in completion
    with pytest.raises(ValueError, match="enable_thinking=False"):
        r.encode_completion(CONV_THINK[2])


ROUND_TRIP = [m for m in CONV_TOOLS + CONV_CHAT + CONV_THINK if m.role == "assistant"] + [
    Message(role="assistant", content=""),
    Message(role="assistant", content="<think>\nmulti\n\nline\n</think>", tool_calls=(_call("f", x=[1, "ü"]),)),
]


@pytest.mark.parametrize("message", ROUND_TRIP)
def test_parse_of_encode_round_trips(r, qtok, message):
    ids = r.encode_completion(message)
    assert ids[-1] == r.im_end_id and ids[0] == qtok.convert_tokens_to_ids("<think>")  # thinking models think first
    parsed = r.parse_completion(ids)
    assert parsed.errors == () and parsed.ended_with_eot
    assert parsed.message.content == message.content
    assert [(c.name, c.arguments) for c in parsed.message.tool_calls] == [(c.name, c.arguments) for c in message.tool_calls]
    assert r.encode_completion(parsed.message) == ids
    # <tool_call>, </tool_call>, <think>, </think> are single ids, as the model generates them
    for token in ("<tool_call>", "</tool_call>"):
        assert ids.count(qtok.convert_tokens_to_ids(token)) == len(message.tool_calls)


def test_malformed_calls_are_errors_and_calls_while_thinking_are_not_calls(r):
    text = (
        '<think>\nmaybe <tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n</think>\n\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    parsed = r.parse_completion(r.encode_text(text) + [r.im_end_id])
    assert [(c.name, c.arguments, c.id) for c in parsed.message.tool_calls] == [("add", {"a": 1, "b": 2}, "call_0")]
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("Tool call 1: invalid JSON")
    assert parsed.message.content.startswith("<think>\nmaybe <tool_call>")
    unclosed = r.parse_completion(r.encode_text("<think>\nok\n</think>\n\n<tool_call>\n{") + [r.im_end_id])
    assert unclosed.message.tool_calls == () and "never closed" in unclosed.errors[0]
    bad_ids = r.parse_completion([-1, *r.encode_text("<think>\nx\n</think>\n\nhi"), r.im_end_id])
    assert bad_ids.message.content == "<think>\nx\n</think>\n\nhi" and "outside the vocabulary" in bad_ids.errors[0]


def _trajectory(r, conversation, tools):
    positions = [i for i, m in enumerate(conversation) if m.role == "assistant"]
    turns, prompt = [], r.render_prompt(conversation[: positions[0]], tools)
    for k, a in enumerate(positions):
        completion = r.encode_completion(conversation[a])
        end = positions[k + 1] if k + 1 < len(positions) else len(conversation)
        turns.append(Turn(prompt_ids=tuple(prompt), completion_ids=tuple(completion), message=conversation[a],
                          env_messages=tuple(conversation[a + 1 : end])))
        prompt = r.continue_prompt(prompt, completion, conversation[a + 1 : end])
    return Trajectory(env="test", task_id="t", tools=tuple(tools or ()), messages=conversation, turns=tuple(turns))


@pytest.mark.parametrize("conversation,tools", CONVERSATIONS, ids=IDS)
def test_continue_prompt_is_the_template_and_splits_are_counted(r, qtok, conversation, tools):
    assert r.history_preserving is False
    trajectory = _trajectory(r, conversation, tools)
    positions = [i for i, m in enumerate(conversation) if m.role == "assistant"]
    expected_splits = 0
    for k, turn in enumerate(trajectory.turns):
        # every prompt built token by token equals the template's rendering of the conversation so far
        assert list(turn.prompt_ids) == _template_ids(qtok, conversation[: positions[k]], tools, True)
        if k:
            previous = trajectory.turns[k - 1]
            extends = list(turn.prompt_ids[: len(previous.prompt_ids) + len(previous.completion_ids)]) == list(
                previous.prompt_ids + previous.completion_ids
            )
            expected_splits += not extends
    stats = BuildStats()
    examples = r.build_examples(trajectory, stats=stats)
    assert stats.splits == expected_splits and len(examples) == expected_splits + 1
    assert stats.trained_tokens == sum(len(t.completion_ids) for t in trajectory.turns)
    # trained tokens are exactly the completions: the <think> block included
    trained = [[i for i, f in zip(ex.input_ids, ex.loss_mask) if f] for ex in examples]
    assert sum(trained, []) == [i for t in trajectory.turns for i in t.completion_ids]


def test_split_counts_per_conversation(r):
    def splits(conversation, tools):
        stats = BuildStats()
        r.build_examples(_trajectory(r, conversation, tools), stats=stats)
        return stats.splits

    # A tool loop whose turns all reason keeps history: no split until the new user query.
    assert splits(CONV_THINK[:7], TOOLS) == 0
    assert splits(CONV_THINK, TOOLS) == 1
    # Without reasoning (an expert), the empty block of every turn is dropped later: a split per turn.
    assert splits(CONV_TOOLS, TOOLS) == 3
    # A sampled block the template would write differently (one newline) is rewritten too.
    prompt = r.render_prompt(CONV_THINK[:2], TOOLS)
    odd = r.encode_text("<think>\nI add first.\n</think>\nAdding.\n") + r.encode_completion(
        Message(role="assistant", tool_calls=(_call("add", a=2, b=3),)))[-6:]
    nxt = r.continue_prompt(prompt, odd, CONV_THINK[3:4])
    assert nxt[: len(prompt) + len(odd)] != prompt + odd


def test_registry(qtok, tmp_path):
    assert type(get_renderer("qwen3", qtok)) is Qwen3Renderer
    assert renderer_name_for("/models/Qwen3-0.6B") == "qwen3"
    assert renderer_name_for("/models/Qwen2.5-0.5B-Instruct") == "hermes"
    assert renderer_name_for(str(tmp_path), qtok) == "qwen3"  # a local folder: read from its template
    assert get_renderer("qwen3", qtok).chat_template == qtok.chat_template
