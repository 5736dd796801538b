"""AdamW, learning-rate schedules with warmup, and gradient clipping, from an ``OptimConfig``."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from tracegym.config import OptimConfig

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


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """The multiplier of ``lr`` for the optimizer step that comes after ``step`` steps (0-based).

    Warmup: step ``s < N`` runs at ``(s + 1) / (N + 1)``, so the first step moves the weights. The
    usual linear warmup (transformers' ``get_scheduler``) gives step 0 a factor of 0: its first step
    only primes Adam's moments and "4 warmup steps" waste one. After warmup: constant 1, or a linear
    or cosine decay from 1 towards 0 over the remaining ``total_steps - N`` steps.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))
    raise ValueError(f"unknown schedule {schedule!r}: constant, linear or cosine")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``cfg.warmup_steps`` (the first step already moves: ``lr_factor``), then
    constant, linear or cosine decay towards 0 at ``total_steps``. Step it once per optimizer step,
    after ``optimizer.step()``."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, total_steps, cfg.schedule))


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


# The LoRA RL learning rate below the LoRA SFT rate, scaled with the square root of the batch.
RL_TO_SFT_LR = 1 / 8
"""RL rate / SFT rate at ``RL_REFERENCE_EPISODES`` episodes per step. Tinker's LoRA RL recipe runs
about 7.5x below its LoRA SFT rate (4e-5 vs 3e-4); our 3-call runs from one SFT start lost 0.28 at
2/3 of the SFT rate (2e-4 vs 3e-4) and 0.02-0.09 at 1/6 (5e-5), both at 32 episodes per step."""

RL_REFERENCE_EPISODES = 64
"""Episodes per step at which the RL rate is ``RL_TO_SFT_LR`` x the SFT rate."""


def rl_learning_rate(sft_lr: float, episodes_per_step: int) -> float:
    """The RL learning rate of a LoRA policy that SFT trained at ``sft_lr``:
    ``sft_lr / 8 * sqrt(episodes_per_step / 64)``, capped at ``sft_lr / 4``.

    Why: with Adam every step moves each weight by about the rate whatever the evidence, and a step
    of a competent policy carries few groups with signal; a larger batch averages more evidence into
    the direction, and Adam's step is then safe to grow like the square root of the batch (the
    scaling tinker-cookbook's docs give for LoRA). The cap keeps RL clearly below SFT at any batch."""
    if sft_lr <= 0 or episodes_per_step <= 0:
        raise ValueError(f"sft_lr and episodes_per_step must be positive, got {sft_lr} and {episodes_per_step}")
    return min(sft_lr * RL_TO_SFT_LR * math.sqrt(episodes_per_step / RL_REFERENCE_EPISODES), sft_lr / 4)
