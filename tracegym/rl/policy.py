"""The policy an RL-family recipe trains: the model (LoRA or full, with the frozen reference the KL
term needs), its renderer and the rollout engine that samples from it."""

from __future__ import annotations

from typing import Any

import torch

from tracegym.algos.config import PolicyLossConfig
from tracegym.config import RLConfig
from tracegym.render import get_renderer
from tracegym.train.lora import is_peft_model, prepare_model, starting_reference
from tracegym.train.precision import needs_train_mode, resolve_autocast, set_training_autocast

__all__ = ["load_policy", "make_renderer", "make_sampler"]


def make_renderer(cfg: RLConfig, tokenizer: Any) -> Any:
    """The renderer of ``model.renderer`` (or the model's), showing tool results as
    ``rollout.untrusted_tool_output`` says."""
    return get_renderer(cfg.model.renderer or cfg.model.name, tokenizer,
                        untrusted_tool_output=cfg.rollout.untrusted_tool_output)


def load_policy(cfg: Any, loss_cfg: PolicyLossConfig | None, device: torch.device, *,
                reference: bool | None = None, train: bool = False) -> tuple[Any, Any, Any]:
    """(trainable model on ``device``, tokenizer, frozen reference or None) as the ``model`` and ``lora``
    sections of ``cfg`` say (any training recipe's config: RL, distillation, SFT, DPO/KTO): a LoRA
    adapter (fresh or ``model.adapter``) or every weight, with gradient checkpointing when asked.

    The reference is the policy at step 0: a frozen copy for full fine-tuning, or with the SFT adapter
    merged when training starts from one; None for a fresh adapter (the base, adapter disabled).
    ``reference`` says whether the loss needs one (a preference loss always does); by default it is
    built for a KL term (``loss_cfg.kl_coef > 0``), and None otherwise. The model is in eval mode (RL:
    the rollout engine samples from it) or, with ``train``, in train mode where that changes the
    computation (the fixed-dataset recipes; ``needs_train_mode``). ``model.autocast`` marks the model
    for mixed-precision training forwards (``tracegym/train/precision.py``)."""
    from tracegym.models import load

    wants_reference = reference if reference is not None else loss_cfg is not None and loss_cfg.kl_coef > 0
    model, tokenizer = load(cfg.model.name, cfg.model.dtype)
    # before the adapter goes on: the frozen copy is the untouched (or SFT-merged) weights
    starting = starting_reference(model, cfg.lora, cfg.model.adapter, device) if wants_reference else None
    model = prepare_model(model, cfg.lora, cfg.model.adapter)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if cfg.lora.enabled:
            model.enable_input_require_grads()  # frozen embeddings: make checkpointed inputs carry grad
    # fixed-dataset recipes train in train mode only where it changes the computation (dropout,
    # gradient checkpointing); in eval mode the forward can run a shared prompt prefix once
    model.to(device).train(train and needs_train_mode(model, cfg.model.gradient_checkpointing))
    set_training_autocast(model, resolve_autocast(cfg.model.autocast, device))
    if starting is None and wants_reference and not is_peft_model(model):
        raise ValueError("kl_coef > 0 needs a reference policy: LoRA (adapter disabled) or full fine-tuning")
    return model, tokenizer, starting


def make_sampler(cfg: RLConfig, model: Any, tokenizer: Any, renderer: Any) -> Any:
    """The rollout engine; one that cannot return the log-probs of its samples is refused."""
    from tracegym.engines import make_engine, require_rl_sampler

    options = dict(cfg.rollout.engine_options)
    if cfg.rollout.engine == "hf":  # holds the trainer's model object: weight sync is free and exact
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        options.setdefault("max_batch_size", cfg.rollout.concurrency)
        options.setdefault("pad_token_id", pad_id)
        sampler = make_engine("hf", model=model, tokenizer=tokenizer, renderer=renderer, **options)
    else:
        sampler = make_engine(cfg.rollout.engine, model=options.pop("model", cfg.model.name), tokenizer=tokenizer,
                              renderer=renderer, **options)
    require_rl_sampler(sampler)
    if sampler.capabilities.weight_sync == "none":
        # a server the recipe cannot update would sample every step after the first from a stale policy
        raise ValueError(f"engine {cfg.rollout.engine!r} cannot take the trainer's weights (weight_sync: none): every "
                         "step after the first would sample from a stale policy; use rollout.engine: hf or vllm")
    return sampler
