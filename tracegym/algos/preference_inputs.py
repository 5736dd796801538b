"""What every registered preference loss receives: sequence log-probs of whole trajectories.

A preference loss compares trajectories, not tokens. Each trajectory ``y`` is scored by its
*sequence log-prob* under the policy and under the reference::

    l(y) = sum_t m_t * w_t * log pi(y_t | y_<t)

``m_t`` is the loss mask of ``tracegym.render.build_examples``: 1 exactly on the tokens the model
sampled, so the observations inside a multi-turn trajectory (tool results, user turns) and the
template text between turns count as context only. ``w_t`` is the weight of the assistant turn that
token ``t`` belongs to, from ``PreferenceOptions.turn_weights(num_turns)``: 1 for DPO and KTO,
DMPO's discount ``phi_j``; the same weights are used for the policy and the reference.

Two kinds of data, named by the options model's ``data`` class attribute:

- ``"pairs"`` (dpo, dmpo): ``PairLogps``, chosen and rejected trajectory of ``P`` pairs.
- ``"labelled"`` (kto): ``LabelledLogps``, ``N`` single trajectories, each desirable or not, and
  the reference point ``z0`` of the whole batch.

A registered loss is ``fn(inputs, opts) -> (per_item_loss [P] or [N], metrics)``, unreduced: the
recipe sums the items of a micro-batch and divides by the number of items of the full batch, so
gradient accumulation over micro-batches gives the full-batch gradient exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from tracegym.algos.aggregation import require_one_shape
from tracegym.algos.registry import PREFERENCE_LOSSES

PreferenceData = Literal["pairs", "labelled"]


class PreferenceOptions(BaseModel):
    """Base of every preference loss's options: the temperature ``beta`` of the implicit reward
    ``beta * (l_pi - l_ref)``, the kind of data the loss trains on, and the per-turn weights of the
    sequence log-probs. A plugin loss subclasses it (set ``data``, override ``turn_weights``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    data: ClassVar[PreferenceData] = "pairs"

    beta: float = Field(0.1, gt=0.0)
    """Temperature of the implicit reward ``beta * (l_pi(y) - l_ref(y))``: larger keeps the policy
    closer to the reference."""

    def turn_weights(self, num_turns: int) -> list[float]:
        """Weight of each assistant turn's tokens in the sequence log-prob (here: 1 for every turn)."""
        return [1.0] * num_turns


def sequence_logps(
    token_logps: Tensor, loss_mask: Tensor, weights: Tensor, owner: Tensor | None = None, num_owners: int | None = None
) -> Tensor:
    """``sum_t m_t w_t logp_t`` per row, then summed per owner (trajectory).

    token_logps, loss_mask, weights: [B, T] target-aligned. ``owner`` [B] long: the trajectory each
    row belongs to (a trajectory whose template rewrote history gives several rows); None: one
    trajectory per row. Returns [S] with ``S = num_owners`` (default ``owner.max() + 1``).
    Values at masked positions never reach the result, NaN or not (``where``, not a product).
    """
    require_one_shape(token_logps=token_logps, loss_mask=loss_mask, weights=weights)
    trained = loss_mask > 0
    per_row = torch.where(trained, token_logps * weights.to(token_logps.dtype), torch.zeros_like(token_logps)).sum(-1)  # [B]
    if owner is None:
        return per_row
    size = int(owner.max()) + 1 if num_owners is None else num_owners
    return per_row.new_zeros(size).index_add(0, owner.to(per_row.device), per_row)  # [S]


def _check_same_shape(kind: str, tensors: Mapping[str, Tensor]) -> None:
    if len({tuple(t.shape) for t in tensors.values()}) != 1 or next(iter(tensors.values())).dim() != 1:
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items())
        raise ValueError(f"{kind} must all be 1-d of one length; got {shapes}")


@dataclass(frozen=True)
class PairLogps:
    """Sequence log-probs of ``P`` preference pairs (``w``: chosen, ``l``: rejected), each [P].
    Policy values carry the gradient; reference values are detached."""

    policy_chosen: Tensor
    policy_rejected: Tensor
    reference_chosen: Tensor
    reference_rejected: Tensor

    def __post_init__(self) -> None:
        _check_same_shape("pair log-probs", {k: getattr(self, k) for k in
                                             ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected")})

    @property
    def chosen_logratio(self) -> Tensor:
        """``l_pi(y_w) - l_ref(y_w)`` [P]."""
        return self.policy_chosen - self.reference_chosen.detach()

    @property
    def rejected_logratio(self) -> Tensor:
        """``l_pi(y_l) - l_ref(y_l)`` [P]."""
        return self.policy_rejected - self.reference_rejected.detach()

    @property
    def logits(self) -> Tensor:
        """``(l_pi - l_ref)(y_w) - (l_pi - l_ref)(y_l)`` [P]: the implicit reward margin over beta."""
        return self.chosen_logratio - self.rejected_logratio

    def metrics(self, beta: float) -> dict[str, float]:
        """``accuracy`` (fraction of pairs with a positive margin), ``reward_margin`` (mean of
        ``beta * logits``), ``logratio_chosen`` / ``logratio_rejected`` (means)."""
        with torch.no_grad():
            logits = self.logits.detach()
            return {
                "accuracy": float((logits > 0).float().mean()),
                "reward_margin": float(beta * logits.mean()),
                "logratio_chosen": float(self.chosen_logratio.detach().mean()),
                "logratio_rejected": float(self.rejected_logratio.detach().mean()),
            }

    @staticmethod
    def cat(parts: Sequence["PairLogps"]) -> "PairLogps":
        """The parts (micro-batches) as one detached batch, in order: for full-batch metrics."""
        return PairLogps(*(torch.cat([getattr(p, k).detach() for p in parts]) for k in
                           ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected")))


@dataclass(frozen=True)
class LabelledLogps:
    """Sequence log-probs of ``N`` labelled trajectories, each [N], and the batch's reference point.

    ``reference_point`` is KTO's ``z0``: a detached scalar estimated on the full batch (the same for
    every micro-batch of it), see ``tracegym.algos.kto.kto_reference_point``."""

    policy: Tensor
    reference: Tensor
    desirable: Tensor
    """[N] bool: a desirable (successful) trajectory, or an undesirable one."""
    reference_point: Tensor

    def __post_init__(self) -> None:
        _check_same_shape("labelled log-probs", {"policy": self.policy, "reference": self.reference,
                                                 "desirable": self.desirable})
        if self.reference_point.numel() != 1:
            raise ValueError(f"reference_point must be a scalar, got shape {tuple(self.reference_point.shape)}")

    @property
    def logratio(self) -> Tensor:
        """``r = l_pi(y) - l_ref(y)`` [N]."""
        return self.policy - self.reference.detach()

    def metrics(self) -> dict[str, float]:
        """``reference_point`` (z0), ``accuracy`` (fraction of rows on their side of z0: desirable
        above, undesirable below), ``logratio_desirable`` / ``logratio_undesirable`` (means, only
        when the batch has such rows), ``desirable_frac``."""
        with torch.no_grad():
            r, z0, good = self.logratio.detach(), self.reference_point.detach().reshape(()), self.desirable.bool()
            right_side = torch.where(good, r > z0, r < z0)
            out = {"reference_point": float(z0), "accuracy": float(right_side.float().mean()),
                   "desirable_frac": float(good.float().mean())}
            if good.any():
                out["logratio_desirable"] = float(r[good].mean())
            if (~good).any():
                out["logratio_undesirable"] = float(r[~good].mean())
            return out

    @staticmethod
    def cat(parts: Sequence["LabelledLogps"]) -> "LabelledLogps":
        """The parts (micro-batches of one batch, sharing its reference point) as one detached batch."""
        return LabelledLogps(torch.cat([p.policy.detach() for p in parts]), torch.cat([p.reference.detach() for p in parts]),
                             torch.cat([p.desirable for p in parts]), parts[0].reference_point.detach())


def preference_loss_options(name: str, values: Mapping[str, Any]) -> PreferenceOptions:
    """The options of preference loss ``name`` from ``values`` (a config's loss section): the keys its
    options model declares are taken, the others ignored (``gamma`` means nothing to ``dpo``).
    Raises ``KeyError`` for an unknown name (listing the registered ones) and
    ``pydantic.ValidationError`` for a bad value."""
    entry = PREFERENCE_LOSSES.entry(name)
    fields = entry.options.model_fields
    options = entry.parse_options({k: v for k, v in values.items() if k in fields})
    if not isinstance(options, PreferenceOptions):
        raise TypeError(f"preference loss {name!r}: its options model must subclass PreferenceOptions")
    return options


__all__ = ["LabelledLogps", "PairLogps", "PreferenceData", "PreferenceOptions", "preference_loss_options", "sequence_logps"]
