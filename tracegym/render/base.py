"""Renderer: the token layer between messages and the model.

A Renderer knows one chat-template family. It turns a conversation into the token ids of a
generation prompt, parses a sampled completion back into an assistant ``Message`` (tool calls
included, malformed ones reported as errors), and turns a ``Trajectory`` into
``TrainingExample``s whose loss mask is 1 exactly on the tokens the model generated.

Only ``tracegym.types`` and a tokenizer are known here (see DESIGN.md, import direction).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

from tracegym.types import Message, ParsedCompletion, Trajectory, TrainingExample


@dataclass
class BuildStats:
    """Counters from building training examples.

    ``splits``: how many times a turn's prompt did not extend the sequence so far (the template
    rewrote history), so the trajectory was cut into a new example there.
    """

    examples: int = 0
    splits: int = 0
    trained_tokens: int = 0
    total_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Renderer(ABC):
    """One chat-template family bound to one tokenizer."""

    name: str = "base"
    # True when rendering turn t+1 from scratch always extends the tokens of turns <= t
    # (no history rewriting). The rollout runner can then build prompts incrementally.
    history_preserving: bool = True

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    # -- rendering -----------------------------------------------------------------------------
    @abstractmethod
    def render_text(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The conversation as template text (what ``apply_chat_template(tokenize=False)`` gives)."""

    @abstractmethod
    def render_prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the generation prompt for the next assistant turn."""

    @abstractmethod
    def continue_prompt(
        self,
        previous_prompt: Sequence[int],
        completion_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int]:
        """Next prompt built by extending ``previous_prompt + completion_ids`` (token-in, token-out).

        Appends whatever the template puts after an assistant turn (closing the turn with the
        end-of-turn token when the completion was cut before it), then ``new_messages`` (tool
        results, user turns) and the generation prompt. The sampled tokens are kept exactly.
        """

    @abstractmethod
    def encode_completion(self, message: Message) -> list[int]:
        """The token ids a model must generate to produce this assistant message (end-of-turn
        token included). Used to record scripted experts and teachers on the same token path."""

    # -- parsing -------------------------------------------------------------------------------
    @abstractmethod
    def parse_completion(self, completion_ids: Sequence[int]) -> ParsedCompletion:
        """Sampled completion -> assistant message; malformed tool calls become ``errors``."""

    @property
    @abstractmethod
    def stop_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn (the engine stops on them)."""

    # -- training data -------------------------------------------------------------------------
    def build_examples(
        self,
        trajectory: Trajectory,
        weight: float = 1.0,
        advantage: float | Sequence[float] = 0.0,
        stats: BuildStats | None = None,
    ) -> list[TrainingExample]:
        """Trajectory -> one example (or several, where a turn's prompt does not extend the
        sequence so far). ``advantage`` is a scalar for the whole episode or one value per turn.

        The examples are cut from the token ids the trajectory recorded (token-in, token-out), so
        this default, ``tracegym.render.trajectory_examples.build_examples``, serves every template."""
        from tracegym.render.trajectory_examples import build_examples

        return build_examples(trajectory, weight=weight, advantage=advantage, stats=stats)
