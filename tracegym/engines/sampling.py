"""The sampling distribution every engine draws from: log-probs after temperature and top-p, one
inverse-CDF draw per row, and the checks on ``SamplingParams``. The HF engine, its continuous
decoder and the stepper share these, so a token's reported log-prob is that of the distribution it
was drawn from, whichever loop drew it."""

from __future__ import annotations

import torch

from tracegym.types import SamplingParams

__all__ = ["sample_tokens", "sampling_logprobs", "validate_params"]


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the sampling distribution, in fp32.

    logits: [..., V]. Temperature 0 means greedy: the unscaled softmax is returned (the log-prob
    we report for the argmax token). Otherwise ``softmax(logits / T)`` restricted to the top-p
    nucleus (the smallest set of most likely tokens whose mass reaches ``top_p``, at least one
    token), renormalised; tokens outside the nucleus get ``-inf``.
    """
    logits = logits.float()
    if temperature <= 0.0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # mass strictly before each token; a token is kept while that mass is < top_p
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def sample_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse-CDF sampling: row ``b`` draws the first token whose cumulative
    probability exceeds ``uniforms[b]`` times the row's total.

    probs [B, V] (zeros are never drawn; need not sum to 1); uniforms [B] in [0, 1), one per row.
    Returns [B] token ids. ``torch.multinomial`` draws V exponentials per row instead (measured on
    2 cores, 19 rows x 49k vocabulary: 20 ms against 0.6 ms here, 13% of a decode step).
    The cumulative sum runs in float64, so rounding moves no boundary that matters.
    """
    cdf = probs.double().cumsum(-1)  # [B, V]
    target = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B]
    # a product that rounds up to the total finds no token: take the row's last one with probability
    last = probs.shape[-1] - 1 - torch.argmax((probs > 0).flip(-1).to(torch.int8), dim=-1)  # [B]
    return torch.minimum(chosen, last)


def validate_params(params: SamplingParams) -> None:
    """Reject parameters that have no meaning, with a message naming the field."""
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {params.max_tokens}")
    if params.n < 1:
        raise ValueError(f"n must be >= 1, got {params.n}")
