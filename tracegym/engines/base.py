"""Inference engine interface: token ids in, sampled token ids and log-probs out.

Engines know nothing of environments or recipes. ``generate`` is synchronous and batched: the
rollout runner gathers every episode that waits for the model into one call.

The RL recipe speaks to an engine through the ``Sampler`` protocol: ``generate``,
``update_weights(model or adapter)`` after each optimizer step, and ``capabilities`` (does it return
the log-probs of what it sampled? the exact token ids?). An engine that cannot return sampled
log-probs or exact token ids is refused by ``tracegym.engines.require_rl_sampler`` with a one-line
error. Engines are built with ``tracegym.engines.make_engine``.

Scoring given sequences (``PromptScorer``): ``prompt_logprobs(sequences)`` returns, for each token
sequence, ``log p(seq[i] | seq[:i])`` for ``i = 1 .. len(seq) - 1`` (``len(seq) - 1`` floats; the first
token has no prediction), under the model's raw distribution at temperature 1: no top-p, no
penalty, no logit bias. It is what a distillation teacher needs (``tracegym distill`` with
``teacher.engine: vllm | openai``): the student's own tokens scored id for id, the log-prob of each
actual next token only, never a full distribution. ``hf`` runs one teacher-forced forward pass per
batch of sequences; ``vllm`` asks vLLM for ``prompt_logprobs``; ``openai`` sends ``echo`` with
``logprobs`` to ``/completions`` (vLLM's ``vllm serve``, ``tracegym serve``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

from tracegym.types import BASE_ADAPTER, Generation, SamplingParams  # noqa: F401  (BASE_ADAPTER re-exported)

WeightSync = Literal["shared_model", "state_dict", "adapter", "none"]


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
class PromptScorer(Protocol):
    """An engine that scores given token sequences (see the module docstring)."""

    name: str

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]: ...


def scores_prompts(engine: Any) -> bool:
    """Whether ``engine`` has ``prompt_logprobs`` (a remote server may still refuse it when called)."""
    return callable(getattr(engine, "prompt_logprobs", None))


def prompt_sequences(sequences: Sequence[Sequence[int]]) -> list[list[int]]:
    """``sequences`` as lists of ints, checked: a list of sequences (not one flat sequence), none
    empty, ids non-negative ints. Raises ``ValueError`` naming the first bad sequence."""
    if isinstance(sequences, (str, bytes)) or (len(sequences) and isinstance(sequences[0], int)):
        raise TypeError("prompt_logprobs takes a list of token sequences, not one sequence")
    rows: list[list[int]] = []
    for i, seq in enumerate(sequences):
        row = [int(t) for t in seq]
        if not row:
            raise ValueError(f"sequence {i} is empty: there is nothing to score")
        if min(row) < 0:
            raise ValueError(f"sequence {i} holds a negative token id ({min(row)})")
        rows.append(row)
    return rows


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
