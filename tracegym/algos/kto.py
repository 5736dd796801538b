"""KTO: preference learning from single trajectories labelled desirable or undesirable (no pairs).

Source: Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization". With
``r(y) = l_pi(y) - l_ref(y)`` (sequence log-probs over the sampled tokens) and the reference point
``z0``, per trajectory::

    desirable:    lambda_D * (1 - sigmoid(beta * (r - z0)))
    undesirable:  lambda_U * (1 - sigmoid(beta * (z0 - r)))

``z0 = max(0, mean r(x, y'))`` over *mismatched* pairs of the batch (a task's first prompt ``x`` with
another trajectory's whole continuation ``y'``, every training example of it when its template split it:
``tracegym.recipes.dpo.mismatched_sequence``), detached: an estimate of ``KL(pi || ref)`` that moves with
training but carries no gradient. The paper advises ``lambda_D n_D / (lambda_U n_U)`` in [1, 4/3]
(``n``: desirable and undesirable counts); the recipe warns outside that range.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from tracegym.algos.preference_inputs import LabelledLogps, PreferenceOptions
from tracegym.algos.registry import PREFERENCE_LOSSES


class KTOOptions(PreferenceOptions):
    """Options of ``kto`` (``beta``, ``lambda_d``, ``lambda_u``); trains on labelled trajectories."""

    data = "labelled"

    lambda_d: float = Field(1.0, gt=0.0)
    """Weight lambda_D of the desirable trajectories' loss."""

    lambda_u: float = Field(1.0, gt=0.0)
    """Weight lambda_U of the undesirable trajectories' loss."""


def kto_reference_point(policy_logps: Tensor, reference_logps: Tensor) -> Tensor:
    """``z0 = max(0, mean(l_pi - l_ref))`` over mismatched trajectories [M] -> a detached scalar."""
    if policy_logps.numel() == 0:
        return policy_logps.new_zeros(())
    return (policy_logps.detach() - reference_logps.detach()).mean().clamp(min=0.0)


def kto_loss(policy: Tensor, reference: Tensor, desirable: Tensor, reference_point: Tensor | float, beta: float = 0.1,
             lambda_d: float = 1.0, lambda_u: float = 1.0) -> Tensor:
    """Per-trajectory KTO loss [N] from sequence log-probs [N], labels [N] (bool) and ``z0`` (scalar)."""
    r = policy - reference.detach()  # [N]
    z0 = torch.as_tensor(reference_point, dtype=r.dtype, device=r.device).detach()
    good = desirable.to(torch.bool)
    desirable_loss = lambda_d * (1.0 - torch.sigmoid(beta * (r - z0)))  # [N]
    undesirable_loss = lambda_u * (1.0 - torch.sigmoid(beta * (z0 - r)))  # [N]
    return torch.where(good, desirable_loss, undesirable_loss)


@PREFERENCE_LOSSES.register("kto", options=KTOOptions)
def kto(inputs: LabelledLogps, opts: KTOOptions) -> tuple[Tensor, dict[str, float]]:
    """KTO per trajectory [N]; metrics: the reference point, accuracy, log-ratio means per label."""
    loss = kto_loss(inputs.policy, inputs.reference, inputs.desirable, inputs.reference_point, opts.beta,
                    opts.lambda_d, opts.lambda_u)
    return loss, inputs.metrics()


__all__ = ["KTOOptions", "kto", "kto_loss", "kto_reference_point"]
