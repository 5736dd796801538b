"""``PolicyLossConfig``: which pieces ``compute_policy_loss`` composes, by name, with their options.

Read from the ``policy_loss:`` section of an RL run config (``RLConfig.policy_loss``), e.g.::

    policy_loss:
      loss: ppo_clip          # ppo_clip | gspo | policy_gradient
      clip_eps_low: 0.2
      clip_eps_high: 0.28     # clip-higher (DAPO)
      dual_clip_c: 3.0        # dual clip for negative advantages
      aggregation: token_mean # token_mean | sequence_mean | fixed_length_sum
      tis_cap: 2.0            # truncated importance sampling against the engine's log-probs
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tracegym.algos.registry import POLICY_LOSSES


class PolicyLossConfig(BaseModel):
    """Options of the RL policy loss. Unknown keys are errors. All extras are off by default."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    loss: str = "ppo_clip"
    """Registered policy loss: ``ppo_clip`` (token ratios, PPO), ``gspo`` (sequence ratio, the
    length-normalised geometric mean of token ratios) or ``policy_gradient`` (no clipping)."""

    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower clip range: the ratio is clipped at ``1 - clip_eps_low``. GSPO uses about 3e-4."""

    clip_eps_high: float | None = Field(None, ge=0.0)
    """Upper clip range ``1 + clip_eps_high``; None means the same as ``clip_eps_low``. A larger value
    (clip-higher, DAPO: 0.28) lets unlikely tokens gain probability faster. GSPO uses about 4e-4."""

    dual_clip_c: float | None = Field(None, gt=1.0)
    """Dual clip (Ye et al. 2020): for negative advantages the per-token loss is capped at
    ``c * |A|``, so a huge ratio on a bad token cannot blow up the update. Typical: 3.0. None: off."""

    aggregation: Literal["token_mean", "sequence_mean", "fixed_length_sum"] = "token_mean"
    """How per-token losses become one number: mean over all trained tokens; mean per sequence
    then over sequences; or per-sequence sums over a constant length (Dr. GRPO)."""

    fixed_length: int | None = Field(None, gt=0)
    """The constant of ``fixed_length_sum`` (e.g. the generation token budget). None: the padded
    target length of the batch."""

    kl_coef: float = Field(0.0, ge=0.0)
    """Weight beta of the KL penalty to the reference policy; 0 turns it off (no reference model)."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman, "Approximating KL divergence"): k1 = -log r,
    k2 = (log r)^2 / 2, k3 = (r - 1) - log r with r = pi_ref / pi. k3 is unbiased and non-negative."""

    kl_penalty: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes: added to the loss (``compute_policy_loss`` does it), or taken off
    the rewards before advantages are estimated (the recipe calls ``kl_penalized_rewards``)."""

    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus: the loss minus ``entropy_coef`` times the aggregated token entropy. 0: off."""

    tis_cap: float | None = Field(None, gt=0.0)
    """Truncated importance sampling: each token's loss is multiplied by
    ``min(exp(old_logprob - engine_logprob), tis_cap)`` to correct for the engine/trainer mismatch
    (Yao et al. 2025). Needs trainer-recomputed ``old_logprobs``. Typical: 2.0. None: off."""

    entropy_clip: bool = False
    """Entropy-aware clipping (direction from SWE-Fuse): both clip ranges are multiplied per token by
    ``clamp(H_t / entropy_clip_reference, entropy_clip_min_scale, entropy_clip_max_scale)``, so
    high-entropy tokens get a relaxed range and low-entropy tokens a strict one. The scaling formula
    is tracegym's own; the SWE-Fuse abstract gives only the direction."""

    entropy_clip_reference: float = Field(1.0, gt=0.0)
    """Token entropy (nats) at which the clip range is unchanged (scale 1)."""

    entropy_clip_min_scale: float = Field(0.5, gt=0.0)
    """Smallest multiplier of the clip range (for near-deterministic tokens)."""

    entropy_clip_max_scale: float = Field(2.0, gt=0.0)
    """Largest multiplier of the clip range (for high-entropy tokens)."""

    log_ratio_limit: float = Field(20.0, gt=0.0)
    """Log-ratios are clamped to +-this before ``exp`` so one bad token cannot overflow to inf."""

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        if value not in POLICY_LOSSES:
            try:
                POLICY_LOSSES.get(value)
            except KeyError as error:  # pydantic reports ValueErrors, with the registered names
                raise ValueError(error.args[0]) from None
        return value

    @model_validator(mode="after")
    def _check(self) -> "PolicyLossConfig":
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
