"""A message-level episode loop, for scripted experts and env checks.

``run_episode`` plays one task with a policy that returns assistant ``Message``s (no tokens, no
engine): the scripted expert, a test policy, a replay. ``run_episodes`` plays many concurrently and
isolates failures: an env that raises, a policy that raises or an episode that hangs ends only its
own episode, recorded in ``EpisodeResult.error``, while the others run to completion.

The token-level batched rollout (engine in the loop, token ids and log-probs kept) is
``tracegym.rollout``; this loop is what ``tracegym envs expert`` and ``check_env`` use.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal, Sequence, Union

from tracegym.envs.base import Env, Task
from tracegym.types import Message, ParsedCompletion, Trajectory

__all__ = ["EpisodeResult", "EpisodeEnd", "Policy", "run_episode", "run_episodes"]

EpisodeEnd = Literal["terminated", "truncated", "max_turns", "timeout", "env_error", "policy_error"]

# A policy returns the next assistant message, or a ParsedCompletion (message + parse errors).
# It is called with no argument (``env.expert_action``) or with the conversation so far.
Action = Union[Message, ParsedCompletion]
Policy = Callable[..., Union[Action, Awaitable[Action]]]


@dataclass
class EpisodeResult:
    """One played episode. ``reward`` is the sum of step rewards; ``info`` the last step's info."""

    task_id: str
    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    end_reason: EpisodeEnd = "terminated"
    turns: int = 0
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    step_infos: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The episode ran without an error or a timeout (whatever its reward)."""
        return self.error is None

    def to_trajectory(self, env: str, split: str = "train", tools: Sequence[dict[str, Any]] = (), policy: str = "expert") -> Trajectory:
        """A message-only ``Trajectory`` (no token turns), e.g. expert data for SFT."""
        end = "engine_error" if self.end_reason == "policy_error" else self.end_reason
        metrics = {k: float(v) for k, v in self.info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return Trajectory(
            env=env,
            task_id=self.task_id,
            split=split,
            tools=tuple(tools),
            messages=tuple(self.messages),
            reward=self.reward,
            success=self.success,
            metrics=metrics,
            end_reason=end,
            error=self.error,
            policy=policy,
        )


def _takes_conversation(act: Policy) -> bool:
    try:
        params = [
            p
            for p in inspect.signature(act).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 1


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _play(env: Env, task: Task, act: Policy, max_turns: int, result: EpisodeResult) -> None:
    """The loop; fills ``result`` as it goes so a timeout keeps what happened so far."""
    try:
        result.messages.extend(await env.reset(task))
    except Exception as exc:
        result.end_reason, result.error = "env_error", f"reset failed: {_describe(exc)}"
        return
    with_conversation = _takes_conversation(act)
    while True:
        if result.turns >= max_turns:
            result.end_reason = "max_turns"
            return
        try:
            action = act(list(result.messages)) if with_conversation else act()
            if inspect.isawaitable(action):
                action = await action
        except Exception as exc:
            result.end_reason, result.error = "policy_error", _describe(exc)
            return
        if isinstance(action, ParsedCompletion):
            message, parse_errors = action.message, action.errors
        elif isinstance(action, Message):
            message, parse_errors = action, ()
        else:
            result.end_reason = "policy_error"
            result.error = f"policy returned {type(action).__name__}, expected Message or ParsedCompletion"
            return
        result.messages.append(message)
        result.turns += 1
        try:
            step = await env.step(message, parse_errors)
        except Exception as exc:
            result.end_reason, result.error = "env_error", f"step failed: {_describe(exc)}"
            return
        result.messages.extend(step.messages)
        result.reward += step.reward
        result.info = dict(step.info)
        result.step_infos.append(dict(step.info))
        if step.terminated or step.truncated:
            result.end_reason = "terminated" if step.terminated else "truncated"
            result.success = bool(step.info.get("success", 0))
            return


async def run_episode(
    env: Env, task: Task, act: Policy, max_turns: int = 50, timeout_s: float | None = 60.0
) -> EpisodeResult:
    """Play ``task`` in ``env`` with policy ``act`` for at most ``max_turns`` assistant turns and
    ``timeout_s`` seconds of wall clock. Never raises for an env or policy failure: the result says
    what happened (``end_reason``, ``error``). The timeout can only interrupt code that awaits
    (async tools, sync tools run in threads by ``ToolEnv``), not a CPU loop that blocks the event loop."""
    result = EpisodeResult(task_id=task.id)
    try:
        async with asyncio.timeout(timeout_s):
            await _play(env, task, act, max_turns, result)
    except TimeoutError:
        result.end_reason = "timeout"
        result.error = f"episode timed out after {timeout_s:g} s"
        result.success = False
    return result


async def run_episodes(
    make_env: Callable[[], Env],
    tasks: Sequence[Task],
    act_factory: Callable[[Env], Policy],
    concurrency: int = 16,
    max_turns: int = 50,
    timeout_s: float | None = 60.0,
) -> list[EpisodeResult]:
    """Play every task, each in a fresh env from ``make_env()`` with the policy
    ``act_factory(env)`` (e.g. ``lambda env: env.expert_action``), at most ``concurrency`` at once.
    Results come back in task order; one episode's failure never stops the others."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> EpisodeResult:
        async with gate:
            try:
                env = make_env()
                act = act_factory(env)
            except Exception as exc:
                return EpisodeResult(task_id=task.id, end_reason="env_error", error=f"make_env failed: {_describe(exc)}")
            try:
                return await run_episode(env, task, act, max_turns=max_turns, timeout_s=timeout_s)
            finally:
                try:
                    env.close()
                except Exception:
                    pass  # a failing close must not hide the episode's result

    return list(await asyncio.gather(*(one(t) for t in tasks)))
