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

from typing import Sequence

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
    one seed's proposals. ``[[1, 1, 0]] -> [[1/3, 1/3, -2/3]]``."""
    out = []
    for rewards in groups:
        if not rewards:
            out.append([])
            continue
        mean = sum(rewards) / len(rewards)
        out.append([float(r) - mean for r in rewards])
    return out
