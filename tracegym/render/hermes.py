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

from tracegym.render.base import Segment, split_system_message
from tracegym.render.chatml import ChatMLRenderer, group_tool_runs, packaged_chat_template, tool_responses, tools_block
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
            system, rest = split_system_message(rest, self.with_untrusted_notice(tools_block(tools)) if tools else None)
            if system is not None:
                segments += self._message_segments("system", system)
        for _, turn in group_tool_runs(rest):
            message = turn[0]
            if message.role == "tool":
                segments += self._message_segments(self.tool_role("user"), tool_responses(turn, self.tool_content))
            elif message.role == "assistant":
                segments += self._assistant_segments(self._assistant_text(message))
            else:
                segments += self._message_segments(message.role, message.content)
        return segments
