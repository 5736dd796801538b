"""Trajectory -> TrainingExamples with explicit masks, from the token ids alone.

Nothing here depends on a chat template: each turn already holds the exact prompt the engine saw
and the exact ids it sampled. A turn whose prompt extends the sequence built so far is appended
(the extension is the end-of-turn token if it was not sampled, the template's text between turns,
tool/user turns and the generation prompt: all mask 0), then its completion (mask 1). A prompt that
does not extend the sequence means the template rewrote history; the trajectory is cut there and a
new example starts from that turn's full prompt (``BuildStats.splits`` counts the cuts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tracegym.types import Trajectory, TrainingExample


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


@dataclass
class _Builder:
    """The example being built; every list has the same length L."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    all_turns_have_logprobs: bool = True

    def add_context(self, ids: Sequence[int]) -> None:
        n = len(ids)
        self.ids.extend(ids)
        self.mask.extend([0] * n)
        self.weights.extend([0.0] * n)
        self.advantages.extend([0.0] * n)
        self.logprobs.extend([0.0] * n)

    def add_completion(
        self, ids: Sequence[int], weight: float, advantage: float, logprobs: Sequence[float] | None
    ) -> None:
        n = len(ids)
        self.ids.extend(ids)
        self.mask.extend([1] * n)
        self.weights.extend([weight] * n)
        self.advantages.extend([advantage] * n)
        if logprobs is None:
            self.all_turns_have_logprobs = False
            self.logprobs.extend([0.0] * n)
        else:
            self.logprobs.extend(float(x) for x in logprobs)

    def finish(self, source: str) -> TrainingExample:
        return TrainingExample(
            input_ids=tuple(self.ids),
            loss_mask=tuple(self.mask),
            weights=tuple(self.weights),
            advantages=tuple(self.advantages),
            logprobs=tuple(self.logprobs),
            has_logprobs=self.all_turns_have_logprobs,
            source=source,
        )


def _per_turn(value: float | Sequence[float], num_turns: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * num_turns
    values = [float(a) for a in value]
    if len(values) != num_turns:
        raise ValueError(f"{name} has {len(values)} values but the trajectory has {num_turns} turns")
    return values


def build_examples(
    trajectory: Trajectory,
    weight: float | Sequence[float] = 1.0,
    advantage: float | Sequence[float] = 0.0,
    stats: BuildStats | None = None,
) -> list[TrainingExample]:
    """See ``Renderer.build_examples``. ``has_logprobs`` is per example: True only when every turn
    in that example carries ``completion_logprobs``. A trajectory with no turns gives no example."""
    turns = trajectory.turns
    advantages = _per_turn(advantage, len(turns), "advantage")
    weights = _per_turn(weight, len(turns), "weight")
    base_source = f"{trajectory.env}/{trajectory.task_id}/{trajectory.sample_index}"
    examples: list[TrainingExample] = []
    current: _Builder | None = None
    splits = 0
    for index, turn in enumerate(turns):
        if turn.completion_logprobs is not None and len(turn.completion_logprobs) != len(turn.completion_ids):
            raise ValueError(
                f"{base_source} turn {index}: {len(turn.completion_logprobs)} logprobs for "
                f"{len(turn.completion_ids)} completion tokens"
            )
        prompt = turn.prompt_ids
        if current is not None:
            n = len(current.ids)
            if len(prompt) >= n and tuple(prompt[:n]) == tuple(current.ids):
                current.add_context(prompt[n:])
            else:
                examples.append(current.finish(f"{base_source}#{len(examples)}"))
                splits += 1
                current = None
        if current is None:
            current = _Builder()
            current.add_context(prompt)
        current.add_completion(turn.completion_ids, weights[index], advantages[index], turn.completion_logprobs)
    if current is not None:
        examples.append(current.finish(f"{base_source}#{len(examples)}"))
    if stats is not None:
        stats.examples += len(examples)
        stats.splits += splits
        stats.trained_tokens += sum(sum(ex.loss_mask) for ex in examples)
        stats.total_tokens += sum(len(ex) for ex in examples)
    return examples
