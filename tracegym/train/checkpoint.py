"""Atomic, resumable checkpoints.

Layout of a run directory::

    <run_dir>/checkpoints/step_000010/
        model/                 Hugging Face format: the peft adapter, or the whole model (safetensors)
        training_state.pt      optimizer, scheduler, RNG states (python, numpy, torch), step, recipe state
        meta.json              step, time, format version, what the model folder holds

A checkpoint is written into a hidden temporary folder, every file is fsync'd, and the folder is
renamed into place with ``os.replace``: a crash at any point leaves either the complete new
checkpoint or none, never a half-written one under a ``step_*`` name. Old checkpoints are deleted
the same way in reverse (renamed to a hidden name first, then removed), so ``latest_checkpoint``
never picks a partial folder.

The recipe's own state (data cursor: epoch, position, shuffle seed; a replay buffer; counters) goes
in ``state``. It must be made of tensors, numbers, strings, lists, tuples and dicts, so it loads with
``torch.load(weights_only=True)`` (no pickled code runs when a checkpoint is read); store pydantic
objects as ``model_dump(mode="json")``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tracegym.train.lora import is_peft_model, load_weights, save_weights
from tracegym.train.seed import rng_state, set_rng_state

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
STATE_FILE = "training_state.pt"
META_FILE = "meta.json"
MODEL_DIR = "model"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class Checkpoint:
    """A checkpoint read back: where it is, its step and the recipe state saved with it."""

    path: Path
    step: int
    state: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def _fsync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then every directory (so the names are durable too)."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for root, dirs, _ in os.walk(folder, topdown=False):
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; durability is then best-effort
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_dir(path: Path) -> None:
    """Delete a checkpoint folder without ever leaving a partial folder under its real name."""
    trash = path.parent / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first, as (step, path)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        # meta.json is written last inside the temporary folder: a step_* folder without it was not
        # made by save_checkpoint (or was tampered with) and is not trusted.
        if match and child.is_dir() and (child / META_FILE).is_file() and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The most recent complete checkpoint of a run, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    state: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write a checkpoint of ``step`` atomically; then keep only the ``keep_last`` newest.

    Returns the checkpoint folder. Saving a step that already exists replaces it.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    # Leftovers of a save or delete that crashed: never read, safe to remove.
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(".trash-*"):
        shutil.rmtree(stale, ignore_errors=True)

    final = checkpoint_dir(run_dir, step)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_weights(model, tmp / MODEL_DIR)
        training_state = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(),
            "state": state or {},
        }
        torch.save(training_state, tmp / STATE_FILE)
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "time": time.time(),
            "model": "peft_adapter" if is_peft_model(model) else "full",
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        _fsync_tree(tmp)
        if final.exists():
            _remove_dir(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    if keep_last is not None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        for _, old in list_checkpoints(run_dir)[:-keep_last]:
            _remove_dir(old)
        _fsync_dir(root)
    return final


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    restore_rng: bool = True,
) -> Checkpoint:
    """Restore what was saved into the given objects (those passed) and return step and state.

    ``path`` is a checkpoint folder (``latest_checkpoint(run_dir)``). The model must be built the
    same way as when it was saved (same base model, same LoRA config); its weights are overwritten.
    """
    path = Path(path)
    if not (path / STATE_FILE).is_file() or not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {STATE_FILE} or {META_FILE})")
    meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    saved = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if saved.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {saved.get('format_version')}, expected {FORMAT_VERSION}")
    if model is not None:
        kind = "peft_adapter" if is_peft_model(model) else "full"
        if meta.get("model") != kind:
            raise ValueError(f"{path} holds a {meta.get('model')} checkpoint but the model is {kind}")
        load_weights(model, path / MODEL_DIR)
    if optimizer is not None:
        if saved["optimizer"] is None:
            raise ValueError(f"{path} has no optimizer state")
        optimizer.load_state_dict(saved["optimizer"])
    if scheduler is not None:
        if saved["scheduler"] is None:
            raise ValueError(f"{path} has no scheduler state")
        scheduler.load_state_dict(saved["scheduler"])
    if restore_rng:
        set_rng_state(saved["rng"])
    return Checkpoint(path=path, step=int(saved["step"]), state=saved["state"], meta=meta)


def save_final(model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, info: dict[str, Any]) -> Path:
    """Write ``run_dir/final`` atomically: the adapter (LoRA) or the whole model, the tokenizer, and
    ``tracegym.json`` (``info``: base model, recipe...), which ``tracegym.models.load`` reads to put
    an adapter back on its base model. Returns the folder."""
    run_dir = Path(run_dir)
    final = run_dir / "final"
    tmp = run_dir / f".tmp-final-{uuid.uuid4().hex[:8]}"
    save_weights(model, tmp)
    tokenizer.save_pretrained(str(tmp))
    (tmp / "tracegym.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
    _fsync_tree(tmp)
    if final.exists():
        _remove_dir(final)
    os.replace(tmp, final)
    return final
