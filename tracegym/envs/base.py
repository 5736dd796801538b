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

Envs see messages and return messages and rewards; they know no model, engine or trainer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

from pydantic import BaseModel, ConfigDict, Field

from tracegym.types import Message, StepResult


class Task(BaseModel):
    """One task of an environment. ``data`` holds what the env needs (question, answer, level...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    split: str = "train"
    data: dict[str, Any] = Field(default_factory=dict)


class Env(ABC):
    """Base class of every environment."""

    name: ClassVar[str] = "env"
    description: ClassVar[str] = ""
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

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

    def close(self) -> None:
        """Release per-episode resources."""
