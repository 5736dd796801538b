"""Llama 3.1 with Meta's own chat template and its JSON tool calls ("custom tools", tools in the first
user message, the template's default).

Layout (golden test against Meta's template, fixture ``llama3_1`` of tests/fetch_tokenizers.py):

- ``<|begin_of_text|>``, then always a system turn: the template's header lines (an
  ``Environment: ipython`` line when there are tools, the knowledge and today dates) and the system
  message, trimmed.
- With tools, the first user turn starts with the template's instructions and every schema as JSON
  indented by 4, each followed by a blank line; then the user's own text, trimmed.
- An assistant tool call is the line ``{"name": "NAME", "parameters": {...}}`` alone: the template
  drops the text of a message that calls a tool, and takes one call per message (more is an error
  there; tracegym writes one line per call, which the template cannot show).
- A tool result is an ``ipython`` turn holding the result as a JSON string (``"5"``, quoted): a text
  is iterable in Jinja, so the template's ``tojson`` branch takes it.

The wording (the header lines and the tool instructions) is read from the tokenizer's own template
once, by rendering it with placeholders; nothing of it is written in tracegym. A tokenizer whose
template does not render that way is refused with a one-line error.

History: every turn is written the same way later, so a prompt extends the previous prompt and the
completion the model was trained to write (``encode_completion``: the call line, or the trimmed
text). A sampled completion with text before its call keeps that text in ``continue_prompt``
(token-in, token-out) where the template would drop it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tracegym.render.base import Segment, UntrustedToolOutput, special, text
from tracegym.render.llama3 import BEGIN_OF_TEXT, EOT, END_HEADER, START_HEADER, Llama3Renderer
from tracegym.types import Message, ToolCall

_SYSTEM = "\x00tracegym-system\x00"
_USER = "\x00tracegym-user\x00"
_TOOL = {"type": "function", "function": {"name": "tracegym_placeholder"}}


def _header(role: str) -> str:
    return f"{START_HEADER}{role}{END_HEADER}\n\n"


def _between(value: str, before: str, after: str) -> str:
    if not (value.startswith(before) and value.endswith(after)):
        raise ValueError("unexpected layout")
    return value[len(before) : len(value) - len(after)]


def meta_wording(tokenizer: Any) -> tuple[str, str, str]:
    """``(system header, system header with tools, tool instructions)`` of Meta's Llama 3.1 template,
    read by rendering the tokenizer's template with placeholders. ValueError when it is not that template."""
    try:
        render = tokenizer.apply_chat_template
        system = {"role": "system", "content": _SYSTEM}
        user = {"role": "user", "content": _USER}
        plain = render([system, user], tokenize=False)
        with_tools = render([system, user], tools=[_TOOL], tokenize=False)
        opening, user_turn = BEGIN_OF_TEXT + _header("system"), f"{EOT}{_header('user')}"
        head = _between(plain, opening, f"{_SYSTEM}{user_turn}{_USER}{EOT}")
        tools_head, rest = _between(with_tools, opening, f"{_USER}{EOT}").split(f"{_SYSTEM}{user_turn}")
        instructions = _between(rest, "", json.dumps(_TOOL, indent=4) + "\n\n")
    except Exception as exc:  # noqa: BLE001 - any other template: one clear error
        raise ValueError("renderer 'llama3.1' needs Meta's Llama 3.1 chat template (custom tools in the first user "
                         f"message); this tokenizer's template does not render that way ({exc})") from exc
    return head, tools_head, instructions


def call_line(call: ToolCall) -> str:
    """One call as Meta's template writes it (the name as it is, the parameters through ``tojson``)."""
    return f'{{"name": "{call.name}", "parameters": {json.dumps(call.arguments, ensure_ascii=False)}}}'


class Llama31Renderer(Llama3Renderer):
    """Meta's Llama 3.1 template: JSON tool calls, tools in the first user message, ``ipython`` results."""

    name = "llama3.1"

    def __init__(self, tokenizer: Any, *, untrusted_tool_output: UntrustedToolOutput = "none"):
        super().__init__(tokenizer, untrusted_tool_output=untrusted_tool_output)
        self._system_head, self._system_head_tools, self._tool_instructions = meta_wording(tokenizer)

    @property
    def chat_template(self) -> str:  # type: ignore[override]
        """Meta's template itself (the tokenizer's): it knows tools."""
        return str(self.tokenizer.chat_template)

    def _tools_preamble(self, tools: Sequence[dict]) -> str:
        schemas = "".join(json.dumps(tool, indent=4, ensure_ascii=False) + "\n\n" for tool in tools)
        return self.with_untrusted_notice(self._tool_instructions + schemas)

    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool) -> list[Segment]:
        segments: list[Segment] = []
        rest = list(messages)
        if start:
            own = rest.pop(0).content.strip() if rest and rest[0].role == "system" else ""
            head = self._system_head_tools if tools else self._system_head
            segments += [special(BEGIN_OF_TEXT)] + self._raw_turn("system", head + own)
            if tools and rest:  # the template puts the tools into the first message after the system
                first = rest.pop(0)
                segments += self._raw_turn(first.role, self._tools_preamble(tools) + first.content.strip())
        for message in rest:
            if message.role == "assistant":
                segments += self._generation_prompt() + [Segment("body", self._assistant_text(message)), special(EOT)]
            elif message.role == "tool":
                content = json.dumps(self.tool_content(message.content), ensure_ascii=False)
                segments += self._raw_turn(self.tool_role("ipython"), content)
            else:
                segments += self._turn(message.role, message.content)
        return segments

    @staticmethod
    def _raw_turn(role: str, content: str) -> list[Segment]:
        """One header turn with ``content`` as given (``_turn`` trims it)."""
        return [special(START_HEADER), text(role), special(END_HEADER), text(f"\n\n{content}"), special(EOT)]

    def _assistant_text(self, message: Message) -> str:
        if message.tool_calls:
            return "\n".join(call_line(call) for call in message.tool_calls)
        return message.content.strip()

    def canonical_message(self, message: Message) -> Message:
        """A message that calls tools loses its text, as the template writes it."""
        return message.model_copy(update={"content": ""}) if message.tool_calls else message

    def inline_tool_messages(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[dict[str, Any]]:
        raise ValueError("renderer 'llama3.1' is checked against a template that renders tools (Meta's own)")
