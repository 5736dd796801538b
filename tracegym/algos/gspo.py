"""GSPO: clipped surrogate on a sequence-level ratio.

Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (Qwen team). The sequence ratio is
the length-normalised geometric mean of token ratios::

    s_i = exp( (1/|y_i|) sum_t (logp_{i,t} - old_logp_{i,t}) )

and the objective is ``(1/G) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)``, i.e. the
clipped surrogate with ``aggregation: sequence_mean``. ``y_i`` is a whole trajectory: when its
template split it into several rows (``LossInputs.trajectory_ids``), ``s_i`` is taken over all of
them and every row carries it, as ``sequence_mean`` counts the trajectory once. It is computed in
the paper's "GSPO-token" form ``s_{i,t} = sg[s_i] * exp(logp_{i,t} - sg[logp_{i,t}])``: every token carries the value
``s_i``; with advantages constant over a sequence and ``sequence_mean`` aggregation the gradient is
exactly GSPO's, and per-token (e.g. per-turn) advantages are allowed. Clip ranges are about three
orders of magnitude smaller than PPO's (the paper: 3e-4 / 4e-4, the defaults here).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tracegym.algos.aggregation import trajectory_totals
from tracegym.algos.loss_inputs import LossInputs
from tracegym.algos.ppo_clip import clipped_surrogate
from tracegym.algos.registry import POLICY_LOSSES


class GSPOOptions(BaseModel):
    """Options of ``gspo`` (flat keys of the ``policy_loss:`` section)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    clip_eps_low: float = Field(3e-4, ge=0.0, lt=1.0)
    """Lower clip range of the sequence ratio: clipped at ``1 - clip_eps_low``."""

    clip_eps_high: float | None = Field(4e-4, ge=0.0)
    """Upper clip range ``1 + clip_eps_high`` of the sequence ratio; None: the same as ``clip_eps_low``."""

    @property
    def eps_high(self) -> float:
        """The upper clip range actually used."""
        return self.clip_eps_low if self.clip_eps_high is None else self.clip_eps_high


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, trajectory_ids: Tensor | None = None) -> Tensor:
    """``(1/|y_i|) sum_{t in y_i} mask * (logp - old_logp)`` for the sequence ``y_i`` of each row -> [B]
    (0 for rows without tokens). ``trajectory_ids`` [B]: rows sharing an id are one sequence (a
    trajectory split by its template) and all get its value; None: a sequence per row. All [B, T]."""
    m = mask.to(logprobs.dtype)
    numerator, count = ((logprobs - old_logprobs) * m).sum(-1), m.sum(-1)  # [B] each
    if trajectory_ids is not None:  # a trajectory of one row keeps its own values exactly
        numerator, count = trajectory_totals(numerator, trajectory_ids), trajectory_totals(count, trajectory_ids)
    return numerator / count.clamp(min=1.0)


@POLICY_LOSSES.register("gspo", options=GSPOOptions)
def gspo_loss(inputs: LossInputs, opts: GSPOOptions) -> tuple[Tensor, dict[str, float]]:
    """GSPO(-token) per-token loss [B, T] (see the module docstring). Metrics: ``clip_frac_low``,
    ``clip_frac_high``, ``ratio_mean``/``_min``/``_max`` of the sequence ratio at the trained
    tokens, ``approx_kl`` from the token log-ratios."""
    logprobs, old = inputs.logprobs, inputs.old_logprobs.detach()
    limit = inputs.log_ratio_limit
    # [B]: one value per trajectory (all its rows; the micro-batch splitters keep them in one part)
    seq = sequence_log_ratio(logprobs, old, inputs.mask, inputs.trajectory_ids).detach().clamp(-limit, limit)
    # value: s_i at every token; gradient: s_i * grad(logp_t) per token
    ratio = torch.exp(seq.unsqueeze(-1) + logprobs - logprobs.detach())  # [B, T]
    per_token, metrics = clipped_surrogate(
        ratio, inputs.advantages.detach(), inputs, eps_low=opts.clip_eps_low, eps_high=opts.eps_high
    )
    metrics.update(inputs.ratio_metrics(ratio, logprobs.detach() - old))
    return per_token, metrics
