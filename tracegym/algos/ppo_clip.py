"""PPO clipped surrogate with token-level ratios, clip-higher, dual clip and entropy-aware clip.

Sources: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (clipped surrogate);
Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (clip-higher:
separate ``eps_low``/``eps_high``); Ye et al. 2020, "Mastering Complex Control in MOBA Games with
Deep Reinforcement Learning" (dual clip); entropy-aware ranges: see ``entropy_clip``.

Per token (target-aligned, ``r_t = exp(logp_t - old_logp_t)``)::

    l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
    dual clip, A_t < 0:  l_t = min(l_t, -c A_t)      (c > 1)

The loss returns ``l`` per token; ``compose.compute_policy_loss`` masks, weights and aggregates
it. Clipped tokens get zero gradient.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from tracegym.algos.entropy_clip import entropy_clip_scale
from tracegym.algos.loss_inputs import LossInputs
from tracegym.algos.registry import POLICY_LOSSES


class PPOClipOptions(BaseModel):
    """Options of ``ppo_clip`` (flat keys of the ``policy_loss:`` section)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower clip range: the ratio is clipped at ``1 - clip_eps_low``."""

    clip_eps_high: float | None = Field(None, ge=0.0)
    """Upper clip range ``1 + clip_eps_high``; None means the same as ``clip_eps_low``. A larger value
    (clip-higher, DAPO: 0.28) lets unlikely tokens gain probability faster."""

    dual_clip_c: float | None = Field(None, gt=1.0)
    """Dual clip (Ye et al. 2020): for negative advantages the per-token loss is capped at
    ``c * |A|``, so a huge ratio on a bad token cannot blow up the update. Typical: 3.0. None: off."""

    entropy_clip: bool = False
    """Entropy-aware clipping (direction from SWE-Fuse): both clip ranges are multiplied per token by
    ``clamp(H_t / entropy_clip_reference, entropy_clip_min_scale, entropy_clip_max_scale)``, so
    high-entropy tokens get a relaxed range and low-entropy tokens a strict one. The scaling formula
    is tracegym's own; the SWE-Fuse abstract gives only the direction. Needs the token entropy."""

    entropy_clip_reference: float = Field(1.0, gt=0.0)
    """Token entropy (nats) at which the clip range is unchanged (scale 1)."""

    entropy_clip_min_scale: float = Field(0.5, gt=0.0)
    """Smallest multiplier of the clip range (for near-deterministic tokens)."""

    entropy_clip_max_scale: float = Field(2.0, gt=0.0)
    """Largest multiplier of the clip range (for high-entropy tokens)."""

    @model_validator(mode="after")
    def _check(self) -> "PPOClipOptions":
        if self.entropy_clip_min_scale > self.entropy_clip_max_scale:
            raise ValueError(
                f"entropy_clip_min_scale ({self.entropy_clip_min_scale}) exceeds entropy_clip_max_scale "
                f"({self.entropy_clip_max_scale})"
            )
        return self

    @property
    def eps_high(self) -> float:
        """The upper clip range actually used."""
        return self.clip_eps_low if self.clip_eps_high is None else self.clip_eps_high


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    inputs: LossInputs,
    *,
    eps_low: float | Tensor,
    eps_high: float | Tensor,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token clipped objective for any ratio tensor [B, T] (token ratios for PPO, sequence
    ratios for GSPO), with clip-fraction metrics over ``inputs.mask``.

    ``eps_low``/``eps_high``: floats or per-token [B, T] ranges. Returns ``(per_token, metrics)``
    with ``clip_frac_low`` (``A < 0`` and ``r < 1 - eps_low``), ``clip_frac_high`` (``A > 0`` and
    ``r > 1 + eps_high``) and, with the dual clip, ``dual_clip_frac`` (``A < 0`` and ``r > c``).
    """
    lower = (1.0 - torch.as_tensor(eps_low, dtype=ratio.dtype, device=ratio.device)).clamp(min=0.0)
    upper = 1.0 + torch.as_tensor(eps_high, dtype=ratio.dtype, device=ratio.device)
    clipped_ratio = torch.clamp(ratio, lower, upper)
    per_token = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c  # positive where A < 0
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
    with torch.no_grad():
        r = ratio.detach()
        metrics = {
            "clip_frac_low": inputs.masked_mean(((advantages < 0) & (r < lower)).to(r.dtype)),
            "clip_frac_high": inputs.masked_mean(((advantages > 0) & (r > upper)).to(r.dtype)),
        }
        if dual_clip_c is not None:
            metrics["dual_clip_frac"] = inputs.masked_mean(((advantages < 0) & (r > dual_clip_c)).to(r.dtype))
    return per_token, metrics


@POLICY_LOSSES.register("ppo_clip", options=PPOClipOptions)
def ppo_clip_loss(inputs: LossInputs, opts: PPOClipOptions) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip with token ratios ``r_t = exp(logp_t - old_logp_t)`` (see the module docstring).

    Returns the per-token loss [B, T] and ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac``
    (with ``dual_clip_c``), ``ratio_mean``/``_min``/``_max``, ``approx_kl``.
    """
    log_ratio = inputs.log_ratio()
    ratio = torch.exp(log_ratio)
    eps_low: float | Tensor = opts.clip_eps_low
    eps_high: float | Tensor = opts.eps_high
    if opts.entropy_clip:
        if inputs.entropy is None:
            raise ValueError(
                "ppo_clip: entropy_clip is on but no token entropy was given; pass it from token_logprobs_and_entropy"
            )
        scale = entropy_clip_scale(
            inputs.entropy, opts.entropy_clip_reference, opts.entropy_clip_min_scale, opts.entropy_clip_max_scale
        )
        eps_low, eps_high = opts.clip_eps_low * scale, opts.eps_high * scale
    per_token, metrics = clipped_surrogate(
        ratio, inputs.advantages.detach(), inputs, eps_low=eps_low, eps_high=eps_high, dual_clip_c=opts.dual_clip_c
    )
    metrics.update(inputs.ratio_metrics(ratio, log_ratio))
    return per_token, metrics
