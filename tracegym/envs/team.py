"""Team environments: several roles act in one episode, each with its own view.

A ``TeamEnv`` declares its ``roles``; the episode loop (:func:`play_team_episode`) asks the env
which role acts next, shows that role its own conversation so far (its system prompt, what it was
told, its own earlier messages and tool results: partial information is the point), steps the env
with the role's message, and hands each role the new messages the env addressed to it.

Lifecycle::

    env = make("logic_grid")                             # a TeamEnv, registered like any env
    views = await env.reset(task)                        # {role: initial messages of that role}
    while (role := env.next_role()) is not None:
        result = await env.step(role, message, parse_errors)  # -> TeamStep
        # result.views[r]: new messages for role r (tool results for the actor, the actor's words
        # for its partners); result.reward: team reward of this step; result.role_rewards: per role

One episode gives one ``Trajectory`` per role that acted or was shown anything (token-exact
``turns`` of that role only), all with ``info["episode_id"]`` (the same for the whole team),
``info["role"]``, ``info["team_order"]`` (which role acted at each turn of the episode) and
``policy`` = the role. Each role's ``metrics`` count its own failed tool-call attempts by reason
(``parse_errors/<reason>``, as in the single-agent loop). The team's reward (the sum of ``TeamStep.reward``) is
every role's ``Trajectory.reward`` unless the env gives ``role_rewards`` (then a role's reward is
the team reward plus its own), credited on that role's last turn: every role sees the shared
outcome, and group estimators (``magrpo``: a group baseline per role) compare it across samples. ``success`` comes from the last step's ``info["success"]``.

End reasons and failure isolation are those of the single-agent loop (``tracegym.envs.episode``):
a raising env, a hang or a malformed policy answer fails this episode only, for every role.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from tracegym.envs.base import Task
from tracegym.envs.episode import (
    FAILED_END_REASONS,
    Action,
    ContextExhausted,
    Observation,
    Policy,
    _close_env,
    _describe,
    _numeric,
    _play_in_time,
)
from tracegym.render.call_errors import failure_metrics, turn_failures
from tracegym.types import EndReason, Message, Trajectory, Turn

log = logging.getLogger(__name__)

__all__ = ["TeamEnv", "TeamStep", "is_team_env", "play_team_episode", "team_episode_id"]


class TeamStep(BaseModel):
    """What a team env returns after one role's message.

    ``views[role]``: the new messages for that role (the acting role's tool results; its words, as a
    ``user`` message, for the partners it addressed). ``reward``: the team's reward of this step.
    ``role_rewards``: optional per-role rewards of this step, on top of the team reward.
    ``terminated`` / ``truncated`` / ``info`` mean what they mean in ``StepResult``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    views: dict[str, tuple[Message, ...]] = Field(default_factory=dict)
    reward: float = 0.0
    role_rewards: dict[str, float] = Field(default_factory=dict)
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)


class TeamEnv(ABC):
    """Base class of a team environment (one instance per episode, like ``Env``)."""

    name: ClassVar[str] = "team"
    description: ClassVar[str] = ""
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    #: The roles, in a fixed order (the first one usually speaks first).
    roles: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        """``n`` tasks of ``split``, the same for the same seed; the splits never share a task."""

    @abstractmethod
    def tool_schemas(self, role: str) -> list[dict[str, Any]]:
        """The tools shown to ``role`` (OpenAI function schemas; [] for a role that only talks)."""

    @abstractmethod
    async def reset(self, task: Task) -> dict[str, list[Message]]:
        """Start an episode; returns each role's initial messages (its system prompt and first user
        message, with the part of the task that role may know)."""

    @abstractmethod
    def next_role(self) -> str | None:
        """The role that acts now; None when nobody can act (the loop then ends the episode as
        ``truncated`` unless the last step terminated it)."""

    @abstractmethod
    async def step(self, role: str, message: Message, parse_errors: Sequence[str] = ()) -> TeamStep:
        """Apply ``role``'s assistant message (``parse_errors``: its malformed tool calls, shown back
        to it as errors)."""

    @abstractmethod
    def expert_action(self, role: str) -> Message:
        """The scripted expert team's next message for ``role`` (privileged state allowed)."""

    def close(self) -> None:
        """Release resources. Safe to call twice."""


def is_team_env(env: Any) -> bool:
    """True for a ``TeamEnv`` instance or class."""
    return isinstance(env, TeamEnv) or (isinstance(env, type) and issubclass(env, TeamEnv))


def team_episode_id(task_id: str, sample_index: int, salt: str = "") -> str:
    """A short id shared by the trajectories of one team episode (stable for a task and sample)."""
    return hashlib.sha1(f"{task_id}\x00{sample_index}\x00{salt}".encode()).hexdigest()[:16]


@dataclass
class _RoleProgress:
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    new: list[Message] = field(default_factory=list)  # told since its last action
    actions: int = 0
    own_reward: float = 0.0
    call_failures: Counter[str] = field(default_factory=Counter)  # reason -> this role's failed call attempts


@dataclass
class _TeamProgress:
    env_name: str
    roles: dict[str, _RoleProgress] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # who acted, in order
    team_reward: float = 0.0
    generated: int = 0
    last_info: dict[str, Any] = field(default_factory=dict)
    end_reason: EndReason | None = None
    error: str | None = None

    def end(self, reason: EndReason, error: str | None = None) -> None:
        self.end_reason, self.error = reason, error


def _close_turn(rp: _RoleProgress) -> None:
    """The role's last turn gets every message it was told after it (for reading the trajectory)."""
    if rp.turns and rp.new:
        last = rp.turns[-1]
        rp.turns[-1] = last.model_copy(update={"env_messages": tuple(last.env_messages) + tuple(rp.new)})


async def _play_team(env: TeamEnv, task: Task, policies: Mapping[str, Policy], max_turns: int,
                     max_tokens: int | None, st: _TeamProgress) -> None:
    try:
        views = await env.reset(task)
        for role in env.roles:
            st.roles[role] = _RoleProgress(tools=list(env.tool_schemas(role)))
    except Exception as exc:  # noqa: BLE001
        return st.end("env_error", f"reset failed: {_describe(exc)}")
    unknown = sorted(set(views) - set(env.roles))
    if unknown:
        return st.end("env_error", f"reset returned views for unknown roles {unknown}")
    for role, messages in views.items():
        st.roles[role].messages.extend(messages)
        st.roles[role].new.extend(messages)
    turn = 0
    while True:
        if turn >= max_turns:
            return st.end("max_turns")
        try:
            role = env.next_role()
        except Exception as exc:  # noqa: BLE001
            return st.end("env_error", f"next_role failed: {_describe(exc)}")
        if role is None:
            return st.end("truncated")
        if role not in st.roles:
            return st.end("env_error", f"next_role() returned unknown role {role!r}")
        rp = st.roles[role]
        key = hashlib.sha1(repr([(m.role, m.content) for m in rp.messages]).encode()).hexdigest()[:16]
        budget = None if max_tokens is None else max_tokens - st.generated
        obs = Observation(task, rp.actions, tuple(rp.messages), tuple(rp.new), tuple(rp.tools), budget)
        try:
            action = await policies[role](obs)
        except ContextExhausted:
            return st.end("context")
        except Exception as exc:  # noqa: BLE001
            return st.end("engine_error", f"{role}: {_describe(exc)}")
        if not isinstance(action, Action) or action.message.role != "assistant":
            return st.end("engine_error", f"{role}: policy must return an Action with an assistant message")
        tokens = action.tokens
        if tokens is not None and tokens.completion_logprobs is not None \
                and len(tokens.completion_logprobs) != len(tokens.completion_ids):
            return st.end("engine_error", f"{role}: log-probs and completion tokens differ in length")
        _close_turn(rp)
        rp.new = []
        rp.messages.append(action.message)
        rp.actions += 1
        turn += 1
        st.order.append(role)
        rp.call_failures.update(turn_failures(action.message, action.parse_errors, rp.tools,
                                              None if tokens is None else tokens.finish_reason != "stop"))
        if tokens is not None:
            st.generated += len(tokens.completion_ids)
        try:
            result = await env.step(role, action.message, tuple(action.parse_errors))
        except Exception as exc:  # noqa: BLE001
            return st.end("env_error", f"step {turn} ({role}) failed: {_describe(exc)}")
        if not isinstance(result, TeamStep):
            return st.end("env_error", f"step {turn} returned {type(result).__name__}, expected TeamStep")
        rewards = [float(result.reward), *map(float, result.role_rewards.values())]
        if not all(math.isfinite(r) for r in rewards):
            return st.end("env_error", f"task {task.id}: step {turn} returned a non-finite reward")
        unknown = sorted((set(result.views) | set(result.role_rewards)) - set(st.roles))
        if unknown:
            return st.end("env_error", f"step {turn} addressed unknown roles {unknown}")
        if tokens is not None:
            rp.turns.append(Turn(
                prompt_ids=tuple(tokens.prompt_ids), completion_ids=tuple(tokens.completion_ids),
                completion_logprobs=(tuple(float(x) for x in tokens.completion_logprobs)
                                     if tokens.completion_logprobs is not None else None),
                finish_reason=tokens.finish_reason, message=action.message, parse_errors=tuple(action.parse_errors),
                reward=0.0, metrics=_numeric(result.info), state_key=key,
            ))
        st.team_reward += float(result.reward)
        for other, own in result.role_rewards.items():
            st.roles[other].own_reward += float(own)
        for target, messages in result.views.items():
            st.roles[target].messages.extend(messages)
            st.roles[target].new.extend(messages)
        st.last_info = dict(result.info)
        if result.terminated:
            return st.end("terminated")
        if result.truncated:
            return st.end("truncated")
        if max_tokens is not None and st.generated >= max_tokens:
            return st.end("max_tokens")


def _role_trajectory(st: _TeamProgress, role: str, task: Task, sample_index: int, episode_id: str,
                     info: dict[str, Any]) -> Trajectory:
    """One role's trajectory: its own view and turns; its reward = team reward + its own rewards,
    credited on its last turn (earlier turns keep nothing, so the outcome is what every role shares)."""
    rp = st.roles[role]
    _close_turn(rp)
    failed = st.end_reason in FAILED_END_REASONS
    reward = st.team_reward + rp.own_reward
    turns = list(rp.turns)
    if turns:
        turns[-1] = turns[-1].model_copy(update={"reward": reward})
    metrics = _numeric(st.last_info)
    if rp.tools or rp.call_failures:
        metrics.update(failure_metrics(rp.call_failures))
    return Trajectory(
        env=st.env_name, task_id=task.id, split=task.split, sample_index=sample_index, tools=tuple(rp.tools),
        messages=tuple(rp.messages), turns=tuple(turns), reward=reward,
        success=False if failed else bool(st.last_info.get("success", False)),
        metrics=metrics, end_reason=st.end_reason or "engine_error", error=st.error,
        policy=role, info={**info, "episode_id": episode_id, "role": role, "team_turns": len(st.order),
                           "role_turns": rp.actions, "team_order": list(st.order)},
    )


async def play_team_episode(
    make_env: Callable[[], TeamEnv],
    task: Task,
    make_policies: Callable[[TeamEnv], Mapping[str, Policy]],
    *,
    max_turns: int = 20,
    max_tokens: int | None = None,
    timeout_s: float | None = None,
    sample_index: int = 0,
    env_name: str | None = None,
    episode_id: str | None = None,
) -> list[Trajectory]:
    """Play one team episode; returns one trajectory per role (in ``env.roles`` order) that acted or
    was shown anything. ``max_turns`` counts the turns of all roles together. Never raises for a
    failure of the env or a policy: every role's trajectory carries the end reason and error."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    started = time.perf_counter()
    episode_id = episode_id or uuid.uuid4().hex[:16]
    st = _TeamProgress(env_name=env_name or "")
    env: TeamEnv | None = None
    try:
        env = make_env()
        if not isinstance(env, TeamEnv):
            raise TypeError(f"{type(env).__name__} is not a TeamEnv")
    except Exception as exc:  # noqa: BLE001
        st.end("env_error", f"making the env failed: {_describe(exc)}")
        env = None
    roles: tuple[str, ...] = ()
    if env is not None:
        roles = tuple(env.roles)
        st.env_name = env_name or env.name
        try:
            policies = dict(make_policies(env))
            missing = [r for r in roles if r not in policies]
            if missing:
                raise ValueError(f"no policy for roles {missing}")
        except Exception as exc:  # noqa: BLE001
            st.end("engine_error", f"making the policies failed: {_describe(exc)}")
        else:
            await _play_in_time(_play_team(env, task, policies, max_turns, max_tokens, st), st, timeout_s,
                                f"team episode {task.id}", log)
        _close_env(env, log)
    info = {"wall_time_s": round(time.perf_counter() - started, 4)}
    if not st.roles:  # the env never reset: one trajectory per declared role still records the failure
        for role in roles or ("team",):
            st.roles[role] = _RoleProgress()
    return [_role_trajectory(st, role, task, sample_index, episode_id, info)
            for role in st.roles if st.roles[role].messages or st.roles[role].turns or st.error]
