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
