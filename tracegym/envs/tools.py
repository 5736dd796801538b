"""Typed Python functions as tools: JSON schemas, validated dispatch, errors as tool messages.

A tool is a method of a :class:`ToolEnv` subclass marked with :func:`tool`. Its schema (OpenAI
function-calling format) comes from the type hints and the Google-style docstring::

    class Calc(ToolEnv):
        @tool(timeout=2.0)
        def calculate(self, expression: str) -> str:
            \"\"\"Evaluate an arithmetic expression.

            Args:
                expression: The expression, e.g. "37 * 24 - 129".
            \"\"\"

``ToolEnv.step`` validates every call against that schema, runs it under a timeout and turns every
failure (unknown tool, bad arguments, an exception, a timeout, a malformed call the renderer could
not parse) into a ``tool`` message starting with ``"Error:"``: the model sees what went wrong and
the episode goes on. Counters of calls, errors, timeouts and cut outputs are reported in
``StepResult.info``.

A tool's output (or error text) longer than ``max_tool_output_chars`` (default 16,000 characters) is
cut: the head and the tail are kept around a marker saying how many characters were dropped, so one
runaway tool cannot put megabytes into every trajectory.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import inspect
import json
import re
import threading
import types
import typing
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence, Union

import pydantic
import typing_extensions

from tracegym.envs.base import Env, Task
from tracegym.envs.rewards import RewardParts
from tracegym.types import Message, StepResult, ToolCall

__all__ = [
    "ToolEnv",
    "ToolSpec",
    "extract_answer",
    "in_call_order",
    "tool",
    "tool_schema",
    "validate_tool_arguments",
]

_TOOL_ATTR = "__tracegym_tool__"
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class ToolSpec:
    """What :func:`tool` attaches to a function."""

    timeout: float = 5.0


def tool(fn: Callable[..., Any] | None = None, *, timeout: float = 5.0) -> Any:
    """Mark a method of a :class:`ToolEnv` subclass as a tool (usable as ``@tool`` or ``@tool(timeout=...)``).

    ``timeout`` is the wall-clock limit of one call in seconds; a call that runs longer answers
    ``"Error: ... timed out"``. (A sync tool runs in its own daemon thread, which Python cannot kill:
    the thread finishes in the background, but neither the episode nor the process waits for it.)
    """
    if timeout <= 0:
        raise ValueError(f"tool timeout must be > 0, got {timeout}")

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, _TOOL_ATTR, ToolSpec(timeout=float(timeout)))
        return f

    return mark(fn) if fn is not None else mark


# --- schema generation ----------------------------------------------------------------------------


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Google-style docstring -> (description = first paragraph, {arg name: description})."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    para: list[str] = []
    for line in lines:
        if not line.strip():
            if para:
                break
            continue
        if re.match(r"^(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?):\s*$", line.strip()):
            break
        para.append(line.strip())
    description = " ".join(para)

    args: dict[str, str] = {}
    in_args = False
    base_indent: int | None = None
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        if re.match(r"^(Args|Arguments|Parameters):\s*$", stripped):
            in_args, base_indent, current = True, None, None
            continue
        if not in_args:
            continue
        if not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:  # the next section ("Returns:") ends the Args block
            break
        if base_indent is None:
            base_indent = indent
        m = re.match(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
        if indent == base_indent and m:
            current = m.group(1)
            args[current] = m.group(2).strip()
        elif current is not None:  # continuation line of the current argument
            args[current] = (args[current] + " " + stripped).strip()
    return description, args


def _is_optional(hint: Any) -> tuple[bool, Any]:
    """``Optional[X]`` / ``X | None`` -> (True, X); anything else -> (False, hint)."""
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)):
            inner = args[0] if len(args) == 1 else Union[tuple(args)]  # type: ignore[valid-type]
            return True, inner
    return False, hint


def _json_type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    raise TypeError(f"Literal values must be str, int, float or bool, got {value!r}")


def _hint_schema(hint: Any, where: str) -> dict[str, Any]:
    """JSON schema of one type hint (the subset tools support)."""
    if hint is inspect.Parameter.empty:
        raise TypeError(f"{where}: tool parameters need a type hint")
    optional, inner = _is_optional(hint)
    if optional:
        return _hint_schema(inner, where)
    if hint is str:
        return {"type": "string"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:
        return {"type": "number"}
    if hint is Any:
        return {}
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is list or origin is list:
        schema: dict[str, Any] = {"type": "array"}
        if args:
            schema["items"] = _hint_schema(args[0], where)
        return schema
    if hint is dict or origin is dict:
        schema = {"type": "object"}
        if len(args) == 2 and args[1] is not Any:
            schema["additionalProperties"] = _hint_schema(args[1], where)
        return schema
    if origin is Literal:
        kinds = {_json_type_of(v) for v in args}
        schema = {"type": kinds.pop()} if len(kinds) == 1 else {}
        schema["enum"] = list(args)
        return schema
    if origin is Union or origin is types.UnionType:
        return {"anyOf": [_hint_schema(a, where) for a in args]}
    raise TypeError(
        f"{where}: unsupported type hint {hint!r} (use str, int, float, bool, list[...], dict, Literal[...], Optional[...])"
    )


def _tool_parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The parameters the model fills in: everything except ``self``/``cls``."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    for p in params:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described by a schema")
    return params


def _resolved_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception as exc:  # a forward reference that does not resolve
        raise TypeError(f"tool {fn.__name__}: cannot resolve type hints: {exc}") from exc


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI function-calling schema of a typed function (a method's ``self`` is left out).

    Description = first docstring paragraph; parameter descriptions from the ``Args:`` section;
    a parameter without a default is required; a default is shown as ``"default"`` when it is JSON.
    """
    hints = _resolved_hints(fn)
    description, arg_docs = _parse_docstring(fn.__doc__)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in _tool_parameters(fn):
        prop = _hint_schema(hints.get(p.name, p.annotation), f"tool {fn.__name__}, parameter {p.name!r}")
        if p.name in arg_docs and arg_docs[p.name]:
            prop["description"] = arg_docs[p.name]
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
        elif p.default is not None:
            try:
                json.dumps(p.default)
                prop["default"] = p.default
            except TypeError:
                pass
        properties[p.name] = prop
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


# --- argument validation --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _arguments_adapter(fn: Callable[..., Any]) -> pydantic.TypeAdapter[Any]:
    """A strict validator of ``fn``'s keyword arguments (the same types the schema states).

    A TypedDict rather than a BaseModel, so parameter names such as ``json`` or ``schema`` cannot
    clash with model attributes; missing optional arguments stay missing and take the function's
    own defaults when it is called.
    """
    hints = _resolved_hints(fn)
    fields: dict[str, Any] = {}
    for p in _tool_parameters(fn):
        hint = hints.get(p.name, p.annotation)
        fields[p.name] = hint if p.default is inspect.Parameter.empty else typing_extensions.NotRequired[hint]
    arguments = typing_extensions.TypedDict(f"{fn.__name__}_arguments", fields)  # type: ignore[misc]
    arguments.__pydantic_config__ = pydantic.ConfigDict(strict=True, extra="forbid")  # type: ignore[attr-defined]
    return pydantic.TypeAdapter(arguments)


def _describe_error(err: dict[str, Any], allowed: Sequence[str]) -> str:
    loc = ".".join(str(x) for x in err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "missing":
        return f"missing required argument '{loc}'"
    if kind == "extra_forbidden":
        return f"unknown argument '{loc}' (allowed: {', '.join(allowed) or 'none'})"
    return f"argument '{loc}': {err.get('msg', 'invalid value')} (got {err.get('input')!r})"


def validate_tool_arguments(fn: Callable[..., Any], arguments: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Check ``arguments`` against ``fn``'s signature: types (strict: "3" is not an int, True is not
    a number), required arguments, unknown arguments. Returns (kwargs, None) or (None, message)."""
    allowed = [p.name for p in _tool_parameters(fn)]
    if not isinstance(arguments, dict):
        return None, f"arguments must be a JSON object, got {type(arguments).__name__}"
    try:
        parsed = _arguments_adapter(fn).validate_python(arguments)
    except pydantic.ValidationError as exc:
        problems = [_describe_error(e, allowed) for e in exc.errors()]
        return None, "; ".join(problems)
    return dict(parsed), None


def extract_answer(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` in ``text`` (stripped), or None."""
    found = _ANSWER_RE.findall(text or "")
    return found[-1].strip() if found else None


# --- the tool environment -------------------------------------------------------------------------


def _call_in_daemon_thread(
    fn: Callable[..., Any], kwargs: dict[str, Any], name: str, started: list[threading.Thread] | None = None
) -> asyncio.Future[Any]:
    """Run a blocking ``fn(**kwargs)`` on a new daemon thread; its outcome lands in the returned future.

    Why not ``asyncio.to_thread``: it uses the loop's default executor, a bounded pool of non-daemon
    threads. A tool that never returns keeps its worker forever, so a few dozen stuck calls fill the
    pool and every later sync tool call (in any episode) queues behind them and times out without
    having run; and ``asyncio.run`` joins the pool's threads on exit, so the process never ends.
    One daemon thread per call has neither problem: a stuck call only holds its own thread, and the
    interpreter exits without waiting for it. Starting a thread costs tens of microseconds, nothing
    next to a tool call. The result is handed back with ``call_soon_threadsafe``; once the caller
    gave up (timeout, cancellation) the future is done and a late result is dropped.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()  # like to_thread: the tool sees the caller's context vars

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # timed out or cancelled meanwhile
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, context.run(fn, **kwargs))
        except BaseException as exc:  # handed to the awaiting episode, like a pool would
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits for this result any more
            pass

    thread = threading.Thread(target=work, name=f"tracegym-tool-{name}", daemon=True)
    thread.start()
    if started is not None:
        started.append(thread)
    return future


def _truncate_output(text: str, limit: int) -> tuple[str, bool]:
    """Cut ``text`` to ``limit`` characters (3/4 head, 1/4 tail) around a marker naming the cut;
    (text, False) when it fits or ``limit`` is 0 (no limit)."""
    if limit <= 0 or len(text) <= limit:
        return text, False
    tail = limit // 4
    head = limit - tail
    cut = len(text) - limit
    marker = f"\n...[truncated {cut:,} characters]...\n"
    return text[:head] + marker + (text[len(text) - tail:] if tail else ""), True


def _format_result(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list, tuple)):
        return json.dumps(result, ensure_ascii=False, default=str)
    return str(result)


# Sync tool calls that timed out but whose thread still runs (Python cannot stop it), per env: they
# may still change the env's state, so the env refuses to branch until they finish. Kept outside
# the instance so that they are never part of a snapshot's state.
_STRAY_TOOL_CALLS: dict[int, list[tuple[str, threading.Thread]]] = {}  # id(env) -> calls, until the env is collected
_STRAY_LOCK = threading.Lock()


def _note_stray_calls(env: Any, name: str, threads: list[threading.Thread]) -> None:
    alive = [(name, t) for t in threads if t.is_alive()]
    if not alive:
        return
    with _STRAY_LOCK:
        if id(env) not in _STRAY_TOOL_CALLS:
            weakref.finalize(env, _forget_stray_calls, id(env))
        _STRAY_TOOL_CALLS.setdefault(id(env), []).extend(alive)


def _forget_stray_calls(key: int) -> None:
    with _STRAY_LOCK:
        _STRAY_TOOL_CALLS.pop(key, None)


def _stray_calls(env: Any) -> list[str]:
    """Names of the timed-out sync tool calls of ``env`` whose threads still run."""
    with _STRAY_LOCK:
        calls = [(name, t) for name, t in _STRAY_TOOL_CALLS.get(id(env), []) if t.is_alive()]
        if id(env) in _STRAY_TOOL_CALLS:
            _STRAY_TOOL_CALLS[id(env)] = calls  # the finalizer still removes the entry
        return [name for name, _ in calls]


class ToolEnv(Env):
    """An environment whose actions are tool calls.

    Subclasses define tools with :func:`tool` and implement ``tasks``, ``reset`` (return the system
    and user messages), ``expert_action`` and either ``on_text`` or ``score_answer``. Per-episode
    state lives on the instance; the turn and error counters are reset automatically whenever a
    subclass's ``reset`` runs (no ``super().reset`` call needed).

    A tool may end the episode (the goal is reached, the agent fell in a hole) by calling
    :meth:`end_episode`; calls after it in the same message are answered with an error and not run.

    Branching: a subclass whose episode state is plain Python data on the instance opts in with
    ``branchable = True`` (listing shared read-only resources in ``snapshot_exclude``); the
    generic :meth:`Env.snapshot` then also captures this class's bookkeeping (``turn``, ``done``,
    the pending end of episode, the ``counters`` of tool calls, errors, timeouts, parse errors and
    cut outputs, ``max_turns``), so a restored episode reports the same counters and is truncated at
    the same turn. A subclass with its own ``snapshot_state``/``restore_state`` includes
    :meth:`tool_bookkeeping` and :meth:`restore_tool_bookkeeping`. An env refuses to branch while a
    timed-out sync tool call still runs in its thread, and MCP-backed envs (:class:`MCPToolEnv`)
    refuse: their servers' state lives in other processes.

    Reward parts (``tracegym.envs.rewards``): a subclass that splits its reward declares
    ``offered_reward_parts`` (the outcome part first) and passes its ``reward_parts`` option to
    ``__init__``. The outcome part's value is the reward of :meth:`end_episode` / :meth:`on_text`;
    other parts are earned during a step by :meth:`earn` (from a tool) or returned by
    :meth:`step_reward_parts` (parts of the step as a whole). With the option unset the reward is
    the outcome reward, exactly as without parts, and no parts are reported.
    """

    #: The attributes of this class's per-episode bookkeeping (part of every snapshot).
    TOOL_BOOKKEEPING: tuple[str, ...] = (
        "turn", "done", "_pending_end", "counters", "_episode_started", "max_turns", "max_tool_output_chars",
    )

    default_max_turns: int = 10
    default_max_tool_output_chars: int = 16_000
    #: The reward parts this env can split its reward into, each with the range of one step's
    #: unweighted value; the first is the outcome part. Empty: the env has no parts.
    offered_reward_parts: typing.ClassVar[dict[str, tuple[float, float]]] = {}

    def __init__(
        self, max_turns: int | None = None, max_tool_output_chars: int | None = None,
        reward_parts: typing.Mapping[str, float] | None = None,
    ) -> None:
        """``max_turns``: assistant turns before the episode is truncated (None: ``default_max_turns``).
        ``max_tool_output_chars``: longest tool message content kept, in characters, marker aside
        (None: ``default_max_tool_output_chars``, 16,000; 0: no limit). ``reward_parts``: the
        subclass's env option ``{part: weight}`` (None: parts off)."""
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_tool_output_chars is not None and max_tool_output_chars < 0:
            raise ValueError(f"max_tool_output_chars must be >= 0 (0: no limit), got {max_tool_output_chars}")
        self.max_turns: int = max_turns if max_turns is not None else self.default_max_turns
        self.max_tool_output_chars: int = (
            max_tool_output_chars if max_tool_output_chars is not None else self.default_max_tool_output_chars
        )
        self.reward_parts: RewardParts | None = RewardParts.from_option(reward_parts, self.offered_reward_parts)
        if self.reward_parts is not None:
            # Weights scale the step reward, so the range check_env holds steps to scales with them.
            self.reward_range = self.reward_parts.step_range(self.offered_reward_parts)  # type: ignore[misc]
        self._begin_episode()
        self._episode_started = False

    # Wrap every subclass's ``reset`` so per-episode counters restart even when it does not call super().
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        reset = cls.__dict__.get("reset")
        if reset is not None and not getattr(reset, "_tracegym_wrapped", False):

            @functools.wraps(reset)
            async def wrapped_reset(self: ToolEnv, task: Task) -> list[Message]:
                self._begin_episode()
                messages = await reset(self, task)
                self._episode_started = True
                return messages

            wrapped_reset._tracegym_wrapped = True  # type: ignore[attr-defined]
            cls.reset = wrapped_reset  # type: ignore[method-assign]

    def _begin_episode(self) -> None:
        self.turn = 0
        self.done = False
        self._pending_end: tuple[float, dict[str, Any]] | None = None
        self.counters: dict[str, int] = {
            "tool_calls": 0,
            "tool_errors": 0,
            "tool_timeouts": 0,
            "parse_errors": 0,
            "tool_output_truncated": 0,
        }
        self._earned: dict[str, float] = {}

    # -- branching --

    def branch_refusal(self) -> str | None:
        reason = super().branch_refusal()
        if reason is not None:
            return reason
        stray = _stray_calls(self)
        if stray:
            return f"a timed-out call of tool '{stray[0]}' still runs in the background and may still change the env's state"
        return None

    def tool_bookkeeping(self) -> dict[str, Any]:
        """A deep copy of the turn counter, the done flag, the pending end and the tool counters."""
        return {a: copy.deepcopy(self.__dict__[a]) for a in self.TOOL_BOOKKEEPING if a in self.__dict__}

    def restore_tool_bookkeeping(self, state: dict[str, Any]) -> None:
        """Set the bookkeeping from :meth:`tool_bookkeeping` (copied again: the argument stays usable)."""
        for attr in self.TOOL_BOOKKEEPING:
            if attr in state:
                self.__dict__[attr] = copy.deepcopy(state[attr])

    # -- tools --

    @classmethod
    def tool_functions(cls) -> dict[str, Callable[..., Any]]:
        """{tool name: function} of the decorated methods, in definition order (base classes first)."""
        found: dict[str, Callable[..., Any]] = {}
        for klass in reversed(cls.__mro__):
            for name, attr in vars(klass).items():
                fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
                if callable(fn) and hasattr(fn, _TOOL_ATTR):
                    found[name] = fn
                elif name in found:  # a subclass overrode a tool with a plain attribute
                    del found[name]
        return found

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(fn) for fn in self.tool_functions().values()]

    def earn(self, part: str, value: float) -> None:
        """Add ``value`` (unweighted) to reward part ``part`` of the current step; a no-op when the
        part is not enabled by the ``reward_parts`` option, so tools may call it unconditionally."""
        if part not in self.offered_reward_parts:
            raise ValueError(f"{type(self).__name__} does not offer reward part {part!r}")
        if self.reward_parts is not None and part in self.reward_parts:
            self._earned[part] = self._earned.get(part, 0.0) + float(value)

    def step_reward_parts(self) -> dict[str, float]:
        """Parts earned by the step as a whole, called once at the end of every step while parts
        are enabled, after its tool calls (or final answer) ran. Default: none. Override it for parts
        that compare the state before and after the step (potential-based shaping)."""
        return {}

    def end_episode(self, reward: float, success: bool, **info: Any) -> None:
        """Called by a tool: the episode ends after the current call with this reward."""
        self._pending_end = (float(reward), {"success": int(bool(success)), **info})

    def _bounded(self, text: str) -> str:
        """``text`` cut to ``max_tool_output_chars`` (counted in ``tool_output_truncated``)."""
        text, cut = _truncate_output(text, self.max_tool_output_chars)
        if cut:
            self.counters["tool_output_truncated"] += 1
        return text

    async def _run_tool(self, call: ToolCall) -> Message:
        functions = self.tool_functions()
        self.counters["tool_calls"] += 1

        def error(text: str) -> Message:
            self.counters["tool_errors"] += 1
            return Message(role="tool", content=self._bounded(f"Error: {text}"), tool_call_id=call.id, name=call.name)

        fn = functions.get(call.name)
        if fn is None:
            return error(f"unknown tool '{call.name}'. Available tools: {', '.join(functions) or 'none'}.")
        kwargs, problem = validate_tool_arguments(fn, call.arguments)
        if problem is not None:
            return error(f"invalid arguments for tool '{call.name}': {problem}.")
        spec: ToolSpec = getattr(fn, _TOOL_ATTR)
        bound = getattr(self, call.name)
        started: list[threading.Thread] = []
        try:
            if inspect.iscoroutinefunction(fn):
                result = await asyncio.wait_for(bound(**kwargs), timeout=spec.timeout)
            else:
                result = await asyncio.wait_for(
                    _call_in_daemon_thread(bound, kwargs, call.name, started), timeout=spec.timeout
                )
        except (asyncio.TimeoutError, TimeoutError):
            self.counters["tool_timeouts"] += 1
            _note_stray_calls(self, call.name, started)
            return error(f"tool '{call.name}' timed out after {spec.timeout:g} s.")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the tool's own failure is the model's information, not a crash
            detail = str(exc) or type(exc).__name__
            return error(f"tool '{call.name}' failed: {type(exc).__name__}: {detail}")
        return Message(role="tool", content=self._bounded(_format_result(result)), tool_call_id=call.id, name=call.name)

    # -- the step --

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        if not self._episode_started:
            raise RuntimeError(f"{type(self).__name__}.step called before reset(task)")
        if self.done:
            raise RuntimeError(f"{type(self).__name__}.step called after the episode ended; call reset(task)")
        self.turn += 1
        self._earned = {}
        out: list[Message] = []
        for problem in parse_errors:
            self.counters["parse_errors"] += 1
            out.append(Message(role="tool", content=f"Error: {problem}"))

        reward, terminated, limit_hit, info = 0.0, False, False, {}
        if message.tool_calls or parse_errors:
            for call in message.tool_calls:
                if self._pending_end is not None:
                    out.append(
                        Message(
                            role="tool",
                            content="Error: not run, the episode ended at an earlier call.",
                            tool_call_id=call.id,
                            name=call.name,
                        )
                    )
                    continue
                out.append(await self._run_tool(call))
            if self._pending_end is not None:
                reward, info = self._pending_end
                terminated = True
        else:
            outcome = self.on_text(message)
            if inspect.isawaitable(outcome):
                outcome = await outcome
            out.extend(outcome.messages)
            reward, terminated, info = outcome.reward, outcome.terminated, dict(outcome.info)
            limit_hit = outcome.truncated

        if self.reward_parts is not None:
            earned = {**self._earned, self.reward_parts.outcome: reward}
            for part, value in self.step_reward_parts().items():
                earned[part] = earned.get(part, 0.0) + value
            reward = self.reward_parts.reward(earned)
            info = {**info, **self.reward_parts.info(earned)}
        # Never both: a task that ended on the last allowed turn is terminated, not truncated.
        truncated = not terminated and (limit_hit or self.turn >= self.max_turns)
        self.done = terminated or truncated
        return self._result(out, reward, terminated, truncated, info)

    def _result(
        self, out: list[Message], reward: float, terminated: bool, truncated: bool, info: dict[str, Any]
    ) -> StepResult:
        info = {**info, **self.counters, "turns": self.turn}
        if terminated or truncated:
            info.setdefault("success", 0)
        return StepResult(messages=tuple(out), reward=reward, terminated=terminated, truncated=truncated, info=info)

    # -- final answers --

    def on_text(self, message: Message) -> StepResult:
        """An assistant message without tool calls. Default: read ``<answer>...</answer>``, score it
        with :meth:`score_answer` and end the episode; a message with no answer also ends it with
        reward 0 (the agent stopped without answering)."""
        answer = extract_answer(message.content)
        if answer is None:
            return StepResult(terminated=True, reward=0.0, info={"success": 0, "no_answer": 1})
        reward = float(self.score_answer(answer))
        return StepResult(terminated=True, reward=reward, info={"success": int(reward >= 1.0), "answer": answer})

    def score_answer(self, answer: str) -> float:
        """Reward of a final answer; override this (or ``on_text``)."""
        raise NotImplementedError(f"{type(self).__name__} must override score_answer or on_text")


def in_call_order(calls: Sequence[ToolCall], inner_out: list[Message], own: list[Message]) -> list[Message]:
    """The inner env's messages and a wrapper's own answers (the honeypot's, the memory tools') in
    the order of the calls they answer, so results line up with calls as if one env had run them all
    (templates pair them by position). Messages answering no call (parse errors) come first, as
    ``ToolEnv`` writes them; without distinct call ids the wrapper's answers simply follow."""
    if not own:
        return inner_out
    ids = [call.id for call in calls]
    if None in ids or len(set(ids)) != len(ids):
        return inner_out + own
    by_id: dict[str | None, Message] = {}
    rest: list[Message] = []
    for m in inner_out + own:
        if m.tool_call_id in ids and m.tool_call_id not in by_id:
            by_id[m.tool_call_id] = m
        else:
            rest.append(m)
    return rest + [by_id[i] for i in ids if i in by_id]
