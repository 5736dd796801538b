"""SmolLM2's own chat template (plain ChatML), extended with tools the Hermes way.

The template shipped with SmolLM2-135M-Instruct renders every message as
``<|im_start|>role\\ncontent<|im_end|>\\n`` and adds a default system message when the first message
is not a system message. It knows nothing of tools, so this renderer puts the tools block at the end
of the system message text, serialises tool calls into the assistant text (``<tool_call>`` blocks)
and renders tool results as messages with role ``tool``. With those parts pre-serialised into the
message contents, the text equals the tokenizer's own template output (golden test).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tracegym.render.base import Segment
from tracegym.render.chatml import ChatMLRenderer, tools_block
from tracegym.types import Message

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class SmolLM2Renderer(ChatMLRenderer):
    """ChatML as SmolLM2's template writes it; tools in the system prompt, tool results as role ``tool``."""

    name = "smollm2"

    def system_text(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> str | None:
        """The system message text the template will show (tools block included), or None when the
        conversation's own first message is a system message rendered unchanged."""
        has_system = bool(messages) and messages[0].role == "system"
        if not tools:
            # The template adds its default inside the message loop, so an empty conversation
            # gets none.
            return None if has_system or not messages else DEFAULT_SYSTEM_PROMPT
        base = messages[0].content if has_system else DEFAULT_SYSTEM_PROMPT
        return f"{base}\n\n{self.with_untrusted_notice(tools_block(tools))}"

    def inline_tool_messages(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[dict[str, Any]]:
        """For SmolLM2's own template (no tools): the tools block in the system message, calls as
        ``<tool_call>`` blocks in the assistant text, results as ``tool`` messages."""
        out: list[dict[str, Any]] = []
        rest = list(messages)
        if tools:  # without tools the template writes the system message (or its default) itself
            out.append({"role": "system", "content": self.system_text(messages, tools)})
            rest = rest[1:] if rest and rest[0].role == "system" else rest
        for message in rest:
            out.append(self._plain_message(message))
        return out

    def _plain_message(self, message: Message) -> dict[str, Any]:
        """One message with its tool parts written as text (``inline_tool_messages``)."""
        if message.role == "assistant":
            return {"role": "assistant", "content": self._assistant_text(message)}
        if message.role == "tool":
            return {"role": self.tool_role("tool"), "content": self.tool_content(message.content)}
        return {"role": message.role, "content": message.content}

    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool) -> list[Segment]:
        segments: list[Segment] = []
        rest = list(messages)
        if start:
            system = self.system_text(messages, tools)
            if system is not None:
                segments += self._message_segments("system", system)
                if rest and rest[0].role == "system":
                    rest = rest[1:]
        for message in rest:
            if message.role == "assistant":
                segments += self._assistant_segments(self._assistant_text(message))
            elif message.role == "tool":
                segments += self._message_segments(self.tool_role("tool"), self.tool_content(message.content))
            else:
                segments += self._message_segments(message.role, message.content)
        return segments
