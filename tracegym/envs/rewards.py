"""Named reward parts (a rubric): a denser, logged reward whose outcome part stays the success metric.

An env that offers parts declares them with the range of one step's unweighted value, the outcome
part first (``ToolEnv.offered_reward_parts``)::

    offered_reward_parts = {"answer": (0.0, 1.0), "calls": (0.0, 1.0)}

and takes the option ``reward_parts``, a mapping ``{part: weight}`` (``{"answer": 1.0, "calls":
0.3}``). Each step reports the unweighted value of every enabled part as ``info["reward/<part>"]``
(0.0 where it earned nothing), its ``reward`` is ``sum(weight * value)``, and the episode loop sums
the parts per episode into ``Trajectory.metrics["reward/<part>"]``, so that

    Trajectory.reward == sum(turn rewards) == sum(weight[p] * metrics["reward/" + p])

The outcome part is the env's own reward (the final answer's score, reaching the goal): success is
still decided by it alone, whatever the weights. It must keep a positive weight, so no setting
trains on the shaping parts alone. Parts the option leaves out keep their default weight: the
outcome part 1.0, the others off (not computed, not reported).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from tracegym.types import REWARD_PART_PREFIX

__all__ = ["RewardParts", "part_key"]


def part_key(part: str) -> str:
    """The info / metrics key of a part: ``"reward/<part>"``."""
    return REWARD_PART_PREFIX + part


@dataclass(frozen=True)
class RewardParts:
    """The enabled parts of one env instance and their weights, in the env's declared order.

    Stored as a tuple of pairs (not a dict or a mapping proxy) so that it is immutable and an env
    snapshot can deep-copy it.
    """

    parts: tuple[tuple[str, float], ...]
    outcome: str

    @classmethod
    def from_option(
        cls, value: Any, offered: Mapping[str, tuple[float, float]], option: str = "reward_parts"
    ) -> RewardParts | None:
        """Validate the env option ``value`` (None: parts off, the env's reward unchanged and no
        parts reported) against the ``offered`` parts, the first of which is the outcome part.
        Raises ``ValueError`` with a one-line message naming ``option``."""
        if value is None:
            return None
        if not offered:
            raise ValueError(f"{option}: this env offers no reward parts")
        names = list(offered)
        outcome = names[0]
        example = f'{{"{outcome}": 1.0' + (f', "{names[1]}": 0.3}}' if len(names) > 1 else "}")
        if not isinstance(value, Mapping):
            raise ValueError(f"{option} must be a mapping of part -> weight such as {example}, got {value!r}")
        unknown = [p for p in value if p not in offered]
        if unknown:
            raise ValueError(f"{option}: unknown part {unknown[0]!r}; this env's parts are {', '.join(names)}")
        weights: dict[str, float] = {outcome: 1.0}
        for part, weight in value.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"{option}: the weight of {part!r} must be a finite number, got {weight!r}")
            if weight < 0:
                raise ValueError(f"{option}: the weight of {part!r} must be >= 0, got {weight!r}")
            weights[part] = float(weight)
        if weights[outcome] <= 0:
            raise ValueError(
                f"{option}: the outcome part {outcome!r} needs a positive weight (it alone defines success), "
                f"got {weights[outcome]!r}"
            )
        return cls(parts=tuple((p, weights[p]) for p in names if p in weights), outcome=outcome)

    @property
    def weights(self) -> dict[str, float]:
        return dict(self.parts)

    def __contains__(self, part: object) -> bool:
        return any(part == name for name, _ in self.parts)

    def values(self, earned: Mapping[str, float]) -> dict[str, float]:
        """Every enabled part's unweighted value of one step (0.0 where none was earned)."""
        return {part: float(earned.get(part, 0.0)) for part, _ in self.parts}

    def reward(self, earned: Mapping[str, float]) -> float:
        """The step's reward: the weighted sum of its enabled parts."""
        return sum(weight * float(earned.get(part, 0.0)) for part, weight in self.parts)

    def info(self, earned: Mapping[str, float]) -> dict[str, float]:
        """The step's ``info`` entries: ``{"reward/<part>": unweighted value}`` for every enabled part,
        so every step (and every episode's metrics) has the same keys."""
        return {part_key(part): value for part, value in self.values(earned).items()}

    def step_range(self, offered: Mapping[str, tuple[float, float]]) -> tuple[float, float]:
        """Bounds of one step's reward from each part's per-step range (as if every part could be
        earned in the same step: safe, if loose for parts that never coincide)."""
        low = sum(weight * offered[part][0] for part, weight in self.parts)
        high = sum(weight * offered[part][1] for part, weight in self.parts)
        return low, high
