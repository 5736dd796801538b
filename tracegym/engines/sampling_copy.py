"""The HF engine's sampling weights in another dtype: a plain copy of the policy, LoRA merged.

Why: on a CPU with AVX512-BF16 or AMX (and on GPUs) a decode step in bfloat16 weights runs about
twice as fast as in float32 (SmolLM2-135M, 64 rows, 2 EPYC Zen 4 cores: 13.0 s against 25.0 s for
64 one-turn calculator episodes, bench/README.md), and the merged copy drops peft's extra LoRA
matmuls (two small ones per adapted projection, per token). This is what vLLM does on a GPU: it
samples in bfloat16 from merged or fused weights while the trainer keeps float32 master weights.

What changes: the sampled tokens' log-probs come from bfloat16 logits (cast to float32 before the
softmax, as vLLM does), so they differ from the trainer's by bfloat16 rounding. The RL recipe
therefore never uses them as the PPO's old log-probs: it takes those from the trainer
(``sample_dtype_differs`` makes ``every_row_needs_rescoring`` hold, and a one-pass update reads
them from its own forward, train/policy_update.py).

How the copy follows the trainer (``refresh_sampling_copy``, called by ``HFEngine.update_weights``
after every optimizer step): each LoRA-adapted layer's merged weight ``W + scale * B @ A`` is
computed in float32 from the trainer's module (peft's ``get_delta_weight``, the function its own
``merge`` uses) and cast into the copy; the trainer's weights are never touched (peft's
``merge_adapter`` / ``unmerge_adapter`` would add and subtract in place, which rounds). A trainer
whose trainable weights lie outside LoRA layers (full fine-tuning, ``modules_to_save``) has its
whole state copied. About 0.3 s for SmolLM2-135M.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch

SampleDtype = Literal["float32", "bfloat16", "auto"]

__all__ = ["SampleDtype", "refresh_sampling_copy", "resolve_sample_dtype", "sampling_copy"]


def resolve_sample_dtype(setting: str | None, device: torch.device) -> torch.dtype | None:
    """``None`` -> None (sample with the model itself); ``float32`` / ``bfloat16`` -> that dtype;
    ``auto`` -> bfloat16 where ``device`` computes it natively (``native_bfloat16``), else float32."""
    if setting is None:
        return None
    if setting == "float32":
        return torch.float32
    if setting == "bfloat16":
        return torch.bfloat16
    if setting == "auto":
        from tracegym.train.precision import native_bfloat16

        return torch.bfloat16 if native_bfloat16(device) else torch.float32
    raise ValueError(f"sample_dtype must be one of float32, bfloat16, auto (or None); got {setting!r}")


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _lora_layers(model: Any) -> dict[str, Any]:
    """The LoRA layers of a peft model, by their module name in the merged (plain) model."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.get_base_model().named_modules() if isinstance(module, LoraLayer)}


def _check_mergeable(model: Any) -> None:
    """One active adapter, plain LoRA: what a single merged copy can hold."""
    configs = getattr(model, "peft_config", {}) or {}
    if len(configs) != 1:
        raise ValueError(f"sample_dtype merges one LoRA adapter into its copy; this model has {len(configs)} "
                         f"({', '.join(sorted(configs))}): sample a multi-adapter model in its own dtype (sample_dtype: null)")
    (config,) = configs.values()
    if getattr(config, "use_dora", False):
        raise ValueError("sample_dtype: DoRA adapters are not merged into the sampling copy; use sample_dtype: null")


def _only_lora_trains(model: Any) -> bool:
    return all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)


def sampling_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A plain transformers model in ``dtype``, eval mode, no gradients: ``model``'s weights with
    its LoRA adapter merged (in float32, then cast). ``model`` itself is left as it was."""
    if _is_peft(model):
        _check_mergeable(model)
        merged = copy.deepcopy(model).merge_and_unload()  # peft's own merge, on a copy
    else:
        merged = copy.deepcopy(model)
    merged = merged.to(dtype).eval()
    for p in merged.parameters():
        p.requires_grad_(False)
    return merged


@torch.no_grad()
def refresh_sampling_copy(target: torch.nn.Module, model: torch.nn.Module) -> None:
    """Write ``model``'s current (merged) weights into ``target``, a ``sampling_copy`` of it."""
    if not _is_peft(model):
        target.load_state_dict(model.state_dict())  # copy_ casts each tensor to the copy's dtype
        return
    if not _only_lora_trains(model):  # modules_to_save and the like: merge a fresh copy
        target.load_state_dict(sampling_copy(model, next(target.parameters()).dtype).state_dict())
        return
    _check_mergeable(model)
    params = dict(target.named_parameters())
    for name, layer in _lora_layers(model).items():
        base = layer.get_base_layer()
        weight = base.weight.detach().float()
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                weight = weight + layer.get_delta_weight(adapter).float()
        params[f"{name}.weight"].copy_(weight)
