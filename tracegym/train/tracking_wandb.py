"""Weights & Biases as a tracker (``wandb`` in ``logging.backends``).

Offline unless asked otherwise: ``logging.wandb.mode: auto`` runs online only when ``WANDB_MODE`` says
``online`` or, without ``WANDB_MODE``, when ``WANDB_API_KEY`` is set; offline runs are written under
``<output_dir>/wandb/offline-run-*`` and uploaded later with ``wandb sync``. Nothing waits on the
network for longer than ``logging.timeout_s`` (``wandb.init``'s and ``finish``'s own timeouts, and the
guard of ``GuardedTracker``). W&B records no command line, environment, git state, code or console
output of the run (``x_disable_meta``, ``console="off"``): only what tracegym logs, secrets masked.

The config goes in as the run config, each logged step's scalars at that step, the final model folder
and ``report.html`` as artifacts (``final-<run id>`` of type ``model``, ``report-<run id>``; their files
are referenced where they are, not copied). The run id is kept in ``<output_dir>/wandb_run_id`` for
``--resume``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from tracegym.config.shared import LoggingConfig
from tracegym.train.tracking import Requirement, Tracker, read_run_id

__all__ = ["WANDB_REQUIREMENTS", "WandbTracker", "open_wandb", "wandb_mode"]

ID_FILE = "wandb_run_id"
WANDB_REQUIREMENTS = [Requirement("wandb", "wandb", "pip install 'tracegym[wandb]' (or pip install wandb)")]


def wandb_mode(mode: str, environ: Mapping[str, str]) -> str:
    """``offline`` or ``online``: ``mode`` unless it is ``auto``; then ``WANDB_MODE`` when it names one
    of the two, else online exactly when ``WANDB_API_KEY`` is set."""
    if mode != "auto":
        return mode
    if environ.get("WANDB_MODE") in ("offline", "online"):
        return environ["WANDB_MODE"]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


class WandbTracker(Tracker):
    """One W&B run (``wandb.init``'s run object; no global ``wandb.run`` calls)."""

    name = "wandb"

    def __init__(self, wandb: Any, run: Any):
        self.wandb = wandb
        self.run = run

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def log_artifact(self, path: Path, name: str, kind: str) -> None:
        artifact = self.wandb.Artifact(f"{name}-{self.run.id}", type=kind)
        if path.is_dir():
            artifact.add_dir(str(path), policy="immutable")
        else:
            artifact.add_file(str(path), policy="immutable")
        self.run.log_artifact(artifact)

    def finish(self, completed: bool) -> None:
        self.run.finish(exit_code=0 if completed else 1)


def open_wandb(run_dir: Path, settings: LoggingConfig, resume_step: int | None,
               params: Mapping[str, Any] | None = None) -> WandbTracker:
    """Start (or, resumed, continue) the W&B run of ``run_dir``; ``params`` (the redacted config)
    go into the run record itself, written with the run's start rather than in a later update."""
    import wandb

    mode = wandb_mode(settings.wandb.mode, os.environ)
    id_file = run_dir / ID_FILE
    resumed_id = read_run_id(id_file, resume_step is not None)
    run_id = resumed_id or os.urandom(8).hex()
    id_file.write_text(run_id, encoding="utf-8")
    quiet = wandb.Settings(console="off", x_disable_meta=True, x_disable_stats=True, x_save_requirements=False,
                           save_code=False, disable_git=True, silent=True,
                           init_timeout=settings.timeout_s, finish_timeout=settings.timeout_s)
    run = wandb.init(project=settings.wandb.project, entity=settings.wandb.entity, dir=str(run_dir), id=run_id,
                     name=run_dir.name, mode=mode, config=dict(params or {}), resume="allow" if resumed_id and mode == "online" else None,
                     settings=quiet)
    if mode == "offline":
        print(f"wandb: offline run {run_id}; upload it with: wandb sync {run.settings.sync_dir}")
    else:
        print(f"wandb: online run {run_id} {run.url or ''}".rstrip())
    return WandbTracker(wandb, run)
