"""Supervised fine-tuning loss: masked negative log-likelihood with per-token weights.

With ``nll_t = -logp_t`` on target-aligned tokens, ``m_t`` the loss mask and ``w_t`` the weights
(``TrainingExample.weights``; 1.0 for plain SFT):

- ``weighted_mean`` (default): ``sum(m w nll) / sum(m w)``: a weighted average, so the loss
  keeps the scale of an NLL whatever the weights are; a weight only says how much a token counts
  relative to the others.
- ``token_mean``: ``sum(m w nll) / sum(m)``: weights scale the loss (a weight of 0.5 on every
  token halves the loss and the gradient).

With all weights 1 the two are the same: the token-mean NLL over trained tokens (what Hugging
Face's ``labels=-100`` loss gives). Denominators come from ``normalizers`` (the full batch) when
given, so micro-batch losses add up to the batch loss.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from tracegym.algos.aggregation import LossNormalizers, masked_mean

SFTReduction = Literal["weighted_mean", "token_mean"]


def sft_loss(
    logprobs: Tensor,
    mask: Tensor,
    weights: Tensor | None = None,
    *,
    reduction: SFTReduction = "weighted_mean",
    normalizers: LossNormalizers | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Masked (weighted) NLL of ``logprobs`` [B, T] under ``mask`` [B, T] and ``weights`` [B, T].

    Returns the scalar loss and metrics ``nll`` (unweighted token mean over these tensors),
    ``num_tokens`` and ``ppl`` (``exp(nll)``).
    """
    if logprobs.shape != mask.shape or (weights is not None and weights.shape != mask.shape):
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, mask {tuple(mask.shape)} and weights "
            f"{None if weights is None else tuple(weights.shape)} must have one shape"
        )
    m = mask.to(logprobs.dtype)
    w = torch.ones_like(m) if weights is None else weights.to(logprobs.dtype)
    nll = -logprobs
    numerator = (nll * m * w).sum()
    norm = normalizers if normalizers is not None else LossNormalizers.from_mask(m, w)
    if reduction == "weighted_mean":
        loss = numerator / (norm.weight_sum if norm.weight_sum > 0 else 1.0)
    elif reduction == "token_mean":
        loss = numerator / max(norm.num_tokens, 1.0)
    else:
        raise ValueError(f"unknown SFT reduction {reduction!r}; choose weighted_mean or token_mean")
    with torch.no_grad():
        mean_nll = float(masked_mean(nll.detach(), m))
        metrics = {"nll": mean_nll, "ppl": float(torch.tensor(mean_nll).exp()), "num_tokens": float(m.sum())}
    return loss, metrics
