"""The ChatML family: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message.

Subclasses (one per template, ``smollm2.py`` and ``hermes.py``) decide only how a conversation is
laid out as a list of segments (``_layout``); tokenisation, parsing, prompt continuation and
training examples are shared here.

Tokenisation. A prompt is a list of segments: special tokens, plain text, and assistant bodies.
Special tokens become their single ids. Text between two special tokens is encoded in one piece,
with special-token strings inside it encoded as ordinary text (so a user or a tool result that
writes ``<|im_end|>`` cannot forge a turn boundary). An assistant body is encoded on its own
(``encode_completion``), not merged with the ``assistant\\n`` before it, so a prompt rendered from
scratch contains exactly the ids of every earlier turn's canonical completion, and rendering turn
t+1 extends turn t's prompt plus its completion.

For the text that occurs in practice this equals ``tokenizer(render_text(...),
add_special_tokens=False)`` (tested). It differs in two documented cases: (1) message text that
contains a special-token string (the tokenizer would turn it into the special id; we do not), and
(2) an assistant body starting with two or more newlines (the tokenizer may merge them with the
``\\n`` after ``assistant``; we keep the split a model sampling after the generation prompt sees).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Literal

from tracegym.render.base import Renderer
from tracegym.render.toolcalls import parse_assistant_text, serialize_assistant, tools_json_lines
from tracegym.types import Message, ParsedCompletion

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"

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


SegmentKind = Literal["special", "text", "body"]


@dataclass(frozen=True)
class Segment:
    """One piece of a rendered conversation: a special token, plain text, or an assistant body."""

    kind: SegmentKind
    text: str


def special(token: str) -> Segment:
    return Segment("special", token)


def text(value: str) -> Segment:
    return Segment("text", value)


class ChatMLRenderer(Renderer):
    """Shared machinery of the ChatML templates. Subclasses implement ``_layout``."""

    name = "chatml"
    history_preserving = True

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self._special_ids: dict[str, int] = {}
        for token in (IM_START, IM_END):
            token_id = self._single_token_id(token)
            if token_id is None:
                raise ValueError(
                    f"renderer {self.name!r} needs a tokenizer with {token} as one token; "
                    f"{type(tokenizer).__name__} does not have it (pick another renderer)"
                )
            self._special_ids[token] = token_id
        eot = self._single_token_id(END_OF_TEXT)
        if eot is not None:
            self._special_ids[END_OF_TEXT] = eot
        self.im_start_id = self._special_ids[IM_START]
        self.im_end_id = self._special_ids[IM_END]
        # Strings the tokenizer would turn into one added token; text containing one is encoded
        # with special-token matching switched off.
        self._added_token_strings = tuple(getattr(tokenizer, "get_added_vocab", dict)().keys())
        self._vocab_size = len(tokenizer)

    def _single_token_id(self, token: str) -> int | None:
        ids = self.tokenizer(token, add_special_tokens=False)["input_ids"]
        return ids[0] if len(ids) == 1 else None

    @property
    def chat_template(self) -> str | None:
        """This renderer as a Jinja chat template (``templates/<name>.jinja``), tools included, or
        None when tracegym ships none for it. Saved checkpoints carry it as ``chat_template.jinja``."""
        return packaged_chat_template(self.name)

    # -- layout (template-specific) -------------------------------------------------------------
    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool) -> list[Segment]:
        """Segments of ``messages``. ``start``: they open the conversation (the system prompt,
        tools block and default system message belong here); otherwise they continue it after an
        assistant turn (``continue_prompt``). No generation prompt."""
        raise NotImplementedError

    @staticmethod
    def _message_segments(role: str, content: str) -> list[Segment]:
        return [special(IM_START), text(f"{role}\n{content}"), special(IM_END), text("\n")]

    @staticmethod
    def _assistant_segments(message: Message) -> list[Segment]:
        return [
            special(IM_START),
            text("assistant\n"),
            Segment("body", serialize_assistant(message)),
            special(IM_END),
            text("\n"),
        ]

    @staticmethod
    def _generation_prompt() -> list[Segment]:
        return [special(IM_START), text("assistant\n")]

    # -- tokenisation ---------------------------------------------------------------------------
    def encode_text(self, value: str) -> list[int]:
        """Plain text -> ids, special-token strings encoded as ordinary text, no BOS/EOS."""
        if not value:
            return []
        # Only text that holds an added-token string takes the split path: the flag is stored on the
        # shared backend tokenizer for the duration of the call (restored by the next plain call).
        split = any(token in value for token in self._added_token_strings)
        kwargs = {"split_special_tokens": True} if split else {}
        return list(self.tokenizer(value, add_special_tokens=False, **kwargs)["input_ids"])

    def _segments_to_text(self, segments: Sequence[Segment]) -> str:
        return "".join(segment.text for segment in segments)

    def _segments_to_ids(self, segments: Sequence[Segment]) -> list[int]:
        ids: list[int] = []
        pending: list[str] = []  # adjacent text segments, encoded together
        for segment in segments:
            if segment.kind == "text":
                pending.append(segment.text)
                continue
            ids.extend(self.encode_text("".join(pending)))
            pending = []
            if segment.kind == "special":
                ids.append(self._special_ids[segment.text])
            else:  # assistant body: its own piece, exactly as encode_completion gives it
                ids.extend(self.encode_text(segment.text))
        ids.extend(self.encode_text("".join(pending)))
        return ids

    def _conversation(
        self, messages: Sequence[Message], tools: Sequence[dict] | None, add_generation_prompt: bool
    ) -> list[Segment]:
        """The segments of a whole conversation, with the generation prompt when asked for."""
        segments = self._layout(messages, tools, start=True)
        if add_generation_prompt:
            segments += self._generation_prompt()
        return segments

    # -- Renderer interface ---------------------------------------------------------------------
    def render_text(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return self._segments_to_text(self._conversation(messages, tools, add_generation_prompt))

    def render_ids(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``render_text`` (same arguments); ``render_prompt`` is the generation-prompt case."""
        return self._segments_to_ids(self._conversation(messages, tools, add_generation_prompt))

    def render_prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        return self.render_ids(messages, tools, add_generation_prompt=True)

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

    def encode_completion(self, message: Message) -> list[int]:
        if message.role != "assistant":
            raise ValueError(f"encode_completion takes an assistant message, got role {message.role!r}")
        return self.encode_text(serialize_assistant(message)) + [self.im_end_id]

    def parse_completion(self, completion_ids: Sequence[int]) -> ParsedCompletion:
        errors: list[str] = []
        stops = set(self.stop_token_ids)
        kept: list[int] = []
        ended = False
        bad = 0
        for raw_token in completion_ids:
            try:  # accept Python, numpy and 0-d torch integers; anything else is a bad id
                token = operator.index(raw_token)
            except TypeError:
                token = -1
            if isinstance(raw_token, bool) or not 0 <= token < self._vocab_size:
                bad += 1
                continue
            if token in stops:
                ended = True
                break
            kept.append(token)
        if bad:
            errors.append(f"The completion held {bad} token id(s) outside the vocabulary; they were dropped.")
        try:
            decoded = self.tokenizer.decode(kept, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except Exception as exc:  # a tokenizer should not fail here; if it does, report, never raise
            errors.append(f"Could not decode the completion: {type(exc).__name__}: {exc}")
            decoded = ""
        message, call_errors = parse_assistant_text(decoded)
        return ParsedCompletion(message=message, errors=tuple(errors) + call_errors, ended_with_eot=ended)

    @property
    def stop_token_ids(self) -> list[int]:
        ids = [self.im_end_id]
        if END_OF_TEXT in self._special_ids:
            ids.append(self._special_ids[END_OF_TEXT])
        return ids
