"""How far one RL update moved the policy, and a cap on it (a backtracking trust region).

Why: with Adam every step moves each weight by about the learning rate whatever the evidence, and
an RL step of a competent agent often holds only a few groups with signal. The step size, not the
evidence, then decides how far the policy goes (docs/algorithms.md, "Why RL lost the strong start").
Two measures make the move visible every step:

* ``drift/kl``: KL(pi_old || pi_new) per sampled token on up to ``rows`` rows of the step's own
  batch (``ceil(rows / micro_batch_size)`` no-grad forward passes), with Schulman's unbiased, always-positive estimator ``k3 = (r - 1) - log r``,
  ``r = pi_new / pi_old`` (http://joschu.net/blog/kl-approx.html), over tokens sampled from pi_old.
* ``drift/probe_nll``: mean negative log-likelihood per assistant token of a fixed probe set (expert
  trajectories of train tasks, chosen once at the start): it rises when RL forgets what SFT taught.

The cap (``max_policy_drift``) is the backtracking line search of TRPO (Schulman et al. 2015,
"Trust Region Policy Optimization", Appendix C) applied to the optimizer's step: when the measured
KL exceeds the bound, the trainable weights go back along the step, ``theta = theta_old + alpha *
(theta_new - theta_old)`` with ``alpha = 1/2, 1/4, ...``, until the KL is within the bound; if no
``alpha`` in ``max_backtracks`` halvings is, the step is undone (``alpha = 0``). Adam's moments keep
the update they saw (as in every clipped-step method).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from tracegym.batch import Batch, make_batch
from tracegym.train.policy_update import batch_logprobs


def drift_rows(batch: Batch, rows: int) -> Batch | None:
    """Up to ``rows`` evenly spaced rows of ``batch`` that hold sampled tokens with engine log-probs
    (so pi_old needs no extra forward pass); the measure's sample, fixed for the step. None when
    there is none (or ``rows`` is 0)."""
    if rows <= 0:
        return None
    candidates = [r for r in range(batch.size)
                  if bool(batch.has_engine_logprobs[r]) and float(batch.loss_mask[r].sum()) > 0]
    if len(candidates) > rows:
        step = len(candidates) / rows
        candidates = [candidates[int(i * step)] for i in range(rows)]
    return batch.select(candidates) if candidates else None


def kl_old_new(new_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> float:
    """Mean over masked tokens of ``k3 = (r - 1) - log r``, ``r = exp(new - old)`` (all [B, T])."""
    log_ratio = (new_logprobs - old_logprobs).clamp(-20.0, 20.0)
    k3 = torch.expm1(log_ratio) - log_ratio
    return float((k3 * mask).sum() / mask.sum().clamp(min=1.0))


def measure_drift(model: torch.nn.Module, sample: Batch, micro_batch_size: int, temperature: float) -> float:
    """KL(pi_old || pi_model) per sampled token of ``sample`` (``drift_rows``). pi_old: the trainer's
    own old log-probs when the step computed them (top-p, stale batches, several passes: the
    engine's would carry the nucleus renormalisation or the version lag), else the engine's."""
    new = batch_logprobs(model, sample, micro_batch_size, temperature=temperature)
    old = sample.old_logprobs if sample.old_logprobs is not None else sample.engine_logprobs
    return kl_old_new(new, old.to(new.device), sample.loss_mask.to(new.device))


def probe_nll(model: torch.nn.Module, probe: Batch | None, micro_batch_size: int) -> float | None:
    """Mean NLL per assistant token of the probe set at temperature 1 (None without a probe)."""
    if probe is None:
        return None
    logprobs = batch_logprobs(model, probe, micro_batch_size, temperature=1.0)
    mask = probe.loss_mask.to(logprobs.device)
    return float(-(logprobs * mask).sum() / mask.sum().clamp(min=1.0))


def trainable_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """A copy of the trainable weights (LoRA: the adapter alone, a few MB)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def _interpolate(model: torch.nn.Module, before: dict[str, Tensor], after: dict[str, Tensor], alpha: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in before:
                p.copy_(before[name] + alpha * (after[name] - before[name]))


def cap_drift(
    model: torch.nn.Module, before: dict[str, Tensor], sample: Batch, *, max_kl: float, micro_batch_size: int,
    temperature: float, max_backtracks: int = 4,
) -> dict[str, float]:
    """After ``optimizer.step()``: measure the move from ``before``; over ``max_kl``, shrink it by
    halves (line search) or undo it. Returns ``drift/kl`` (the kept step's), ``drift/kl_full`` (the
    optimizer's own step) and ``drift/step_scale`` (alpha: 1 = kept whole, 0 = undone)."""
    full = measure_drift(model, sample, micro_batch_size, temperature)
    out = {"drift/kl": full, "drift/kl_full": full, "drift/step_scale": 1.0}
    if full <= max_kl:
        return out
    after = trainable_state(model)
    alpha, kl = 1.0, full
    for _ in range(max_backtracks):
        alpha /= 2
        _interpolate(model, before, after, alpha)
        kl = measure_drift(model, sample, micro_batch_size, temperature)
        if kl <= max_kl:
            return {**out, "drift/kl": kl, "drift/step_scale": alpha}
    _interpolate(model, before, after, 0.0)  # no step within the bound: keep the old policy
    return {**out, "drift/kl": 0.0, "drift/step_scale": 0.0}


def build_probe(examples: Sequence[Any], pad_token_id: int) -> Batch | None:
    """The probe set's batch (its examples' assistant tokens are what ``probe_nll`` scores)."""
    return make_batch(list(examples), pad_token_id=pad_token_id) if examples else None


__all__ = ["build_probe", "cap_drift", "drift_rows", "kl_old_new", "measure_drift", "probe_nll", "trainable_state"]
