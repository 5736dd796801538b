"""The one episode loop: an ``Env``, a ``Task`` and a per-episode policy -> a ``Trajectory``.

``play_episode`` plays one task: it makes the env (and the episode's policy), resets it, then per
turn shows the policy the conversation so far (an :class:`Observation`), takes its :class:`Action`,
steps the env and records what happened, until one of the end reasons of ``tracegym.types.EndReason``:

================  =================================================================================
``terminated``    the env ended the task (``StepResult.terminated``)
``truncated``     the env cut it by its own limit (``StepResult.truncated``)
``max_turns``     the loop's turn limit T
``max_tokens``    the per-episode budget of generated tokens is spent
``context``       the policy raised :class:`ContextExhausted` (its next prompt would not fit)
``timeout``       the wall-clock limit; what happened before it is kept
``env_error``     making the env, ``reset``, ``step`` or ``state_key`` raised, or ``step`` returned a
                  non-finite reward or reward part (a NaN/inf reward is never recorded)
``engine_error``  making the policy or the policy itself raised, or it returned a malformed action
================  =================================================================================

The last three are failures (:data:`FAILED_END_REASONS`). ``play_episode`` never raises for any of
them: one episode's failure never stops the others that run beside it.

Policies. A :data:`Policy` is an async callable ``policy(observation) -> Action``, made fresh per
episode (it may keep per-episode state, e.g. the previous prompt's token ids). An ``Action`` carries
the assistant ``Message``, the parse errors of malformed tool calls, and optionally the
:class:`TokenData` it was sampled as (prompt ids, completion ids, log-probs, finish reason).

Turns. ``Trajectory.turns`` are token-exact by contract (SFT and RL train on them, and every reader
takes "has turns" to mean "has tokens"), so the loop records one ``Turn`` per assistant message
exactly when the policy gives token data, and none for message-only policies (scripted experts run
by ``run_episode``, test policies): their trajectories keep the whole conversation in ``messages``
with ``turns == ()``, as text-level data always was. A policy gives token data on every turn or on
none (mixing is an ``engine_error``). The rollout runner (``tracegym.rollout``) gives token data for
every kind of policy it drives, the scripted expert included (the renderer's encoding of its
messages), so its expert trajectories are SFT data.

Metrics. ``Turn.metrics`` are the numeric entries of that step's info; ``Trajectory.metrics`` those of
the final step's info (the env's counters are running totals), except the reward parts
``reward/<part>`` (``tracegym.envs.rewards``), which are per step and summed over the episode's steps.
``Trajectory.metrics["parse_errors/<reason>"]`` count the episode's failed tool-call attempts by
reason (``bad_json``, ``unknown_tool``, ``bad_args``, ``truncated``, ``other``;
``tracegym.render.call_errors``): every reason, 0 where none, in every episode that declared tools or
had a failure. They count the action's parse errors (a ``CallError``'s own reason, else the one its
text names; an open call is ``truncated`` when the turn's ``finish_reason`` is not ``stop``) and the
parsed calls that name an undeclared tool or whose arguments fail the tool's JSON schema. The loop
only counts: the action goes to the env unchanged, which answers every failed call with an error.

State keys. Each recorded ``Turn.state_key`` is ``env.state_key()`` taken before that turn's action,
or, when the env returns None, a 16-hex-digit sha1 of the observations so far (role and content of
every non-assistant message, in order): turns of one task with equal keys faced the same state.

``run_episode`` / ``run_episodes`` are the message-level entry points (``check_env``, ``tracegym
envs expert``, tests): the policy there is a plain function returning a ``Message`` (or a
``ParsedCompletion``/``Action``), called with no argument (``env.expert_action``) or with the
conversation so far, sync or async.

The timeout can only interrupt code that awaits (async tools; sync tools run in threads by
``ToolEnv``), not a CPU loop that blocks the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import math
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from tracegym.envs.base import Env, Task
from tracegym.render.call_errors import failure_metrics, turn_failures
from tracegym.types import (
    REWARD_PART_PREFIX,
    EndReason,
    FinishReason,
    Message,
    ParsedCompletion,
    StepResult,
    Trajectory,
    Turn,
)

log = logging.getLogger(__name__)

__all__ = [
    "Action",
    "ContextExhausted",
    "FAILED_END_REASONS",
    "MessagePolicy",
    "Observation",
    "Policy",
    "PolicyError",
    "TokenData",
    "message_policy",
    "play_episode",
    "run_episode",
    "run_episodes",
]

FAILED_END_REASONS: frozenset[str] = frozenset({"env_error", "timeout", "engine_error"})
"""End reasons that mean the episode failed (counted as failures, excluded or zero-rewarded)."""


@dataclass(frozen=True)
class TokenData:
    """How a token-level policy produced an action: what becomes the ``Turn``'s token fields.

    ``prompt_ids``: the whole prompt the engine saw; ``completion_ids``: the sampled ids (end-of-turn
    included when sampled); ``completion_logprobs``: one per completion id, or None when unknown
    (text-level engines, scripted experts); ``finish_reason``: why sampling stopped.
    """

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    completion_logprobs: Sequence[float] | None = None
    finish_reason: FinishReason = "stop"


@dataclass(frozen=True)
class Action:
    """A policy's answer for one turn.

    ``message``: the assistant message the env is stepped with. ``parse_errors``: tool calls the
    renderer could not parse (the env shows them to the model). ``tokens``: the token data, or None
    for a message-only policy (then the trajectory records no turns, see the module docstring).
    """

    message: Message
    parse_errors: tuple[str, ...] = ()
    tokens: TokenData | None = None
    summary_request: Message | None = None
    """Set when this action is a summary of the episode's history that the policy wrote to manage
    its context (``rollout.context: summarize``): the user message it answered. The episode records
    the turn (``Turn.kind == "summary"``) and adds both messages to the transcript, but never steps
    the env with it; it does not count toward the turn limit."""


@dataclass(frozen=True)
class Observation:
    """What a policy sees before each turn.

    ``messages``: the whole conversation so far (reset messages, then each assistant message and the
    env's answer). ``new_messages``: the env's answer to the previous action (the reset messages on
    turn 0). ``token_budget``: generated tokens this episode may still use (None: no budget); a
    token policy samples at most that many.
    """

    task: Task
    turn: int  # 0-based index of the turn about to be played
    messages: tuple[Message, ...]
    new_messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...]
    token_budget: int | None = None


class ContextExhausted(Exception):
    """Raised by a policy when its next prompt no longer fits the context window: the episode ends
    with end reason ``context`` (not a failure) and keeps its turns so far."""


class PolicyError(Exception):
    """Raised by a policy to end the episode with ``engine_error`` and exactly this text as the
    error (any other exception from a policy is recorded as ``"<Type>: <text>"``)."""


Policy = Callable[[Observation], Awaitable[Action]]
"""A per-episode policy: ``await policy(observation) -> Action``."""

MessagePolicy = Callable[..., Any]
"""What ``run_episode`` accepts: ``act()`` or ``act(conversation)``, sync or async, returning a
``Message``, a ``ParsedCompletion`` (message + parse errors) or an ``Action``."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, PolicyError):
        return str(exc)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _play_in_time(play: Awaitable[None], st: Any, timeout_s: float | None, episode: str,
                        logger: logging.Logger = log) -> None:
    """Await ``play`` (an episode's turns, filling ``st``) within ``timeout_s``: a timeout ends the episode
    ``timeout``; any other exception ends it ``engine_error`` and is logged on ``logger`` with its
    traceback (``episode`` names it in the message): a bug here must not kill the other episodes."""
    try:
        async with asyncio.timeout(timeout_s):
            await play
    except TimeoutError:
        st.end("timeout", f"episode timed out after {timeout_s:g} s")
    except Exception as exc:  # noqa: BLE001 - a bug here must not kill the other episodes
        logger.error("unexpected error in %s: %s", episode, "".join(traceback.format_exception(exc)))
        st.end("engine_error", _describe(exc))


def _close_env(env: Any, logger: logging.Logger = log) -> None:
    """``env.close()``; what it raises is logged on ``logger``, never raised: a failing close must not
    hide the episode's result."""
    try:
        env.close()
    except Exception as exc:  # noqa: BLE001 - a failing close must not hide the result
        logger.warning("env.close() raised: %s", _describe(exc))


def _artifacts(info: dict[str, Any]) -> dict[str, str]:
    """``info["artifacts"]``'s ``{name: path}`` entries (anything else there is left out)."""
    found = info.get("artifacts")
    if not isinstance(found, dict):
        return {}
    return {str(k): v for k, v in found.items() if isinstance(v, str)}


def _numeric(info: dict[str, Any]) -> dict[str, float]:
    """The finite numeric entries of a step's info (bools as 0/1): what lands in ``metrics``."""
    out: dict[str, float] = {}
    for k, v in info.items():
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


def _takes_conversation(act: Callable[..., Any]) -> bool:
    try:
        params = [
            p
            for p in inspect.signature(act).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 1


def message_policy(act: MessagePolicy) -> Policy:
    """Wrap a message-level function (see :data:`MessagePolicy`) as a :data:`Policy`."""
    with_conversation = _takes_conversation(act)

    async def policy(obs: Observation) -> Action:
        out = act(list(obs.messages)) if with_conversation else act()
        if inspect.isawaitable(out):
            out = await out
        if isinstance(out, Action):
            return out
        if isinstance(out, ParsedCompletion):
            return Action(message=out.message, parse_errors=tuple(out.errors))
        if isinstance(out, Message):
            return Action(message=out)
        raise PolicyError(f"policy returned {type(out).__name__}, expected Message, ParsedCompletion or Action")

    return policy


class _ObservationHash:
    """Running sha1 over the role and content of every non-assistant message."""

    def __init__(self) -> None:
        self._h = hashlib.sha1()

    def add(self, messages: Sequence[Message]) -> None:
        for m in messages:
            if m.role != "assistant":
                self._h.update(m.role.encode() + b"\x00" + m.content.encode("utf-8", "replace") + b"\x1e")

    def key(self) -> str:
        return self._h.copy().hexdigest()[:16]


@dataclass
class _Progress:
    """The episode as far as it got; filled as the loop goes so a timeout keeps it."""

    env_name: str
    tools: list[dict[str, Any]] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    assistant_turns: int = 0
    generated: int = 0
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)  # part -> unweighted sum over the steps
    call_failures: Counter[str] = field(default_factory=Counter)  # reason -> failed call attempts
    last_info: dict[str, Any] = field(default_factory=dict)
    end_reason: EndReason | None = None
    error: str | None = None

    def end(self, reason: EndReason, error: str | None = None) -> None:
        self.end_reason, self.error = reason, error


def _turn(action: Action, step: StepResult | None, reward: float, state_key: str) -> Turn:
    """The token-exact record of ``action``; ``step`` None: a summary turn (no env step)."""
    tokens = action.tokens
    assert tokens is not None
    logprobs = tuple(float(x) for x in tokens.completion_logprobs) if tokens.completion_logprobs is not None else None
    return Turn(
        prompt_ids=tuple(tokens.prompt_ids),
        completion_ids=tuple(tokens.completion_ids),
        completion_logprobs=logprobs,
        finish_reason=tokens.finish_reason,
        message=action.message,
        parse_errors=tuple(action.parse_errors),
        env_messages=() if step is None else tuple(step.messages),
        reward=reward,
        metrics={} if step is None else _numeric(step.info),
        artifacts=_artifacts(step.info) if step is not None else {},
        kind="summary" if step is None else "action",
        state_key=state_key,
    )


def _record_summary(action: Action, st: _Progress, key: str, after_summary: bool) -> str | None:
    """Record a summary turn (``Action.summary_request``): its two messages join the transcript, its
    tokens the turns; the env is not stepped. Returns an error text for a malformed one."""
    assert action.summary_request is not None
    if after_summary:
        return "policy wrote two summaries without acting in between"
    if action.summary_request.role != "user":
        return "a summary's request must be a user message"
    if action.tokens is None:
        return "a summary turn needs token data"
    try:  # its own state key: GiGPO compares summaries with summaries, never with actions
        st.turns.append(_turn(action, None, 0.0, f"summary:{key}"))
    except Exception as exc:  # noqa: BLE001 - malformed token data is the policy's fault
        return f"invalid token data: {_describe(exc)}"
    st.generated += len(action.tokens.completion_ids)
    st.messages.extend([action.summary_request, action.message])
    return None


async def _play(env: Env, task: Task, policy: Policy, max_turns: int, max_tokens: int | None, st: _Progress) -> None:
    try:
        st.tools = list(env.tool_schemas())
        initial = list(await env.reset(task))
    except Exception as exc:  # noqa: BLE001 - recorded as the episode's error
        return st.end("env_error", f"reset failed: {_describe(exc)}")
    st.messages.extend(initial)
    observed = _ObservationHash()
    observed.add(initial)
    new_messages: tuple[Message, ...] = tuple(initial)
    with_tokens: bool | None = None  # decided by the first action
    after_summary = False  # the last action was a summary: the next one must act
    while True:
        if st.assistant_turns >= max_turns:
            return st.end("max_turns")
        try:
            key = env.state_key() if hasattr(env, "state_key") else None
        except Exception as exc:  # noqa: BLE001
            return st.end("env_error", f"state_key failed: {_describe(exc)}")
        if key is not None and not isinstance(key, str):
            return st.end("env_error", f"state_key() returned {type(key).__name__}, expected str or None")
        if key is None:
            key = observed.key()
        budget = None if max_tokens is None else max_tokens - st.generated
        obs = Observation(task, st.assistant_turns, tuple(st.messages), new_messages, tuple(st.tools), budget)
        try:
            action = await policy(obs)
        except ContextExhausted:
            return st.end("context")
        except Exception as exc:  # noqa: BLE001
            return st.end("engine_error", _describe(exc))
        if not isinstance(action, Action):
            return st.end("engine_error", f"policy returned {type(action).__name__}, expected Action")
        if not isinstance(action.message, Message) or action.message.role != "assistant":
            return st.end("engine_error", "policy's action message must be an assistant Message")
        has_tokens = action.tokens is not None
        if with_tokens is None:
            with_tokens = has_tokens
        elif has_tokens != with_tokens:
            return st.end("engine_error", "policy mixed token and message-only actions in one episode")
        tokens = action.tokens
        if tokens is not None and tokens.completion_logprobs is not None:
            if len(tokens.completion_logprobs) != len(tokens.completion_ids):
                return st.end(
                    "engine_error",
                    f"policy gave {len(tokens.completion_logprobs)} log-probs for "
                    f"{len(tokens.completion_ids)} completion tokens",
                )
        if action.summary_request is not None:  # the policy summarized its history: no env step
            problem = _record_summary(action, st, key, after_summary)
            if problem is not None:
                return st.end("engine_error", problem)
            after_summary, new_messages = True, ()  # no env answer: the next prompt is rendered afresh
            if max_tokens is not None and st.generated >= max_tokens:
                return st.end("max_tokens")
            continue
        after_summary = False
        st.messages.append(action.message)
        st.assistant_turns += 1
        cut = None if tokens is None else tokens.finish_reason != "stop"
        st.call_failures.update(turn_failures(action.message, action.parse_errors, st.tools, cut))
        if tokens is not None:
            st.generated += len(tokens.completion_ids)
        try:
            step = await env.step(action.message, tuple(action.parse_errors))
        except Exception as exc:  # noqa: BLE001
            return st.end("env_error", f"step {st.assistant_turns} failed: {_describe(exc)}")
        if not isinstance(step, StepResult):
            return st.end("env_error", f"step {st.assistant_turns} returned {type(step).__name__}, expected StepResult")
        reward = float(step.reward)
        if not math.isfinite(reward):
            return st.end(
                "env_error", f"task {task.id}: step {st.assistant_turns} returned a non-finite reward {reward!r}"
            )
        parts = step.reward_parts
        bad_parts = {part: value for part, value in parts.items() if not math.isfinite(value)}
        if bad_parts:
            return st.end(
                "env_error", f"task {task.id}: step {st.assistant_turns} returned a non-finite reward part {bad_parts}"
            )
        if tokens is not None:
            try:
                st.turns.append(_turn(action, step, reward, key))
            except Exception as exc:  # noqa: BLE001 - malformed token data is the policy's fault
                return st.end("engine_error", f"invalid token data: {_describe(exc)}")
        st.reward += reward
        for part, value in parts.items():
            st.reward_parts[part] = st.reward_parts.get(part, 0.0) + value
        st.last_info = dict(step.info)
        st.messages.extend(step.messages)
        observed.add(step.messages)
        new_messages = tuple(step.messages)
        if step.terminated:
            return st.end("terminated")
        if step.truncated:
            return st.end("truncated")
        if max_tokens is not None and st.generated >= max_tokens:
            return st.end("max_tokens")


async def play_episode(
    make_env: Callable[[], Env],
    task: Task,
    make_policy: Callable[[Env], Policy],
    *,
    max_turns: int = 50,
    max_tokens: int | None = None,
    timeout_s: float | None = None,
    sample_index: int = 0,
    env_name: str | None = None,
    policy_name: str = "",
    close_env: bool = True,
) -> Trajectory:
    """Play ``task`` once and return its ``Trajectory`` (see the module docstring). Never raises for
    a failure of the env or the policy; the trajectory's ``end_reason`` and ``error`` say what
    happened.

    Args:
        make_env: zero-argument factory of the episode's env.
        make_policy: ``make_policy(env) -> Policy``, the episode's policy (it may use the env, e.g.
            its scripted expert).
        max_turns: at most this many assistant turns (end reason ``max_turns``).
        max_tokens: budget of generated tokens (``TokenData.completion_ids``) of the episode.
        timeout_s: wall-clock limit (end reason ``timeout``); None: none.
        sample_index, policy_name: recorded in the trajectory.
        env_name: recorded as ``Trajectory.env`` (default: the env's ``name``).
        close_env: call ``env.close()`` at the end (False when the caller owns the env).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    started = time.perf_counter()
    factory_name = getattr(make_env, "name", "")  # a class's ClassVar, when the factory is the class
    st = _Progress(env_name=env_name or (factory_name if isinstance(factory_name, str) else ""))
    env: Env | None = None
    try:
        env = make_env()
    except Exception as exc:  # noqa: BLE001
        st.end("env_error", f"making the env failed: {_describe(exc)}")
    if env is not None:
        name = getattr(env, "name", "")
        st.env_name = env_name or (name if isinstance(name, str) and name else type(env).__name__)
        try:
            policy = make_policy(env)
        except Exception as exc:  # noqa: BLE001
            st.end("engine_error", f"making the policy failed: {_describe(exc)}")
        else:
            await _play_in_time(_play(env, task, policy, max_turns, max_tokens, st), st, timeout_s,
                                f"episode {task.id}")
        if close_env:
            _close_env(env)
    failed = st.end_reason in FAILED_END_REASONS
    if st.error is not None:
        log.debug("episode %s/%d ended with %s: %s", task.id, sample_index, st.end_reason, st.error)
    info: dict[str, Any] = {"wall_time_s": round(time.perf_counter() - started, 4)}
    if "reference_calls" in task.data:
        info["reference_calls"] = task.data["reference_calls"]
    metrics = _numeric(st.last_info)
    metrics.update({REWARD_PART_PREFIX + part: total for part, total in st.reward_parts.items()})
    if st.tools or st.call_failures:
        metrics.update(failure_metrics(st.call_failures))
    return Trajectory(
        env=st.env_name,
        task_id=task.id,
        split=task.split,
        sample_index=sample_index,
        tools=tuple(st.tools),
        messages=tuple(st.messages),
        turns=tuple(st.turns),
        reward=st.reward,
        success=False if failed else bool(st.last_info.get("success", False)),
        metrics=metrics,
        end_reason=st.end_reason or "engine_error",
        error=st.error,
        policy=policy_name,
        info=info,
    )


# --- message-level entry points ---------------------------------------------------------------------


async def run_episode(
    env: Env,
    task: Task,
    act: MessagePolicy,
    max_turns: int = 50,
    timeout_s: float | None = 60.0,
    *,
    max_tokens: int | None = None,
    policy_name: str = "",
    sample_index: int = 0,
) -> Trajectory:
    """Play ``task`` in ``env`` (which the caller owns and closes) with the message-level policy
    ``act`` (see :data:`MessagePolicy`; a :data:`Policy` is not accepted here, use
    :func:`play_episode`). The trajectory has ``turns == ()`` unless ``act`` returns ``Action``s
    with token data."""
    return await play_episode(
        lambda: env, task, lambda _env: message_policy(act), max_turns=max_turns, max_tokens=max_tokens,
        timeout_s=timeout_s, sample_index=sample_index, policy_name=policy_name, close_env=False,
    )


async def run_episodes(
    make_env: Callable[[], Env],
    tasks: Sequence[Task],
    act_factory: Callable[[Env], MessagePolicy],
    concurrency: int = 16,
    max_turns: int = 50,
    timeout_s: float | None = 60.0,
    *,
    policy_name: str = "",
) -> list[Trajectory]:
    """Play every task, each in a fresh env from ``make_env()`` (closed afterwards) with the policy
    ``act_factory(env)`` (e.g. ``lambda env: env.expert_action``), at most ``concurrency`` at once.
    Trajectories come back in task order; one episode's failure never stops the others."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> Trajectory:
        async with gate:
            return await play_episode(
                make_env, task, lambda env: message_policy(act_factory(env)), max_turns=max_turns,
                timeout_s=timeout_s, policy_name=policy_name,
            )

    return list(await asyncio.gather(*(one(t) for t in tasks)))

