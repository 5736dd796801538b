"""Tool-call metrics: strict matching against reference calls, and the invalid-call rate.

Reference matching (in the spirit of UniToolCall's call / turn / conversation levels) applies to
trajectories whose ``info["reference_calls"]`` holds the calls an expert makes, either

- a flat list of ``{"name": str, "arguments": dict}``: one reference call per tool-calling turn
  (serial execution, the usual shape of a multi-turn tool episode), or
- a list of lists of such dicts: one inner list per tool-calling turn (parallel calls in a turn).

A predicted call matches a reference call iff the names are equal and the arguments are equal
after ``normalize_arguments``. Matching is on multisets: two identical predicted calls match two
identical reference calls, never one reference call twice.

- call level: strict precision = matched / predicted calls, recall = matched / reference calls,
  micro-averaged over all trajectories (sums of counts, then the ratio).
- turn level: the tool-calling turns of the episode (assistant turns that attempted at least one
  call, malformed ones included) are aligned by position with the reference turns; a turn matches
  iff its call multiset equals the reference turn's. Turn accuracy = matched turns / reference
  turns; turn precision = matched turns / predicted tool-calling turns.
- conversation level: exact match iff every reference turn matched and there is no extra
  tool-calling turn.

The invalid-call rate needs no reference and is computed from every trajectory: a call attempt is
invalid when the renderer could not parse it (``Turn.parse_errors``), when it names a tool that is
not in ``trajectory.tools``, or when the tool answered with a message starting with ``Error:``.

Call failures by reason (``call_failure_stats``): the failed call attempts of every trajectory split
into ``bad_json``, ``unknown_tool``, ``bad_args``, ``truncated`` and ``other``
(``tracegym.render.call_errors``), each as a count and a rate per call attempt. The counts are the
episode loop's ``Trajectory.metrics["parse_errors/<reason>"]``; a trajectory written before those
existed is classified here from its turns, the same way.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from tracegym.render.call_errors import failures_in_metrics, schema_failure, turn_failures
from tracegym.types import CALL_FAILURE_REASONS, Message, ToolCall, Trajectory

__all__ = [
    "CallFailureStats",
    "CallKey",
    "InvalidCallStats",
    "ReferenceMatchStats",
    "call_failure_stats",
    "call_key",
    "invalid_call_stats",
    "normalize_arguments",
    "predicted_call_turns",
    "reference_call_stats",
    "reference_turns",
]

_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_SPACE = re.compile(r"\s+")


def _normalize_value(value: Any) -> Any:
    """Canonical, hashable form of a JSON value (see ``normalize_arguments``)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return ("bool", value)  # True == 1 in Python; a flag is not a count
    if isinstance(value, (int, float)):
        f = float(value)
        if not math.isfinite(f):
            return ("nonfinite", str(f))
        # 3, 3.0 and "3" are the same argument; keep ints exact (no float rounding of big ints).
        return int(value) if isinstance(value, int) else (int(f) if f.is_integer() and abs(f) < 2**53 else f)
    if isinstance(value, str):
        text = _SPACE.sub(" ", value.strip())
        if _NUMBER.fullmatch(text):
            return _normalize_value(int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text))
        return text.casefold()
    if isinstance(value, dict):
        return tuple(sorted((str(k), _normalize_value(v)) for k, v in value.items() if v is not None))
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_normalize_value(v) for v in value))
    return ("repr", repr(value))


def normalize_arguments(arguments: dict[str, Any] | None) -> tuple:
    """Canonical form of call arguments, for strict comparison.

    Keys are sorted; an argument set to null counts as absent; strings are stripped, inner
    whitespace collapsed to one space and case-folded; numbers compare by value (``3 == 3.0 ==
    "3"``); booleans stay distinct from numbers; lists keep their order.
    """
    if arguments is None:
        return ()
    if not isinstance(arguments, dict):
        raise TypeError(f"tool-call arguments must be a JSON object, got {type(arguments).__name__}")
    return _normalize_value(arguments)


CallKey = tuple[str, tuple]


def call_key(name: str, arguments: dict[str, Any] | None) -> CallKey:
    """What two calls must share to match: the tool name (stripped) and normalised arguments."""
    return (str(name).strip(), normalize_arguments(arguments))


def _reference_key(ref: Any) -> CallKey:
    if isinstance(ref, ToolCall):
        return call_key(ref.name, ref.arguments)
    if not isinstance(ref, dict) or "name" not in ref:
        raise ValueError(f"a reference call must be a dict with 'name' and 'arguments', got {ref!r}")
    return call_key(ref["name"], ref.get("arguments") or {})


def reference_turns(trajectory: Trajectory) -> list[list[CallKey]] | None:
    """The reference calls of an episode grouped by turn, or None when it has no reference."""
    refs = trajectory.info.get("reference_calls")
    if refs is None:
        return None
    if not isinstance(refs, (list, tuple)):
        raise ValueError(f"{trajectory.env}/{trajectory.task_id}: info['reference_calls'] must be a list, got {type(refs).__name__}")
    if refs and all(isinstance(r, (list, tuple)) for r in refs):
        return [[_reference_key(c) for c in turn] for turn in refs]
    if any(isinstance(r, (list, tuple)) for r in refs):
        raise ValueError(f"{trajectory.env}/{trajectory.task_id}: reference_calls mixes calls and lists of calls")
    return [[_reference_key(c)] for c in refs]


@dataclass(frozen=True)
class _AssistantTurn:
    message: Message
    parse_errors: tuple[str, ...]
    results: tuple[Message, ...]  # the env messages that followed this assistant message
    cut: bool | None = None  # sampling stopped without a stop token (None: not recorded)


def _assistant_turns(trajectory: Trajectory) -> list[_AssistantTurn]:
    """Each assistant message with its parse errors and the env messages that answered it.

    Token-exact turns are preferred (they carry parse errors); trajectories without turns are read
    from the message list, where each assistant message is answered by the messages up to the next
    assistant message.
    """
    if trajectory.turns:
        return [_AssistantTurn(t.message, tuple(t.parse_errors), tuple(t.env_messages), t.finish_reason != "stop")
                for t in trajectory.turns if t.kind == "action"]  # a context summary is no env step
    out: list[_AssistantTurn] = []
    messages = list(trajectory.messages)
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        j = i + 1
        while j < len(messages) and messages[j].role != "assistant":
            j += 1
        out.append(_AssistantTurn(m, (), tuple(messages[i + 1 : j])))
    return out


def predicted_call_turns(trajectory: Trajectory) -> list[list[CallKey | None]]:
    """The tool-calling turns of an episode; a malformed call is a ``None`` that matches nothing."""
    turns = []
    for turn in _assistant_turns(trajectory):
        calls: list[CallKey | None] = [call_key(c.name, c.arguments) for c in turn.message.tool_calls]
        calls.extend([None] * len(turn.parse_errors))
        if calls:
            turns.append(calls)
    return turns


def _multiset_matches(predicted: Iterable[CallKey | None], reference: Iterable[CallKey]) -> int:
    pred = Counter(k for k in predicted if k is not None)
    ref = Counter(reference)
    return sum(min(count, ref[key]) for key, count in pred.items())


@dataclass
class ReferenceMatchStats:
    """Counts summed over episodes with references; ratios are properties."""

    episodes: int = 0
    predicted_calls: int = 0
    reference_calls: int = 0
    matched_calls: int = 0
    predicted_turns: int = 0
    reference_turns: int = 0
    matched_turns: int = 0
    exact_conversations: int = 0

    @property
    def precision(self) -> float:
        return self.matched_calls / self.predicted_calls if self.predicted_calls else 0.0

    @property
    def recall(self) -> float:
        return self.matched_calls / self.reference_calls if self.reference_calls else 1.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    @property
    def turn_accuracy(self) -> float:
        return self.matched_turns / self.reference_turns if self.reference_turns else 1.0

    @property
    def turn_precision(self) -> float:
        return self.matched_turns / self.predicted_turns if self.predicted_turns else 0.0

    @property
    def conversation_exact_match(self) -> float:
        return self.exact_conversations / self.episodes if self.episodes else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "episodes": self.episodes,
            "call_precision": self.precision,
            "call_recall": self.recall,
            "call_f1": self.f1,
            "turn_accuracy": self.turn_accuracy,
            "turn_precision": self.turn_precision,
            "conversation_exact_match": self.conversation_exact_match,
            "predicted_calls": self.predicted_calls,
            "reference_calls": self.reference_calls,
            "matched_calls": self.matched_calls,
            "predicted_turns": self.predicted_turns,
            "reference_turns": self.reference_turns,
            "matched_turns": self.matched_turns,
        }


def reference_call_stats(trajectories: Iterable[Trajectory]) -> ReferenceMatchStats | None:
    """Strict call / turn / conversation scores over the episodes that carry references; None when
    none does."""
    stats = ReferenceMatchStats()
    for traj in trajectories:
        ref = reference_turns(traj)
        if ref is None:
            continue
        pred = predicted_call_turns(traj)
        stats.episodes += 1
        stats.predicted_calls += sum(len(t) for t in pred)
        stats.reference_calls += sum(len(t) for t in ref)
        stats.matched_calls += _multiset_matches([c for t in pred for c in t], [c for t in ref for c in t])
        stats.predicted_turns += len(pred)
        stats.reference_turns += len(ref)
        matched_turns = sum(
            1 for p, r in zip(pred, ref) if None not in p and Counter(p) == Counter(r)
        )
        stats.matched_turns += matched_turns
        if matched_turns == len(ref) and len(pred) == len(ref):
            stats.exact_conversations += 1
    return stats if stats.episodes else None


def _tool_names(tools: Sequence[dict[str, Any]]) -> set[str]:
    names = set()
    for schema in tools:
        fn = schema.get("function", schema) if isinstance(schema, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def _is_error_result(message: Message) -> bool:
    return message.content.lstrip().lower().startswith("error:")


def _results_for_calls(turn: _AssistantTurn) -> list[Message | None]:
    """The tool message answering each parsed call of a turn (None when there is none).

    Calls and results are paired by ``tool_call_id`` when the call has an id; calls without ids
    take the unclaimed tool messages in order.
    """
    tool_msgs = [m for m in turn.results if m.role == "tool"]
    by_id = {m.tool_call_id: m for m in tool_msgs if m.tool_call_id is not None}
    claimed = {id(by_id[c.id]) for c in turn.message.tool_calls if c.id is not None and c.id in by_id}
    free = iter([m for m in tool_msgs if id(m) not in claimed])
    out: list[Message | None] = []
    for call in turn.message.tool_calls:
        if call.id is not None and call.id in by_id:
            out.append(by_id[call.id])
        else:
            out.append(next(free, None))
    return out


@dataclass
class InvalidCallStats:
    """Call attempts and how many were invalid, summed over episodes."""

    assistant_turns: int = 0
    turns_with_parse_errors: int = 0
    attempted_calls: int = 0  # parsed calls + malformed calls
    parse_errors: int = 0
    unknown_tool_calls: int = 0
    error_results: int = 0  # parsed calls to a known tool answered with "Error: ..."

    @property
    def invalid_calls(self) -> int:
        return self.parse_errors + self.unknown_tool_calls + self.error_results

    @property
    def invalid_call_rate(self) -> float:
        return self.invalid_calls / self.attempted_calls if self.attempted_calls else 0.0

    @property
    def parse_error_turn_rate(self) -> float:
        return self.turns_with_parse_errors / self.assistant_turns if self.assistant_turns else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "invalid_call_rate": self.invalid_call_rate,
            "parse_error_turn_rate": self.parse_error_turn_rate,
            "attempted_calls": self.attempted_calls,
            "invalid_calls": self.invalid_calls,
            "parse_errors": self.parse_errors,
            "unknown_tool_calls": self.unknown_tool_calls,
            "error_results": self.error_results,
            "assistant_turns": self.assistant_turns,
            "turns_with_parse_errors": self.turns_with_parse_errors,
        }


def invalid_call_stats(trajectories: Iterable[Trajectory]) -> InvalidCallStats:
    """Count malformed calls, calls to unknown tools and calls answered with an error.

    A call to a tool missing from ``trajectory.tools`` counts once (as unknown), whatever the env
    answered. When a trajectory lists no tools, no call is judged unknown.
    """
    stats = InvalidCallStats()
    for traj in trajectories:
        known = _tool_names(traj.tools)
        for turn in _assistant_turns(traj):
            stats.assistant_turns += 1
            stats.parse_errors += len(turn.parse_errors)
            stats.turns_with_parse_errors += bool(turn.parse_errors)
            stats.attempted_calls += len(turn.parse_errors) + len(turn.message.tool_calls)
            for call, result in zip(turn.message.tool_calls, _results_for_calls(turn)):
                if known and call.name not in known:
                    stats.unknown_tool_calls += 1
                elif result is not None and _is_error_result(result):
                    stats.error_results += 1
    return stats


@dataclass
class CallFailureStats:
    """Failed call attempts by reason, summed over episodes; rates are per call attempt."""

    attempted_calls: int = 0  # parsed calls + malformed calls
    counts: Counter[str] = field(default_factory=Counter)

    @property
    def failed_calls(self) -> int:
        return sum(self.counts[reason] for reason in CALL_FAILURE_REASONS)

    def rate(self, count: int) -> float:
        return count / self.attempted_calls if self.attempted_calls else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempted_calls": self.attempted_calls,
            "failed_calls": self.failed_calls,
            "failure_rate": self.rate(self.failed_calls),
            "by_reason": {r: {"count": self.counts[r], "rate": self.rate(self.counts[r])} for r in CALL_FAILURE_REASONS},
        }


def _episode_failures(trajectory: Trajectory, turns: Sequence[_AssistantTurn]) -> dict[str, int]:
    """``{reason: count}`` of one episode: the episode loop's metrics, else classified from its turns."""
    recorded = failures_in_metrics(trajectory.metrics)
    if recorded is not None:
        return recorded
    found: Counter[str] = Counter()
    for turn in turns:
        found.update(turn_failures(turn.message, turn.parse_errors, trajectory.tools, turn.cut))
    return dict(found)


def _attempts(trajectory: Trajectory, turns: Sequence[_AssistantTurn], failures: dict[str, int]) -> int:
    """Call attempts of one episode: parsed calls + malformed ones. An episode without token turns
    (message-level) keeps its parse errors only in its metrics: they are what the metrics count
    beyond the parsed calls the schemas reject."""
    parsed = sum(len(t.message.tool_calls) for t in turns)
    malformed = sum(len(t.parse_errors) for t in turns)
    if not trajectory.turns:
        rejected = sum(schema_failure(c, trajectory.tools) is not None for t in turns for c in t.message.tool_calls)
        malformed = max(malformed, sum(failures.values()) - rejected)
    return parsed + malformed


def call_failure_stats(trajectories: Iterable[Trajectory]) -> CallFailureStats:
    """Why tool calls failed: counts per reason over every trajectory, and the call attempts."""
    stats = CallFailureStats()
    for traj in trajectories:
        turns = _assistant_turns(traj)
        failures = _episode_failures(traj, turns)
        stats.attempted_calls += _attempts(traj, turns, failures)
        stats.counts.update(failures)
    return stats
