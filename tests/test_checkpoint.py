"""Checkpoints: atomic (a failed save never shadows the previous one), keep-last-N, exact restore."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re

import numpy as np
import pytest
import torch

from tracegym.config import LoraConfig, OptimConfig
from tracegym.train import checkpoint as ckpt
from tracegym.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from tracegym.train.lora import prepare_model
from tracegym.train.optim import build_optimizer, build_scheduler
from tracegym.train.seed import seed_everything


def _tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def _train_steps(model, optimizer, scheduler, n: int) -> None:
    for _ in range(n):
        ids = torch.randint(0, 64, (2, 8))  # uses the torch RNG, so RNG restore matters
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _setup(lora: bool):
    model = prepare_model(_tiny_llama(), LoraConfig(enabled=lora, r=4, target_modules=["q_proj", "v_proj"]))
    optim_cfg = OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine")
    optimizer = build_optimizer(model, optim_cfg)
    scheduler = build_scheduler(optimizer, optim_cfg, total_steps=10)
    return model, optimizer, scheduler


@pytest.mark.parametrize("lora", [True, False])
def test_save_load_restores_everything_exactly(tmp_path, lora):
    seed_everything(1)
    model, optimizer, scheduler = _setup(lora)
    _train_steps(model, optimizer, scheduler, 3)
    path = save_checkpoint(tmp_path, 3, model, optimizer, scheduler, state={"cursor": {"epoch": 1, "position": 5}})
    assert path == tmp_path / "checkpoints" / "step_000003"
    # The run goes on: weights, optimizer moments, schedule and RNG all move past the checkpoint.
    _train_steps(model, optimizer, scheduler, 2)
    expected_next = (random.random(), np.random.rand(), torch.rand(3))
    after_straight = {k: v.clone() for k, v in model.state_dict().items()}

    seed_everything(999)  # scramble the RNGs; the checkpoint must bring them back
    model2, optimizer2, scheduler2 = _setup(lora)
    restored = load_checkpoint(latest_checkpoint(tmp_path), model2, optimizer2, scheduler2)
    assert restored.step == 3 and restored.state == {"cursor": {"epoch": 1, "position": 5}}
    assert scheduler2.last_epoch == 3
    _train_steps(model2, optimizer2, scheduler2, 2)
    for key, value in model2.state_dict().items():
        assert torch.equal(value, after_straight[key]), key
    got_next = (random.random(), np.random.rand(), torch.rand(3))
    assert got_next[0] == expected_next[0] and got_next[1] == expected_next[1]
    assert torch.equal(got_next[2], expected_next[2])


def test_lora_checkpoint_holds_only_the_adapter(tmp_path):
    model, optimizer, scheduler = _setup(lora=True)
    path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    files = sorted(p.name for p in (path / "model").iterdir())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert "model.safetensors" not in files
    # A full model cannot be restored from an adapter checkpoint: a clear error, not silent garbage.
    full, _, _ = _setup(lora=False)
    with pytest.raises(ValueError, match="peft_adapter"):
        load_checkpoint(path, full)


def test_failure_mid_save_leaves_previous_latest_intact(tmp_path, monkeypatch):
    model, optimizer, scheduler = _setup(lora=True)
    good = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, state={"tag": "good"})

    def crash(*args, **kwargs):
        raise OSError("disk full (injected)")

    # The model files are written, then saving the training state fails.
    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(tmp_path, 2, model, optimizer, scheduler, state={"tag": "bad"})
    monkeypatch.undo()

    assert latest_checkpoint(tmp_path) == good
    assert load_checkpoint(good, restore_rng=False).state == {"tag": "good"}
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert leftovers == ["step_000001"], leftovers


def test_crash_leftovers_are_never_picked_and_are_cleaned(tmp_path):
    model, optimizer, scheduler = _setup(lora=True)
    good = save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    root = tmp_path / "checkpoints"
    # A process killed mid-save leaves its temporary folder; one killed mid-copy by hand leaves a
    # step folder without meta.json. Neither is a checkpoint.
    (root / ".tmp-step_000005-deadbeef" / "model").mkdir(parents=True)
    (root / "step_000009").mkdir()
    (root / "step_000009" / "training_state.pt").write_bytes(b"torn")
    assert latest_checkpoint(tmp_path) == good
    save_checkpoint(tmp_path, 2, model, optimizer, scheduler)
    assert not (root / ".tmp-step_000005-deadbeef").exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2]


def test_keep_last_n(tmp_path):
    model, optimizer, scheduler = _setup(lora=True)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, optimizer, scheduler, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000005"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004", "step_000005"]


def test_resaving_a_step_replaces_it(tmp_path):
    model, optimizer, scheduler = _setup(lora=True)
    save_checkpoint(tmp_path, 3, model, optimizer, scheduler, state={"v": 1})
    save_checkpoint(tmp_path, 3, model, optimizer, scheduler, state={"v": 2})
    assert load_checkpoint(latest_checkpoint(tmp_path), restore_rng=False).state == {"v": 2}


def test_no_checkpoint_and_incomplete_folder(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "x").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "x")


# --- corrupt checkpoints: verified on load, skipped with a warning, never a silent fresh start ----


def _truncate(file, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _two_checkpoints(tmp_path):
    model, optimizer, scheduler = _setup(lora=True)
    older = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, state={"tag": "older"})
    _train_steps(model, optimizer, scheduler, 1)
    newer = save_checkpoint(tmp_path, 2, model, optimizer, scheduler, state={"tag": "newer"})
    return model, optimizer, scheduler, older, newer


def test_manifest_records_size_and_hash_of_every_file(tmp_path):
    model, optimizer, scheduler = _setup(lora=True)
    path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    files = json.loads((path / "meta.json").read_text())["files"]
    assert set(files) == {"training_state.pt", "model/adapter_model.safetensors", "model/adapter_config.json",
                          *(f"model/{p.name}" for p in (path / "model").iterdir())}
    state = files["training_state.pt"]
    assert state["size"] == (path / "training_state.pt").stat().st_size
    assert state["sha256"] == hashlib.sha256((path / "training_state.pt").read_bytes()).hexdigest()
    assert ckpt.verify_checkpoint(path) == []


@pytest.mark.parametrize("victim", ["training_state.pt", "model/adapter_model.safetensors"])
def test_truncated_latest_resumes_from_the_older_with_a_warning(tmp_path, caplog, victim):
    model, optimizer, scheduler, older, newer = _two_checkpoints(tmp_path)
    _truncate(newer / victim)
    with caplog.at_level(logging.WARNING, logger="tracegym.train.checkpoint"):
        assert latest_checkpoint(tmp_path) == older  # what the recipes call
    assert str(newer / victim) in caplog.text and "truncated" in caplog.text
    assert latest_checkpoint(tmp_path, verify=False) == newer  # the unchecked, old behaviour
    # Loading it directly is a clear error naming the file, not a raw traceback from torch/safetensors.
    with pytest.raises(ckpt.CorruptCheckpointError, match=re.escape(str(newer / victim))):
        load_checkpoint(newer, model, optimizer, scheduler)

    caplog.clear()
    model2, optimizer2, scheduler2 = _setup(lora=True)
    with caplog.at_level(logging.WARNING, logger="tracegym.train.checkpoint"):
        restored = ckpt.load_latest_intact(tmp_path, model2, optimizer2, scheduler2)
    assert restored.path == older and restored.step == 1 and restored.state == {"tag": "older"}
    assert str(newer / victim) in caplog.text


def test_same_size_corruption_is_caught_by_the_hash(tmp_path):
    _, _, _, older, newer = _two_checkpoints(tmp_path)
    file = newer / "model" / "adapter_model.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the tensor data: size and structure unchanged
    file.write_bytes(bytes(data))
    (problem,) = ckpt.verify_checkpoint(newer)
    assert problem.startswith(str(file)) and "sha256" in problem
    assert latest_checkpoint(tmp_path) == older


def test_all_checkpoints_corrupt_is_a_clear_error_naming_the_files(tmp_path):
    model, optimizer, scheduler, older, newer = _two_checkpoints(tmp_path)
    _truncate(older / "training_state.pt")
    _truncate(newer / "model" / "adapter_model.safetensors", keep=0.0)
    for resume in (lambda: latest_checkpoint(tmp_path),
                   lambda: ckpt.load_latest_intact(tmp_path, model, optimizer, scheduler)):
        with pytest.raises(ckpt.CorruptCheckpointError, match="no intact checkpoint") as caught:
            resume()
        message = str(caught.value)
        assert str(older / "training_state.pt") in message
        assert str(newer / "model" / "adapter_model.safetensors") in message
        assert "not starting from scratch" in message
    assert ckpt.load_latest_intact(tmp_path / "elsewhere") is None  # no checkpoint at all: a fresh run


def _strip_manifest(path) -> None:
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]
    (path / "meta.json").write_text(json.dumps(meta))


def test_checkpoints_without_a_manifest_still_load_and_truncation_is_still_caught(tmp_path):
    model, optimizer, scheduler, older, newer = _two_checkpoints(tmp_path)
    for path in (older, newer):
        _strip_manifest(path)  # as written before the manifest existed
    assert ckpt.verify_checkpoint(newer) == []
    assert latest_checkpoint(tmp_path) == newer
    assert load_checkpoint(newer, model, optimizer, scheduler).state == {"tag": "newer"}

    # Without sizes to compare, the file structure still gives truncation away.
    _truncate(newer / "model" / "adapter_model.safetensors", keep=0.9)
    _truncate(older / "training_state.pt", keep=0.9)
    (adapter_problem,) = ckpt.verify_checkpoint(newer)
    (state_problem,) = ckpt.verify_checkpoint(older)
    assert adapter_problem.startswith(str(newer / "model" / "adapter_model.safetensors"))
    assert state_problem.startswith(str(older / "training_state.pt"))
    with pytest.raises(ckpt.CorruptCheckpointError, match="no intact checkpoint"):
        latest_checkpoint(tmp_path)
    # Even unverified, a read failure is named, not a raw torch/safetensors traceback.
    with pytest.raises(ckpt.CorruptCheckpointError, match=re.escape(str(older / "training_state.pt"))):
        load_checkpoint(older, model, optimizer, scheduler, verify=False)


def test_saving_after_a_fallback_never_prunes_the_checkpoint_it_just_wrote(tmp_path):
    model, optimizer, scheduler = _setup(lora=True)
    for step in (4, 6):
        save_checkpoint(tmp_path, step, model, optimizer, scheduler, keep_last=2)
    _truncate(tmp_path / "checkpoints" / "step_000006" / "training_state.pt")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000004"
    # The resumed run saves step 5 keeping 1: the corrupt step 6 must not push step 5 out.
    fresh = save_checkpoint(tmp_path, 5, model, optimizer, scheduler, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 6]
    assert latest_checkpoint(tmp_path) == fresh
    # Reaching step 6 again replaces the corrupt one; then pruning is as usual.
    save_checkpoint(tmp_path, 6, model, optimizer, scheduler, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6] and ckpt.verify_checkpoint(list_checkpoints(tmp_path)[0][1]) == []
