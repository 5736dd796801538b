"""Unclipped (importance-weighted) policy gradient.

Source: Williams 1992 (REINFORCE); the importance ratio makes the same loss usable for a slightly
stale policy. Per token: ``l_t = -A_t * exp(logp_t - old_logp_t)``. At ``logp == old_logp`` the
value is ``-A_t`` and the gradient is ``-A_t * grad(logp_t)``, the REINFORCE gradient. No clipping
and no options (``dual_clip_c``, ``entropy_clip``, clip ranges are errors here): use it on-policy
(one optimizer pass per batch of rollouts).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tracegym.algos.loss_inputs import LossInputs
from tracegym.algos.registry import POLICY_LOSSES, NoOptions


@POLICY_LOSSES.register("policy_gradient", options=NoOptions)
def policy_gradient_loss(inputs: LossInputs, opts: NoOptions) -> tuple[Tensor, dict[str, float]]:
    """``-A_t * r_t`` per token [B, T]; metrics ``ratio_mean``/``_min``/``_max``, ``approx_kl``."""
    log_ratio = inputs.log_ratio()
    ratio = torch.exp(log_ratio)
    return -inputs.advantages.detach() * ratio, inputs.ratio_metrics(ratio, log_ratio)
