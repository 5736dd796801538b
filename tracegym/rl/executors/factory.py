"""``make_executor``: the executor ``cfg.executor.kind`` names, started at policy ``version``."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tracegym.rl.executors.base import Executor


def make_executor(cfg: Any, model: torch.nn.Module, tokenizer: Any, renderer: Any, sampler: Any,
                  train_tasks: Sequence[Any], version: int, gap_model: torch.nn.Module | None = None) -> Executor:
    """``local`` samples with ``sampler`` (the trainer's own engine); ``threads`` and ``ray`` build
    their own policy copies and engines. ``version``: updates applied so far (the step resumed at).
    ``tasks.curriculum`` runs on ``local`` only; the others refuse it."""
    kind = cfg.executor.kind
    curriculum = cfg.tasks.curriculum
    if kind != "local" and curriculum is not None and curriculum.enabled:
        # The asynchronous executors sample step s+1 while step s trains, before s's outcomes are
        # known, and on several workers at once: a draw from the pass rates would depend on timing.
        raise ValueError(f"tasks.curriculum needs executor.kind: local (got {kind}); drop the section or set "
                         "tasks.curriculum.enabled: false")
    if kind == "local":
        from tracegym.rl.executors.local import LocalExecutor

        return LocalExecutor(cfg, sampler, renderer, train_tasks, version, gap_model=gap_model)
    if kind == "threads":
        from tracegym.rl.executors.threads import ThreadsExecutor

        return ThreadsExecutor(cfg, model, tokenizer, renderer, train_tasks, version)
    if kind == "ray":
        from tracegym.rl.executors.ray_workers import RayExecutor

        return RayExecutor(cfg, model, version)
    raise ValueError(f"unknown executor.kind {kind!r}; expected local, threads or ray")
