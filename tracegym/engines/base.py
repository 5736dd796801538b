"""Inference engine interface: token ids in, sampled token ids and log-probs out.

Engines know nothing of environments or recipes. ``generate`` is synchronous and batched: the
rollout runner gathers every episode that waits for the model into one call.

The RL recipe speaks to an engine through the ``Sampler`` protocol: ``generate``,
``update_weights(model or adapter)`` after each optimizer step, and ``capabilities`` (does it return
the log-probs of what it sampled? the exact token ids?). An engine that cannot return sampled
log-probs or exact token ids is refused by ``tracegym.engines.require_rl_sampler`` with a one-line
error. Engines are built with ``tracegym.engines.make_engine``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

from tracegym.types import Generation, SamplingParams

WeightSync = Literal["shared_model", "state_dict", "adapter", "none"]

BASE_ADAPTER = "__base__"
"""The adapter name that means "the base model, no LoRA" in a mixed-adapter batch (peft's name for it),
for every engine whose ``generate`` takes ``adapters=``."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What a sampler can do, so recipes can refuse what would silently train wrong.

    - ``returns_logprobs``: per-token log-probs of the sampling distribution come back (RL-ready).
    - ``exact_token_ids``: the token ids sampled come back as ids (token in, token out); False for
      text-level engines whose completions are re-encoded by the renderer.
    - ``weight_sync``: how ``update_weights`` reaches the sampler: ``shared_model`` (the trainer's
      model object itself: free and exact), ``state_dict`` / ``adapter`` (weights or a LoRA adapter
      are copied in), ``none`` (a remote server the recipe cannot update).
    """

    returns_logprobs: bool = True
    exact_token_ids: bool = True
    weight_sync: WeightSync = "none"


@runtime_checkable
class Sampler(Protocol):
    """What the RL recipe needs of an engine."""

    name: str

    @property
    def capabilities(self) -> EngineCapabilities: ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]: ...

    def update_weights(self, model_or_state: Any) -> None: ...


class Engine(ABC):
    """A batched sampler over token-id prompts."""

    name: str = "base"
    # True when the engine returns per-token log-probs of the sampling distribution (RL-ready).
    returns_logprobs: bool = True

    @property
    def capabilities(self) -> EngineCapabilities:
        """What this engine can do (engines override with their own)."""
        return EngineCapabilities(returns_logprobs=self.returns_logprobs)

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        """For each prompt, ``params.n`` generations (outer list aligned with ``prompts``)."""

    def update_weights(self, model_or_state: Any) -> None:
        """Take new weights from the trainer (full state dict, or a peft model). Optional."""
        raise NotImplementedError(f"engine {self.name!r} does not take weight updates")

    def close(self) -> None:
        """Release resources (servers, threads). Safe to call twice."""
