"""Qwen3: ChatML with Hermes-style tool calls and ``<think>`` reasoning blocks, as Qwen3's own chat
template writes them.

Layout (what the template renders; the golden tests compare ids with ``apply_chat_template``):

- Tools: the schemas, one JSON object per line inside ``<tools></tools>``, end the system message
  (with tools and no system message, the system message is the tools block alone). The wording
  around the schemas is read from the tokenizer's own template at construction (rendered once with
  a placeholder system message and tool), so none of it is written here; a tokenizer whose template
  cannot render tools gets tracegym's own Hermes wording (``chatml.tools_block``).
- A tool call is ``<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`` after the
  content; tool results are user turns with each result in ``<tool_response>`` tags, a run of
  results sharing one turn.
- Reasoning lives in the assistant content as a leading ``<think>\\nREASONING\\n</think>\\n\\n``
  block (``Message`` has no separate field for it). The template keeps a turn's block in later
  prompts only when the turn comes after the last real user query (a user turn that is not just
  tool responses) and its reasoning is not empty; every other block is dropped from history, and
  the final assistant turn of a rendered conversation always gets a block (an empty one when it
  has no reasoning).

Consequences for the token layer:

- ``encode_completion`` gives what a thinking model generates: the ``<think>`` block (empty when the
  message has none) and the answer. All of it is trained (mask 1).
- ``history_preserving`` is False. ``continue_prompt`` keeps every earlier turn token-exact where the
  template shows it unchanged, and where the template drops a block (a new user query came, or the
  reasoning was empty) it writes that turn the way the template does. Such a prompt no longer
  extends the previous one, so ``build_examples`` starts a new example there and counts it in
  ``BuildStats.splits``. In a tool loop with non-empty reasoning nothing is dropped (no split); an
  expert without reasoning splits at every turn, as Qwen3's template trains it.
- ``enable_thinking=False`` puts the empty block ``<think>\\n\\n</think>\\n\\n`` into the generation
  prompt (mask 0); the model generates only the answer. The template drops that block from history,
  so every later turn splits as well.
- ``parse_completion`` reads tool calls only after ``</think>``; an empty block is left out of the
  parsed content, a non-empty one is kept in canonical form.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tracegym.render.base import Segment, UntrustedToolOutput, special, split_system_message, text
from tracegym.render.chatml import (
    IM_END,
    IM_START,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    ChatMLRenderer,
    group_tool_runs,
    tool_responses,
    tools_block,
)
from tracegym.render.toolcalls import tools_json_lines
from tracegym.types import Message, ParsedCompletion, ToolCall

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
EMPTY_THINK = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"


def split_reasoning(content: str) -> tuple[str, str] | None:
    """``(reasoning, answer)`` the way Qwen3's template splits an assistant content at its last
    ``</think>``, or None when there is no ``</think>``."""
    if THINK_CLOSE not in content:
        return None
    reasoning = content.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
    answer = content.split(THINK_CLOSE)[-1].lstrip("\n")
    return reasoning, answer


def think_block(reasoning: str) -> str:
    """The block as the template writes it (followed by the answer)."""
    return f"{THINK_OPEN}\n{reasoning.strip(chr(10))}\n{THINK_CLOSE}\n\n"


def with_reasoning(reasoning: str, answer: str) -> str:
    """Canonical assistant content holding ``reasoning``: ``<think>\\nR\\n</think>\\n\\nANSWER``
    (no trailing blank line when the answer is empty); just ``answer`` when there is no reasoning."""
    reasoning = reasoning.strip("\n")
    if not reasoning.strip():
        return answer
    block = think_block(reasoning)
    return block + answer if answer else block.rstrip("\n")


def _is_query(message: Message) -> bool:
    content = message.content
    return message.role == "user" and not (
        content.startswith(TOOL_RESPONSE_OPEN) and content.endswith(TOOL_RESPONSE_CLOSE)
    )


def _qwen3_call_block(call: ToolCall) -> str:
    # The template writes the name between quotes as it is and the arguments through ``tojson``
    # (json.dumps with ensure_ascii=False and default separators).
    return (
        f'<tool_call>\n{{"name": "{call.name}", "arguments": '
        f"{json.dumps(call.arguments, ensure_ascii=False)}}}\n</tool_call>"
    )


def _calls_after(answer: str, calls: Sequence[ToolCall]) -> str:
    parts = [answer] if answer else []
    parts.extend(_qwen3_call_block(call) for call in calls)
    return "\n".join(parts)


_PLACEHOLDER_SYSTEM = "\x00tracegym-system\x00"
_PLACEHOLDER_TOOL = {"type": "function", "function": {"name": "tracegym_placeholder"}}


def tools_wording_from_template(tokenizer: Any) -> tuple[str, str] | None:
    """``(head, tail)`` around the schema lines in the system message of the tokenizer's own
    template, found by rendering it once with placeholders; None when it cannot render tools
    that way (no template, a template without tools, another layout)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return None
    tool_line = tools_json_lines([_PLACEHOLDER_TOOL])
    try:
        with_system = tokenizer.apply_chat_template(
            [{"role": "system", "content": _PLACEHOLDER_SYSTEM}, {"role": "user", "content": "u"}],
            tools=[_PLACEHOLDER_TOOL],
            tokenize=False,
            add_generation_prompt=False,
        )
        without_system = tokenizer.apply_chat_template(
            [{"role": "user", "content": "u"}], tools=[_PLACEHOLDER_TOOL], tokenize=False, add_generation_prompt=False
        )
    except Exception:  # noqa: BLE001 - any template failure means: use our own wording
        return None
    opening = f"{IM_START}system\n"
    prefix = f"{opening}{_PLACEHOLDER_SYSTEM}\n\n"
    closing = f"{IM_END}\n{IM_START}user\nu{IM_END}\n"
    if not (with_system.startswith(prefix) and with_system.endswith(closing)):
        return None
    block = with_system[len(prefix) : -len(closing)]
    if without_system != f"{opening}{block}{closing}" or block.count(tool_line) != 1:
        return None
    head, tail = block.split(tool_line)
    return head, tail


class Qwen3Renderer(ChatMLRenderer):
    """Qwen3's chat template: Hermes tool calls, ``<tool_response>`` user turns, ``<think>`` blocks."""

    name = "qwen3"
    history_preserving = False
    reasoning = True

    def __init__(
        self, tokenizer: Any, enable_thinking: bool = True, *, untrusted_tool_output: UntrustedToolOutput = "none"
    ):
        super().__init__(tokenizer, untrusted_tool_output=untrusted_tool_output)
        self.enable_thinking = enable_thinking
        self._tools_wording = tools_wording_from_template(tokenizer)
        self._assistant_header_ids = self.encode_text("assistant\n")

    @property
    def chat_template(self) -> str | None:
        """Qwen3's own template (the tokenizer's): it already knows tools and reasoning."""
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    # -- layout ----------------------------------------------------------------------------------
    def _tools_block(self, tools: Sequence[dict]) -> str:
        if self._tools_wording is None:
            return tools_block(tools)
        head, tail = self._tools_wording
        return head + tools_json_lines(tools) + tail

    def _generation_prompt(self) -> list[Segment]:
        segments = [special(IM_START), text("assistant\n")]
        if not self.enable_thinking:
            segments.append(Segment("body", EMPTY_THINK))
        return segments

    @staticmethod
    def assistant_body(message: Message, keep_reasoning: bool, last: bool) -> str:
        """The text the template writes between ``assistant\\n`` and ``<|im_end|>``. ``keep_reasoning``:
        the turn comes after the last user query; ``last``: it is the conversation's final message."""
        parts = split_reasoning(message.content)
        reasoning, answer = parts if parts is not None else ("", message.content)
        if keep_reasoning and (last or reasoning):
            return think_block(reasoning) + _calls_after(answer.lstrip("\n"), message.tool_calls)
        return _calls_after(answer, message.tool_calls)

    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool) -> list[Segment]:
        segments: list[Segment] = []
        rest = list(messages)
        last_query = None  # continuing: earlier queries are not in view; see continue_prompt
        if start:
            tools_text = self.with_untrusted_notice(self._tools_block(tools)) if tools else None
            system, rest = split_system_message(rest, tools_text)
            if system is not None:
                segments += self._message_segments("system", system)
            # The template's last real user query (messages after it keep their reasoning).
            last_query = next((i for i in range(len(rest) - 1, -1, -1) if _is_query(rest[i])), None)
        for i, turn in group_tool_runs(rest):
            message = turn[0]
            if message.role == "tool":
                segments += self._message_segments(self.tool_role("user"), tool_responses(turn, self.tool_content))
            elif message.role == "assistant":
                keep = start and (i > last_query if last_query is not None else False)
                body = self.assistant_body(message, keep_reasoning=keep, last=start and i == len(rest) - 1)
                segments += self._assistant_segments(body)
            else:
                segments += self._message_segments(message.role, message.content)
        return segments

    # -- tokens ----------------------------------------------------------------------------------
    def encode_completion(self, message: Message) -> list[int]:
        """What the model generates after the generation prompt: with thinking on, the ``<think>``
        block (empty when the message has no reasoning) and the answer, as the template writes a
        final turn; with thinking off, the answer alone (the empty block is in the prompt)."""
        if message.role != "assistant":
            raise ValueError(f"encode_completion takes an assistant message, got role {message.role!r}")
        if self.enable_thinking:
            body = self.assistant_body(message, keep_reasoning=True, last=True)
        else:
            parts = split_reasoning(message.content)
            if parts is not None and parts[0].strip():
                raise ValueError("enable_thinking=False: this assistant message has a non-empty <think> block")
            body = self.assistant_body(message, keep_reasoning=False, last=False)
        return self.encode_text(body) + [self.im_end_id]

    def parse_completion(self, completion_ids: Sequence[int]) -> ParsedCompletion:
        decoded = self.decode_until_stop(completion_ids)  # stops, bad ids, decoding
        parts = split_reasoning(decoded.text)
        if parts is None:
            return self._parsed(decoded, decoded.text)
        reasoning, answer = parts
        # Calls are read from the answer only: a <tool_call> written while thinking is not a call.
        parsed = self._parsed(decoded, answer)
        content = with_reasoning(reasoning, parsed.message.content)
        return parsed.model_copy(update={"message": parsed.message.model_copy(update={"content": content})})

    # -- history ---------------------------------------------------------------------------------
    def _assistant_spans(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """``(start, end)`` of every assistant body in ``ids`` (after ``assistant\\n``, up to the
        ``<|im_end|>`` that closes it)."""
        spans = []
        header = self._assistant_header_ids
        n = len(header)
        for k, token in enumerate(ids):
            if token == self.im_start_id and list(ids[k + 1 : k + 1 + n]) == header:
                start = k + 1 + n
                end = next((j for j in range(start, len(ids)) if ids[j] == self.im_end_id), len(ids))
                spans.append((start, end))
        return spans

    def _last_query_end(self, ids: Sequence[int]) -> int:
        """Position just after the last user turn in ``ids`` that is a real query (-1: none)."""
        header = self.encode_text("user")
        n = len(header)
        found = -1
        for k, token in enumerate(ids):
            if token == self.im_start_id and list(ids[k + 1 : k + 1 + n]) == header:
                end = next((j for j in range(k + 1, len(ids)) if ids[j] == self.im_end_id), len(ids))
                turn = self.tokenizer.decode(list(ids[k + 1 : end]), skip_special_tokens=False)
                if turn.startswith("user\n") and _is_query(Message(role="user", content=turn[len("user\n") :])):
                    found = end
        return found

    def continue_prompt(
        self,
        previous_prompt: Sequence[int],
        completion_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int]:
        """The next prompt as the template shows it. Earlier turns stay token-exact where the template
        writes them unchanged; a turn whose ``<think>`` block the template drops is written without
        it (then the prompt does not extend the previous one: ``build_examples`` counts a split)."""
        extended = super().continue_prompt(previous_prompt, completion_ids, new_messages)
        history = len(previous_prompt) + len(completion_ids)
        if not completion_ids or completion_ids[-1] != self.im_end_id:
            history += 1
        head, tail = extended[:history], extended[history:]
        new_query = any(_is_query(m) for m in new_messages)
        last_query_end = len(head) if new_query else self._last_query_end(head)
        out: list[int] = []
        pos = 0
        for start, end in self._assistant_spans(head):
            body_ids = head[start:end]
            body = self.tokenizer.decode(body_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            parts = split_reasoning(body)
            if parts is None:
                continue
            reasoning, answer = parts
            keep = start > last_query_end and bool(reasoning)
            shown = think_block(reasoning) + answer if keep else answer
            if shown != body:
                out += head[pos:start] + self.encode_text(shown)
                pos = end
        return out + head[pos:] + tail
