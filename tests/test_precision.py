"""``model.autocast`` (bfloat16 training forwards) and the eval-mode training of the fixed-dataset
recipes: the mixed-precision forward against the float32 one, the RL update re-scoring the old
policy so its ratio starts at exactly 1, and when training needs train mode at all."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tracegym.config import ModelConfig, RLConfig, SFTConfig, load_config
from tracegym.train.precision import (needs_train_mode, resolve_autocast, set_training_autocast, training_autocast,
                                      training_forward_context)


def _tiny_lora(dropout: float = 0.0):
    from tracegym.config import LoraConfig
    from tracegym.models import load
    from tracegym.train.lora import prepare_model

    model, tokenizer = load("tiny-random")
    return prepare_model(model, LoraConfig(r=4, dropout=dropout), None).eval(), tokenizer


def test_resolve_autocast_and_the_mark():
    cpu = torch.device("cpu")
    assert resolve_autocast("none", cpu) is None
    assert resolve_autocast("bfloat16", cpu) is torch.bfloat16
    assert resolve_autocast("auto", torch.device("meta")) is None  # no native bfloat16 known there
    with pytest.raises(ValueError, match="model.autocast"):
        resolve_autocast("fp8", cpu)
    with pytest.raises(ValueError, match="autocast"):
        ModelConfig(autocast="fp8")
    model = torch.nn.Linear(2, 2)
    assert training_autocast(model) is None
    set_training_autocast(model, torch.bfloat16)
    assert training_autocast(model) is torch.bfloat16
    with training_forward_context(model, cpu):
        assert model(torch.ones(1, 2)).dtype == torch.bfloat16
    assert model(torch.ones(1, 2)).dtype == torch.float32  # outside the training forward: the weights' dtype


def test_bfloat16_forward_is_close_to_float32_and_trains_float32_weights():
    """The same rows, log-probs and LoRA gradients, float32 against bfloat16 autocast: close (bfloat16
    keeps 8 bits of mantissa), log-probs float32 either way, gradients on the float32 weights."""
    from tracegym.train.logprobs import token_logprobs

    model, _ = _tiny_lora()
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (3, 40))
    ids[:, :20] = ids[0, :20]  # a shared prefix: the prefix path runs under autocast too
    mask = torch.ones_like(ids)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    with torch.no_grad():
        for p in lora_b:
            p.normal_(0, 0.02)  # B starts at 0: make the adapter's path carry gradient to A as well
    results = {}
    for dtype in (None, torch.bfloat16):
        set_training_autocast(model, dtype)
        model.zero_grad(set_to_none=True)
        logprobs = token_logprobs(model, ids, mask, first_column=20)
        logprobs[:, 20:].sum().backward()
        grads = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.grad is not None])
        results[dtype] = (logprobs.detach(), grads)
        assert logprobs.dtype == torch.float32
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
                   for p in model.parameters() if p.grad is not None)
    (full, full_grad), (mixed, mixed_grad) = results[None], results[torch.bfloat16]
    assert not torch.equal(full, mixed)  # bfloat16 really ran
    diff = (full[:, 20:] - mixed[:, 20:]).abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.2
    cosine = torch.nn.functional.cosine_similarity(full_grad, mixed_grad, dim=0)
    assert float(cosine) > 0.99


def test_rl_update_rescores_the_old_policy_under_autocast(tmp_path):
    """With autocast the engine's float32 log-probs are not the trainer's: ``score_batch`` scores the
    old policy with the trainer, so the first pass's ratio is exactly 1; without it the engine's
    log-probs stand in (no extra forward) and the ratio is 1 up to float32 rounding."""
    from tracegym.algos.advantages import has_signal
    from tracegym.algos.config import PolicyLossConfig
    from tracegym.batch import examples_from_groups, make_batch
    from tracegym.envs import make
    from tracegym.rl import collect, policy, tasks as rl_tasks
    from tracegym.train.optim import build_optimizer, build_scheduler
    from tracegym.train.policy_update import policy_update, score_batch

    ratios = {}
    for setting in ("none", "bfloat16"):
        cfg = load_config(RLConfig, data={
            "model": {"name": "tiny-random", "autocast": setting}, "lora": {"enabled": True, "r": 4},
            "env": {"name": "calculator", "options": {"num_calls": 1}}, "tasks": {"train": 4, "test": 0, "seed": 0},
            "tasks_per_step": 2, "group_size": 4, "rollout": {"max_turns": 2, "max_tokens_per_turn": 6},
            "micro_batch_size": 4, "output_dir": str(tmp_path / setting), "logging": {"progress": False}})
        loss_cfg = PolicyLossConfig(**cfg.policy_loss)
        model, tokenizer, reference = policy.load_policy(cfg, loss_cfg, torch.device("cpu"))
        assert training_autocast(model) == (torch.bfloat16 if setting == "bfloat16" else None)
        renderer = policy.make_renderer(cfg, tokenizer)
        sampler = policy.make_sampler(cfg, model, tokenizer, renderer)
        tasks = rl_tasks.tasks_for_step(make("calculator", num_calls=1).tasks("train", 4), 2, 0, 0)
        groups, _ = collect.collect_groups(sampler, cfg, tasks, renderer, seed=0)
        # one advantage of +-1 per episode, whatever the rewards: every row trains
        advantages = [[[1.0 if i % 2 else -1.0] * len(t.turns) for i, t in enumerate(g.trajectories)] for g in groups]
        assert all(has_signal(a) for a in advantages)
        data = examples_from_groups(groups, renderer, advantages)
        batch = score_batch(model, reference, make_batch(data.examples, pad_token_id=tokenizer.eos_token_id), loss_cfg,
                            micro_batch_size=4, temperature=1.0, epochs=1)
        assert (batch.old_logprobs is not None) == (setting == "bfloat16")
        optimizer = build_optimizer(model, cfg.optim)
        metrics = policy_update(model, batch, loss_cfg, optimizer, build_scheduler(optimizer, cfg.optim, 2), epochs=1,
                                micro_batch_size=4, temperature=1.0, max_grad_norm=1.0)
        ratios[setting] = (metrics["train/ratio_min"], metrics["train/ratio_max"])
    assert ratios["bfloat16"] == (1.0, 1.0)
    assert ratios["none"][0] == pytest.approx(1.0, abs=1e-4) and ratios["none"][1] == pytest.approx(1.0, abs=1e-4)


def test_old_log_probs_from_the_update_forward_equal_a_rescoring_pass_under_autocast(tmp_path):
    """One pass (``epochs=1``) under bfloat16 autocast: taking the old log-probs from the update's own
    forward (``old_from_forward``) gives the gradients of re-scoring the whole batch first, with the
    ratio exactly 1, and saves that pass (fewer model forwards). Rows without engine log-probs (a
    guidance trajectory) are still scored before the update; several passes refuse the shortcut."""
    from tracegym.algos.config import PolicyLossConfig
    from tracegym.batch import examples_from_groups, make_batch
    from tracegym.envs import make
    from tracegym.rl import collect, policy, tasks as rl_tasks
    from tracegym.train.optim import build_scheduler
    from tracegym.train.policy_update import old_from_forward_is_exact, policy_update, score_batch

    cfg = load_config(RLConfig, data={
        "model": {"name": "tiny-random", "autocast": "bfloat16"}, "lora": {"enabled": True, "r": 4},
        "env": {"name": "calculator", "options": {"num_calls": 1}}, "tasks": {"train": 4, "test": 0, "seed": 0},
        "tasks_per_step": 2, "group_size": 4, "rollout": {"max_turns": 2, "max_tokens_per_turn": 6},
        "micro_batch_size": 4, "output_dir": str(tmp_path / "run"), "logging": {"progress": False}})
    loss_cfg = PolicyLossConfig(**cfg.policy_loss)
    model, tokenizer, reference = policy.load_policy(cfg, loss_cfg, torch.device("cpu"))
    assert old_from_forward_is_exact(model, epochs=1, train_mode=False)
    assert not old_from_forward_is_exact(model, epochs=2, train_mode=False)
    renderer = policy.make_renderer(cfg, tokenizer)
    sampler = policy.make_sampler(cfg, model, tokenizer, renderer)
    tasks = rl_tasks.tasks_for_step(make("calculator", num_calls=1).tasks("train", 4), 2, 0, 0)
    groups, _ = collect.collect_groups(sampler, cfg, tasks, renderer, seed=0)
    advantages = [[[1.0 if i % 2 else -1.0] * len(t.turns) for i, t in enumerate(g.trajectories)] for g in groups]
    batch = make_batch(examples_from_groups(groups, renderer, advantages).examples, pad_token_id=tokenizer.eos_token_id)
    forwards = []
    model.get_input_embeddings().register_forward_hook(lambda *_: forwards.append(1))  # every forward starts there

    def update(old_from_forward: bool) -> tuple[dict, dict, int]:
        forwards.clear()
        scored = score_batch(model, reference, batch, loss_cfg, micro_batch_size=4, temperature=1.0, epochs=1,
                             old_from_forward=old_from_forward)
        assert (scored.old_logprobs is None) == old_from_forward  # every row has engine log-probs
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)  # keeps the weights
        metrics = policy_update(model, scored, loss_cfg, optimizer, build_scheduler(optimizer, cfg.optim, 2), epochs=1,
                                micro_batch_size=4, temperature=1.0, max_grad_norm=None, old_from_forward=old_from_forward)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return metrics, grads, len(forwards)

    rescored, rescored_grads, rescored_forwards = update(False)
    shortcut, shortcut_grads, shortcut_forwards = update(True)
    assert (shortcut["train/ratio_min"], shortcut["train/ratio_max"]) == (1.0, 1.0) == (
        rescored["train/ratio_min"], rescored["train/ratio_max"])
    assert shortcut["train/loss"] == pytest.approx(rescored["train/loss"], rel=1e-6)
    assert any(float(g.abs().sum()) > 0 for g in shortcut_grads.values())
    for name, grad in shortcut_grads.items():
        torch.testing.assert_close(grad, rescored_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # the re-scoring pass: one or two forwards per micro-batch (two when a shared prefix runs first)
    assert 0 < shortcut_forwards and rescored_forwards - shortcut_forwards >= batch.size // 4
    # a row without engine log-probs (LUFFY's expert trajectory) is scored alone, the others not
    guided = dataclasses.replace(batch, has_engine_logprobs=torch.tensor([i != 2 for i in range(batch.size)]))
    forwards.clear()
    old = score_batch(model, reference, guided, loss_cfg, micro_batch_size=4, temperature=1.0, epochs=1,
                      old_from_forward=True).old_logprobs
    assert old is not None and 1 <= len(forwards) <= 2  # the one row's forward
    torch.testing.assert_close(old[[0, 1, 3]], batch.engine_logprobs[[0, 1, 3]])
    with pytest.raises(ValueError, match="epochs=1"):
        score_batch(model, reference, batch, loss_cfg, micro_batch_size=4, temperature=1.0, epochs=2, old_from_forward=True)


def test_train_mode_only_where_it_changes_the_computation():
    model, _ = _tiny_lora()
    assert not needs_train_mode(model, gradient_checkpointing=False)
    assert needs_train_mode(model, gradient_checkpointing=True)
    dropped, _ = _tiny_lora(dropout=0.1)
    assert needs_train_mode(dropped, gradient_checkpointing=False)
    attention_dropout, _ = _tiny_lora()
    attention_dropout.config.attention_dropout = 0.1  # applied functionally inside attention, train mode only
    assert needs_train_mode(attention_dropout, gradient_checkpointing=False)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_sft_loads_in_eval_mode_without_dropout(tmp_path: Path, dropout: float):
    """SFT (a fixed-dataset recipe) trains in eval mode unless dropout or gradient checkpointing
    needs train mode: without dropout both modes compute the same thing, and eval mode lets the
    shared prompt prefix run once."""
    from tracegym.rl.policy import load_policy

    cfg = load_config(SFTConfig, data={"model": {"name": "tiny-random"}, "lora": {"r": 4, "dropout": dropout},
                                       "data": {"train_files": ["x.jsonl"]}, "output_dir": str(tmp_path)})
    model, _, _ = load_policy(cfg, None, torch.device("cpu"), train=True)
    assert model.training == (dropout > 0)


def test_sft_gradient_in_eval_mode_with_shared_prefix_equals_train_mode():
    """Two implementations of one SFT gradient: train mode (every row's full forward) against eval
    mode (the rows' common system prompt run once): the same loss and gradients up to float rounding."""
    from tracegym.envs import make
    from tracegym.recipes.sft import accumulate_sft_gradients
    from tracegym.render import get_renderer
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    model, tokenizer = _tiny_lora()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    renderer = get_renderer("tiny-random", tokenizer)
    tasks = make("calculator", num_calls=2).tasks("train", 4, 0)
    result = run_rollouts_sync("calculator", tasks, "expert", renderer, RolloutConfig(max_turns=4, max_tokens_per_turn=64),
                               progress=False, env_options={"num_calls": 2}, policy_name="expert")
    examples = [e for t in result.trajectories for e in renderer.build_examples(t)]
    outputs = {}
    for train_mode in (True, False):
        model.train(train_mode)
        model.zero_grad(set_to_none=True)
        out = accumulate_sft_gradients(model, examples, 4, torch.device("cpu"), tokenizer.eos_token_id)
        outputs[train_mode] = (out["loss"], torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert outputs[True][0] == pytest.approx(outputs[False][0], rel=1e-5)
    torch.testing.assert_close(outputs[True][1], outputs[False][1], rtol=1e-3, atol=1e-6)
