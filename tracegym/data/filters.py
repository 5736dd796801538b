"""Filters for synthesized (or any) episodes: plain functions ``(trajectories, **options) ->
trajectories`` kept in :data:`FILTERS` (``register_filter`` adds one), parsed from names with options
(``parse_filters``) and composed left to right, each run counting what it kept (``apply_filters``).
Teacher synthesis (``tracegym.recipes.synthesize``) applies them to re-rendered episodes.

- ``success``: rejection sampling. Keeps successful episodes, or with ``min_reward=TAU`` those with
  reward >= TAU.
- ``pareto``: among each task's successful episodes keeps those no other success dominates on cost
  ``(tool calls, generated tokens)`` (another is <= on both and < on one; ties are all kept).
  Failed episodes pass through untouched: dropping them is ``success``'s job.
- ``recovery``: keeps successful episodes in which a tool answered with an error and the agent
  acted again afterwards (it recovered). ``prefer`` keeps everything instead and orders each task's
  episodes recovered first, then by fewer generated tokens; ``per_task=N`` then keeps the first N.
- ``dedupe``: drops an episode whose assistant messages (content and tool calls, call ids ignored)
  equal those of an earlier episode of the same task.

A tool error is a ``tool`` message whose content starts with ``"Error"``: ``ToolEnv`` (and the MCP
envs built on it) answer an unknown tool, invalid arguments, a tool that raised or timed out, and a
malformed call the renderer could not parse that way, and ``check_env`` reads errors the same way.
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from tracegym.types import Message, Trajectory

log = logging.getLogger(__name__)

__all__ = [
    "FILTERS",
    "FilterCount",
    "FilterFn",
    "FilterSpec",
    "TOOL_ERROR_PREFIX",
    "apply_filters",
    "dedupe_filter",
    "generated_tokens",
    "is_recovery",
    "is_tool_error",
    "pareto_filter",
    "parse_filters",
    "recovered_errors",
    "recovery_filter",
    "register_filter",
    "task_key",
    "success_filter",
    "tool_call_count",
]

TOOL_ERROR_PREFIX = "Error"


# --- what the filters measure -------------------------------------------------------------------------


def is_tool_error(message: Message) -> bool:
    """A tool's answer that reports a failure (see the module doc)."""
    return message.role == "tool" and message.content.lstrip().startswith(TOOL_ERROR_PREFIX)


def tool_call_count(trajectory: Trajectory) -> int:
    """Tool calls the assistant made in the episode (well-formed ones: a malformed call is no call)."""
    return sum(len(m.tool_calls) for m in trajectory.messages if m.role == "assistant")


def generated_tokens(trajectory: Trajectory) -> int:
    """Completion tokens of the recorded turns (after :func:`retokenize`: the student's tokens)."""
    return trajectory.num_generated_tokens


def recovered_errors(trajectory: Trajectory) -> int:
    """Tool errors the agent acted on: error answers followed by a later assistant message. An error
    in the episode's last answer (e.g. calls after the one that ended it) was never recovered from."""
    count = pending = 0
    for message in trajectory.messages:
        if message.role == "assistant":
            count, pending = count + pending, 0
        elif is_tool_error(message):
            pending += 1
    return count


def is_recovery(trajectory: Trajectory) -> bool:
    """A successful episode that hit a tool error and went on after it."""
    return trajectory.success and recovered_errors(trajectory) > 0


def task_key(trajectory: Trajectory) -> tuple[str, str]:
    return trajectory.env, trajectory.task_id


# --- filters ---------------------------------------------------------------------------------------


def success_filter(trajectories: Sequence[Trajectory], *, min_reward: float | None = None) -> list[Trajectory]:
    """Rejection sampling: the successful episodes, or those with ``reward >= min_reward`` when given."""
    if min_reward is not None:
        if isinstance(min_reward, bool) or not isinstance(min_reward, (int, float)):
            raise ValueError(f"success: min_reward must be a number, got {min_reward!r}")
        return [t for t in trajectories if t.reward >= min_reward]
    return [t for t in trajectories if t.success]


def _dominates(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """``a`` is no worse than ``b`` on every cost and better on one (lower is better)."""
    return all(x <= y for x, y in zip(a, b)) and a != b


def pareto_filter(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Each task's successes not dominated on ``(tool calls, generated tokens)``; failures untouched."""
    costs = {id(t): (tool_call_count(t), generated_tokens(t)) for t in trajectories if t.success}
    by_task: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for t in trajectories:
        if t.success:
            by_task.setdefault(task_key(t), []).append(costs[id(t)])
    return [
        t for t in trajectories
        if not t.success or not any(_dominates(other, costs[id(t)]) for other in by_task[task_key(t)])
    ]


def recovery_filter(
    trajectories: Sequence[Trajectory], *, prefer: bool = False, per_task: int | None = None
) -> list[Trajectory]:
    """The recovered episodes (:func:`is_recovery`); with ``prefer``, every episode, each task's
    ordered recovered first, then successful, then by fewer generated tokens, at most ``per_task``
    of them per task when given."""
    if per_task is not None and (isinstance(per_task, bool) or not isinstance(per_task, int) or per_task < 1):
        raise ValueError(f"recovery: per_task must be an integer >= 1, got {per_task!r}")
    if not isinstance(prefer, bool):
        raise ValueError(f"recovery: prefer must be true or false, got {prefer!r}")
    if not prefer:
        kept = [t for t in trajectories if is_recovery(t)]
        if per_task is None:
            return kept
        trajectories, prefer = kept, True  # the cap applies to the recovered ones, shortest first
    groups: dict[tuple[str, str], list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(task_key(t), []).append(t)
    out: list[Trajectory] = []
    for group in groups.values():
        ranked = sorted(group, key=lambda t: (not is_recovery(t), not t.success, generated_tokens(t)))  # stable
        out.extend(ranked if per_task is None else ranked[:per_task])
    return out


def _assistant_signature(trajectory: Trajectory) -> tuple:
    """What the agent did, comparable across samples: call ids differ between samples (servers make
    them up), so they are left out, as is the raw call text (the parsed call is what ran)."""
    return tuple(
        (m.content, tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in m.tool_calls))
        for m in trajectory.messages if m.role == "assistant"
    )


def dedupe_filter(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Drops an episode whose assistant messages equal an earlier episode's of the same task."""
    seen: set[tuple] = set()
    out: list[Trajectory] = []
    for t in trajectories:
        key = (task_key(t), _assistant_signature(t))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


FilterFn = Callable[..., list[Trajectory]]

FILTERS: dict[str, FilterFn] = {
    "success": success_filter,
    "pareto": pareto_filter,
    "recovery": recovery_filter,
    "dedupe": dedupe_filter,
}
"""Filter name -> ``fn(trajectories, **options) -> kept trajectories``. Options are keyword-only
parameters; a filter must accept an empty list (options are checked by calling it on one)."""


def register_filter(name: str, fn: FilterFn) -> None:
    """Make ``fn`` usable by name in ``filters`` / ``--filters``."""
    if not name or any(ch in name for ch in ",:= "):
        raise ValueError(f"a filter name cannot be empty or hold ',', ':', '=' or spaces: {name!r}")
    FILTERS[name] = fn


@dataclass(frozen=True)
class FilterSpec:
    """One filter of a chain: its name in :data:`FILTERS` and its options."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        opts = "".join(f":{k}" if v is True else f":{k}={json.dumps(v)}" for k, v in self.options.items())
        return f"{self.name}{opts}"


def _option_value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _parse_one(text: str) -> FilterSpec:
    """``name``, ``name:flag`` or ``name:key=value`` (several ``:``-separated options)."""
    name, *parts = [p.strip() for p in text.split(":")]
    options: dict[str, Any] = {}
    for part in parts:
        if not part:
            raise ValueError(f"filter {text!r}: empty option")
        key, eq, value = part.partition("=")
        options[key.strip()] = _option_value(value) if eq else True
    return FilterSpec(name, options)


def _check(spec: FilterSpec) -> FilterSpec:
    fn = FILTERS.get(spec.name)
    if fn is None:
        close = difflib.get_close_matches(spec.name, list(FILTERS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown filter {spec.name!r}{hint}; known filters: {', '.join(FILTERS)}")
    accepted = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = [k for k in spec.options if k not in accepted]
    if unknown:
        takes = f"it takes {', '.join(accepted)}" if accepted else "it takes none"
        raise ValueError(f"filter {spec.name!r} has no option {unknown[0]!r} ({takes})")
    try:  # bad option values fail here, before any teacher time is spent
        fn([], **spec.options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"filter {spec}: {exc}") from exc
    return spec


def parse_filters(filters: str | Iterable[str | FilterSpec] | None) -> list[FilterSpec]:
    """Filter specs from ``"success,pareto,recovery:prefer,dedupe"`` (options after ``:``, values
    parsed as YAML: ``success:min_reward=0.5``, ``recovery:prefer:per_task=2``), a list of such
    strings, or ``FilterSpec``s. ValueError for an unknown filter, option or value. ``None``, ``""``
    and ``"none"`` mean no filter."""
    if filters is None:
        return []
    if isinstance(filters, str):
        items: list[str | FilterSpec] = [p for p in (s.strip() for s in filters.split(",")) if p]
        if items == ["none"]:
            return []
    else:
        items = list(filters)
    return [_check(item if isinstance(item, FilterSpec) else _parse_one(item)) for item in items]


@dataclass
class FilterCount:
    """How many trajectories one filter of the chain saw and kept."""

    filter: str
    before: int
    after: int


def apply_filters(
    trajectories: Sequence[Trajectory], filters: str | Iterable[str | FilterSpec] | None
) -> tuple[list[Trajectory], list[FilterCount]]:
    """Run the filters left to right; returns the survivors and each filter's counts (also logged)."""
    kept = list(trajectories)
    counts: list[FilterCount] = []
    for spec in parse_filters(filters):
        before = len(kept)
        kept = list(FILTERS[spec.name](kept, **spec.options))
        counts.append(FilterCount(str(spec), before, len(kept)))
        log.info("filter %s: kept %d of %d", spec, len(kept), before)
    return kept, counts
