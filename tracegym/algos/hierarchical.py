"""Hierarchical GRPO for proposer / solver self-play, and the proposer's learnability reward.

Sources: prime-rl's hierarchical GRPO (``PrimeIntellect-ai/prime-rl:
src/prime_rl/orchestrator/algo/hierarchical_grpo.py``): each level is baselined within its own
group -- a proposed problem's solver attempts against each other, and the proposals made from one
seed against each other. Tool-R0 / verifiers ``proposer_solver``: the proposer is paid for problems
the solver solves about half the time, ``valid * 4 p (1 - p)`` with ``p`` the solver's pass rate.

    solver_adv   = hierarchical_advantages([[1, 1, 0]])            # [[1/3, 1/3, -2/3]]
    reward       = learnability_reward(valid=True, pass_rate=0.5)  # 1.0
"""

from __future__ import annotations

import math
from typing import Sequence

from tracegym.algos._groups import values_uniform

__all__ = ["hierarchical_advantages", "learnability_reward"]


def learnability_reward(valid: bool, pass_rate: float) -> float:
    """``valid * 4 p (1 - p)``: 1 at p = 0.5, 0 for problems always or never solved (nothing to
    learn from) and for invalid ones."""
    p = float(pass_rate)
    if not 0.0 <= p <= 1.0:  # also refuses NaN
        raise ValueError(f"pass_rate must be in [0, 1], got {pass_rate!r}")
    return 4.0 * p * (1.0 - p) if valid else 0.0


def hierarchical_advantages(groups: Sequence[Sequence[float]]) -> list[list[float]]:
    """Each group's rewards minus the group's mean (no std: GRPO's difficulty bias avoided, as in
    Dr. GRPO). Call it once per level: solver groups are one proposal's attempts, proposer groups
    one seed's proposals. ``[[1, 1, 0]] -> [[1/3, 1/3, -2/3]]``.

    A group whose rewards are all equal (up to ``EQUAL_VALUES_TOLERANCE``: three learnability rewards
    of 0.75 average to 0.7500000000000001) gets exactly 0, so ``has_signal`` skips it. A NaN or
    infinite reward raises ``ValueError`` naming the group and the position (it would silently make
    the whole group NaN or, compared with ``!=``, look like signal)."""
    out = []
    for g, rewards in enumerate(groups):
        values = [float(r) for r in rewards]
        bad = [i for i, r in enumerate(values) if not math.isfinite(r)]
        if bad:
            raise ValueError(f"hierarchical_advantages: group {g} has non-finite rewards at positions {bad[:10]}: "
                             f"{[values[i] for i in bad[:10]]}")
        if values_uniform(values):  # also the empty group
            out.append([0.0] * len(values))
            continue
        mean = sum(values) / len(values)
        out.append([r - mean for r in values])
    return out
