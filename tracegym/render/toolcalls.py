"""Tool calls in assistant text, Hermes/Qwen convention: one JSON object per ``<tool_call>`` block.

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

``serialize_assistant`` writes an assistant message as the text a model must produce;
``parse_assistant_text`` reads such text back. Parsing never raises: every malformed block becomes
an error text that names the problem and shows the expected format, because an environment shows
that text to the model so it can correct itself. Each error is a ``CallError`` that carries why the
call failed (``call_errors.py``): an unclosed block is ``truncated`` (``bad_json`` once the renderer
sees the completion ended with its stop token), bad JSON or a call object without a name
``bad_json``, arguments that are not an object ``bad_args``, a stray closing tag ``other``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tracegym.render.call_errors import reason_from_text
from tracegym.types import CallError, CallFailureReason, Message, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

EXPECTED_FORMAT = (
    'Write each tool call as a JSON object with a string "name" and an object "arguments", '
    "inside its own tags:\n"
    '<tool_call>\n{"name": "<tool name>", "arguments": {"<parameter>": <value>}}\n</tool_call>'
)

# Longest stretch of the offending text quoted back in an error message.
_SNIPPET_CHARS = 200


def tool_call_json(call: ToolCall) -> str:
    """The canonical JSON of one call. Equals the Jinja ``tojson`` of the same dict (HF's filter is
    ``json.dumps(..., ensure_ascii=False)`` with default separators), so both templates agree."""
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)


def tool_call_block(call: ToolCall) -> str:
    return f"{TOOL_CALL_OPEN}\n{tool_call_json(call)}\n{TOOL_CALL_CLOSE}"


def serialize_assistant(message: Message) -> str:
    """Assistant message -> the text between ``<|im_start|>assistant\\n`` and ``<|im_end|>``:
    the content, then one block per tool call, separated by single newlines."""
    parts = [message.content] if message.content else []
    parts.extend(tool_call_block(call) for call in message.tool_calls)
    return "\n".join(parts)


def tools_json_lines(tools: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> str:
    """One JSON schema per line, as they appear inside ``<tools></tools>``."""
    return "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)


def snippet(value: str) -> str:
    """``value`` stripped, cut to ``_SNIPPET_CHARS`` characters, for quoting in an error text."""
    value = value.strip()
    if len(value) > _SNIPPET_CHARS:
        return value[:_SNIPPET_CHARS] + "..."
    return value


def call_error(
    index: int, problem: str, expected_format: str = EXPECTED_FORMAT, reason: CallFailureReason | None = None,
) -> CallError:
    """The error text of the ``index``-th call (from 0): the problem, then the expected format, as a
    ``CallError`` whose reason is ``reason`` (default: the one ``problem`` names, ``reason_from_text``)."""
    return CallError(f"Tool call {index + 1}: {problem}. {expected_format}", reason or reason_from_text(problem))


def check_call_object(
    obj: Any,
    raw: str,
    index: int,
    call_id: str,
    argument_keys: Sequence[str] = ("arguments",),
    expected_format: str = EXPECTED_FORMAT,
) -> tuple[ToolCall | None, CallError | None]:
    """A decoded call -> (``ToolCall`` with ``raw`` and ``call_id``, None), or (None, error text).

    The call must be an object with a non-empty string "name"; its arguments are read from the
    first of ``argument_keys`` it holds (``{}`` when none) and must be an object or a string that
    holds a JSON object. ``index`` numbers the call in error texts."""
    if not isinstance(obj, dict):
        problem = f"expected a JSON object, got {type(obj).__name__} {snippet(raw)!r}"
        return None, call_error(index, problem, expected_format, "bad_json")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        problem = 'missing "name"' if "name" not in obj else f'"name" must be a non-empty string, got {name!r}'
        return None, call_error(index, problem, expected_format, "bad_json")
    label = argument_keys[0]
    arguments = next((obj[key] for key in argument_keys if key in obj), {})
    if isinstance(arguments, str):
        # Some models (and the OpenAI wire format) give arguments as a JSON string: accept it when
        # it holds an object.
        try:
            decoded = json.loads(arguments)
        except (ValueError, RecursionError):
            decoded = None
        if not isinstance(decoded, dict):
            problem = f'"{label}" of {name!r} is a string that is not a JSON object'
            return None, call_error(index, problem, expected_format, "bad_args")
        arguments = decoded
    if not isinstance(arguments, dict):
        problem = f'"{label}" of {name!r} must be a JSON object, got {type(arguments).__name__}'
        return None, call_error(index, problem, expected_format, "bad_args")
    return ToolCall(name=name, arguments=arguments, raw=raw, id=call_id), None


def _parse_block(body: str, index: int, call_id: str) -> tuple[ToolCall | None, CallError | None]:
    """JSON text of one block -> (ToolCall, None) or (None, error text)."""
    stripped = body.strip()
    if not stripped:
        return None, call_error(index, "the block is empty", reason="bad_json")
    try:
        obj = json.loads(stripped)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; so are huge ints
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc) or type(exc).__name__
        return None, call_error(index, f"invalid JSON ({msg}) in {snippet(stripped)!r}", reason="bad_json")
    return check_call_object(obj, stripped, index, call_id)


def parse_assistant_text(text: str) -> tuple[Message, tuple[CallError, ...]]:
    """Assistant text -> (assistant message, errors).

    Content is the text outside the tool-call blocks: each outside piece stripped, the non-empty
    ones joined by newlines. Valid calls get ids ``call_0``, ``call_1``, ... in order of appearance
    (turn-local, deterministic). An unclosed ``<tool_call>`` swallows the rest of the text and is an
    error; a ``</tool_call>`` with no opening tag is an error and stays in the content.
    """
    outside: list[str] = []
    calls: list[ToolCall] = []
    errors: list[CallError] = []
    pos = 0
    block_index = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end < 0:  # open where the text ends: cut by the token limit, or the model ended its turn in it
            problem = f"<tool_call> is never closed by </tool_call>: {snippet(text[body_start:])!r}"
            errors.append(call_error(block_index, problem, reason="truncated"))
            break
        call, error = _parse_block(text[body_start:end], block_index, call_id=f"call_{len(calls)}")
        if error is not None:
            errors.append(error)
        else:
            assert call is not None
            calls.append(call)
        block_index += 1
        pos = end + len(TOOL_CALL_CLOSE)
    pieces = [piece.strip() for piece in outside]
    content = "\n".join(piece for piece in pieces if piece)
    if TOOL_CALL_CLOSE in content:
        errors.append(CallError(f"Found </tool_call> without a matching <tool_call>. {EXPECTED_FORMAT}", "other"))
    return Message(role="assistant", content=content, tool_calls=tuple(calls)), tuple(errors)


def to_openai_messages(messages: Sequence[Message], arguments_as_string: bool = False) -> list[dict[str, Any]]:
    """Messages in the OpenAI chat format (what HF chat templates and OpenAI-compatible servers
    read). Tool-call arguments stay dicts unless ``arguments_as_string`` (the OpenAI wire format)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id or f"call_{index}",
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": json.dumps(call.arguments, ensure_ascii=False)
                        if arguments_as_string
                        else dict(call.arguments),
                    },
                }
                for index, call in enumerate(message.tool_calls)
            ]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            item["name"] = message.name
        out.append(item)
    return out
