"""Reduce a per-token loss ``[B, T]`` to a scalar, with micro-batch-safe normalisation.

Modes (``m`` the target-aligned loss mask, ``w`` optional token weights, e.g. TIS, ``n_b`` the
trained tokens of row ``b``, ``S`` the rows with at least one trained token):

- ``token_mean``: ``sum_{b,t} m w l / sum_{b,t} m``: every trained token weighs the same
  (DAPO's token-level loss; long sequences weigh more).
- ``sequence_mean`` (seq-mean-token-mean): ``(1/S) sum_b (sum_t m w l) / n_b``: mean over each
  sequence's tokens, then over sequences (the original GRPO/PPO-RLHF form; GSPO).
- ``sequence_sum`` (seq-mean-token-sum): ``(1/S) sum_b sum_t m w l``: token sums averaged over
  sequences (no per-sequence length normalisation; scale grows with the length).
- ``fixed_length_sum``: ``(1/S) sum_b (sum_t m w l) / L_fixed``: token sums divided by one
  configured constant (the generation budget), then averaged over sequences (Dr. GRPO). It needs
  ``fixed_length``: dividing by a batch's padded length instead would make the scale of the loss
  depend on the longest sequence that happened to be sampled.

Token weights ``w`` (importance weights) multiply the numerator only; the denominators count masked
tokens and sequences. Sample weights ``s`` (how much a token counts as data, e.g. ``1/|L(n)|`` for
a tree node repeated in ``|L(n)|`` flattened leaves) multiply the numerator and also the counts:
``token_mean`` divides by ``sum m s`` (``LossNormalizers.weight_sum``), ``sequence_mean`` divides
each row by ``sum_t m s``; the sequence counts are unchanged. With ``s = 1`` on every trained token
(what the RL recipe builds unless an estimator gives weights) both are the unweighted modes.

Gradient accumulation: when a batch is split into micro-batches, the denominators (token count,
sequence count) must be those of the *full* batch, otherwise a micro-batch with few tokens gets
too much weight. ``LossNormalizers`` carries the full-batch values; the micro-batch loss is then
exactly its share of the full-batch loss (every mode is a sum over rows of row-local terms divided
by full-batch constants), and summing the micro-batch gradients gives the full-batch gradient.
Without normalizers, the tensors given are taken as the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor

Aggregation = Literal["token_mean", "sequence_mean", "sequence_sum", "fixed_length_sum"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "sequence_mean", "sequence_sum", "fixed_length_sum")


@dataclass(frozen=True)
class LossNormalizers:
    """Denominators taken from the full batch, so micro-batch losses add up to the batch loss.

    - ``num_tokens``: trained tokens (``sum(loss_mask)``) in the full batch.
    - ``num_sequences``: rows with at least one trained token in the full batch.
    - ``weight_sum``: ``sum(loss_mask * weights)`` in the full batch (weighted SFT mean).
    - ``max_target_length``: padded target length ``T`` of the full batch (informational; no
      aggregation divides by it).
    """

    num_tokens: float
    num_sequences: float
    weight_sum: float
    max_target_length: int

    @staticmethod
    def from_mask(mask: Tensor, weights: Tensor | None = None) -> "LossNormalizers":
        """Normalizers of the batch whose target-aligned ``mask`` [B, T] (and weights) is given."""
        mask = mask.float()
        weight_sum = float((mask * weights).sum()) if weights is not None else float(mask.sum())
        return LossNormalizers(
            num_tokens=float(mask.sum()),
            num_sequences=float((mask.sum(dim=-1) > 0).sum()),
            weight_sum=weight_sum,
            max_target_length=int(mask.shape[-1]),
        )


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    normalizers: LossNormalizers | None = None,
    fixed_length: int | None = None,
    token_weights: Tensor | None = None,
    sample_weights: Tensor | None = None,
) -> Tensor:
    """Scalar from ``per_token`` [B, T] under ``mask`` [B, T] (see the module docstring).

    ``token_weights`` [B, T] multiply the numerator only (e.g. truncated importance weights);
    ``sample_weights`` [B, T] weigh tokens as data (numerator and token counts; module docstring).
    ``fixed_length`` is required by ``fixed_length_sum``. An empty mask gives a zero loss that
    still depends on ``per_token`` (so ``backward`` works and yields zero gradients).
    """
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} differ in shape")
    if token_weights is not None and token_weights.shape != mask.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} and mask {tuple(mask.shape)} differ in shape")
    if sample_weights is not None and sample_weights.shape != mask.shape:
        raise ValueError(f"sample_weights {tuple(sample_weights.shape)} and mask {tuple(mask.shape)} differ in shape")
    mask = mask.to(per_token.dtype)
    if sample_weights is not None:  # counted data: numerator and token counts alike
        mask = mask * sample_weights.to(per_token.dtype)
    weighted = per_token * mask if token_weights is None else per_token * mask * token_weights.to(per_token.dtype)
    norm = normalizers if normalizers is not None else LossNormalizers.from_mask(mask)
    sequences = max(norm.num_sequences, 1.0)
    if mode == "token_mean":
        count = norm.weight_sum if sample_weights is not None else norm.num_tokens
        return weighted.sum() / max(count, 1e-12 if sample_weights is not None else 1.0)
    if mode == "sequence_mean":
        lengths = mask.sum(dim=-1)  # [B]; rows without tokens contribute 0
        lengths = lengths.clamp(min=1e-12) if sample_weights is not None else lengths.clamp(min=1.0)
        return (weighted.sum(dim=-1) / lengths).sum() / sequences
    if mode == "sequence_sum":
        return weighted.sum() / sequences
    if mode == "fixed_length_sum":
        if fixed_length is None:
            raise ValueError(
                "aggregation 'fixed_length_sum' needs fixed_length (e.g. the generation token budget); "
                "the batch's padded length would make the loss scale depend on the longest sample"
            )
        if fixed_length <= 0:
            raise ValueError(f"fixed_length must be positive, got {fixed_length}")
        return weighted.sum() / (float(fixed_length) * sequences)
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}")


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where ``mask`` is set (0 when the mask is empty); for metrics."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def masked_min_max(values: Tensor, mask: Tensor) -> tuple[float, float]:
    """Min and max of ``values`` where ``mask`` is set ((0, 0) when empty); for metrics."""
    selected = values[mask.bool()]
    if selected.numel() == 0:
        return 0.0, 0.0
    return float(selected.min()), float(selected.max())


__all__ = ["AGGREGATIONS", "Aggregation", "LossNormalizers", "aggregate", "masked_mean", "masked_min_max"]
