"""AdamW groups, warmup schedules (hand-computed values), gradient clipping, LoRA wrapping."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.config import LoraConfig, OptimConfig
from tracegym.train.lora import count_parameters, load_weights, prepare_model, save_weights
from tracegym.train.optim import build_optimizer, build_scheduler, clip_gradients


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    ))


def _lrs(schedule: str, warmup: int, total: int) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(2, 2))
    cfg = OptimConfig(lr=1.0, warmup_steps=warmup, schedule=schedule)
    optimizer = torch.optim.AdamW([param], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg, total)
    out = []
    for _ in range(total):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


def test_schedules_match_hand_computed_values():
    # Warmup 2 of 6 steps: lr = (step + 1) / 3 for step < 2 (the first step is not lr 0, unlike
    # transformers' linear warmup), then the decay over the remaining 4 steps.
    assert _lrs("constant", 2, 6) == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])
    assert _lrs("linear", 2, 6) == pytest.approx([1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25])
    cosine = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert _lrs("cosine", 2, 6) == pytest.approx([1 / 3, 2 / 3, *cosine])
    assert _lrs("constant", 0, 3) == pytest.approx([1, 1, 1])
    assert _lrs("constant", 1, 3)[0] > 0  # one warmup step: half the rate, never a wasted step


def test_weight_decay_skips_biases_and_norms_and_frozen_params():
    model = _tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert id(model.model.embed_tokens.weight) not in ids
    assert len(ids) == sum(1 for p in model.parameters() if p.requires_grad)


def test_no_trainable_parameters_is_a_clear_error():
    model = _tiny_llama().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(model, OptimConfig())


def test_clip_returns_the_norm_before_clipping():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_gradients([a, b], max_norm=1.0) == pytest.approx(5.0)
    assert torch.allclose(a.grad, torch.tensor([0.6, 0.0]), atol=1e-6) and b.grad.item() == pytest.approx(0.8, abs=1e-6)
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_gradients([a, b], max_norm=None) == pytest.approx(5.0)
    assert a.grad.tolist() == [3.0, 0.0]  # no clipping


def test_lora_all_linear_wraps_every_projection_and_starts_as_the_base_model():
    base = _tiny_llama()
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        expected = base(input_ids=ids).logits
    model = prepare_model(base, LoraConfig(r=4))
    wrapped = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trainable, total = count_parameters(model)
    assert 0 < trainable < total
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)  # B = 0 at init


def test_full_fine_tuning_and_weight_round_trip(tmp_path):
    model = prepare_model(_tiny_llama(), LoraConfig(enabled=False))
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    save_weights(model, tmp_path)
    other = _tiny_llama()
    load_weights(other, tmp_path)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="LoRA is disabled"):
        prepare_model(_tiny_llama(), LoraConfig(enabled=False), adapter_path=tmp_path)


def test_saved_adapter_loads_trainable_with_the_same_outputs(tmp_path):
    model = prepare_model(_tiny_llama(), LoraConfig(r=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)  # a non-trivial adapter
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    save_weights(model, tmp_path)
    assert (tmp_path / "adapter_model.safetensors").is_file()
    again = prepare_model(_tiny_llama(), LoraConfig(r=4), adapter_path=tmp_path)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, expected)
    assert any(p.requires_grad for n, p in again.named_parameters() if "lora_" in n)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        prepare_model(_tiny_llama(), LoraConfig(), adapter_path=tmp_path / "missing")


def test_rl_learning_rate_rule():
    from tracegym.train.optim import rl_learning_rate

    # 3e-4 SFT, 64 episodes per step (8 tasks x 8): 3e-4 / 8
    assert rl_learning_rate(3e-4, 64) == pytest.approx(3.75e-5)
    # a quarter of the batch: half the rate (square root of the batch)
    assert rl_learning_rate(3e-4, 16) == pytest.approx(1.875e-5)
    # never above a quarter of the SFT rate, however large the batch
    assert rl_learning_rate(3e-4, 100_000) == pytest.approx(7.5e-5)
    with pytest.raises(ValueError, match="positive"):
        rl_learning_rate(0.0, 64)
