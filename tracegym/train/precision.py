"""Mixed precision for the training forward passes (``model.autocast``), and when training needs train mode.

``model.autocast: bfloat16`` runs every training forward (SFT, the RL update, DPO, distillation,
the drift and probe measures: everything that goes through ``token_logprobs`` or ``forward_logits``) under
``torch.autocast``: matmuls in bfloat16, weights, gradients, optimizer state and the log-prob /
loss arithmetic (the log-prob functions of ``train/logprobs.py`` work in float32) stay float32. On a CPU with AMX or
AVX512-BF16 the matmuls run about twice as fast (an SFT step of 8 three-call calculator traces on
this project's 2-core VM: 5.1 s against 11.4 s, bench/README.md); on a CPU without them bfloat16
is emulated and slower, so ``auto`` turns it on only where the hardware computes it natively.

The rollout engine samples in the weights' own dtype (float32 here), or with its own copy in
``sample_dtype`` (``tracegym.engines.sampling_copy``); it is not wrapped. The trainer's log-probs
then differ from the engine's by bfloat16 rounding, so with autocast (or a bfloat16 sampling copy)
the RL update takes the old policy's log-probs from the trainer itself (``score_batch``): the PPO
ratio starts at exactly 1 and measures only the update, never the two numerics' gap.

The mark lives on the model object (``set_training_autocast``), so every recipe and helper that
computes training log-probs finds it without a new argument.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Literal

import torch

AutocastSetting = Literal["none", "bfloat16", "auto"]
_MARK = "_tracegym_training_autocast"


def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 matmuls in hardware (CUDA with bf16 support; a CPU with
    AMX tiles or AVX512-BF16)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        cpu = getattr(torch, "cpu", None)
        checks = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
        return any(bool(check()) for check in checks if check is not None)
    return False


def resolve_autocast(setting: str, device: torch.device) -> torch.dtype | None:
    """``none`` -> None; ``bfloat16`` -> torch.bfloat16; ``auto`` -> bfloat16 where ``native_bfloat16``."""
    if setting == "none":
        return None
    if setting == "bfloat16":
        return torch.bfloat16
    if setting == "auto":
        return torch.bfloat16 if native_bfloat16(device) else None
    raise ValueError(f"model.autocast must be one of none, bfloat16, auto; got {setting!r}")


def set_training_autocast(model: Any, dtype: torch.dtype | None) -> None:
    """Mark ``model`` so its training forwards run under autocast to ``dtype`` (None: full precision)."""
    object.__setattr__(model, _MARK, dtype)


def training_autocast(model: Any) -> torch.dtype | None:
    """The autocast dtype of ``model``'s training forwards, or None."""
    return getattr(model, "__dict__", {}).get(_MARK)


def training_forward_context(model: Any, device: torch.device) -> Any:
    """``torch.autocast`` for ``model``'s training forward on ``device``, or a null context."""
    dtype = training_autocast(model)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def needs_train_mode(model: torch.nn.Module, gradient_checkpointing: bool) -> bool:
    """Whether training must run in train mode: gradient checkpointing (it acts only there) or an
    active dropout: a ``Dropout`` module (LoRA's) or a dropout rate in the model's config (attention
    code applies ``config.attention_dropout`` functionally, only in train mode). Otherwise eval mode
    computes the same thing, and lets the forward run a shared prompt prefix once (``forward_logits``)."""
    if gradient_checkpointing or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    return any("dropout" in key and isinstance(value, (int, float)) and value > 0 for key, value in settings.items())


__all__ = ["AutocastSetting", "native_bfloat16", "needs_train_mode", "resolve_autocast", "set_training_autocast",
           "training_autocast", "training_forward_context"]
