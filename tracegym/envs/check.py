"""``check_env``: the invariants every environment must satisfy (used by the tests of each env).

Checks, each reported by name (each is a ``check_<name>`` function here; ``acheck_env`` runs them in
this order and gathers their findings in a :class:`CheckReport`):

- ``determinism``: the same seed gives the same tasks, the same reset messages and the same
  ``state_key()`` after reset, on two separate instances; a different seed gives different tasks;
  every task carries the split it was asked for.
- ``disjoint_splits``: train and test share no task id and no task content (data, prompt text).
- ``tool_schemas``: well-formed OpenAI function schemas (JSON-serialisable, an object
  ``parameters`` schema with valid property schemas, ``required`` within ``properties``), unique names.
- ``bad_calls``: an unknown tool, a malformed call (a parse error) and bad arguments to a real tool
  each give an ``Error:`` tool message, not an exception, and do not end the episode.
- ``isolation``: two instances on different tasks, stepped in turn by the expert, produce exactly
  what each produces alone.
- ``expert``: the expert solves at least ``min_expert_success`` of the tasks; its episodes end with
  ``terminated`` (never ``truncated``), rewards stay within ``reward_range``, terminated and
  truncated are never both set, and the final step's info has ``success``.
- ``truncation``: a policy that never finishes (it keeps calling an unknown tool) is cut with
  ``truncated=True`` (not ``terminated``) within the env's ``max_turns``.
- ``branching`` (envs whose ``can_branch`` is True; the others are reported as skipped, which is
  not a failure): on a few test tasks the expert plays some steps, the env is snapshotted, and the
  expert plays on to the end; the snapshot restored into a fresh instance and into the same
  (finished) instance gives back the same ``state_key()`` and the same expert action, and replaying
  the recorded actions gives identical observations, rewards, termination and info counters.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Union

from tracegym.envs.base import Env, Task
from tracegym.envs.episode import run_episode
from tracegym.types import Message, StepResult, ToolCall, Trajectory

__all__ = ["CheckReport", "EnvCheckError", "acheck_env", "check_env", "schema_problems"]

_JSON_TYPES = {"string", "integer", "number", "boolean", "array", "object", "null"}
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_PROBE_TOOL = "__tracegym_check_no_such_tool__"


class EnvCheckError(AssertionError):
    """An environment broke one of the invariants; the message lists every failure."""


@dataclass
class CheckReport:
    """What ``check_env`` found: one entry per check, plus measured figures."""

    env: str
    passed: list[str] = field(default_factory=list)
    failures: dict[str, list[str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # check -> why it does not apply (not a failure)
    expert_success_rate: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, check: str, problem: str) -> None:
        self.failures.setdefault(check, []).append(problem)

    def __str__(self) -> str:
        lines = [f"check_env({self.env}): {'OK' if self.ok else 'FAILED'}; expert success {self.expert_success_rate:.1%}"]
        for name in self.passed:
            lines.append(f"  pass  {name}")
        for name, why in self.skipped.items():
            lines.append(f"  skip  {name}: {why}")
        for name, problems in self.failures.items():
            for problem in problems[:5]:
                lines.append(f"  FAIL  {name}: {problem}")
            if len(problems) > 5:
                lines.append(f"  FAIL  {name}: ... and {len(problems) - 5} more")
        return "\n".join(lines)


# --- schema validation ----------------------------------------------------------------------------


def _property_problems(schema: Any, where: str) -> list[str]:
    if not isinstance(schema, dict):
        return [f"{where}: schema must be an object, got {type(schema).__name__}"]
    problems = []
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in _JSON_TYPES:
            problems.append(f"{where}: unknown type {k!r}")
    if "description" in schema and not isinstance(schema["description"], str):
        problems.append(f"{where}: description must be a string")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        problems.append(f"{where}: enum must be a non-empty list")
    if "items" in schema:
        problems += _property_problems(schema["items"], f"{where}.items")
    if "properties" in schema:
        problems += _object_problems(schema, where)
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                problems.append(f"{where}: {key} must be a non-empty list")
            else:
                for i, sub in enumerate(schema[key]):
                    problems += _property_problems(sub, f"{where}.{key}[{i}]")
    if not kinds and not any(k in schema for k in ("enum", "anyOf", "oneOf", "allOf", "const")) and schema:
        problems.append(f"{where}: property schema has no type")
    return problems


def _object_problems(schema: dict[str, Any], where: str) -> list[str]:
    problems = []
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        return [f"{where}: properties must be an object"]
    for name, sub in properties.items():
        problems += _property_problems(sub, f"{where}.{name}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        problems.append(f"{where}: required must be a list of names")
    else:
        for r in required:
            if r not in properties:
                problems.append(f"{where}: required argument {r!r} is not in properties")
    return problems


def schema_problems(schemas: Any) -> list[str]:
    """Everything wrong with a list of OpenAI function-calling tool schemas ([] when well-formed)."""
    if not isinstance(schemas, list):
        return [f"tool_schemas() must return a list, got {type(schemas).__name__}"]
    problems: list[str] = []
    names: list[str] = []
    for i, schema in enumerate(schemas):
        where = f"tool[{i}]"
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as exc:
            problems.append(f"{where}: not JSON-serialisable ({exc})")
            continue
        if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
            problems.append(f'{where}: must be {{"type": "function", "function": {{...}}}}')
            continue
        fn = schema["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            problems.append(f"{where}: invalid tool name {name!r}")
        else:
            names.append(name)
            where = f"tool {name!r}"
        if not isinstance(fn.get("description", ""), str):
            problems.append(f"{where}: description must be a string")
        params = fn.get("parameters")
        if not isinstance(params, dict) or params.get("type") != "object":
            problems.append(f'{where}: parameters must be a JSON schema with "type": "object"')
            continue
        problems += _object_problems(params, f"{where}.parameters")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(f"duplicate tool names: {', '.join(duplicates)}")
    return problems


# --- helpers --------------------------------------------------------------------------------------

MakeEnv = Union[str, Callable[[], Env]]


def _factory(make_env: MakeEnv) -> tuple[Callable[[], Env], str]:
    if isinstance(make_env, str):
        from tracegym.envs.registry import make

        name = make_env
        return (lambda: make(name)), name
    return make_env, getattr(make_env(), "name", "env")


def _task_content(task: Task) -> str:
    return json.dumps(task.data, sort_keys=True, default=str)


def _prompt_text(messages: list[Message]) -> str:
    return "\n".join(m.content for m in messages if m.role in ("system", "user"))


def _state_key(env: Env) -> Any:
    state_key = getattr(env, "state_key", None)
    return state_key() if state_key is not None else None


def _is_error_tool_message(m: Message) -> bool:
    return m.role == "tool" and m.content.startswith("Error")


# One expert step of a trace: the assistant message and the env's answer, compared across runs.
_TraceStep = tuple[Message, tuple[Message, ...], float, bool, bool]


async def _expert_trace(env: Env, task: Task, limit: int) -> list[_TraceStep]:
    await env.reset(task)
    trace: list[_TraceStep] = []
    for _ in range(limit):
        message = env.expert_action()
        step = await env.step(message)
        trace.append((message, step.messages, step.reward, step.terminated, step.truncated))
        if step.terminated or step.truncated:
            break
    return trace


async def _interleaved_traces(env_a: Env, task_a: Task, env_b: Env, task_b: Task, limit: int) -> tuple[list[_TraceStep], list[_TraceStep]]:
    await env_a.reset(task_a)
    await env_b.reset(task_b)
    traces: tuple[list[_TraceStep], list[_TraceStep]] = ([], [])
    active = [True, True]
    for _ in range(limit):
        for i, env in enumerate((env_a, env_b)):
            if not active[i]:
                continue
            message = env.expert_action()
            step = await env.step(message)
            traces[i].append((message, step.messages, step.reward, step.terminated, step.truncated))
            if step.terminated or step.truncated:
                active[i] = False
        if not any(active):
            break
    return traces


# The info entries a restored episode must reproduce: the outcome and ToolEnv's counters.
_BRANCH_INFO_KEYS = ("success", "turns", "tool_calls", "tool_errors", "tool_timeouts", "parse_errors", "tool_output_truncated")


def _branch_record(step: StepResult) -> tuple[Any, ...]:
    info = {k: step.info[k] for k in _BRANCH_INFO_KEYS if k in step.info}
    return (step.messages, step.reward, step.terminated, step.truncated, info)


def _branch_difference(expected: tuple[Any, ...], got: tuple[Any, ...]) -> str:
    names = ("observation", "reward", "terminated", "truncated", "info counters")
    for name, a, b in zip(names, expected, got):
        if a != b:
            shown_a, shown_b = (
                ([m.content[:80] for m in a], [m.content[:80] for m in b]) if name == "observation" else (a, b)
            )
            return f"{name} {shown_b!r} instead of {shown_a!r}"
    return "no difference"


def _can_branch(env: Any) -> tuple[bool, str]:
    """(can branch, why not) of any env object, Env subclass or not."""
    refusal = getattr(env, "branch_refusal", None)
    if refusal is None or not hasattr(env, "snapshot") or not hasattr(env, "restore"):
        return False, f"env {getattr(env, 'name', type(env).__name__)!r} cannot branch: it does not implement snapshot/restore"
    reason = refusal()
    if reason is None:
        return True, ""
    return False, f"env {getattr(env, 'name', type(env).__name__)!r} ({type(env).__name__}) cannot branch: {reason}"


async def _branching_problems(factory: Callable[[], Env], task: Task, limit: int, at: str) -> list[str]:
    """Snapshot the expert's episode on ``task`` (``at``: "start", "middle" or "last", the step
    before the end), play on, then restore into a fresh and into the same instance and replay."""
    where = f"task {task.id}"
    probe = factory()
    length = len(await _expert_trace(probe, task, limit))
    probe.close()
    prefix = {"start": 0, "middle": length // 2, "last": max(length - 1, 0)}[at]
    env = factory()
    await env.reset(task)
    for _ in range(prefix):
        await env.step(env.expert_action())
    try:
        snap = env.snapshot()
    except Exception as exc:
        return [f"{where}: snapshot() after {prefix} expert steps raised {type(exc).__name__}: {exc}"]
    key = _state_key(env)
    actions: list[Message] = []
    records: list[tuple[Any, ...]] = []
    for _ in range(limit):
        message = env.expert_action()
        step = await env.step(message)
        actions.append(message)
        records.append(_branch_record(step))
        if step.terminated or step.truncated:
            break
    problems: list[str] = []
    fresh = factory()
    # The same instance, now at the end of its episode, must come back too (the snapshot was not
    # changed by the steps after it), and so must a fresh instance that never saw a reset.
    for label, target in (("a fresh instance", fresh), ("the same instance", env)):
        try:
            target.restore(snap)
        except Exception as exc:
            problems.append(f"{where}: restore into {label} raised {type(exc).__name__}: {exc}")
            continue
        if _state_key(target) != key:
            problems.append(f"{where}: restored into {label}, state_key() {_state_key(target)!r} differs from {key!r}")
        if actions and target.expert_action() != actions[0]:
            problems.append(f"{where}: restored into {label} after {prefix} steps, the expert's next action differs")
        for i, message in enumerate(actions):
            got = _branch_record(await target.step(message))
            if got != records[i]:
                problems.append(
                    f"{where}: restored into {label} after {prefix} steps, replayed step {i + 1} gave "
                    f"{_branch_difference(records[i], got)}"
                )
                break
    fresh.close()
    env.close()
    return problems


def _step_problems(step: StepResult, reward_range: tuple[float, float], where: str) -> list[str]:
    problems = []
    low, high = reward_range
    if not low - 1e-9 <= step.reward <= high + 1e-9:
        problems.append(f"{where}: reward {step.reward} outside reward_range {reward_range}")
    if step.terminated and step.truncated:
        problems.append(f"{where}: terminated and truncated both set")
    if (step.terminated or step.truncated) and "success" not in step.info:
        problems.append(f"{where}: final step info lacks 'success'")
    return problems


# --- the checks -----------------------------------------------------------------------------------


@dataclass
class _CheckContext:
    """What the checks share: the env factory, two instances made up front (``first`` and
    ``second``), both splits' tasks, the episode step limit and the run's settings. A check that
    measures a figure or skips itself writes that to ``report``."""

    factory: Callable[[], Env]
    first: Env
    second: Env
    train: list[Task]
    test: list[Task]
    n_tasks: int
    seed: int
    limit: int  # steps an expert episode may take: the env's max_turns + 1
    min_expert_success: float
    timeout_s: float
    report: CheckReport


async def _resets_and_state_keys(env: Env, tasks: list[Task]) -> tuple[list[list[Message]], list[Any]]:
    """The messages of ``env.reset(task)`` and the ``state_key()`` after it, task by task."""
    resets, keys = [], []
    for t in tasks:
        resets.append(await env.reset(t))
        keys.append(_state_key(env))
    return resets, keys


async def check_determinism(ctx: _CheckContext) -> list[str]:
    """The same seed gives the same tasks, reset messages and ``state_key()`` on two instances; the
    next seed gives other tasks; every task carries the split it was asked for."""
    train, test, n_tasks, seed = ctx.train, ctx.test, ctx.n_tasks, ctx.seed
    problems = []
    if len(train) != n_tasks or len(test) != n_tasks:
        problems.append(f"asked for {n_tasks} tasks, got {len(train)} train and {len(test)} test")
    if len({t.id for t in train}) != len(train):
        problems.append("duplicate task ids within the train split")
    if [t.model_dump() for t in ctx.second.tasks("train", n_tasks, seed)] != [t.model_dump() for t in train]:
        problems.append(f"tasks('train', {n_tasks}, seed={seed}) differ between two instances")
    if [t.id for t in ctx.first.tasks("train", n_tasks, seed + 1)] == [t.id for t in train]:
        problems.append(f"seeds {seed} and {seed + 1} give the same train tasks")
    wrong = [t.id for t in train if t.split != "train"] + [t.id for t in test if t.split != "test"]
    if wrong:
        problems.append(f"tasks carry the wrong split: {wrong[:3]}")
    resets_first, keys_first = await _resets_and_state_keys(ctx.first, test[:5])
    resets_second, keys_second = await _resets_and_state_keys(ctx.second, test[:5])
    if resets_first != resets_second:
        problems.append("reset(task) gives different messages on two instances")
    wrong_keys = [k for k in keys_first if k is not None and not isinstance(k, str)]
    if wrong_keys:
        problems.append(f"state_key() must return str or None, got {type(wrong_keys[0]).__name__}")
    elif keys_first != keys_second:
        problems.append("state_key() after reset(task) differs between two instances")
    if any(not messages or messages[-1].role not in ("user", "system") for messages in resets_first):
        problems.append("reset must return the initial system/user messages")
    return problems


async def check_disjoint_splits(ctx: _CheckContext) -> list[str]:
    """Train and test share no task id, no task content and no initial prompt."""
    train, test = ctx.train, ctx.test
    problems = []
    shared_ids = {t.id for t in train} & {t.id for t in test}
    if shared_ids:
        problems.append(f"train and test share task ids: {sorted(shared_ids)[:3]}")
    shared_data = {_task_content(t) for t in train} & {_task_content(t) for t in test}
    if shared_data:
        problems.append(f"train and test share {len(shared_data)} task contents")
    train_prompts = {_prompt_text(await ctx.first.reset(t)) for t in train}
    test_prompts = {_prompt_text(await ctx.first.reset(t)) for t in test}
    if train_prompts & test_prompts:
        problems.append(f"train and test share {len(train_prompts & test_prompts)} initial prompts")
    return problems


async def check_tool_schemas(ctx: _CheckContext) -> list[str]:
    """The tool schemas are well-formed OpenAI function schemas with unique names (``schema_problems``)."""
    return schema_problems(ctx.first.tool_schemas())


def _bad_call_probes(schemas: Any) -> list[tuple[str, Message, tuple[str, ...]]]:
    """(label, assistant message, parse errors) of each bad call: an unknown tool, a malformed call
    and, when the env has a tool, an argument its first tool does not take."""
    tool_names = [s["function"]["name"] for s in schemas if isinstance(s, dict) and isinstance(s.get("function"), dict)]
    probes: list[tuple[str, Message, tuple[str, ...]]] = [
        ("unknown tool", Message(role="assistant", tool_calls=(ToolCall(name=_PROBE_TOOL, arguments={}, id="probe"),)), ()),
        ("malformed call", Message(role="assistant", content="<tool_call>{not json"), ("invalid JSON in tool call",)),
    ]
    if tool_names:
        bad_args = {"__no_such_argument__": 1}
        probes.append(("bad arguments", Message(role="assistant", tool_calls=(ToolCall(name=tool_names[0], arguments=bad_args, id="probe"),)), ()))
    return probes


async def check_bad_calls(ctx: _CheckContext) -> list[str]:
    """Each bad call (see ``_bad_call_probes``), on a fresh instance, gives an ``Error:`` tool
    message, no exception, and the episode goes on."""
    problems: list[str] = []
    for label, message, parse_errors in _bad_call_probes(ctx.first.tool_schemas()):
        env = ctx.factory()
        await env.reset(ctx.test[0])
        try:
            step = await env.step(message, parse_errors)
        except Exception as exc:
            problems.append(f"{label}: step raised {type(exc).__name__}: {exc}")
            continue
        if not any(_is_error_tool_message(m) for m in step.messages):
            problems.append(f"{label}: no 'Error: ...' tool message in {[m.content[:60] for m in step.messages]}")
        if step.terminated:
            problems.append(f"{label}: the episode was terminated by a bad call")
        problems += _step_problems(step, env.reward_range, label)
    return problems


async def check_isolation(ctx: _CheckContext) -> list[str]:
    """Two instances on different tasks, stepped in turn by the expert, produce exactly what each
    produces alone."""
    problems = []
    for a, b in [(ctx.test[0], ctx.test[1]), (ctx.train[0], ctx.test[-1])]:
        alone_a = await _expert_trace(ctx.factory(), a, ctx.limit)
        alone_b = await _expert_trace(ctx.factory(), b, ctx.limit)
        mixed_a, mixed_b = await _interleaved_traces(ctx.factory(), a, ctx.factory(), b, ctx.limit)
        if mixed_a != alone_a or mixed_b != alone_b:
            problems.append(f"tasks {a.id} and {b.id}: interleaved episodes differ from the same episodes run alone")
    return problems


async def check_expert(ctx: _CheckContext) -> list[str]:
    """The expert solves at least ``min_expert_success`` of the test tasks (the rate goes to
    ``report.expert_success_rate``), its episodes end terminated, and every step is valid
    (``_step_problems``)."""
    problems: list[str] = []
    solved = 0
    for task in ctx.test:
        result = await _checked_expert_episode(ctx.factory(), task, ctx.limit, ctx.timeout_s, problems)
        solved += int(result.success)
        if result.error:
            problems.append(f"task {task.id}: expert episode failed: {result.error}")
        elif result.end_reason != "terminated":
            problems.append(f"task {task.id}: expert episode ended with {result.end_reason}, not terminated")
    ctx.report.expert_success_rate = solved / len(ctx.test)
    if ctx.report.expert_success_rate < ctx.min_expert_success:
        problems.append(f"expert solved {solved}/{len(ctx.test)} test tasks, below {ctx.min_expert_success:.0%}")
    return problems


async def check_truncation(ctx: _CheckContext) -> list[str]:
    """An agent that never finishes (it keeps calling an unknown tool) is cut with ``truncated``
    (not ``terminated``) at the env's ``max_turns``, every idle step valid on the way."""
    problems: list[str] = []
    env = ctx.factory()
    await env.reset(ctx.test[0])
    max_turns = getattr(env, "max_turns", None)
    cap = int(max_turns) if isinstance(max_turns, int) else 1000
    idle = Message(role="assistant", tool_calls=(ToolCall(name=_PROBE_TOOL, arguments={}, id="idle"),))
    ended = None
    for turn in range(1, cap + 1):
        step = await env.step(idle)
        problems += _step_problems(step, env.reward_range, f"idle turn {turn}")
        if step.terminated or step.truncated:
            ended = (turn, step)
            break
    if ended is None:
        problems.append(f"an agent that never finishes was not truncated within {cap} turns")
        return problems
    turn, step = ended
    if not step.truncated or step.terminated:
        problems.append(
            f"idle episode ended at turn {turn} with terminated={step.terminated}, truncated={step.truncated}; expected truncated"
        )
    if isinstance(max_turns, int) and turn != max_turns:
        problems.append(f"idle episode was truncated at turn {turn}, expected max_turns={max_turns}")
    return problems


async def check_branching(ctx: _CheckContext) -> list[str] | None:
    """snapshot/restore round trips on three test tasks, snapshotted in the middle, at the start and
    one step before the end (``_branching_problems``); None (skipped, the reason in
    ``report.skipped``) for an env that cannot branch."""
    supported, why = _can_branch(ctx.factory())
    if not supported:
        ctx.report.skipped["branching"] = why
        return None
    problems: list[str] = []
    for task, at in zip(ctx.test, ("middle", "start", "last")):
        problems += await _branching_problems(ctx.factory, task, ctx.limit, at)
    return problems


# (report name, check), run in this order. A check returns its problems ([] when it passes), or None
# when it does not apply to the env.
_CHECKS: tuple[tuple[str, Callable[[_CheckContext], Awaitable[list[str] | None]]], ...] = (
    ("determinism", check_determinism),
    ("disjoint_splits", check_disjoint_splits),
    ("tool_schemas", check_tool_schemas),
    ("bad_calls", check_bad_calls),
    ("isolation", check_isolation),
    ("expert", check_expert),
    ("truncation", check_truncation),
    ("branching", check_branching),
)


def _both_splits(env: Env, n_tasks: int, seed: int, report: CheckReport,
                 raise_on_failure: bool) -> tuple[list[Task], list[Task]] | None:
    """``env``'s train and test tasks, or, when ``tasks()`` raises or gives fewer than two per split
    (nothing else can be checked then), None with the failure on ``report`` (EnvCheckError with
    ``raise_on_failure``)."""
    try:
        train = env.tasks("train", n_tasks, seed)
        test = env.tasks("test", n_tasks, seed)
    except Exception as exc:
        report.fail("tasks", f"tasks() raised {type(exc).__name__}: {exc}")
        if raise_on_failure:
            raise EnvCheckError(str(report)) from exc
        return None
    if len(train) < 2 or len(test) < 2:
        report.fail("tasks", f"asked for {n_tasks} tasks per split, got {len(train)} train and {len(test)} test")
        if raise_on_failure:
            raise EnvCheckError(str(report))
        return None
    return train, test


async def _run_check(check: Callable[[_CheckContext], Awaitable[list[str] | None]], ctx: _CheckContext) -> list[str] | None:
    try:
        return await check(ctx)
    except Exception as exc:  # a crashing env is a failed check, reported with the others
        return [f"raised {type(exc).__name__}: {exc}"]


async def acheck_env(
    make_env: MakeEnv,
    n_tasks: int = 20,
    seed: int = 0,
    min_expert_success: float = 0.95,
    timeout_s: float = 30.0,
    raise_on_failure: bool = True,
) -> CheckReport:
    """Check an environment's invariants (see the module docstring). ``make_env`` is a registered
    name or a zero-argument callable returning a fresh instance. Raises :class:`EnvCheckError`
    listing every failure, or with ``raise_on_failure=False`` returns the report (``check_env`` runs
    this for callers without an event loop)."""
    if n_tasks < 2:
        raise ValueError("check_env needs n_tasks >= 2")
    factory, name = _factory(make_env)
    report = CheckReport(env=name)
    first, second = factory(), factory()
    if first is second:
        report.fail("fresh_instances", "make_env() returned the same instance twice; episodes would share state")
    splits = _both_splits(first, n_tasks, seed, report, raise_on_failure)
    if splits is None:
        return report
    train, test = splits
    limit = int(getattr(first, "max_turns", 100)) + 1
    ctx = _CheckContext(factory, first, second, train, test, n_tasks, seed, limit, min_expert_success, timeout_s, report)

    for check_name, check in _CHECKS:
        problems = await _run_check(check, ctx)
        if problems is None:  # the check does not apply to this env (see report.skipped)
            continue
        if problems:
            for problem in problems:
                report.fail(check_name, problem)
        else:
            report.passed.append(check_name)

    if raise_on_failure and not report.ok:
        raise EnvCheckError(str(report))
    return report


async def _checked_expert_episode(env: Env, task: Task, limit: int, timeout_s: float, problems: list[str]) -> Trajectory:
    """The expert's episode through ``run_episode``, with every step checked on the way."""
    original_step = env.step

    async def checked_step(message: Message, parse_errors: Any = ()) -> StepResult:
        step = await original_step(message, parse_errors)
        problems.extend(_step_problems(step, env.reward_range, f"task {task.id}"))
        return step

    env.step = checked_step  # type: ignore[method-assign]
    try:
        return await run_episode(env, task, env.expert_action, max_turns=limit, timeout_s=timeout_s, policy_name="expert")
    finally:
        env.close()


def check_env(*args: Any, **kwargs: Any) -> CheckReport:
    """``asyncio.run(acheck_env(...))``: check an environment's invariants (see the module docstring and
    :func:`acheck_env` for the arguments). Raises :class:`EnvCheckError` listing every failure, or with
    ``raise_on_failure=False`` returns the report."""
    return asyncio.run(acheck_env(*args, **kwargs))
