"""Inference engine interface: token ids in, sampled token ids and log-probs out.

Engines know nothing of environments or recipes. ``generate`` is synchronous and batched: the
rollout runner gathers every episode that waits for the model into one call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

from tracegym.types import Generation, SamplingParams


class Engine(ABC):
    """A batched sampler over token-id prompts."""

    name: str = "base"
    # True when the engine returns per-token log-probs of the sampling distribution (RL-ready).
    returns_logprobs: bool = True

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        """For each prompt, ``params.n`` generations (outer list aligned with ``prompts``)."""

    def update_weights(self, model_or_state: Any) -> None:
        """Take new weights from the trainer (full state dict, or a peft model). Optional."""
        raise NotImplementedError(f"engine {self.name!r} does not take weight updates")

    def close(self) -> None:
        """Release resources (servers, threads). Safe to call twice."""
