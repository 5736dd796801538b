"""Entropy-aware clip ranges, after SWE-Fuse.

Source of the idea: SWE-Fuse ("Empowering Software Agents via Issue-free Trajectory Learning and
Entropy-aware RLVR Training"), whose abstract states only the direction: "relaxed clipping under
high entropy to encourage exploration, and stricter clipping under low entropy to ensure training
stability". The formula below is tracegym's own, not the paper's:

    scale_t = clamp(H_t / H_ref, s_min, s_max)
    eps_low_t = eps_low * scale_t,   eps_high_t = eps_high * scale_t

``H_t`` is the policy's token entropy (detached). The scale depends on each token alone (a fixed
reference, not a batch statistic), so micro-batching does not change the loss.
"""

from __future__ import annotations

from torch import Tensor


def entropy_clip_scale(entropy: Tensor, reference: float, min_scale: float, max_scale: float) -> Tensor:
    """Per-token multiplier of the clip ranges, ``clamp(H / reference, min_scale, max_scale)``, detached."""
    if reference <= 0:
        raise ValueError(f"entropy reference must be positive, got {reference}")
    return (entropy.detach() / reference).clamp(min_scale, max_scale)
