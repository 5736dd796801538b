"""LoRA (peft) or full fine-tuning, chosen by a ``LoraConfig``; saving and loading the trained weights.

With LoRA only the adapter is trained and saved (``adapter_model.safetensors`` + ``adapter_config.json``,
loadable with ``peft.PeftModel.from_pretrained``); with full fine-tuning every parameter is trained and
the whole model is saved in Hugging Face format (``model.safetensors`` + ``config.json``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tracegym.config import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def is_peft_model(model: torch.nn.Module) -> bool:
    """True for a peft-wrapped model (a LoRA adapter on a frozen base)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def prepare_model(
    model: torch.nn.Module, cfg: LoraConfig, adapter_path: str | Path | None = None
) -> torch.nn.Module:
    """Make ``model`` trainable as ``cfg`` asks.

    - ``cfg.enabled`` and no ``adapter_path``: a fresh LoRA adapter (B initialised to zero, so the
      wrapped model computes exactly what the base did) on ``cfg.target_modules``.
    - ``cfg.enabled`` and ``adapter_path``: that saved adapter, loaded trainable (continue training).
    - not ``cfg.enabled``: full fine-tuning, every parameter trainable.
    """
    if not cfg.enabled:
        if adapter_path is not None:
            raise ValueError("an adapter to load was given but LoRA is disabled")
        for param in model.parameters():
            param.requires_grad_(True)
        return model

    import peft

    if adapter_path is not None:
        adapter_path = Path(adapter_path)
        if not (adapter_path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no peft adapter (adapter_config.json) in {adapter_path}")
        return peft.PeftModel.from_pretrained(model, str(adapter_path), is_trainable=True)

    peft_config = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, peft_config)


def starting_reference(
    model: torch.nn.Module, cfg: LoraConfig, adapter_path: str | Path | None = None,
    device: torch.device | str = "cpu",
) -> torch.nn.Module | None:
    """The frozen reference policy of a run that trains ``model`` as ``cfg`` says: the policy at
    step 0, so a KL penalty anchors training where it started, on ``device``. Call it before
    ``prepare_model``.

    - full fine-tuning: a frozen copy of the untouched weights;
    - LoRA from ``adapter_path`` (RL or DPO after SFT): a frozen copy with that adapter merged. The
      bare base would pull the policy back before its SFT, which is not where it started;
    - a fresh LoRA adapter: None, meaning "the model with its adapter disabled" (no second copy: a
      fresh adapter computes exactly what the base does).
    """
    import copy

    if not cfg.enabled:
        reference = copy.deepcopy(model)
    elif adapter_path is not None:
        import peft

        if not (Path(adapter_path) / ADAPTER_CONFIG).is_file():
            raise FileNotFoundError(f"no peft adapter (adapter_config.json) in {adapter_path}")
        reference = peft.PeftModel.from_pretrained(copy.deepcopy(model), str(adapter_path)).merge_and_unload()
    else:
        return None
    return reference.eval().requires_grad_(False).to(device)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def save_weights(model: torch.nn.Module, folder: str | Path, base_model: str | None = None) -> None:
    """Save what training changed: the adapter of a peft model, or the whole model, as safetensors.

    An adapter's ``adapter_config.json`` (``base_model_name_or_path``) and model card name
    ``base_model`` when given, else the portable name of the base peft recorded
    (``tracegym.models.portable_model_name``: ``smollm2-135m`` rather than this machine's cache
    folder). Files are written with the permissions the umask gives (safetensors itself writes 0600).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    if (folder / ADAPTER_CONFIG).is_file():
        set_adapter_base(folder, base_model)
    normalize_permissions(folder)


def set_adapter_base(folder: str | Path, base_model: str | None = None) -> str | None:
    """Rewrite the base model an adapter folder names (``adapter_config.json`` and peft's README
    model card) to ``base_model``, or to the portable name of the one it names. Returns the name."""
    import json

    from tracegym.models import portable_model_name

    folder = Path(folder)
    config_file = folder / ADAPTER_CONFIG
    config = json.loads(config_file.read_text(encoding="utf-8"))
    old = config.get("base_model_name_or_path")
    new = portable_model_name(base_model if base_model is not None else old)
    if new is None or new == old:
        return new
    config["base_model_name_or_path"] = new
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    card = folder / "README.md"
    if old and card.is_file():
        card.write_text(card.read_text(encoding="utf-8").replace(str(old), new), encoding="utf-8")
    return new


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc/self/status``)."""
    import os

    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # the portable way: set and restore (not atomic across threads)
    os.umask(mask)
    return mask


def normalize_permissions(folder: str | Path) -> None:
    """Give ``folder``, its subfolders and files the modes a plain ``open``/``mkdir`` would:
    0666 / 0777 minus the umask (0644 / 0755 with the usual 022). Libraries that write through a
    temporary file (safetensors) leave 0600, which other users and containers cannot read."""
    import os

    mask = _umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode)
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, dir_mode)
    os.chmod(folder, dir_mode)


def load_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Load weights written by ``save_weights`` into an already built ``model`` of the same shape.

    For a peft model the adapter tensors are set; for a full model every tensor is loaded and the
    only tensors allowed to be absent from the files are those tied to another (the output head
    tied to the embeddings is saved once).
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        file = folder / ADAPTER_WEIGHTS
        if not file.is_file():
            raise FileNotFoundError(f"no adapter weights {ADAPTER_WEIGHTS} in {folder}")
        result = set_peft_model_state_dict(model, load_file(str(file)))
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ValueError(f"adapter in {folder} does not fit the model: unexpected keys {unexpected[:5]}")
        return

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"weights in {folder} do not fit the model: unexpected keys {result.unexpected_keys[:5]}")
    missing = [key for key in result.missing_keys if not _is_tied(model, key)]
    if missing:
        raise ValueError(f"weights in {folder} do not fit the model: missing keys {missing[:5]}")


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    """Whether parameter ``key`` shares its storage with another parameter of the model."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensor = tensors.get(key)
    if tensor is None:
        return False
    return any(other is tensor or other.data_ptr() == tensor.data_ptr() for name, other in tensors.items() if name != key)
