"""Atomic, resumable checkpoints.

Layout of a run directory::

    <run_dir>/checkpoints/step_000010/
        model/                 Hugging Face format: the peft adapter, or the whole model (safetensors)
        training_state.pt      optimizer, scheduler, RNG states (python, numpy, torch), step, recipe state
        meta.json              step, time, format version, what the model folder holds, and the
                               manifest: size and sha256 of every other file

A checkpoint is written into a hidden temporary folder, every file is fsync'd, and the folder is
renamed into place with ``os.replace``: a crash at any point leaves either the complete new
checkpoint or none, never a half-written one under a ``step_*`` name. Old checkpoints are deleted
the same way in reverse (renamed to a hidden name first, then removed), so ``latest_checkpoint``
never picks a partial folder.

Checkpoints are verified before they are trusted: every file against the manifest (size, then
sha256), and, for checkpoints written before the manifest existed, the structure of each file (a
safetensors header that promises more bytes than the file has, a ``.pt`` zip archive without its
central directory: both are what a truncated copy looks like). ``latest_checkpoint`` skips a corrupt
checkpoint with a warning naming the file and returns the newest intact one; when checkpoints exist
but none is intact it raises :class:`CorruptCheckpointError` naming the files (a resume never
silently starts from scratch). ``load_checkpoint`` raises the same error, naming the file, when a
file cannot be read; ``load_latest_intact`` loads the newest checkpoint that verifies *and* loads.

The recipe's own state (data cursor: epoch, position, shuffle seed; a replay buffer; counters) goes
in ``state``. It must be made of tensors, numbers, strings, lists, tuples and dicts, so it loads with
``torch.load(weights_only=True)`` (no pickled code runs when a checkpoint is read); store pydantic
objects as ``model_dump(mode="json")``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tracegym.train.lora import is_peft_model, load_weights, normalize_permissions, save_weights
from tracegym.train.seed import rng_state, set_rng_state

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
STATE_FILE = "training_state.pt"
META_FILE = "meta.json"
MODEL_DIR = "model"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 22

log = logging.getLogger(__name__)


class CorruptCheckpointError(RuntimeError):
    """A checkpoint (or every checkpoint of a run) whose files are missing, truncated, altered or
    unreadable. ``problems`` holds one line per bad file, each starting with the file's path."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = list(problems or [])
        super().__init__(message)


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


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """{path relative to ``folder`` (posix): {"size", "sha256"}} of every file but meta.json."""
    files = {}
    for file in sorted(folder.rglob("*")):
        if file.is_file() and file.name != META_FILE:
            files[file.relative_to(folder).as_posix()] = {"size": file.stat().st_size, "sha256": _sha256(file)}
    return files


def _safetensors_problem(file: Path) -> str | None:
    """Why a safetensors file is unusable (header unreadable, data shorter than the header says), or None."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, too short for a safetensors header (truncated?)"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"safetensors header of {length} bytes but the file has {size} bytes (truncated?)"
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            return f"unreadable safetensors header ({exc})"
    if not isinstance(header, dict):
        return "unreadable safetensors header (not a JSON object)"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(x, int) for x in offsets)):
            return f"unreadable safetensors header (tensor {name!r} has no data_offsets)"
        end = max(end, offsets[1])
    if 8 + length + end > size:
        return f"{size} bytes but its tensors need {8 + length + end} (truncated?)"
    return None


def _zip_problem(file: Path) -> str | None:
    """Why a ``torch.save`` file (a zip archive) is unusable, or None."""
    size = file.stat().st_size
    try:
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"{size} bytes, shorter than its member {info.filename} needs (truncated?)"
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        return f"not a readable torch archive, {size} bytes ({exc}; truncated?)"
    return None


def verify_checkpoint(path: str | Path, check_hashes: bool = True) -> list[str]:
    """What is wrong with a checkpoint folder: one line per bad file, starting with its path; [] if intact.

    Files listed in meta.json's manifest must have their recorded size and (``check_hashes``) sha256.
    Every safetensors and ``.pt`` file is also checked for structure, which catches truncation in
    checkpoints written before the manifest existed.
    """
    path = Path(path)
    problems: list[str] = []
    meta_file = path / META_FILE
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return [f"{meta_file}: unreadable ({exc})"]
    manifest = meta.get("files")
    if isinstance(manifest, dict):
        for name, expected in manifest.items():
            file = path / name
            if not file.is_file():
                problems.append(f"{file}: missing")
                continue
            size = file.stat().st_size
            if isinstance(expected, dict) and "size" in expected and size != expected["size"]:
                problems.append(f"{file}: {size} bytes, expected {expected['size']} (truncated?)")
            elif check_hashes and isinstance(expected, dict) and expected.get("sha256") and _sha256(file) != expected["sha256"]:
                problems.append(f"{file}: sha256 differs from the one recorded when it was saved (corrupted)")
    if not (path / STATE_FILE).is_file():
        problems.append(f"{path / STATE_FILE}: missing")
    weights = sorted((path / MODEL_DIR).glob("*.safetensors")) if (path / MODEL_DIR).is_dir() else []
    if not weights:
        problems.append(f"{path / MODEL_DIR}: no .safetensors weights")
    already = {p.split(": ", 1)[0] for p in problems}
    for file in [*weights, *sorted(path.glob("*.pt"))]:
        if str(file) in already or not file.is_file():
            continue
        problem = _safetensors_problem(file) if file.suffix == ".safetensors" else _zip_problem(file)
        if problem:
            problems.append(f"{file}: {problem}")
    return problems


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


def latest_checkpoint(run_dir: str | Path, verify: bool = True) -> Path | None:
    """The most recent intact checkpoint of a run, or None when the run has no checkpoint.

    With ``verify`` (the default) each candidate, newest first, is checked with
    :func:`verify_checkpoint`; a corrupt one is skipped with a warning naming its bad file(s). When
    there are checkpoints but none is intact, :class:`CorruptCheckpointError` names every bad file.
    ``verify=False``: the newest complete folder, unchecked (the old behaviour).
    """
    found = list_checkpoints(run_dir)
    if not found:
        return None
    if not verify:
        return found[-1][1]
    problems: list[str] = []
    for _, path in reversed(found):
        bad = verify_checkpoint(path)
        if not bad:
            return path
        problems.extend(bad)
        log.warning("checkpoint %s is corrupt, trying an older one: %s", path, "; ".join(bad))
    raise _none_intact(run_dir, problems)


def _none_intact(run_dir: str | Path, problems: list[str]) -> CorruptCheckpointError:
    listing = "\n  ".join(problems)
    return CorruptCheckpointError(
        f"no intact checkpoint in {Path(run_dir) / CHECKPOINTS}; not starting from scratch. Bad files:\n  {listing}\n"
        "Restore or delete the bad checkpoint folders (or train into a new output_dir) to go on.",
        problems,
    )


def load_latest_intact(
    run_dir: str | Path,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    restore_rng: bool = True,
) -> Checkpoint | None:
    """Load the newest checkpoint of ``run_dir`` that verifies and loads (see :func:`load_checkpoint`);
    a corrupt one is skipped with a warning naming the bad file. None when the run has no checkpoint;
    :class:`CorruptCheckpointError` (naming the files) when it has some but none loads.

    (A mismatch between the checkpoint and the objects passed, e.g. another model, is not corruption:
    its ``ValueError`` propagates.)
    """
    found = list_checkpoints(run_dir)
    if not found:
        return None
    problems: list[str] = []
    for _, path in reversed(found):
        try:
            return load_checkpoint(path, model, optimizer, scheduler, restore_rng=restore_rng)
        except CorruptCheckpointError as exc:
            bad = exc.problems or [str(exc)]
            problems.extend(bad)
            log.warning("checkpoint %s is corrupt, trying an older one: %s", path, "; ".join(bad))
    raise _none_intact(run_dir, problems)


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
            "files": _manifest(tmp),  # read back by verify_checkpoint; older checkpoints lack it
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
        # Checkpoints of later steps than this one exist only when a resume fell back past corrupt
        # ones: they neither count nor push this fresh checkpoint out (saving their step replaces them).
        for _, old in [c for c in list_checkpoints(run_dir) if c[0] <= step][:-keep_last]:
            _remove_dir(old)
        _fsync_dir(root)
    return final


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    restore_rng: bool = True,
    verify: bool = True,
) -> Checkpoint:
    """Restore what was saved into the given objects (those passed) and return step and state.

    ``path`` is a checkpoint folder (``latest_checkpoint(run_dir)``). The model must be built the
    same way as when it was saved (same base model, same LoRA config); its weights are overwritten.
    A checkpoint whose files fail :func:`verify_checkpoint` (``verify``) or cannot be read raises
    :class:`CorruptCheckpointError` naming the file, before anything is restored when the check
    catches it.
    """
    path = Path(path)
    if not (path / STATE_FILE).is_file() or not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {STATE_FILE} or {META_FILE})")
    if verify:
        problems = verify_checkpoint(path)
        if problems:
            raise CorruptCheckpointError(f"corrupt checkpoint {path}: " + "; ".join(problems), problems)
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        problem = f"{path / META_FILE}: unreadable ({exc})"
        raise CorruptCheckpointError(f"corrupt checkpoint {path}: {problem}", [problem]) from exc
    try:
        saved = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle stream...: the file, not the caller, is wrong
        problem = f"{path / STATE_FILE}: cannot be read ({type(exc).__name__}: {exc})"
        raise CorruptCheckpointError(f"corrupt checkpoint {path}: {problem}", [problem]) from exc
    if not isinstance(saved, dict):
        problem = f"{path / STATE_FILE}: holds a {type(saved).__name__}, not a training state"
        raise CorruptCheckpointError(f"corrupt checkpoint {path}: {problem}", [problem])
    if saved.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {saved.get('format_version')}, expected {FORMAT_VERSION}")
    if model is not None:
        kind = "peft_adapter" if is_peft_model(model) else "full"
        if meta.get("model") != kind:
            raise ValueError(f"{path} holds a {meta.get('model')} checkpoint but the model is {kind}")
        try:
            load_weights(model, path / MODEL_DIR)
        except Exception as exc:
            if not _is_read_error(exc):
                raise  # a model that does not fit the weights: the caller's mistake, said as is
            files = ", ".join(str(f) for f in sorted((path / MODEL_DIR).glob("*.safetensors"))) or str(path / MODEL_DIR)
            problem = f"{files}: cannot be read ({type(exc).__name__}: {exc})"
            raise CorruptCheckpointError(f"corrupt checkpoint {path}: {problem}", [problem]) from exc
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


def _is_read_error(exc: BaseException) -> bool:
    """An error from reading weight files (I/O, safetensors' own error), not from fitting them to a model."""
    if isinstance(exc, (OSError, EOFError)):  # FileNotFoundError included: a weight file is missing
        return True
    return type(exc).__name__ == "SafetensorError"


INFO_FILE = "tracegym.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Fields transformers 5 moved into ``rope_parameters`` that transformers 4.x reads at the top level.
_ROPE_TOP_LEVEL = ("rope_theta", "partial_rotary_factor")
# Tokenizer-config keys that record how a tokenizer was loaded here, not what it is.
_LOAD_ONLY_TOKENIZER_KEYS = ("is_local", "local_files_only")


def renderer_chat_template(renderer: str | None, tokenizer: Any) -> str | None:
    """The Jinja chat template of the renderer ``renderer`` names (a renderer name such as
    ``smollm2``/``hermes``, a model name, or a model path), tools included; None (with a warning)
    when no renderer is found for it or tracegym ships no template for that renderer."""
    if not renderer:
        return None
    from tracegym.render import get_renderer

    try:
        template = getattr(get_renderer(str(renderer), tokenizer), "chat_template", None)
    except ValueError as exc:
        log.warning("no renderer for %s (%s); the saved tokenizer keeps its own chat template", renderer, exc)
        return None
    if not isinstance(template, str):
        # e.g. a renderer checked against the model's own template: that one is already saved
        log.info("tracegym ships no template for renderer %s; the saved tokenizer keeps its own", renderer)
        return None
    return template


def save_tokenizer(tokenizer: Any, folder: str | Path, chat_template: str | None = None) -> None:
    """``tokenizer.save_pretrained(folder)``, then made portable: ``chat_template`` (when given) as
    ``chat_template.jinja`` (what transformers 5 reads first) and in ``tokenizer_config.json`` (what
    older readers use); transformers 5's ``TokenizersBackend`` class written under its transformers
    4.x name ``PreTrainedTokenizerFast`` (an alias in 5); load-time flags dropped. ``tokenizer`` is
    not changed."""
    folder = Path(folder)
    tokenizer.save_pretrained(str(folder))
    config_file = folder / "tokenizer_config.json"
    if chat_template is not None:
        (folder / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for key in _LOAD_ONLY_TOKENIZER_KEYS:
        config.pop(key, None)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if chat_template is not None:
        config["chat_template"] = chat_template
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def legacy_config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json`` as a dict) plus the fields transformers 4.x reads instead of
    transformers 5's ``rope_parameters``: ``rope_theta`` (and ``partial_rotary_factor``) at the top
    level, ``rope_scaling`` for a scaled RoPE (transformers 5 reads it back into the same
    ``rope_parameters``), and ``torch_dtype`` beside ``dtype``. Without them transformers 4.x falls
    back to rope_theta 10000 (SmolLM2 was trained with 100000). Per-layer-type RoPE (nested
    ``rope_parameters``) has no transformers 4.x form and is left as is."""
    config = dict(config)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope and all(not isinstance(v, dict) for v in rope.values()):
        for key in _ROPE_TOP_LEVEL:
            if key in rope:
                config[key] = rope[key]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default" and config.get("rope_scaling") is None:
            scaling = {k: v for k, v in rope.items() if k not in _ROPE_TOP_LEVEL}
            scaling.setdefault("rope_type", rope_type)
            config["rope_scaling"] = scaling
    if "dtype" in config and "torch_dtype" not in config:
        config["torch_dtype"] = config["dtype"]
    return config


def write_legacy_config(folder: str | Path) -> None:
    """Add :func:`legacy_config_fields` to ``folder/config.json`` (when there is one)."""
    file = Path(folder) / "config.json"
    if file.is_file():
        config = json.loads(file.read_text(encoding="utf-8"))
        file.write_text(json.dumps(legacy_config_fields(config), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_model_folder(model: torch.nn.Module | None, tokenizer: Any, folder: str | Path, info: dict[str, Any],
                       write_weights: Any | None = None) -> Path:
    """Write a portable model folder (not atomically; see :func:`save_final`): the adapter (LoRA) or
    the whole model as safetensors, the tokenizer with the renderer's tool-aware chat template,
    ``tracegym.json`` (``info``), a config.json transformers 4.x reads the same, and the file modes
    the umask gives. ``info["base_model"]`` is recorded as a portable name (``smollm2-135m``, not a
    cache path), in ``tracegym.json`` and in an adapter's ``adapter_config.json``; ``info["renderer"]``
    (else the base model) picks the chat template. ``write_weights(folder, base_model)`` writes the
    weights instead of ``model`` (one adapter of an ``AdapterPool``)."""
    from tracegym.models import portable_model_name

    folder = Path(folder)
    info = dict(info)
    if info.get("base_model") is not None:
        info["base_model"] = portable_model_name(str(info["base_model"]))
    if write_weights is not None:
        write_weights(folder, info.get("base_model"))
    else:
        save_weights(model, folder, base_model=info.get("base_model"))
    template = renderer_chat_template(info.get("renderer") or info.get("base_model"), tokenizer)
    save_tokenizer(tokenizer, folder, template)
    write_legacy_config(folder)
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2), encoding="utf-8")
    normalize_permissions(folder)
    return folder


def _write_final(run_dir: str | Path, write: Any) -> Path:
    """Create ``run_dir/final`` atomically: ``write(folder)`` fills a hidden temporary folder, which
    is fsync'd and renamed into place (an older ``final`` is removed first). Returns the folder."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / "final"
    tmp = run_dir / f".tmp-final-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write(tmp)
        _fsync_tree(tmp)
        if final.exists():
            _remove_dir(final)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_final(model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, info: dict[str, Any]) -> Path:
    """Write ``run_dir/final`` atomically (see :func:`write_model_folder` for what it holds):
    ``tracegym.json`` (``info``: base model, renderer, recipe...) is what ``tracegym.models.load``
    reads to put an adapter back on its base model. Returns the folder."""
    return _write_final(run_dir, lambda folder: write_model_folder(model, tokenizer, folder, info))


def save_team_final(pool: Any, tokenizer: Any, run_dir: str | Path, info: dict[str, Any]) -> Path:
    """Write ``run_dir/final`` atomically for an ``AdapterPool``: one portable model folder per
    adapter (``final/<adapter>``, each loadable like a single run's ``final``) and ``team.json``
    (``info``, e.g. which role plays with which adapter). Returns the folder."""

    def write(folder: Path) -> None:
        for name in pool.names:
            write_model_folder(None, tokenizer, folder / name, {**info, "adapter": name},
                               write_weights=lambda sub, base, name=name: pool.save(name, sub, base_model=base))
        (folder / "team.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
        normalize_permissions(folder)

    return _write_final(run_dir, write)


_EXPORT_CHECK_TOLERANCE = 1e-5
_EXPORT_CHECK_TEXT = "<|im_start|>user\nWhat is 12 * 7 + 3? Use the calculate tool.<|im_end|>\n<|im_start|>assistant\n"


def export_merged(source: str | Path, out: str | Path, dtype: Any = "float32", overwrite: bool = False) -> dict[str, Any]:
    """Write ``out``: ``source`` as one plain Hugging Face model folder, the LoRA adapter merged
    into the base weights (safetensors, config.json that transformers 4.x reads the same,
    generation config, tokenizer with the renderer's tool-aware chat template, ``tracegym.json``).

    ``source`` is a run folder (its ``final/`` is used), an adapter folder (loaded on the base it
    names), or a model folder. ``out`` is written into a temporary sibling and renamed into place
    after the folder has been reloaded with plain transformers and its logits compared with the
    merged model's (at most 1e-5 apart); an existing ``out`` is replaced only with ``overwrite``.
    Returns what was done: ``out``, ``source``, ``base_model``, ``merged`` (an adapter was merged),
    ``renderer``, ``max_abs_logit_diff``.
    """
    from transformers import AutoModelForCausalLM

    from tracegym.models import adapter_base_model, load, portable_model_name, resolve_model_name

    source, out = Path(source), Path(out)
    if (source / "final").is_dir() and not (source / "config.json").is_file() and not (source / "adapter_config.json").is_file():
        source = source / "final"
    if not source.is_dir():
        raise FileNotFoundError(f"{source}: no such folder (give a run folder, an adapter folder or a model folder)")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --force (overwrite=True) to replace it")
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents:
        raise ValueError(f"--out {out} must be outside the source folder {source}")
    resolve_model_name(source)  # a clear error for a folder that holds no model
    info: dict[str, Any] = {}
    if (source / INFO_FILE).is_file():
        info = json.loads((source / INFO_FILE).read_text(encoding="utf-8"))
    base = adapter_base_model(source)
    model, tokenizer = load(source, dtype)  # an adapter comes back merged into its base
    renderer = info.get("renderer") or base or str(source)
    out_info = {k: v for k, v in info.items() if k not in ("lora",)}
    out_info.update({
        "base_model": portable_model_name(base) if base is not None else info.get("base_model"),
        "renderer": renderer,
        "merged": base is not None,
        "exported_from": str(source.resolve()),
    })
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write_model_folder(model, tokenizer, tmp, out_info)
        # The folder must load as it is with plain transformers and compute what the merged model does.
        ids = torch.tensor([tokenizer(_EXPORT_CHECK_TEXT, add_special_tokens=False)["input_ids"]])  # [1, T]
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=model.dtype, local_files_only=True).eval()
        with torch.no_grad():
            diff = (model(ids).logits - reloaded(ids).logits).abs().max().item()
        del reloaded
        if not diff <= _EXPORT_CHECK_TOLERANCE:
            raise RuntimeError(f"the exported folder's logits differ from the merged model's by {diff}")
        _fsync_tree(tmp)
        if out.exists():
            _remove_dir(out)
        os.replace(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "source": source, "base_model": out_info["base_model"], "merged": base is not None,
            "renderer": renderer, "max_abs_logit_diff": diff}
