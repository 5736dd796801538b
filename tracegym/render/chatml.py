"""The ChatML family: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message.

Subclasses (one per template, ``smollm2.py``, ``hermes.py`` and ``qwen3.py``) decide only how a
conversation is laid out as a list of segments (``_layout``); parsing and prompt continuation are
shared here, tokenisation and rendering in ``base.py``.

Tokenisation (``Renderer`` in ``base.py``) encodes an assistant body on its own, not merged with the
``assistant\\n`` before it, so rendering turn t+1 extends turn t's prompt plus its completion.
For the text that occurs in practice the ids equal ``tokenizer(render_text(...),
add_special_tokens=False)`` (tested). They differ in two documented cases: (1) message text that
contains a special-token string (the tokenizer would turn it into the special id; we do not), and
(2) an assistant body starting with two or more newlines (the tokenizer may merge them with the
``\\n`` after ``assistant``; we keep the split a model sampling after the generation prompt sees).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from importlib import resources
from typing import Any

from tracegym.render.base import Renderer, Segment, UntrustedToolOutput, special, text
from tracegym.render.toolcalls import parse_assistant_text, serialize_assistant, tools_json_lines
from tracegym.types import Message

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

# The tools block both templates put in the system prompt (hermes.jinja holds the same text).
TOOLS_BLOCK_HEAD = (
    "# Tools\n\n"
    "You can call the functions below. Their JSON schemas are listed inside <tools></tools> tags:\n"
    "<tools>\n"
)
TOOLS_BLOCK_TAIL = (
    "\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-json-object>}\n'
    "</tool_call>"
)


def tools_block(tools: Sequence[dict]) -> str:
    """The tools section of the system prompt: every schema as one JSON line, then the call format."""
    return TOOLS_BLOCK_HEAD + tools_json_lines(tools) + TOOLS_BLOCK_TAIL


@lru_cache(maxsize=None)
def packaged_chat_template(name: str) -> str | None:
    """The Jinja source of ``templates/<name>.jinja`` shipped with tracegym (the renderer ``name``
    written as a chat template for ``tokenizer.apply_chat_template``), or None when there is none."""
    file = resources.files("tracegym.render").joinpath(f"templates/{name}.jinja")
    return file.read_text(encoding="utf-8") if file.is_file() else None


def smollm2_chat_template() -> str:
    """The Jinja source of ``templates/smollm2.jinja``: the ``smollm2`` renderer with tools, as saved
    checkpoints carry it (SmolLM2's own template knows no tools)."""
    template = packaged_chat_template("smollm2")
    assert template is not None, "tracegym/render/templates/smollm2.jinja is missing from the install"
    return template


def group_tool_runs(messages: Sequence[Message]) -> Iterator[tuple[int, list[Message]]]:
    """``(index, turn)`` for each turn of ``messages``: a run of consecutive tool messages is one
    turn, every other message is a turn of its own; ``index`` is the position of its first message."""
    i = 0
    while i < len(messages):
        end = i + 1
        if messages[i].role == "tool":
            while end < len(messages) and messages[end].role == "tool":
                end += 1
        yield i, list(messages[i:end])
        i = end


def tool_responses(tool_messages: Sequence[Message], shown: Callable[[str], str] | None = None) -> str:
    """The content of the user turn that carries tool results: each in ``<tool_response>`` tags.
    ``shown`` maps a result's content to what the model sees (``Renderer.tool_content``)."""
    show = shown or (lambda content: content)
    return "\n".join(f"{TOOL_RESPONSE_OPEN}\n{show(m.content)}\n{TOOL_RESPONSE_CLOSE}" for m in tool_messages)


class ChatMLRenderer(Renderer):
    """Shared machinery of the ChatML templates. Subclasses implement ``_layout``."""

    name = "chatml"
    history_preserving = True
    end_of_turn = IM_END
    stop_tokens = (IM_END, END_OF_TEXT)

    def __init__(self, tokenizer: Any, *, untrusted_tool_output: UntrustedToolOutput = "none"):
        super().__init__(tokenizer, untrusted_tool_output=untrusted_tool_output)
        self._read_tokenizer(required=(IM_START, IM_END), optional=(END_OF_TEXT,))
        self.im_start_id = self._special_ids[IM_START]
        self.im_end_id = self._special_ids[IM_END]

    @property
    def chat_template(self) -> str | None:
        """This renderer as a Jinja chat template (``templates/<name>.jinja``), tools included, or
        None when tracegym ships none for it. Saved checkpoints carry it as ``chat_template.jinja``."""
        return packaged_chat_template(self.name)

    # -- layout (template-specific) -------------------------------------------------------------
    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool) -> list[Segment]:
        raise NotImplementedError

    @staticmethod
    def _message_segments(role: str, content: str) -> list[Segment]:
        """One ``<|im_start|>role\\ncontent<|im_end|>\\n`` turn."""
        return [special(IM_START), text(f"{role}\n{content}"), special(IM_END), text("\n")]

    @staticmethod
    def _assistant_segments(body: str) -> list[Segment]:
        """One assistant turn whose body (between ``assistant\\n`` and ``<|im_end|>``) is ``body``."""
        return [special(IM_START), text("assistant\n"), Segment("body", body), special(IM_END), text("\n")]

    def _generation_prompt(self) -> list[Segment]:
        return [special(IM_START), text("assistant\n")]

    # -- tool-call convention (Hermes ``<tool_call>`` blocks, ``toolcalls.py``) -----------------
    def _assistant_text(self, message: Message) -> str:
        return serialize_assistant(message)

    def _parse_assistant_text(self, value: str) -> tuple[Message, tuple[str, ...]]:
        return parse_assistant_text(value)

    # -- Renderer interface ---------------------------------------------------------------------
    def continue_prompt(
        self,
        previous_prompt: Sequence[int],
        completion_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int]:
        ids = list(previous_prompt) + list(completion_ids)
        if not completion_ids or completion_ids[-1] != self.im_end_id:
            ids.append(self.im_end_id)  # cut by max_tokens (or stopped on another token): close the turn
        segments = [text("\n")] + self._layout(new_messages, None, start=False) + self._generation_prompt()
        return ids + self._segments_to_ids(segments)
