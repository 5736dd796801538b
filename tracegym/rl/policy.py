"""The policy an RL-family recipe trains: the model (LoRA or full, with the frozen reference the KL
term needs), its renderer and the rollout engine that samples from it."""

from __future__ import annotations

from typing import Any

import torch

from tracegym.algos.config import PolicyLossConfig
from tracegym.config import RLConfig
from tracegym.render import get_renderer
from tracegym.train.lora import is_peft_model, prepare_model, starting_reference

__all__ = ["load_policy", "make_renderer", "make_sampler"]


def make_renderer(cfg: RLConfig, tokenizer: Any) -> Any:
    """The renderer of ``model.renderer`` (or the model's), showing tool results as
    ``rollout.untrusted_tool_output`` says."""
    return get_renderer(cfg.model.renderer or cfg.model.name, tokenizer,
                        untrusted_tool_output=cfg.rollout.untrusted_tool_output)


def load_policy(cfg: RLConfig, loss_cfg: PolicyLossConfig, device: torch.device) -> tuple[Any, Any, Any]:
    """(trainable model in eval mode, tokenizer, frozen reference or None)."""
    from tracegym.models import load

    model, tokenizer = load(cfg.model.name, cfg.model.dtype)
    # the policy at step 0: a frozen copy (full fine-tuning, or the SFT adapter merged when RL starts
    # from one); None for a fresh adapter (the base, adapter disabled) or without a KL term
    reference = starting_reference(model, cfg.lora, cfg.model.adapter, device) if loss_cfg.kl_coef > 0 else None
    model = prepare_model(model, cfg.lora, cfg.model.adapter)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if cfg.lora.enabled:
            model.enable_input_require_grads()
    model.to(device).eval()
    if reference is None and loss_cfg.kl_coef > 0 and not is_peft_model(model):
        raise ValueError("kl_coef > 0 needs a reference policy: LoRA (adapter disabled) or full fine-tuning")
    return model, tokenizer, reference


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
