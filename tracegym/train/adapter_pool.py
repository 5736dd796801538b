"""Many LoRA adapters over one base model: one per role (or per policy) of a team.

    pool = AdapterPool(base, {"planner": lora_cfg, "solver": lora_cfg}, optim=optim_cfg, total_steps=100)
    engine.generate(prompts, params, adapters=["planner", "solver", ...])   # mixed-role batch
    with pool.training("planner"):                                           # only planner's weights move
        policy_update(pool.model, batch, loss, pool.optimizers["planner"], pool.schedulers["planner"], ...)
    pool.save("planner", folder); pool.load("planner", folder)

How peft makes this work (peft 0.21, checked in tests): ``get_peft_model(base, cfg, adapter_name=a)``
then ``add_adapter(b, cfg)`` puts several adapters on the same frozen base; a forward with
``adapter_names=[...]`` (one per batch row, ``"__base__"`` for none) runs each row through its own
adapter -- in eval mode only, which is how the rollout engine samples; ``set_adapter(a)`` makes ``a``
the active adapter and the only one with ``requires_grad``, so a training step on ``a`` cannot touch
``b``. Memory: the base is held once; each adapter costs its LoRA factors (and its AdamW moments,
2x more), printed by :meth:`memory_report`.

Each adapter has its own AdamW and learning-rate schedule (optimizer state is adapter-local, as in
OpenTinker): a role's schedule advances only when that role trains. Roles may share an adapter
(``roles -> adapter`` is many-to-one): then they share its weights and optimizer.

Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` hold every adapter's weights, optimizer
and scheduler state, so a resumed run continues exactly (the RL recipe's team path writes them
atomically with ``tracegym.train.checkpoint``).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from tracegym.config import LoraConfig, OptimConfig
from tracegym.types import BASE_ADAPTER  # "__base__": no adapter, in a mixed batch

__all__ = ["AdapterPool", "BASE_ADAPTER"]


def _peft_lora_config(cfg: LoraConfig) -> Any:
    import peft

    return peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=cfg.target_modules,
                           bias="none", task_type="CAUSAL_LM")


class AdapterPool:
    """Named LoRA adapters on one frozen base, each with its own optimizer and schedule.

    Args:
        base: the base causal LM (not yet wrapped by peft).
        adapters: adapter name -> ``LoraConfig`` (r, alpha, target modules; ``enabled`` must be True).
        init: adapter name -> a saved adapter folder to start from (e.g. an SFT adapter); adapters
            not listed start fresh (B = 0: they compute exactly what the base does).
        optim: AdamW settings, the same for every adapter (None: no optimizers, sampling only).
        total_steps: length of each adapter's learning-rate schedule (optimizer steps).
    """

    def __init__(self, base: torch.nn.Module, adapters: Mapping[str, LoraConfig], *,
                 init: Mapping[str, str | Path | None] | None = None, optim: OptimConfig | None = None,
                 total_steps: int = 1) -> None:
        import peft

        if not adapters:
            raise ValueError("AdapterPool needs at least one adapter")
        for name, cfg in adapters.items():
            if not name or name == BASE_ADAPTER or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(f"adapter name {name!r}: use letters, digits, '-' or '_' (and not {BASE_ADAPTER!r})")
            if not cfg.enabled:
                raise ValueError(f"adapter {name!r}: an adapter pool needs LoRA (lora.enabled: true)")
        init = dict(init or {})
        unknown = sorted(set(init) - set(adapters))
        if unknown:
            raise ValueError(f"init names adapters the pool does not have: {unknown}")
        self.names: tuple[str, ...] = tuple(adapters)
        model: Any = None
        for name in self.names:
            folder = init.get(name)
            if folder is not None and not (Path(folder) / "adapter_config.json").is_file():
                raise FileNotFoundError(f"adapter {name!r}: no peft adapter (adapter_config.json) in {folder}")
            if model is None:
                if folder is not None:
                    model = peft.PeftModel.from_pretrained(base, str(folder), adapter_name=name, is_trainable=True)
                else:
                    model = peft.get_peft_model(base, _peft_lora_config(adapters[name]), adapter_name=name)
            elif folder is not None:
                model.load_adapter(str(folder), adapter_name=name, is_trainable=True)
            else:
                model.add_adapter(name, _peft_lora_config(adapters[name]))
        self.model = model
        self.model.eval()
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, Any] = {}
        if optim is not None:
            from tracegym.train.optim import build_optimizer, build_scheduler

            for name in self.names:
                with self.training(name):
                    self.optimizers[name] = build_optimizer(self.model, optim)
                self.schedulers[name] = build_scheduler(self.optimizers[name], optim, total_steps)
        self.model.set_adapter(self.names[0])

    # -- which adapter is live -----------------------------------------------------------------------
    @contextlib.contextmanager
    def training(self, name: str) -> Iterator[torch.nn.Module]:
        """Make ``name`` the active adapter and the only trainable one for the block (forwards
        without ``adapter_names`` use it: scoring, the update); yields the model."""
        if name not in self.names:
            raise KeyError(f"no adapter {name!r} in the pool (it has {list(self.names)})")
        self.model.set_adapter(name)
        try:
            yield self.model
        finally:
            pass  # the active adapter stays until the next call; sampling names every row's adapter

    def parameters(self, name: str) -> dict[str, torch.nn.Parameter]:
        """The LoRA parameters of adapter ``name`` by parameter name."""
        marker = f".{name}."
        return {key: p for key, p in self.model.named_parameters() if "lora_" in key and marker in key}

    # -- saving ---------------------------------------------------------------------------------------
    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s weights as peft saves them (keys without the adapter name), cloned."""
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers=False).items()}

    def save(self, name: str, folder: str | Path, base_model: str | None = None) -> Path:
        """Write adapter ``name`` as a plain peft adapter folder (``adapter_model.safetensors`` +
        ``adapter_config.json``), loadable on its own with ``PeftModel.from_pretrained`` or as an
        ``init`` of another pool. Not atomic: callers write into a temporary folder and rename."""
        from safetensors.torch import save_file

        from tracegym.train.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, normalize_permissions, set_adapter_base

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.adapter_state(name).items()}, str(folder / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        self.model.peft_config[name].save_pretrained(str(folder))  # adapter_config.json
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        config["inference_mode"] = True
        (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if base_model is not None or config.get("base_model_name_or_path"):
            set_adapter_base(folder, base_model)
        normalize_permissions(folder)
        return folder

    def load(self, name: str, folder: str | Path) -> None:
        """Set adapter ``name``'s weights from an adapter folder (same rank and modules)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        from tracegym.train.lora import ADAPTER_WEIGHTS

        file = Path(folder) / ADAPTER_WEIGHTS
        if not file.is_file():
            raise FileNotFoundError(f"adapter {name!r}: no {ADAPTER_WEIGHTS} in {folder}")
        result = set_peft_model_state_dict(self.model, load_file(str(file)), adapter_name=name)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ValueError(f"adapter {name!r} in {folder} does not fit the pool: unexpected keys {unexpected[:3]}")

    def state_dict(self) -> dict[str, Any]:
        """Every adapter's weights, optimizer and scheduler state (for a checkpoint), copied: later
        steps do not change it (an optimizer's state_dict holds its live moment tensors)."""
        return {name: {"weights": self.adapter_state(name),
                       "optimizer": copy.deepcopy(self.optimizers[name].state_dict()) if name in self.optimizers else None,
                       "scheduler": self.schedulers[name].state_dict() if name in self.schedulers else None}
                for name in self.names}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (every adapter of the pool must be there)."""
        from peft import set_peft_model_state_dict

        missing = sorted(set(self.names) - set(state))
        if missing:
            raise ValueError(f"checkpoint lacks adapters {missing} (it has {sorted(state)})")
        for name in self.names:
            part = state[name]
            set_peft_model_state_dict(self.model, part["weights"], adapter_name=name)
            if part.get("optimizer") is not None and name in self.optimizers:
                self.optimizers[name].load_state_dict(part["optimizer"])
            if part.get("scheduler") is not None and name in self.schedulers:
                self.schedulers[name].load_state_dict(part["scheduler"])

    # -- memory ---------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, float]:
        """MB held by the base weights, by each adapter's weights and by its optimizer state: N
        adapters cost N adapters, not N models."""
        mb = 1 / 2**20
        base = sum(p.numel() * p.element_size() for k, p in self.model.named_parameters() if "lora_" not in k) * mb
        out = {"base_mb": base}
        for name in self.names:
            out[f"adapter_mb/{name}"] = sum(p.numel() * p.element_size() for p in self.parameters(name).values()) * mb
            opt = self.optimizers.get(name)
            if opt is not None:
                out[f"optimizer_mb/{name}"] = sum(t.numel() * t.element_size() for s in opt.state.values()
                                                 for t in s.values() if torch.is_tensor(t)) * mb
        return out
