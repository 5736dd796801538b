"""Golden tests of the token layer (tracegym/render) on the SmolLM2 tokenizer.

Properties checked for both templates ("smollm2" and "hermes"):
- the rendered text equals the template's own output (SmolLM2's template with pre-serialised tool
  parts; our hermes.jinja through ``apply_chat_template``);
- the ids equal ``tokenizer(text)`` on these conversations;
- each turn's prompt extends the previous prompt plus the canonical completion, and
  ``continue_prompt`` gives exactly ``render_prompt`` of the longer conversation;
- the masked tokens of ``build_examples`` decode to exactly the assistant turns;
- parse(encode(message)) round-trips; malformed calls are errors, never exceptions.
"""

from __future__ import annotations

import json
import random

import pytest

from tracegym.render import BuildStats, HermesRenderer, SmolLM2Renderer, get_renderer, hermes_chat_template
from tracegym.render.conformance import ADD_TOOL  # the schema the conformance suite uses too
from tracegym.render.toolcalls import to_openai_messages
from tracegym.types import Message, ToolCall, Trajectory, Turn

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the wiki (returns the top passage, «quoted»).",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
TOOLS = [ADD_TOOL, SEARCH_TOOL]


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


# Several calls in one turn, tool results, a second round of calls, a final answer.
CONV_TOOLS = (
    Message(role="system", content="Solve the task. Give the final answer as <answer>...</answer>."),
    Message(role="user", content="What is (2 + 3) + (4 + 5)? Then look up the result."),
    Message(role="assistant", content="I will add both pairs.", tool_calls=(_call("add", a=2, b=3), _call("add", a=4, b=5))),
    Message(role="tool", content="5", tool_call_id="call_0", name="add"),
    Message(role="tool", content="9", tool_call_id="call_1", name="add"),
    Message(role="assistant", content="", tool_calls=(_call("add", a=5, b=9),)),
    Message(role="tool", content="14", tool_call_id="call_0", name="add"),
    Message(role="assistant", content="", tool_calls=(_call("search", query="14 — the number, café"),)),
    Message(role="tool", content='{"title": "14", "text": "Fourteen is\nan even number."}', tool_call_id="call_0", name="search"),
    Message(role="assistant", content="The sum is 14.\n<answer>14</answer>"),
)
# No system message (SmolLM2 adds its default one); a user turn follows a tool result.
CONV_NO_SYSTEM = (
    Message(role="user", content="Add 10 and 32."),
    Message(role="assistant", content="", tool_calls=(_call("add", a=10, b=32),)),
    Message(role="tool", content="Error: the service is busy", tool_call_id="call_0", name="add"),
    Message(role="user", content="Try again, please."),
    Message(role="assistant", content="Retrying.", tool_calls=(_call("add", a=10, b=32),)),
    Message(role="tool", content="42", tool_call_id="call_0", name="add"),
    Message(role="assistant", content="<answer>42</answer>"),
)
# Plain chat, no tools.
CONV_CHAT = (
    Message(role="user", content="Hi! Say hello in French."),
    Message(role="assistant", content="Bonjour ! 👋"),
    Message(role="user", content="And in German?"),
    Message(role="assistant", content="Hallo!"),
)
CONVERSATIONS = [(CONV_TOOLS, TOOLS), (CONV_NO_SYSTEM, [ADD_TOOL]), (CONV_CHAT, None), (CONV_CHAT, [])]
IDS = ["tools", "no_system", "chat", "chat_empty_tools"]


@pytest.fixture(scope="module", params=["smollm2", "hermes"])
def renderer(request, tokenizer):
    return get_renderer(request.param, tokenizer)


def _assistant_positions(messages) -> list[int]:
    return [i for i, m in enumerate(messages) if m.role == "assistant"]


# --- the template's own output ----------------------------------------------------------------

# Written out by hand (not taken from the renderer): the tools block and call format.
HAND_TOOLS_HEAD = (
    "# Tools\n\nYou can call the functions below. Their JSON schemas are listed inside <tools></tools> tags:\n<tools>\n"
)
HAND_TOOLS_TAIL = (
    "\n</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments inside "
    '<tool_call></tool_call> tags, one block per call:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <arguments-json-object>}\n</tool_call>'
)
SMOLLM_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _hand_serialise_for_smollm2(messages, tools) -> list[dict]:
    """Tool parts pre-serialised into plain contents, independently of the renderer's code."""
    out = []
    if tools:
        tools_text = HAND_TOOLS_HEAD + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + HAND_TOOLS_TAIL
        if messages[0].role == "system":
            out.append({"role": "system", "content": messages[0].content + "\n\n" + tools_text})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": SMOLLM_DEFAULT + "\n\n" + tools_text})
    for m in messages:
        content = m.content
        if m.tool_calls:
            blocks = [
                "<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False) + "\n</tool_call>"
                for c in m.tool_calls
            ]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": m.role, "content": content})
    return out


@pytest.mark.parametrize("conversation,tools", CONVERSATIONS, ids=IDS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_text_equals_the_tokenizers_own_template(tokenizer, conversation, tools, generation_prompt):
    r = get_renderer("smollm2", tokenizer)
    for end in range(1, len(conversation) + 1):
        messages = conversation[:end]
        expected = tokenizer.apply_chat_template(
            _hand_serialise_for_smollm2(messages, tools), tokenize=False, add_generation_prompt=generation_prompt
        )
        assert r.render_text(messages, tools, add_generation_prompt=generation_prompt) == expected


@pytest.mark.parametrize("conversation,tools", CONVERSATIONS, ids=IDS)
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("arguments_as_string", [False, True])
def test_hermes_text_equals_our_jinja_template(tokenizer, conversation, tools, generation_prompt, arguments_as_string):
    r = get_renderer("hermes", tokenizer)
    for end in range(1, len(conversation) + 1):
        messages = conversation[:end]
        expected = tokenizer.apply_chat_template(
            to_openai_messages(messages, arguments_as_string=arguments_as_string),
            tools=tools or None,
            chat_template=hermes_chat_template(),
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )
        assert r.render_text(messages, tools, add_generation_prompt=generation_prompt) == expected


def test_hermes_golden_text_merges_tool_results(tokenizer):
    r = get_renderer("hermes", tokenizer)
    messages = [
        Message(role="user", content="2+3 and 4+5?"),
        Message(role="assistant", tool_calls=(_call("add", a=2, b=3), _call("add", a=4, b=5))),
        Message(role="tool", content="5"),
        Message(role="tool", content="9"),
    ]
    expected = (
        "<|im_start|>user\n2+3 and 4+5?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n9\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert r.render_text(messages) == expected


def test_smollm2_golden_text_tool_role(tokenizer):
    r = get_renderer("smollm2", tokenizer)
    messages = [Message(role="user", content="hi"), Message(role="assistant", tool_calls=(_call("f"),)), Message(role="tool", content="ok")]
    assert r.render_text(messages) == (
        f"<|im_start|>system\n{SMOLLM_DEFAULT}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
    )


# --- token ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize("conversation,tools", CONVERSATIONS, ids=IDS)
def test_ids_equal_tokenizer_of_text(renderer, tokenizer, conversation, tools):
    for end in range(1, len(conversation) + 1):
        for generation_prompt in (True, False):
            text = renderer.render_text(conversation[:end], tools, add_generation_prompt=generation_prompt)
            ids = renderer.render_ids(conversation[:end], tools, add_generation_prompt=generation_prompt)
            assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = renderer.render_prompt(conversation, tools)
    assert prompt[-3:] == [1, *tokenizer("assistant\n", add_special_tokens=False)["input_ids"]][-3:]
    assert prompt.count(1) == prompt.count(2) + 1  # every turn closed except the generation prompt


def test_special_token_text_in_content_stays_plain_text(renderer, tokenizer):
    """Documented difference: tokenizer(text) would turn a literal "<|im_end|>" in a tool result
    into the end-of-turn id (a forged turn boundary); the renderer encodes it as text."""
    messages = [
        Message(role="system", content="S"),
        Message(role="user", content="say <|im_end|> please"),
        Message(role="assistant", content="<|im_start|>x"),
    ]
    ids = renderer.render_ids(messages, add_generation_prompt=True)
    text = renderer.render_text(messages, add_generation_prompt=True)
    naive = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert naive.count(renderer.im_end_id) == ids.count(renderer.im_end_id) + 1
    assert naive.count(renderer.im_start_id) == ids.count(renderer.im_start_id) + 1
    assert ids.count(renderer.im_end_id) == 3 and ids.count(renderer.im_start_id) == 4  # system, user, assistant, gen
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_stop_token_ids(renderer, tokenizer):
    assert renderer.stop_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    assert renderer.stop_token_ids == [2, 0]


# --- prompts extend ---------------------------------------------------------------------------


@pytest.mark.parametrize("conversation,tools", CONVERSATIONS, ids=IDS)
def test_each_prompt_extends_previous_prompt_plus_completion(renderer, conversation, tools):
    positions = _assistant_positions(conversation)
    for a, b in zip(positions, positions[1:]):
        head = renderer.render_prompt(conversation[:a], tools) + renderer.encode_completion(conversation[a])
        nxt = renderer.render_prompt(conversation[:b], tools)
        assert nxt[: len(head)] == head
        # and continue_prompt builds exactly the same next prompt from tokens
        cont = renderer.continue_prompt(
            renderer.render_prompt(conversation[:a], tools), renderer.encode_completion(conversation[a]), conversation[a + 1 : b]
        )
        assert cont == nxt


def test_continue_prompt_closes_a_cut_completion(renderer):
    conversation, tools = CONV_TOOLS, TOOLS
    prompt = renderer.render_prompt(conversation[:2], tools)
    full = renderer.encode_completion(conversation[2])
    cut = full[:7]  # max_tokens hit: no end-of-turn token sampled
    after_full = renderer.continue_prompt(prompt, full, conversation[3:5])
    after_cut = renderer.continue_prompt(prompt, cut, conversation[3:5])
    tail = after_full[len(prompt) + len(full) :]
    assert after_cut == prompt + cut + [renderer.im_end_id] + tail
    assert tail[0] == 198  # the template's "\n" after <|im_end|>


def test_prompt_length_against_hand_count(tokenizer):
    r = get_renderer("smollm2", tokenizer)
    ids = r.render_prompt([Message(role="system", content="S"), Message(role="user", content="hi")])
    # <|im_start|> system \n S <|im_end|> \n <|im_start|> user \n hi <|im_end|> \n <|im_start|> assist ant \n
    vocab = tokenizer.convert_tokens_to_ids(["system", "S", "user", "hi", "Ċ"])
    assert vocab == [9690, 67, 4093, 6004, 198]
    assert ids == [1, 9690, 198, 67, 2, 198, 1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198]


# --- parse / encode ---------------------------------------------------------------------------

ROUND_TRIP_MESSAGES = [m for m in CONV_TOOLS + CONV_NO_SYSTEM + CONV_CHAT if m.role == "assistant"] + [
    Message(role="assistant", content=""),
    Message(role="assistant", content="Line one\n\nline two", tool_calls=(_call("search", query='a "quoted" <b>'),)),
    Message(role="assistant", tool_calls=(_call("nested", filters={"tags": ["x", "ü"], "n": None, "f": 1.5, "ok": True}),)),
]


@pytest.mark.parametrize("message", ROUND_TRIP_MESSAGES)
def test_parse_of_encode_round_trips(renderer, message):
    ids = renderer.encode_completion(message)
    assert ids[-1] == renderer.im_end_id and renderer.im_end_id not in ids[:-1]
    parsed = renderer.parse_completion(ids)
    assert parsed.errors == ()
    assert parsed.ended_with_eot
    assert parsed.message.role == "assistant"
    assert parsed.message.content == message.content
    assert [(c.name, c.arguments) for c in parsed.message.tool_calls] == [(c.name, c.arguments) for c in message.tool_calls]
    assert [c.id for c in parsed.message.tool_calls] == [f"call_{i}" for i in range(len(message.tool_calls))]
    assert all(c.raw.startswith("{") and c.raw.endswith("}") for c in parsed.message.tool_calls)
    # the ids a message is rendered with inside a prompt are exactly encode_completion's
    assert renderer.encode_completion(parsed.message) == ids


def _parse_text(renderer, text: str, eot: bool = True):
    ids = renderer.encode_text(text) + ([renderer.im_end_id] if eot else [])
    return renderer.parse_completion(ids)


MALFORMED = [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "invalid JSON"),
    ('<tool_call>\n["add", {"a": 1}]\n</tool_call>', "expected a JSON object, got list"),
    ('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', 'missing "name"'),
    ('<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>', '"name" must be a non-empty string'),
    ('<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', '"arguments" of \'add\' must be a JSON object, got list'),
    ('<tool_call>\n{"name": "add", "arguments": "a=1"}\n</tool_call>', "is a string that is not a JSON object"),
    ("<tool_call>\n\n</tool_call>", "the block is empty"),
    ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1', "never closed"),
    ("done </tool_call>", "without a matching <tool_call>"),
]


@pytest.mark.parametrize("text,problem", MALFORMED)
def test_malformed_calls_become_errors(renderer, text, problem):
    parsed = _parse_text(renderer, text)
    assert parsed.message.tool_calls == ()
    assert len(parsed.errors) == 1
    assert problem in parsed.errors[0]
    assert '{"name": "<tool name>", "arguments"' in parsed.errors[0]  # shows the expected format


def test_good_calls_survive_next_to_bad_ones(renderer):
    text = (
        'First.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        "<tool_call>\nnot json\n</tool_call>\n"
        '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>\nLast.'
    )
    parsed = _parse_text(renderer, text)
    assert [(c.name, c.arguments, c.id) for c in parsed.message.tool_calls] == [
        ("add", {"a": 1, "b": 2}, "call_0"),
        ("search", {"query": "x"}, "call_1"),  # arguments given as a JSON string are accepted
    ]
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("Tool call 2: invalid JSON")
    assert parsed.message.content == "First.\nLast."


def test_parse_stops_at_end_of_turn(renderer):
    ids = renderer.encode_text("Answer 1") + [renderer.im_end_id] + renderer.encode_text("garbage <tool_call>")
    parsed = renderer.parse_completion(ids)
    assert parsed.message.content == "Answer 1" and parsed.errors == () and parsed.ended_with_eot
    cut = renderer.parse_completion(renderer.encode_text("Half an ans"))
    assert cut.message.content == "Half an ans" and not cut.ended_with_eot


def test_parse_never_raises_on_random_ids(renderer, tokenizer):
    rng = random.Random(1234)
    vocab = len(tokenizer)
    tag_ids = renderer.encode_text("<tool_call>") + renderer.encode_text("</tool_call>") + renderer.encode_text('{"name": "')
    for _ in range(300):
        length = rng.randint(0, 40)
        ids = []
        for _ in range(length):
            roll = rng.random()
            if roll < 0.05:
                ids.append(rng.choice([-1, vocab, vocab + 10**6, 10**30]))
            elif roll < 0.15:
                ids.append(rng.choice([0, 1, 2]))
            elif roll < 0.45:
                ids.append(rng.choice(tag_ids))
            else:
                ids.append(rng.randrange(vocab))
        parsed = renderer.parse_completion(ids)
        assert parsed.message.role == "assistant"
        stop = next((k for k, i in enumerate(ids) if i in (0, 2)), len(ids))
        assert parsed.ended_with_eot == (stop < len(ids))
        has_bad = any(not 0 <= i < vocab for i in ids[:stop])
        assert has_bad == any("outside the vocabulary" in e for e in parsed.errors)


def test_parse_text_fuzz_and_pathological_json():
    from tracegym.render.toolcalls import parse_assistant_text

    fragments = ["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", '"add"', "[", "]",
                 "1", "null", '"{}"', "\n", " ", "x", '"', "\\"]
    rng = random.Random(7)
    for _ in range(500):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 30)))
        message, errors = parse_assistant_text(text)
        assert message.role == "assistant" and all(isinstance(e, str) for e in errors)
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    huge_int = '<tool_call>{"name": "a", "arguments": {"x": 1' + "0" * 5000 + "}}</tool_call>"
    for text in (deep, huge_int):
        message, errors = parse_assistant_text(text)
        assert message.tool_calls == () and len(errors) == 1 and "invalid JSON" in errors[0]
        assert len(errors[0]) < 1000  # the quoted snippet is shortened


def test_encode_completion_rejects_non_assistant(renderer):
    with pytest.raises(ValueError, match="assistant"):
        renderer.encode_completion(Message(role="user", content="x"))


# --- training examples ------------------------------------------------------------------------


def _trajectory(renderer, conversation, tools, logprobs=True, cut_turn: int | None = None) -> Trajectory:
    """Roll the conversation through the token path a rollout runner takes: render the first
    prompt, then continue_prompt with each turn's sampled ids (canonical encodings here)."""
    positions = _assistant_positions(conversation)
    turns = []
    prompt = renderer.render_prompt(conversation[: positions[0]], tools)
    for k, a in enumerate(positions):
        completion = renderer.encode_completion(conversation[a])
        if k == cut_turn:
            completion = completion[:5]
        lps = tuple(-0.01 * (k + 1) * (i + 1) for i in range(len(completion))) if logprobs else None
        end = positions[k + 1] if k + 1 < len(positions) else len(conversation)
        turns.append(
            Turn(
                prompt_ids=tuple(prompt),
                completion_ids=tuple(completion),
                completion_logprobs=lps,
                finish_reason="length" if k == cut_turn else "stop",
                message=conversation[a],
                env_messages=tuple(conversation[a + 1 : end]),
            )
        )
        prompt = renderer.continue_prompt(prompt, completion, conversation[a + 1 : end])
    return Trajectory(env="test", task_id="t1", tools=tuple(tools or ()), messages=conversation, turns=tuple(turns), reward=1.0)


def _masked_spans(tokenizer, example) -> list[str]:
    spans, current = [], []
    for token, flag in zip(example.input_ids, example.loss_mask):
        if flag:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current, skip_special_tokens=False))
            current = []
    if current:
        spans.append(tokenizer.decode(current, skip_special_tokens=False))
    return spans


@pytest.mark.parametrize("conversation,tools", CONVERSATIONS, ids=IDS)
def test_masked_tokens_decode_to_exactly_the_assistant_turns(renderer, tokenizer, conversation, tools):
    trajectory = _trajectory(renderer, conversation, tools)
    stats = BuildStats()
    (example,) = renderer.build_examples(trajectory, weight=0.5, advantage=2.0, stats=stats)
    # The assistant turns as the template text shows them, cut out of the full rendering by hand.
    full_text = renderer.render_text(conversation, tools, add_generation_prompt=False)
    expected = [chunk.split("<|im_end|>")[0] + "<|im_end|>" for chunk in full_text.split("<|im_start|>assistant\n")[1:]]
    assert _masked_spans(tokenizer, example) == expected
    # the whole sequence is the rendered conversation, minus the "\n" after the last <|im_end|>
    assert list(example.input_ids) == renderer.render_ids(conversation, tools, add_generation_prompt=False)[:-1]
    trained = sum(len(t.completion_ids) for t in trajectory.turns)
    assert sum(example.loss_mask) == trained
    assert stats.examples == 1 and stats.splits == 0 and stats.trained_tokens == trained and stats.total_tokens == len(example)
    for flag, w, adv, lp in zip(example.loss_mask, example.weights, example.advantages, example.logprobs):
        assert (w, adv) == ((0.5, 2.0) if flag else (0.0, 0.0))
        assert (lp < 0) if flag else lp == 0.0
    masked_lps = [lp for lp, flag in zip(example.logprobs, example.loss_mask) if flag]
    assert masked_lps == [lp for t in trajectory.turns for lp in t.completion_logprobs]
    assert example.has_logprobs and example.source == "test/t1/0#0"


def test_per_turn_advantages_and_missing_logprobs(renderer):
    trajectory = _trajectory(renderer, CONV_CHAT, None)
    turns = list(trajectory.turns)
    turns[1] = turns[1].model_copy(update={"completion_logprobs": None})
    trajectory = trajectory.model_copy(update={"turns": tuple(turns)})
    (example,) = renderer.build_examples(trajectory, advantage=[1.5, -0.5])
    masked = [(adv, lp) for adv, lp, flag in zip(example.advantages, example.logprobs, example.loss_mask) if flag]
    n0 = len(turns[0].completion_ids)
    assert [a for a, _ in masked] == [1.5] * n0 + [-0.5] * len(turns[1].completion_ids)
    assert all(lp == 0.0 for _, lp in masked[n0:])
    assert not example.has_logprobs
    with pytest.raises(ValueError, match="2 turns"):
        renderer.build_examples(trajectory, advantage=[1.0, 2.0, 3.0])


def test_logprob_count_mismatch_is_a_clear_error(renderer):
    trajectory = _trajectory(renderer, CONV_CHAT, None)
    bad = trajectory.turns[0].model_copy(update={"completion_logprobs": (-1.0,)})
    with pytest.raises(ValueError, match="turn 0: 1 logprobs for"):
        renderer.build_examples(trajectory.model_copy(update={"turns": (bad, trajectory.turns[1])}))


def test_appended_end_of_turn_is_not_trained(renderer, tokenizer):
    trajectory = _trajectory(renderer, CONV_TOOLS, TOOLS, cut_turn=1)
    (example,) = renderer.build_examples(trajectory)
    cut = trajectory.turns[1]
    assert cut.completion_ids[-1] != renderer.im_end_id
    # find where turn 1's completion ends in the sequence: its prompt length + its length
    end = len(cut.prompt_ids) + len(cut.completion_ids)
    assert list(example.input_ids[len(cut.prompt_ids) : end]) == list(cut.completion_ids)
    assert example.loss_mask[end - 1] == 1
    assert example.input_ids[end] == renderer.im_end_id and example.loss_mask[end] == 0
    assert sum(example.loss_mask) == sum(len(t.completion_ids) for t in trajectory.turns)
    assert example.loss_mask.count(1) == len([x for x in example.loss_mask if x])


def test_history_rewrite_splits_and_counts(renderer, tokenizer):
    """Turn 2's prompt rewrites turn 0's assistant text (as templates that drop old reasoning do):
    the trajectory is cut there, the cut counted, and no token is trained twice or lost."""
    trajectory = _trajectory(renderer, CONV_TOOLS, TOOLS)
    positions = _assistant_positions(CONV_TOOLS)
    rewritten = list(CONV_TOOLS)
    rewritten[positions[0]] = rewritten[positions[0]].model_copy(update={"content": ""})
    turns = list(trajectory.turns)
    turns[2] = turns[2].model_copy(update={"prompt_ids": tuple(renderer.render_prompt(rewritten[: positions[2]], TOOLS))})
    # turn 3 continues the rewritten prompt token by token, as a runner would
    next_prompt = renderer.continue_prompt(turns[2].prompt_ids, turns[2].completion_ids, turns[2].env_messages)
    turns[3] = turns[3].model_copy(update={"prompt_ids": tuple(next_prompt)})
    trajectory = trajectory.model_copy(update={"turns": tuple(turns)})
    stats = BuildStats()
    first, second = renderer.build_examples(trajectory, advantage=[1.0, 2.0, 3.0, 4.0], stats=stats)
    assert stats.splits == 1 and stats.examples == 2
    assert (first.source, second.source) == ("test/t1/0#0", "test/t1/0#1")
    assert list(first.input_ids) == list(turns[1].prompt_ids) + list(turns[1].completion_ids)
    assert list(second.input_ids[: len(turns[2].prompt_ids)]) == list(turns[2].prompt_ids)
    assert sum(second.loss_mask[: len(turns[2].prompt_ids)]) == 0
    assert _masked_spans(tokenizer, first) == [tokenizer.decode(t.completion_ids) for t in turns[:2]]
    assert _masked_spans(tokenizer, second) == [tokenizer.decode(t.completion_ids) for t in turns[2:]]
    assert {a for a, f in zip(second.advantages, second.loss_mask) if f} == {3.0, 4.0}
    assert stats.trained_tokens == sum(len(t.completion_ids) for t in turns)


def test_no_turns_no_examples(renderer):
    stats = BuildStats()
    empty = Trajectory(env="e", task_id="t", messages=(Message(role="user", content="x"),))
    assert renderer.build_examples(empty, stats=stats) == [] and stats.examples == 0


# --- registry ---------------------------------------------------------------------------------


def test_registry_names(tokenizer):
    assert type(get_renderer("smollm2-135m", tokenizer)) is SmolLM2Renderer
    assert type(get_renderer("tiny-random", tokenizer)) is SmolLM2Renderer
    assert type(get_renderer("hermes", tokenizer)) is HermesRenderer
    assert type(get_renderer("/models/Qwen2.5-0.5B-Instruct", tokenizer)) is HermesRenderer
    with pytest.raises(ValueError, match="did you mean 'hermes'"):
        get_renderer("hermse", tokenizer)


def test_registry_reads_the_template_of_a_local_folder(tokenizer, tmp_path):
    class Tok:  # a tokenizer of an unknown ChatML model whose template knows tools
        chat_template = "{{ '<|im_start|>' }}...<tool_call>"

        def __call__(self, text, add_special_tokens=False):
            return tokenizer(text, add_special_tokens=add_special_tokens)

    from tracegym.render import renderer_name_for

    assert renderer_name_for(str(tmp_path), Tok()) == "hermes"
    Tok.chat_template = tokenizer.chat_template
    assert renderer_name_for(str(tmp_path), Tok()) == "smollm2"
    with pytest.raises(ValueError, match="no renderer"):
        renderer_name_for(str(tmp_path / "missing"), Tok())


def test_renderer_needs_chatml_tokens():
    class NoChatML:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    with pytest.raises(ValueError, match="<\\|im_start\\|> as one token"):
        SmolLM2Renderer(NoChatML())
