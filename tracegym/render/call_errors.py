"""Why a tool call failed: one reason per failed call attempt, for every renderer family and plugins.

The reasons (``tracegym.types.CALL_FAILURE_REASONS``):

==============  ==================================================================================
``bad_json``    the call is not a well-formed JSON call: invalid JSON, an empty block, JSON that is
                not an object or has no string ``"name"``; or the model ended its turn inside a call
                it never closed (an unclosed ``<tool_call>``, a JSON object still open)
``unknown_tool`` it names a tool the environment did not declare (``Trajectory.tools``)
``bad_args``    its arguments are not a JSON object (the renderer finds that), or they do not
                validate against the tool's JSON schema: a required argument missing, a wrong type,
                an extra argument where the schema says ``additionalProperties: false``
``truncated``   the completion was cut (no stop token: ``max_tokens`` or the episode's token budget)
                while a call was still open
``other``       an error that is not one call's: a stray ``</tool_call>``, text after Llama 3's call
                lines, token ids outside the vocabulary, a completion that could not be decoded
==============  ==================================================================================

Where each is found. The renderer's parser finds ``bad_json``, ``truncated``, ``bad_args`` (not an
object) and ``other``, and returns each error as a :class:`~tracegym.types.CallError` carrying its
reason (``toolcalls.call_error``; a parser marks a call that is still open where the text ends as
``truncated``, and :func:`settle_errors` turns that into ``bad_json`` when the completion did end
with a stop token). ``unknown_tool`` and ``bad_args`` against the schema are found for the calls the
renderer parsed, by checking them against the declared schemas (:func:`schema_failure`). That check
only observes: the call still goes to the environment, which answers with its own error text, as
before.

A plain ``str`` error (a plugin renderer's own text, or any error read back from JSON, where the
reason is not stored) is classified from its text (:func:`reason_from_text`): the phrases the
built-in parsers write first, then keywords; what matches nothing is ``other``.

The episode loop counts the reasons per episode as ``Trajectory.metrics["parse_errors/<reason>"]``
(:func:`failure_metrics`); evaluation sums them per call attempt (``eval.json``'s ``call_failures``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from tracegym.types import CALL_FAILURE_REASONS, CallError, CallFailureReason, Message, ToolCall

__all__ = [
    "CALL_FAILURE_DESCRIPTIONS",
    "FAILURE_METRIC_PREFIX",
    "error_reason",
    "failure_metrics",
    "failures_in_metrics",
    "reason_from_text",
    "schema_failure",
    "settle_errors",
    "turn_failures",
]

FAILURE_METRIC_PREFIX = "parse_errors/"
"""Metric keys ``parse_errors/<reason>``: failed call attempts of an episode by reason."""

CALL_FAILURE_DESCRIPTIONS: dict[CallFailureReason, str] = {
    "bad_json": "not a well-formed JSON call (invalid JSON, not an object, no name, never closed)",
    "unknown_tool": "names a tool the environment did not declare",
    "bad_args": "arguments not an object, or not valid for the tool's JSON schema",
    "truncated": "cut by the token limit inside a call",
    "other": "not one call's error: a stray closing tag, text after the calls, bad token ids",
}

# (reason, phrases) in the order they are tried on a lower-cased error text. The built-in parsers'
# own phrases come first; the keywords at the end are the default for other texts (plugins).
_TEXT_RULES: tuple[tuple[CallFailureReason, tuple[str, ...]], ...] = (
    ("other", ("outside the vocabulary", "could not decode", "without a matching", "text after the tool calls")),
    ("truncated", ("never closed", "unclosed", "not closed", "truncated", "cut off")),
    ("unknown_tool", ("unknown tool", "no such tool", "unknown function")),
    ("bad_args", ('"arguments" of', '"parameters" of', "invalid arguments", "missing required argument",
                  "unknown argument", "arguments must be")),
    ("bad_json", ("invalid json", "the block is empty", "expected a json object", 'missing "name"',
                  '"name" must be')),
    ("bad_json", ("json",)),
    ("bad_args", ("argument", "parameter")),
)


def reason_from_text(text: str) -> CallFailureReason:
    """The reason an error text names (see the module docstring); ``other`` when it names none.

    The text before its first single quote is read first: the built-in texts quote the model's own
    output there (``invalid JSON (...) in '...'``), which must not decide the reason."""
    lowered = text.lower()
    for part in (lowered.split("'", 1)[0], lowered):
        for reason, phrases in _TEXT_RULES:
            if any(phrase in part for phrase in phrases):
                return reason
    return "other"


def error_reason(error: str, cut: bool | None = None) -> CallFailureReason:
    """The reason of one error: a :class:`CallError`'s own, else :func:`reason_from_text`.

    ``cut``: whether the completion was cut (no stop token). A call still open at the end is
    ``truncated`` only in a cut completion; the model that closed its turn inside it wrote
    ``bad_json``. None: not known, the reason stays as it is."""
    reason = error.reason if isinstance(error, CallError) else reason_from_text(str(error))
    if reason == "truncated" and cut is False:
        return "bad_json"
    return reason


def settle_errors(errors: Iterable[str], cut: bool | None) -> tuple[CallError, ...]:
    """``errors`` as :class:`CallError`s whose reasons take ``cut`` into account (:func:`error_reason`)."""
    return tuple(CallError(str(error), error_reason(error, cut)) for error in errors)


def _declared_parameters(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``{tool name: its parameters schema (None when it gives none)}`` of OpenAI-format schemas
    (``{"type": "function", "function": {...}}``) or bare ``{"name", "parameters"}`` ones."""
    declared: dict[str, Any] = {}
    for schema in tools:
        function = schema.get("function", schema) if isinstance(schema, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            declared[function["name"]] = function.get("parameters")
    return declared


@lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    """A JSON-schema validator of the schema ``schema_json`` (its draft, 2020-12 by default), or None
    when the schema is not one (the environment then has the only say)."""
    import jsonschema

    schema = json.loads(schema_json)
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.SchemaError:
        return None
    return cls(schema)


def schema_failure(call: ToolCall, tools: Sequence[Mapping[str, Any]]) -> CallFailureReason | None:
    """``unknown_tool`` when ``call`` names no declared tool, ``bad_args`` when its arguments do not
    validate against that tool's ``parameters`` schema, else None. With no tools declared nothing is
    judged (None), as ``tracegym.eval.toolcalls`` does for unknown tools."""
    return _declared_failure(call, _declared_parameters(tools))


def _declared_failure(call: ToolCall, declared: Mapping[str, Any]) -> CallFailureReason | None:
    """``schema_failure`` against ``{tool name: parameters schema}`` (built once per turn)."""
    if not declared:
        return None
    if call.name not in declared:
        return "unknown_tool"
    parameters = declared[call.name]
    if not isinstance(parameters, Mapping) or not parameters:
        return None
    try:
        validator = _validator(json.dumps(parameters, sort_keys=True, default=str))
        valid = validator is None or validator.is_valid(call.arguments)
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot apply ($ref elsewhere...): the env decides
        return None
    return None if valid else "bad_args"


def turn_failures(
    message: Message, errors: Sequence[str], tools: Sequence[Mapping[str, Any]], cut: bool | None = None,
) -> Counter[str]:
    """The failed call attempts of one assistant turn by reason: each parse error (``error_reason``)
    and each parsed call the declared schemas reject (``schema_failure``)."""
    found: Counter[str] = Counter(error_reason(error, cut) for error in errors)
    declared = _declared_parameters(tools) if message.tool_calls else {}
    for call in message.tool_calls:
        reason = _declared_failure(call, declared)
        if reason is not None:
            found[reason] += 1
    return found


def failure_metrics(counts: Mapping[str, int]) -> dict[str, float]:
    """``{"parse_errors/<reason>": count}`` for every reason, 0.0 where none."""
    return {FAILURE_METRIC_PREFIX + reason: float(counts.get(reason, 0)) for reason in CALL_FAILURE_REASONS}


def failures_in_metrics(metrics: Mapping[str, float]) -> dict[str, int] | None:
    """``{reason: count}`` read back from :func:`failure_metrics`' keys, or None when ``metrics`` has
    none of them (a trajectory recorded before they existed)."""
    keys = {reason: FAILURE_METRIC_PREFIX + reason for reason in CALL_FAILURE_REASONS}
    if not any(key in metrics for key in keys.values()):
        return None
    return {reason: int(round(float(metrics.get(key, 0.0)))) for reason, key in keys.items()}
