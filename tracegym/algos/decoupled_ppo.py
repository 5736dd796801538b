"""Decoupled PPO (AReaL) for batches sampled by an older policy than the one being updated.

Source: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning" (decoupled PPO objective; after Hilton et al. 2022, "Batch Size-Invariance for
Policy Optimization", which separates the proximal policy from the behaviour policy).

Three policies per token (target-aligned ``[B, T]``):

- ``pi_theta``: the policy being optimised (``LossInputs.logprobs``, with gradient);
- ``pi_prox``: the trainer's policy at the start of this train step (``LossInputs.old_logprobs``,
  from ``Batch.old_logprobs``, recomputed by the trainer);
- ``pi_behav``: the policy that sampled the token (``LossInputs.behaviour_logprobs``, from
  ``Batch.engine_logprobs``: recorded with the trajectory; with asynchronous rollouts it may be
  several updates older than ``pi_prox``).

::

    rho_t = pi_theta / pi_prox                     (the PPO ratio: trust region around pi_prox)
    w_t   = pi_prox / pi_behav                     (behaviour importance weight, no gradient)
    w_t   = 0 if w_t > cap         [behav_weight_mode: mask, the default]
            min(w_t, cap)          [behav_weight_mode: clamp]
    w_t   = 1 on rows without behaviour log-probs (scripted expert turns)
    l_t   = w_t * max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))
          = -w_t * min(rho_t A_t, clip(rho_t, ...) A_t)

``l_t`` is ``ppo_clip``'s per-token loss with ``old = pi_prox`` times ``w_t`` (the options extend
``PPOClipOptions``: clip-higher, dual clip and entropy-aware clip apply to ``rho_t`` as there).
With ``pi_prox == pi_behav`` every ``w_t`` is ``exp(0) = 1`` and the loss is exactly ``ppo_clip``.
A masked token keeps its place in the aggregation's denominator (its loss is 0, as in AReaL, which
divides by the loss-mask count). ``w`` is always applied: current AReaL applies it only when
rejection sampling is configured, and warns otherwise.

Why the behaviour log-probs arrive as a ``LossInputs`` field (and not as ``ppo_clip`` plus a TIS
``mask`` mode in the composition): the weight, its cap and its mode are part of this objective, so
they are this loss's options, validated and documented with it (``policy_loss.loss:
decoupled_ppo``, ``behav_weight_cap: 5``), and its metrics come out with the loss's. The
composition hands every loss the sampler's log-probs with the rows that have them
(``LossInputs.behaviour_logprobs`` / ``has_behaviour_logprobs``), so the next behaviour-aware loss
(prime-rl's ``pi / mu`` masking, M2PO) needs no change there. Two class flags on the options model
keep the composition honest: ``needs_old_logprobs`` (the loss refuses the engine's log-probs in
place of ``pi_prox``, which would make ``w = 1`` silently) and ``applies_behaviour_weights``
(``tis_cap`` computes the same ratio ``pi_old / pi_engine``; both together would apply it twice, so
the config refuses the pair).

What ``w`` corrects: with ``pi_prox`` recomputed, ``pi_prox / pi_behav`` is the whole gap between
the weights that sampled and the weights the update starts from, version lag and engine/trainer
mismatch together (the engine's kernels or dtype), so TIS is not needed on top.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from tracegym.algos.aggregation import masked_mean, require_one_shape
from tracegym.algos.loss_inputs import LossInputs
from tracegym.algos.ppo_clip import PPOClipOptions, ppo_clip_loss
from tracegym.algos.registry import POLICY_LOSSES


class DecoupledPPOOptions(PPOClipOptions):
    """Options of ``decoupled_ppo``: those of ``ppo_clip`` (applied to ``rho = pi_theta / pi_prox``)
    and the behaviour weight's cap and mode."""

    needs_old_logprobs: ClassVar[bool] = True
    """``pi_prox`` must be the trainer's recomputed ``old_logprobs`` (read by the composition)."""
    applies_behaviour_weights: ClassVar[bool] = True
    """The loss weighs tokens by ``pi_old / pi_engine`` itself: ``tis_cap`` is refused with it."""

    behav_weight_cap: float | None = Field(5.0, gt=1.0)
    """Cap of the behaviour importance weight ``w = pi_prox / pi_behav``; tokens above it are
    masked (``behav_weight_mode: mask``) or clamped to it (``clamp``). Must exceed 1 (on-policy
    tokens have ``w`` near 1). None: no cap (unbounded weights, high variance)."""

    behav_weight_mode: Literal["mask", "clamp"] = "mask"
    """What happens to a token whose ``w`` exceeds ``behav_weight_cap``: ``mask`` (its loss is 0,
    AReaL's choice: the sampler and trainer disagree too much to trust the token) or ``clamp``
    (weight ``behav_weight_cap``, as truncated importance sampling does)."""


def behaviour_weights(
    prox_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    *,
    cap: float | None,
    mode: Literal["mask", "clamp"] = "mask",
    rows_with_behaviour: Tensor | None = None,
    log_ratio_limit: float = 20.0,
) -> tuple[Tensor, dict[str, float]]:
    """``w = pi_prox / pi_behav`` per token, capped by ``mode``, detached.

    ``prox_logprobs``/``behaviour_logprobs``/``mask`` [B, T]; ``rows_with_behaviour`` [B] bool marks
    rows whose behaviour log-probs are known (the others get ``w = 1``); None: every row. The log
    weight is clamped to ``+-log_ratio_limit`` before ``exp``.

    Returns the weights [B, T] (1 off the mask and on rows without behaviour log-probs, 0 on masked
    tokens in ``mask`` mode) and metrics over the trained tokens: ``behav_weight_mean`` (of the
    applied weights), ``behav_masked_frac`` (tokens set to 0), ``behav_clamped_frac`` (tokens set
    to the cap), and over the trained tokens of rows with behaviour log-probs
    ``behav_weight_raw_max`` (largest weight before the cap) and ``behav_approx_kl`` (k3 estimate
    of ``KL(pi_behav || pi_prox)``: how far the sampler lags).
    """
    if mode not in ("mask", "clamp"):
        raise ValueError(f"behav_weight_mode must be 'mask' or 'clamp', got {mode!r}")
    if cap is not None and cap <= 0:
        raise ValueError(f"the behaviour weight cap must be positive, got {cap}")
    require_one_shape(prox_logprobs=prox_logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask)
    with torch.no_grad():
        trained = mask.bool()  # [B, T]
        known = trained  # [B, T]: trained tokens whose behaviour log-prob is known
        if rows_with_behaviour is not None:
            known = trained & rows_with_behaviour.to(device=mask.device, dtype=torch.bool).unsqueeze(-1)
        log_w = (prox_logprobs.detach() - behaviour_logprobs.detach()).clamp(-log_ratio_limit, log_ratio_limit)
        raw = torch.exp(log_w)  # [B, T]
        over = known & (raw > cap) if cap is not None else torch.zeros_like(known)
        capped = raw if cap is None else (raw.masked_fill(over, 0.0) if mode == "mask" else raw.clamp(max=cap))
        weights = torch.where(known, capped, torch.ones_like(raw))  # [B, T]
        over_frac = float(masked_mean(over.to(raw.dtype), trained))
        selected = raw[known]
        metrics = {
            "behav_weight_mean": float(masked_mean(weights, trained)),
            "behav_masked_frac": over_frac if mode == "mask" else 0.0,
            "behav_clamped_frac": over_frac if mode == "clamp" else 0.0,
            "behav_weight_raw_max": float(selected.max()) if selected.numel() else 0.0,
            "behav_approx_kl": float(masked_mean(torch.expm1(log_w) - log_w, known)),
        }
    return weights, metrics


@POLICY_LOSSES.register("decoupled_ppo", options=DecoupledPPOOptions)
def decoupled_ppo_loss(inputs: LossInputs, opts: DecoupledPPOOptions) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO (see the module docstring): ``ppo_clip``'s per-token loss against ``pi_prox``
    (``inputs.old_logprobs``) times the behaviour weight ``w = pi_prox / pi_behav``.

    Needs ``inputs.behaviour_logprobs`` (``compute_policy_loss`` fills them from
    ``Batch.engine_logprobs``). Returns the per-token loss [B, T] and ``ppo_clip``'s metrics (clip
    fractions, ``ratio_*`` and ``approx_kl`` of ``rho``) with those of ``behaviour_weights``.
    """
    if inputs.behaviour_logprobs is None:
        raise ValueError(
            "decoupled_ppo needs the sampler's log-probs (pi_behav) but LossInputs.behaviour_logprobs is None: "
            "pass behaviour_logprobs=batch.engine_logprobs and has_behaviour_logprobs=batch.has_engine_logprobs "
            "(compute_policy_loss does it from the batch), and record the engine's log-probs with the trajectories"
        )
    weights, weight_metrics = behaviour_weights(
        inputs.old_logprobs,
        inputs.behaviour_logprobs,
        inputs.mask,
        cap=opts.behav_weight_cap,
        mode=opts.behav_weight_mode,
        rows_with_behaviour=inputs.has_behaviour_logprobs,
        log_ratio_limit=inputs.log_ratio_limit,
    )
    per_token, metrics = ppo_clip_loss(inputs, opts)  # [B, T], rho against pi_prox
    return per_token * weights, {**metrics, **weight_metrics}


__all__ = ["DecoupledPPOOptions", "behaviour_weights", "decoupled_ppo_loss"]
