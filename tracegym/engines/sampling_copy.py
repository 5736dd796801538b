"""The HF engine's sampling weights: a plain copy of the policy, LoRA merged, in float32 or bfloat16.

Why merge: peft's forward adds two small LoRA matmuls (and a dropout, a scaling and an add) to every
adapted projection at every token; the merged copy is one matmul each. In float32 the copy samples
the same tokens with log-probs within float rounding of the peft model's, and an evaluation of the
demo's SFT adapter ran 1.19x faster (40 three-call tasks x 2 on 2 EPYC Zen 4 cores: 76-80 s
against 91-95 s, bench/README.md "Sampling copies"). The RL recipe's rollouts sample from it
(``rollout.engine_options.sample_dtype: float32``, the demo's setting).

bfloat16 (opt-in): decoding runs about 1.3-1.8x faster on a CPU with AVX512-BF16 or AMX, but a LoRA
merged into bfloat16 weights is mostly rounded away: the adapter's delta is far below the 2^-8
relative precision of the weights it is added to. Measured on the demo's SFT adapter (100 held-out
three-call tasks x 2, paired over tasks): pass@1 -0.045 [-0.075, -0.020] against float32 sampling,
as large as the demo's RL gain. (Keeping the adapter unmerged beside bfloat16 base weights, as
vLLM's LoRA kernels do, held pass@1 at -0.010 [-0.040, +0.015] but ran only 1.1x faster here.) A
model trained in full (no adapter) rounds like any bfloat16 inference. Its sampled log-probs come
from bfloat16 logits (softmax in float32), so they differ from the trainer's by that rounding: the
RL recipe then takes the PPO's old log-probs from the trainer (``sample_dtype_differs`` makes
``every_row_needs_rescoring`` hold, and a one-pass update reads them from its own forward,
train/policy_update.py).

How the copy follows the trainer (``refresh_sampling_copy``, called by ``HFEngine.update_weights``
after every optimizer step): each LoRA-adapted layer's merged weight ``W + scale * B @ A`` is
computed in float32 from the trainer's module (peft's ``get_delta_weight``, the function its own
``merge`` uses) and cast into the copy; the trainer's weights are never touched (peft's
``merge_adapter`` / ``unmerge_adapter`` would add and subtract in place, which rounds). A trainer
whose trainable weights lie outside LoRA layers (full fine-tuning, ``modules_to_save``) has its
whole state copied. About 0.3 s for SmolLM2-135M; the copy costs the model's size in memory once.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch

from tracegym.train.lora import is_peft_model

SampleDtype = Literal["float32", "bfloat16"]

__all__ = ["SampleDtype", "merged_state_dict", "refresh_sampling_copy", "resolve_sample_dtype", "sampling_copy"]


def resolve_sample_dtype(setting: str | None) -> torch.dtype | None:
    """``None`` -> None (sample with the model itself); ``float32`` / ``bfloat16`` -> that dtype.
    (No ``auto``: bfloat16 is faster where the device computes it natively, but it costs a merged
    LoRA policy its quality, module docstring, so it is never picked for the user.)"""
    if setting is None:
        return None
    if setting == "float32":
        return torch.float32
    if setting == "bfloat16":
        return torch.bfloat16
    raise ValueError(f"sample_dtype must be float32 or bfloat16 (or None); got {setting!r}")


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
    if is_peft_model(model):
        _check_mergeable(model)
        merged = copy.deepcopy(model).merge_and_unload()  # peft's own merge, on a copy
    else:
        merged = copy.deepcopy(model)
    merged = merged.to(dtype).eval()
    for p in merged.parameters():
        p.requires_grad_(False)
    return merged


def _merged_weight(layer: Any) -> torch.Tensor:
    """A LoRA layer's ``W + sum over its active adapters of scale * B @ A``, in float32."""
    weight = layer.get_base_layer().weight.detach().float()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
            weight = weight + layer.get_delta_weight(adapter).float()
    return weight


def _plain_lora(model: Any) -> bool:
    """Only LoRA factors train, and no adapter is DoRA: ``_merged_weight`` is then peft's merge."""
    configs = (getattr(model, "peft_config", {}) or {}).values()
    return _only_lora_trains(model) and not any(getattr(config, "use_dora", False) for config in configs)


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights as the state dict of a plain transformers model (LoRA merged, HF names,
    each tensor in the model's own dtype), computed without touching ``model``.

    For the engines that load whole weights (vLLM without ``enable_lora``): peft's ``merge_adapter``
    / ``unmerge_adapter`` would add each delta into the trainer's frozen weights and subtract it again,
    which rounds: every sync would move the base model a little (in bfloat16 by up to a unit in the
    last place, 2^-8 relative, wherever the delta is not negligible). Here each LoRA layer's merged
    weight is computed in float32 beside the model (``_merged_weight``) and cast; every other tensor
    is cloned. DoRA adapters and trainable weights outside LoRA (``modules_to_save``) are merged by
    peft's own ``merge_and_unload`` on a copy of the model. A plain model: its state, cloned."""
    if not is_peft_model(model):
        return {key: value.detach().clone() for key, value in model.state_dict().items()}
    if not _plain_lora(model):
        return copy.deepcopy(model).merge_and_unload().state_dict()
    layers = _lora_layers(model)
    merged = {f"{name}.weight": _merged_weight(layer).to(layer.get_base_layer().weight.dtype)
              for name, layer in layers.items()}
    state: dict[str, torch.Tensor] = {}
    for key, value in model.get_base_model().state_dict().items():
        name = key.replace(".base_layer.", ".")
        if "lora_" not in key:  # an adapted layer's base weight is not cloned: its merge replaces it
            state[name] = merged[name] if name in merged else value.detach().clone()
    return state


@torch.no_grad()
def refresh_sampling_copy(target: torch.nn.Module, model: torch.nn.Module) -> None:
    """Write ``model``'s current (merged) weights into ``target``, a ``sampling_copy`` of it."""
    if not is_peft_model(model):
        target.load_state_dict(model.state_dict())  # copy_ casts each tensor to the copy's dtype
        return
    if not _only_lora_trains(model):  # modules_to_save and the like: merge a fresh copy
        target.load_state_dict(sampling_copy(model, next(target.parameters()).dtype).state_dict())
        return
    _check_mergeable(model)
    params = dict(target.named_parameters())
    for name, layer in _lora_layers(model).items():
        params[f"{name}.weight"].copy_(_merged_weight(layer))
