"""DMPO: DPO for multi-turn agents, each turn's log-prob discounted by its position.

Source: Shi et al. 2024, "Direct Multi-Turn Preference Optimization for Language Agents"
(reference code: swt-user/DMPO, ``dmpo_trainer_efficient.py``). Assistant turn ``j`` (0-based) of a
trajectory with ``N`` assistant turns gets the weight::

    phi_j = gamma^j (1 - gamma^(N - j)) / (1 - gamma^N)          (gamma = 1: phi_j = (N - j) / N)

so early decisions weigh most (phi_0 = 1) and the weights fall to ``phi_(N-1)``; chosen and
rejected may have different ``N``. The sequence log-prob becomes
``l^phi(y) = sum_j phi_j sum_(t in turn j) log pi(y_t | y_<t)``, for the policy and the reference
alike, and the loss is DPO's on it::

    L = -log sigmoid(beta * [(l^phi_pi - l^phi_ref)(y_w) - (l^phi_pi - l^phi_ref)(y_l)])

The weights enter through ``DMPOOptions.turn_weights`` (the recipe puts ``phi_j`` on the tokens of
turn ``j``), so the loss function is ``dpo_loss``. With one turn, ``phi_0 = 1``: DMPO is DPO.
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from tracegym.algos.dpo import dpo_pair_loss
from tracegym.algos.preference_inputs import PairLogps, PreferenceOptions
from tracegym.algos.registry import PREFERENCE_LOSSES


def dmpo_turn_weights(num_turns: int, gamma: float = 0.7) -> list[float]:
    """``[phi_0, ..., phi_(N-1)]`` for ``N = num_turns`` assistant turns (see the module docstring)."""
    if num_turns < 0:
        raise ValueError(f"num_turns must be >= 0, got {num_turns}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    n = num_turns
    if gamma == 1.0:  # the limit of the formula as gamma -> 1
        return [(n - j) / n for j in range(n)]
    return [gamma**j * (1.0 - gamma ** (n - j)) / (1.0 - gamma**n) for j in range(n)]


class DMPOOptions(PreferenceOptions):
    """Options of ``dmpo`` (``beta``, ``gamma``)."""

    gamma: float = Field(0.7, ge=0.0, le=1.0)
    """Turn discount: turn ``j`` of ``N`` weighs ``gamma^j (1 - gamma^(N-j)) / (1 - gamma^N)``."""

    def turn_weights(self, num_turns: int) -> list[float]:
        return dmpo_turn_weights(num_turns, self.gamma)


@PREFERENCE_LOSSES.register("dmpo", options=DMPOOptions)
def dmpo(inputs: PairLogps, opts: DMPOOptions) -> tuple[Tensor, dict[str, float]]:
    """DMPO per pair [P] on the phi-weighted sequence log-probs in ``inputs``: DPO's loss and metrics
    (the turn weights are in the log-probs already)."""
    return dpo_pair_loss(inputs, opts.beta)


__all__ = ["DMPOOptions", "dmpo", "dmpo_turn_weights"]
