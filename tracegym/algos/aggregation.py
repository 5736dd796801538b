"""Reduce a per-token loss ``[B, T]`` to a scalar, with micro-batch-safe normalisation.

Modes (``m`` the target-aligned loss mask, ``w`` optional token weights, e.g. TIS, ``n_i`` the
trained tokens of sequence ``i``, ``S`` the sequences with at least one trained token):

- ``token_mean``: ``sum_{b,t} m w l / sum_{b,t} m``: every trained token weighs the same
  (DAPO's token-level loss; long sequences weigh more).
- ``sequence_mean`` (seq-mean-token-mean): ``(1/S) sum_i (sum_{t in i} m w l) / n_i``: mean over each
  sequence's tokens, then over sequences (the original GRPO/PPO-RLHF form; GSPO).
- ``sequence_sum`` (seq-mean-token-sum): ``(1/S) sum_i sum_{t in i} m w l``: token sums averaged over
  sequences (no per-sequence length normalisation; scale grows with the length).
- ``fixed_length_sum``: ``(1/S) sum_i (sum_{t in i} m w l) / L_fixed``: token sums divided by one
  configured constant (the generation budget), then averaged over sequences (Dr. GRPO). It needs
  ``fixed_length``: dividing by a batch's padded length instead would make the scale of the loss
  depend on the longest sequence that happened to be sampled.

A sequence is a trajectory, not a row. A template that rewrites history (Qwen3 with
``history_preserving: false``) splits one trajectory into several training rows; counted per row,
such a trajectory would weigh once per part (``sequence_sum``: ``S`` too large for the others;
``sequence_mean``: each part normalised by its own length and counted as a sequence). With
``trajectory_ids`` [B] (rows of one trajectory share an id; ``Batch.trajectory_ids``) the rows of a
trajectory form one sequence: ``S`` counts trajectories and ``n_i`` sums over all its rows. Without
them every row is its own sequence, exactly as before.

Token weights ``w`` (importance weights) multiply the numerator only; the denominators count masked
tokens and sequences. Sample weights ``s`` (how much a token counts as data, e.g. ``1/|L(n)|`` for
a tree node repeated in ``|L(n)|`` flattened leaves) multiply the numerator and also the counts:
``token_mean`` divides by ``sum m s`` (``LossNormalizers.weight_sum``), ``sequence_mean`` divides
each row by ``sum_t m s``; the sequence counts are unchanged. With ``s = 1`` on every trained token
(what the RL recipe builds unless an estimator gives weights) both are the unweighted modes.

Gradient accumulation: when a batch is split into micro-batches, the denominators (token count,
sequence count) must be those of the *full* batch, otherwise a micro-batch with few tokens gets
too much weight. ``LossNormalizers`` carries the full-batch values, and ``trajectory_rest_sizes``
[B] the full-batch size of each row's trajectory outside the row (its other rows may sit in other
micro-batches); the micro-batch loss is then exactly its share of the full-batch loss (every mode is
a sum over rows of row-local terms divided by full-batch constants), and summing the micro-batch
gradients gives the full-batch gradient. Without normalizers, the tensors given are taken as the
whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
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
    def from_mask(mask: Tensor, weights: Tensor | None = None, trajectory_ids: Tensor | None = None) -> "LossNormalizers":
        """Normalizers of the batch whose target-aligned ``mask`` [B, T] (and weights) is given;
        ``trajectory_ids`` [B]: rows sharing an id are one sequence (None: one sequence per row)."""
        mask = mask.float()
        weight_sum = float((mask * weights).sum()) if weights is not None else float(mask.sum())
        trained_rows = mask.sum(dim=-1) > 0  # [B]
        if trajectory_ids is None:
            sequences = float(trained_rows.sum())
        else:
            sequences = float(torch.unique(trajectory_ids[trained_rows.to(trajectory_ids.device)]).numel())
        return LossNormalizers(
            num_tokens=float(mask.sum()),
            num_sequences=sequences,
            weight_sum=weight_sum,
            max_target_length=int(mask.shape[-1]),
        )


def trajectory_totals(row_values: Tensor, trajectory_ids: Tensor) -> Tensor:
    """Per row [B], the sum of ``row_values`` [B] over every row of its trajectory (rows sharing a
    ``trajectory_ids`` [B] entry). A trajectory of one row gets its own value back exactly."""
    _, dense = torch.unique(trajectory_ids, return_inverse=True)  # [B] in 0..n-1
    dense = dense.to(row_values.device)
    totals = row_values.new_zeros(int(dense.max()) + 1 if dense.numel() else 0).index_add(0, dense, row_values)
    return totals[dense]


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    normalizers: LossNormalizers | None = None,
    fixed_length: int | None = None,
    token_weights: Tensor | None = None,
    sample_weights: Tensor | None = None,
    trajectory_ids: Tensor | None = None,
    trajectory_rest_sizes: Tensor | None = None,
) -> Tensor:
    """Scalar from ``per_token`` [B, T] under ``mask`` [B, T] (see the module docstring).

    ``token_weights`` [B, T] multiply the numerator only (e.g. truncated importance weights);
    ``sample_weights`` [B, T] weigh tokens as data (numerator and token counts; module docstring).
    ``fixed_length`` is required by ``fixed_length_sum``. An empty mask gives a zero loss that
    still depends on ``per_token`` (so ``backward`` works and yields zero gradients).

    ``trajectory_ids`` [B]: rows sharing an id are one sequence (module docstring); the sequence
    count then comes from ``normalizers`` (built with the same ids) or from these rows.
    ``trajectory_rest_sizes`` [B]: for ``sequence_mean``, the size of each row's trajectory outside
    this row in the *full* batch (``sum m``, times ``sample_weights`` when given; 0 for a trajectory
    of one row): a row's sequence length is its own count plus this. None: the trajectory's rows
    given here are taken as all of it.
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
    for name, rows in (("trajectory_ids", trajectory_ids), ("trajectory_rest_sizes", trajectory_rest_sizes)):
        if rows is not None and tuple(rows.shape) != (mask.shape[0],):
            raise ValueError(f"{name} must be [B] = ({mask.shape[0]},), one entry per row; got {tuple(rows.shape)}")
    norm = normalizers if normalizers is not None else LossNormalizers.from_mask(mask, trajectory_ids=trajectory_ids)
    sequences = max(norm.num_sequences, 1.0)
    if mode == "token_mean":
        count = norm.weight_sum if sample_weights is not None else norm.num_tokens
        return weighted.sum() / max(count, 1e-12 if sample_weights is not None else 1.0)
    if mode == "sequence_mean":
        lengths = mask.sum(dim=-1)  # [B]: the row's own count; rows without tokens contribute 0
        if trajectory_rest_sizes is not None:  # + the rest of its trajectory in the full batch (0 if unsplit)
            lengths = lengths + trajectory_rest_sizes.to(lengths.device, lengths.dtype)
        elif trajectory_ids is not None:  # these rows are the whole batch: sum over the trajectory's rows
            lengths = trajectory_totals(lengths, trajectory_ids)
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


def require_one_shape(**tensors: Tensor) -> None:
    """``ValueError`` naming every tensor and its shape (``a (2, 3), b (2, 4) and mask (2, 3) must have one
    shape``) unless all of ``tensors`` have one shape."""
    if len({tuple(t.shape) for t in tensors.values()}) > 1:
        *first, last = [f"{name} {tuple(t.shape)}" for name, t in tensors.items()]
        raise ValueError(f"{', '.join(first)} and {last} must have one shape")


__all__ = ["AGGREGATIONS", "Aggregation", "LossNormalizers", "aggregate", "masked_mean", "masked_min_max",
           "require_one_shape", "trajectory_totals"]
