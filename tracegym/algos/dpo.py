"""DPO on whole trajectories: the preferred one should gain log-prob relative to the reference.

Source: Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model". With ``l(y)`` the sequence log-prob over the sampled tokens only (observations inside
a multi-turn trajectory are masked, see ``preference_inputs``), per pair (``y_w`` chosen, ``y_l``
rejected)::

    L = -log sigmoid(beta * [(l_pi - l_ref)(y_w) - (l_pi - l_ref)(y_l)])

``beta * (l_pi - l_ref)(y)`` is the implicit reward of ``y``. With the policy equal to the reference
every pair's loss is ``log 2``. Tokens the two trajectories share (a common prefix of turns, as
``build_pairs`` keeps after truncating at the first divergent turn) cancel exactly.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from tracegym.algos.preference_inputs import PairLogps, PreferenceOptions
from tracegym.algos.registry import PREFERENCE_LOSSES


class DPOOptions(PreferenceOptions):
    """Options of ``dpo`` (``beta``)."""


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, reference_chosen: Tensor, reference_rejected: Tensor,
             beta: float = 0.1) -> Tensor:
    """Per-pair DPO loss [P] from sequence log-probs, each [P] (reference values are not differentiated)."""
    logits = (policy_chosen - reference_chosen.detach()) - (policy_rejected - reference_rejected.detach())  # [P]
    return -F.logsigmoid(beta * logits)  # [P]; logsigmoid is stable for large |logits|


def dpo_pair_loss(inputs: PairLogps, beta: float) -> tuple[Tensor, dict[str, float]]:
    """``dpo_loss`` per pair [P] on the sequence log-probs in ``inputs``, and DPO's metrics: accuracy,
    reward margin, chosen/rejected log-ratio means."""
    loss = dpo_loss(inputs.policy_chosen, inputs.policy_rejected, inputs.reference_chosen, inputs.reference_rejected,
                    beta)
    return loss, inputs.metrics(beta)


@PREFERENCE_LOSSES.register("dpo", options=DPOOptions)
def dpo(inputs: PairLogps, opts: DPOOptions) -> tuple[Tensor, dict[str, float]]:
    """DPO per pair [P]; metrics: accuracy, reward margin, chosen/rejected log-ratio means."""
    return dpo_pair_loss(inputs, opts.beta)


__all__ = ["DPOOptions", "dpo", "dpo_loss", "dpo_pair_loss"]
