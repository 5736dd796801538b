"""What the conformance suite (tests/test_renderers_check.py) does not spell out for the two families
added with it, on their real tokenizers and templates (tests/fetch_tokenizers.py):

- ``gemma3``: the system text opens the first user turn untrimmed, tool results share one user turn,
  malformed calls are errors;
- ``llama3.1`` (Meta's template): the template's wording is read from it, a tool result is a JSON
  string, a call drops its text (``canonical_message``), a sampled text before the call is parsed,
  and a folder holding Meta's template gets this renderer whatever its name.
"""

from __future__ import annotations

import pytest
from fetch_tokenizers import folder_for_test
from transformers import AutoTokenizer

from tracegym.render import Gemma3Renderer, Llama31Renderer, get_renderer, renderer_name_for
from tracegym.render.conformance import ADD_TOOL
from tracegym.types import Message, ToolCall

CALL = ToolCall(name="add", arguments={"a": 2, "b": 3})


@pytest.fixture(scope="module")
def gemma() -> Gemma3Renderer:
    return get_renderer("gemma3", AutoTokenizer.from_pretrained(str(folder_for_test("gemma3"))))


@pytest.fixture(scope="module")
def meta() -> Llama31Renderer:
    return get_renderer("llama3.1", AutoTokenizer.from_pretrained(str(folder_for_test("llama3_1"))))


def test_gemma3_layout(gemma):
    messages = [Message(role="system", content="Be brief. "), Message(role="user", content=" 2+3? "),
                Message(role="assistant", content="Adding.", tool_calls=(CALL,)),
                Message(role="tool", content="5"), Message(role="tool", content="6")]
    text = gemma.render_text(messages)
    assert text.startswith("<bos><start_of_turn>user\nBe brief. \n\n2+3?<end_of_turn>\n<start_of_turn>model\nAdding.\n<tool_call>")
    assert text.endswith("<start_of_turn>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response>"
                         "<end_of_turn>\n<start_of_turn>model\n")
    # a system message alone: the template writes no turn for it
    only_system = gemma.tokenizer.apply_chat_template([{"role": "system", "content": "S"}], tokenize=False, add_generation_prompt=True)
    assert gemma.render_text(messages[:1]) == only_system == "<bos><start_of_turn>model\n"


def test_gemma3_malformed_calls_are_errors(gemma):
    parsed = gemma.parse_completion(gemma.encode_text('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>')
                                    + [gemma._special_ids["<end_of_turn>"]])
    assert parsed.message.tool_calls == () and parsed.errors[0].startswith("Tool call 1: invalid JSON")


def test_llama31_layout_and_parsing(meta):
    messages = [Message(role="user", content="2+3?"), Message(role="assistant", content="Let me add.", tool_calls=(CALL,)),
                Message(role="tool", content="5")]
    text = meta.render_text(messages, [ADD_TOOL])
    assert "Environment: ipython\n" in text and text.count('"name": "add"') == 2  # the schema and the call
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>' in text
    assert text.endswith('<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n')
    assert meta.canonical_message(messages[1]).content == "" and meta.canonical_message(messages[1]).tool_calls == (CALL,)
    sampled = meta.parse_completion(meta.encode_text('Let me add.\n{"name": "add", "parameters": {"a": 2, "b": 3}}') + [meta.eot_id])
    assert sampled.errors == () and sampled.message.content == "Let me add." and sampled.message.tool_calls[0].arguments == {"a": 2, "b": 3}


def test_llama31_is_picked_for_metas_template_and_refuses_another(meta, tmp_path):
    meta.tokenizer.save_pretrained(str(tmp_path / "some-model"))
    assert renderer_name_for(str(tmp_path / "some-model"), meta.tokenizer) == "llama3.1"
    with pytest.raises(ValueError, match="needs Meta's Llama 3.1 chat template"):
        Llama31Renderer(AutoTokenizer.from_pretrained(str(folder_for_test("llama3"))))
