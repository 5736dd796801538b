"""AdamW, learning-rate schedules with warmup, and gradient clipping, from an ``OptimConfig``."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from tracegym.config import OptimConfig

# OptimConfig.schedule -> the name transformers.get_scheduler knows (all with linear warmup).
_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters in two groups: with weight decay (matrices) and without (biases, norms).

    Only ``requires_grad`` parameters are included, so a LoRA model optimises its adapter alone.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # 1-D tensors are biases and norm scales: decaying them towards 0 hurts and is not done.
        (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of ``model``."""
    groups = param_groups(model, cfg.weight_decay)
    if not any(g["params"] for g in groups):
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``cfg.warmup_steps``, then constant, linear or cosine decay to 0 at
    ``total_steps``. Step it once per optimizer step, after ``optimizer.step()``."""
    from transformers import get_scheduler

    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    return get_scheduler(
        _SCHEDULES[cfg.schedule],
        optimizer=optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=total_steps,
    )


def clip_gradients(parameters: Iterable[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip the global L2 norm of the gradients to ``max_norm`` (None: no clipping).

    Returns the norm before clipping (logged as ``grad_norm``); NaN or inf when a gradient is.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    limit = math.inf if max_norm is None else max_norm
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    return float(norm)
