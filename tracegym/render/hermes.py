"""ChatML with tools in the Hermes/Qwen2.5 convention, as a Python renderer and a Jinja template.

- The tools block (schemas inside ``<tools></tools>`` and the call format) ends the system message;
  with tools and no system message, the system message is the tools block alone. Without tools and
  without a system message, no system turn is written.
- Assistant tool calls are ``<tool_call>`` blocks after the content.
- Tool results become user turns: each wrapped in ``<tool_response>`` ... ``</tool_response>``, and a
  run of consecutive tool messages shares one user turn.

``templates/hermes.jinja`` is the same template for ``tokenizer.apply_chat_template`` (and for
engines that render text themselves); the golden tests check the two against each other.
"""

from __future__ import annotations

from collections.abc import Sequence

from tracegym.render.chatml import (
    IM_END,
    IM_START,
    ChatMLRenderer,
    Segment,
    packaged_chat_template,
    special,
    text,
    tools_block,
)
from tracegym.types import Message


def hermes_chat_template() -> str:
    """The Jinja source of ``templates/hermes.jinja``."""
    template = packaged_chat_template("hermes")
    assert template is not None, "tracegym/render/templates/hermes.jinja is missing from the install"
    return template


class HermesRenderer(ChatMLRenderer):
    """ChatML + Hermes tool convention (Qwen2.5 style); tool results as ``<tool_response>`` user turns."""

    name = "hermes"

    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool) -> list[Segment]:
        segments: list[Segment] = []
        rest = list(messages)
        if start:
            has_system = bool(rest) and rest[0].role == "system"
            if tools:
                prefix = f"{rest[0].content}\n\n" if has_system else ""
                segments += self._message_segments("system", prefix + tools_block(tools))
            elif has_system:
                segments += self._message_segments("system", rest[0].content)
            if has_system:
                rest = rest[1:]
        i = 0
        while i < len(rest):
            message = rest[i]
            if message.role == "tool":
                responses: list[str] = []
                while i < len(rest) and rest[i].role == "tool":
                    responses.append(f"\n<tool_response>\n{rest[i].content}\n</tool_response>")
                    i += 1
                segments += [special(IM_START), text("user" + "".join(responses)), special(IM_END), text("\n")]
                continue
            if message.role == "assistant":
                segments += self._assistant_segments(message)
            else:
                segments += self._message_segments(message.role, message.content)
            i += 1
        return segments
