"""A CISPO-style policy loss in a plain module (after MiniMax-M1's CISPO: the importance weight is
clipped and detached, and every token keeps its ``-A * log p`` gradient, so clipped tokens still
learn). Use it with ``tracegym rl --plugin examples/plugins/cispo_loss.py ...
policy_loss.loss=my_cispo policy_loss.eps_high=0.28``.

A loss returns its per-token loss [B, T], unmasked and unweighted; ``compute_policy_loss`` applies
the mask, TIS weights, aggregation, KL and entropy terms.
"""

import torch
from pydantic import BaseModel, ConfigDict, Field

from tracegym.algos.loss_inputs import LossInputs
from tracegym.algos.registry import POLICY_LOSSES


class CISPOOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    eps_high: float = Field(0.2, gt=0.0)  # the weight is capped at 1 + eps_high (tune it; no paper default claimed)


@POLICY_LOSSES.register("my_cispo", options=CISPOOptions)
def my_cispo(inputs: LossInputs, opts: CISPOOptions):
    ratio = torch.exp(inputs.log_ratio()).detach()
    weight = ratio.clamp(max=1.0 + opts.eps_high)  # clipped importance weight, no gradient
    per_token = -weight * inputs.advantages * inputs.logprobs  # gradient: -w A grad log p
    metrics = {"clip_frac_high": inputs.masked_mean((ratio > 1.0 + opts.eps_high).float())}
    return per_token, {**metrics, **inputs.ratio_metrics(ratio)}
