"""Environment API: async, multi-turn, tool-using, with verifiable rewards.

An ``Env`` instance runs one episode at a time and owns that episode's state, so concurrent
episodes use separate instances (``tracegym.envs.make`` builds a fresh one each call) and never see
each other's data. Read-only resources (a search index, a corpus) may be shared between instances.

Lifecycle::

    env = make("calculator", **options)
    tasks = env.tasks("train", n=100, seed=0)      # seeded, disjoint train/test splits
    messages = await env.reset(tasks[0])           # system prompt (tool schemas) + first user turn
    result = await env.step(assistant_message, parse_errors)   # -> StepResult
    ... until result.terminated or result.truncated
    env.state_key()                                # optional: a key of the current state, or None
    snap = env.snapshot()                          # optional: branch the episode here (if env.can_branch)
    env.restore(snap)                              # ... and continue from it, as often as wanted

Envs see messages and return messages and rewards; they know no model, engine or trainer.
"""

from __future__ import annotations

import copy
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from pydantic import BaseModel, ConfigDict, Field

from tracegym.types import Message, StepResult


class Task(BaseModel):
    """One task of an environment. ``data`` holds what the env needs (question, answer, level...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    split: str = "train"
    data: dict[str, Any] = Field(default_factory=dict)


class SnapshotUnsupported(NotImplementedError):
    """The env cannot branch: it does not implement ``snapshot``/``restore``, or it holds state a
    snapshot cannot capture (an MCP server process, a subprocess, a remote service)."""


@dataclass(frozen=True)
class EnvSnapshot:
    """A branch point of an episode, from :meth:`Env.snapshot`; give it to :meth:`Env.restore`.

    ``state`` is private to the env class that made it (a deep copy, never shared with the env);
    ``env_class`` (``module.QualName``) says which class may restore it. ``task_id`` and ``turn``
    are for display and logs only. ``shared`` holds the env's ``snapshot_exclude`` resources (by
    reference, never copied), so a state that refers to one keeps referring to it on restore."""

    env: str
    env_class: str
    state: Any = field(repr=False)
    task_id: str | None = None
    turn: int | None = None
    shared: tuple[Any, ...] = field(default=(), repr=False, compare=False)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_patched_callable(value: Any) -> bool:
    """A function or bound method stored on the instance (a wrapper a tool patched on, e.g.
    ``env.step = checked_step``): behaviour, not episode state, so never copied or replaced."""
    return isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType))


class Env(ABC):
    """Base class of every environment."""

    name: ClassVar[str] = "env"
    description: ClassVar[str] = ""
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    #: Opt in to the generic :meth:`snapshot`/:meth:`restore` (a deep copy of the instance's
    #: attributes). Only for envs whose whole episode state is plain Python data on the instance.
    branchable: ClassVar[bool] = False
    #: Instance attributes a snapshot does not copy: shared read-only resources (a search index, a
    #: corpus, a thread pool) that every instance of the same options holds alike. ``restore``
    #: keeps the target instance's own value. Anything mutable per episode must not be listed here.
    snapshot_exclude: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        """``n`` tasks of ``split`` ("train" or "test"), the same for the same seed; the two splits
        never share a task."""

    @abstractmethod
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools shown to the model, as OpenAI function-calling JSON schemas."""

    @abstractmethod
    async def reset(self, task: Task) -> list[Message]:
        """Start an episode on ``task``; returns the initial messages (system + user)."""

    @abstractmethod
    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        """Apply one assistant message. ``parse_errors`` are malformed tool calls the renderer
        could not parse; the env shows them to the model as errors and the episode goes on."""

    @abstractmethod
    def expert_action(self) -> Message:
        """The scripted expert's next assistant message, computed from the env's privileged state
        (the answer, the level, the database). Used to record SFT data and as the upper reference."""

    def state_key(self) -> str | None:
        """A key of the env's current state, for step-level credit assignment: two moments of one
        task with equal keys are the same state (a grid game's board and agent position), so turns
        taken there can be compared (GiGPO-style grouping). The episode loop records it on each
        ``Turn`` before that turn's action. Keep it short, deterministic across instances and
        processes (no ``id()``, no ``hash()`` of strings), and independent of how the state was
        reached. None (the default): unknown; the loop then keys the state by a hash of the
        observations so far (every non-assistant message)."""
        return None

    # -- branching ----------------------------------------------------------------------------------

    def branch_refusal(self) -> str | None:
        """Why this env cannot branch, or None when :meth:`snapshot`/:meth:`restore` work.

        Default: None for envs that opt in with ``branchable = True`` or override
        :meth:`snapshot_state` and :meth:`restore_state`; otherwise "it does not implement
        snapshot/restore". Override it when branching depends on the instance (its options, the
        resources it holds)."""
        cls = type(self)
        if self.branchable or (cls.snapshot_state is not Env.snapshot_state and cls.restore_state is not Env.restore_state):
            return None
        return "it does not implement snapshot/restore"

    @property
    def can_branch(self) -> bool:
        """Whether :meth:`snapshot` and :meth:`restore` are supported (see :meth:`branch_refusal`)."""
        return self.branch_refusal() is None

    def _refuse_if_unsupported(self) -> None:
        reason = self.branch_refusal()
        if reason is not None:
            raise SnapshotUnsupported(f"env {self.name!r} ({type(self).__name__}) cannot branch: {reason}")

    def snapshot(self) -> EnvSnapshot:
        """Capture everything that determines the env's future observations and rewards from this
        point of the episode: the task, the turn counter, the internal state (board, database,
        simulated user, tool results so far), the tool-call counters, any RNG state.

        The snapshot is a deep copy: later steps of this env do not change it, and one snapshot can
        be restored any number of times. ``restore`` on this instance, or on a fresh instance of the
        same class built with the same options, continues exactly as this env would from here: the
        same next action gives the same observation, reward and termination.

        Raises :class:`SnapshotUnsupported` when the env cannot branch (``can_branch`` is False)."""
        self._refuse_if_unsupported()
        task = getattr(self, "task", None)
        turn = getattr(self, "turn", None)
        return EnvSnapshot(
            env=self.name,
            env_class=_class_path(type(self)),
            state=self.snapshot_state(),
            shared=self._shared_resources(),
            task_id=getattr(task, "id", None),
            turn=turn if isinstance(turn, int) else None,
        )

    def restore(self, snapshot: EnvSnapshot) -> None:
        """Put the env back at ``snapshot``'s point of an episode (see :meth:`snapshot`). The env
        must be of the class that made the snapshot, built with the same options; it may be the same
        instance, a fresh one (no ``reset`` needed) or one in the middle of another episode. The
        snapshot is not consumed: it stays valid for further restores.

        Raises :class:`SnapshotUnsupported` when the env cannot branch, ``TypeError`` for anything
        but an :class:`EnvSnapshot` and ``ValueError`` for a snapshot of another env class."""
        self._refuse_if_unsupported()
        if not isinstance(snapshot, EnvSnapshot):
            raise TypeError(f"restore needs an EnvSnapshot from snapshot(), got {type(snapshot).__name__}")
        here = _class_path(type(self))
        if snapshot.env_class != here:
            raise ValueError(
                f"cannot restore a snapshot of {snapshot.env_class} (env {snapshot.env!r}) into {here} (env {self.name!r})"
            )
        self.restore_state(copy.deepcopy(snapshot.state, self._shared_memo(snapshot.shared)))

    def _shared_resources(self) -> tuple[Any, ...]:
        """The values of this instance's ``snapshot_exclude`` attributes."""
        return tuple(self.__dict__[a] for a in self.snapshot_exclude if a in self.__dict__)

    @staticmethod
    def _shared_memo(shared: Sequence[Any]) -> dict[int, Any]:
        """A deepcopy memo mapping every shared read-only resource to itself, so it is never
        copied, wherever in the state it is referenced."""
        return {id(value): value for value in shared}

    def snapshot_state(self) -> Any:
        """The episode state to capture, as a deep copy (the generic implementation: every instance
        attribute except ``snapshot_exclude`` and functions patched onto the instance). Override it
        together with :meth:`restore_state` for a custom representation. An attribute that cannot be
        deep-copied (a lock, a thread, a process handle) makes it raise :class:`SnapshotUnsupported`
        naming the attribute: declare it in ``snapshot_exclude`` if it is shared and read-only."""
        excluded = set(self.snapshot_exclude)
        memo = self._shared_memo(self._shared_resources())
        state: dict[str, Any] = {}
        for attr, value in self.__dict__.items():
            if attr in excluded or _is_patched_callable(value):
                continue
            try:
                state[attr] = copy.deepcopy(value, memo)
            except Exception as exc:  # a lock, a thread, a socket, a process: not data
                raise SnapshotUnsupported(
                    f"env {self.name!r} ({type(self).__name__}) cannot branch: attribute {attr!r} "
                    f"({type(value).__name__}) cannot be copied ({type(exc).__name__}: {exc}); list it in "
                    f"snapshot_exclude if it is a shared read-only resource, or implement snapshot_state/restore_state"
                ) from exc
        return state

    def restore_state(self, state: Any) -> None:
        """Set the episode state from a (private, already copied) ``snapshot_state()`` value. The
        generic implementation replaces every instance attribute but ``snapshot_exclude`` and
        patched-on functions, which keep this instance's own values."""
        excluded = set(self.snapshot_exclude)
        for attr in [a for a, v in self.__dict__.items() if a not in excluded and not _is_patched_callable(v)]:
            if attr not in state:
                del self.__dict__[attr]
        for attr, value in state.items():
            if attr not in excluded:
                self.__dict__[attr] = value

    def close(self) -> None:
        """Release per-episode resources."""


class EnvWrapper(Env):
    """An env around ``inner`` that hands it everything it does not change itself: tasks, tools,
    reset, step, the expert, the state key, the turn limit and close. It names the env it wraps
    (trajectories name the env the agent acts in). Subclasses override what they add: the memory
    tools, prompt injections, the feedback of earlier attempts."""

    def __init__(self, inner: Env, description: str | None = None):
        if not isinstance(inner, Env):
            raise TypeError(f"{type(self).__name__} wraps a tracegym Env, got {type(inner).__name__}")
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.description = inner.description if description is None else description  # type: ignore[misc]
        self.reward_range = inner.reward_range  # type: ignore[misc]

    @property
    def max_turns(self) -> int | None:
        """The inner env's turn limit (None when it states none)."""
        return getattr(self.inner, "max_turns", None)

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return self.inner.tasks(split, n, seed)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.inner.tool_schemas()

    async def reset(self, task: Task) -> list[Message]:
        return await self.inner.reset(task)

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        return await self.inner.step(message, parse_errors)

    def expert_action(self) -> Message:
        return self.inner.expert_action()

    def state_key(self) -> str | None:
        return self.inner.state_key()

    def close(self) -> None:
        self.inner.close()
