"""The HF engine's sampling copy (``sample_dtype``): a merged LoRA copy in another dtype that
follows the trainer through ``update_weights``, and what the RL update does with its log-probs."""

from __future__ import annotations

import pytest
import torch

from tracegym.engines.hf import HFEngine
from tracegym.engines.sampling_copy import refresh_sampling_copy, resolve_sample_dtype, sampling_copy
from tracegym.models import load
from tracegym.types import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], [8, 8, 1, 250, 77, 64, 12], [300, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3)


def lora_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load("tiny-random")[0], LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():  # a trained adapter: B != 0, so the merge matters
        generator = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model


def test_resolve_sample_dtype():
    assert resolve_sample_dtype(None) is None
    assert resolve_sample_dtype("float32") is torch.float32
    assert resolve_sample_dtype("bfloat16") is torch.bfloat16
    for wrong in ("fp8", "auto"):  # no auto: bfloat16 costs a merged LoRA quality, so the user picks it
        with pytest.raises(ValueError, match="sample_dtype"):
            resolve_sample_dtype(wrong)


def test_float32_copy_samples_what_the_peft_model_samples():
    model = lora_model()
    plain = HFEngine(model)
    copied = HFEngine(model, sample_dtype="float32")
    assert copied.model is not model and not hasattr(copied.model, "peft_config")
    assert not copied.sample_dtype_differs
    for params in (GREEDY, SAMPLED):
        a, b = plain.generate(PROMPTS, params), copied.generate(PROMPTS, params)
        assert [[g.token_ids for g in row] for row in a] == [[g.token_ids for g in row] for row in b]
        for row_a, row_b in zip(a, b):
            for ga, gb in zip(row_a, row_b):
                assert max(abs(x - y) for x, y in zip(ga.logprobs, gb.logprobs)) < 1e-4
    # the trainer's weights are untouched (no in-place merge) and it is still a peft model
    assert any("lora_B" in n for n, _ in model.named_parameters())


def test_copy_follows_the_trainer_only_through_update_weights():
    model = lora_model()
    engine = HFEngine(model, sample_dtype="float32")
    before = engine.generate(PROMPTS, GREEDY)
    with torch.no_grad():  # an optimizer step on the adapter
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.add_(torch.randn_like(p))
    assert engine.generate(PROMPTS, GREEDY) == before  # a copy: the step is not seen yet
    engine.update_weights(model)
    fresh = HFEngine(model, sample_dtype="float32").generate(PROMPTS, GREEDY)
    assert engine.generate(PROMPTS, GREEDY) == fresh != before
    # the refreshed copy equals peft's own merge of the stepped adapter, weight by weight
    merged = sampling_copy(model, torch.float32).state_dict()
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, merged[name]), name


def test_bfloat16_copy():
    model = lora_model()
    engine = HFEngine(model, sample_dtype="bfloat16")
    assert next(engine.model.parameters()).dtype is torch.bfloat16
    assert next(model.parameters()).dtype is torch.float32  # the trainer keeps float32
    assert engine.sample_dtype_differs
    out = engine.generate(PROMPTS, SAMPLED)
    for row in out:
        for g in row:
            assert len(g.token_ids) == len(g.logprobs) > 0
            assert all(lp <= 0.0 and lp == lp for lp in g.logprobs)  # float log-probs, no NaN
    # each weight is the float32 merge, rounded once to bfloat16
    merged = sampling_copy(model, torch.float32).state_dict()
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, merged[name].to(torch.bfloat16)), name
    # scoring goes through the copy too, in float32 log-probs
    scored = engine.prompt_logprobs([PROMPTS[0] + list(out[0][0].token_ids)])[0]
    assert all(isinstance(x, float) for x in scored)


def test_plain_model_already_in_the_dtype_is_not_copied():
    model, _ = load("tiny-random")
    assert HFEngine(model, sample_dtype="float32").model is model
    bf16 = load("tiny-random")[0].to(torch.bfloat16)
    engine = HFEngine(bf16, sample_dtype="bfloat16")
    assert engine.model is bf16 and not engine.sample_dtype_differs
    # a plain float32 trainer (full fine-tuning) sampled in bfloat16: the whole state is copied
    full = HFEngine(model, sample_dtype="bfloat16")
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0) if not model.config.tie_word_embeddings else model.get_input_embeddings().weight.mul_(2.0)
    full.update_weights(model)
    for name, value in full.model.state_dict().items():
        assert torch.equal(value, model.state_dict()[name].to(torch.bfloat16)), name


def test_refresh_copies_non_lora_trainables_too():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load("tiny-random")[0], LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    target = sampling_copy(model, torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.25)
    refresh_sampling_copy(target, model)
    expected = sampling_copy(model, torch.float32).state_dict()
    for name, value in target.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_multi_adapter_models_are_refused():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load("tiny-random")[0], LoraConfig(r=2, target_modules=["q_proj"]), adapter_name="a")
    model.add_adapter("b", LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="multi-adapter"):
        HFEngine(model, sample_dtype="bfloat16")
    engine = HFEngine(lora_model(), sample_dtype="bfloat16")
    with pytest.raises(ValueError, match="merged copy"):
        engine.generate(PROMPTS, GREEDY, adapters=["default"] * len(PROMPTS))


def test_a_strided_output_layer_input_is_made_contiguous():
    """transformers hands the output layer hidden[:, -1:, :] of a prefill, a strided view; the
    engine's forward makes it contiguous (a bfloat16 F.linear on a strided 3-D input copies the
    whole weight per row), and removes its hook afterwards."""
    from tracegym.engines.hf import contiguous_head_input

    model, _ = load("tiny-random")
    seen = []
    head = model.get_output_embeddings()
    probe = head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].is_contiguous()))  # what forward got
    ids = torch.tensor([[5, 17, 42, 99, 3, 8], [8, 1, 250, 77, 64, 12]])
    with torch.no_grad():
        plain = model(input_ids=ids, logits_to_keep=1).logits
        with contiguous_head_input(model):
            fixed = model(input_ids=ids, logits_to_keep=1).logits
        model(input_ids=ids, logits_to_keep=1)
    probe.remove()
    assert seen == [False, True, False]  # strided without the hook, contiguous with it, hook gone after
    assert torch.allclose(plain, fixed, atol=1e-6)


def test_make_engine_casts_a_model_it_loads():
    from tracegym.engines import make_engine

    engine = make_engine("hf", model="tiny-random", sample_dtype="bfloat16")
    assert engine.model is engine.source and next(engine.model.parameters()).dtype is torch.bfloat16
    assert "sample_dtype=bfloat16" in repr(engine)


def test_a_bfloat16_sampler_makes_the_update_take_old_logprobs_from_the_trainer():
    """Rows with engine log-probs from a bfloat16 sampler: without ``sampler_differs`` score_batch
    would keep them as the old policy's; with it, every row is re-scored by the float32 trainer."""
    from tracegym.algos.config import PolicyLossConfig
    from tracegym.batch import make_batch
    from tracegym.train.policy_update import batch_logprobs, score_batch
    from tracegym.types import TrainingExample

    model = lora_model()
    engine = HFEngine(model, sample_dtype="bfloat16")
    gens = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=6, seed=1))
    examples = []
    for prompt, (g,) in zip(PROMPTS, gens):
        tokens = list(prompt) + list(g.token_ids)
        mask = [0] * len(prompt) + [1] * len(g.token_ids)
        examples.append(TrainingExample(input_ids=tokens, loss_mask=mask, weights=[1.0] * len(tokens),
                                        advantages=[1.0] * len(tokens), has_logprobs=True,
                                        logprobs=[0.0] * len(prompt) + list(g.logprobs)))
    batch = make_batch(examples, pad_token_id=0)
    loss = PolicyLossConfig(loss="ppo_clip")
    kept = score_batch(model, None, batch, loss, micro_batch_size=4, temperature=1.0)
    assert kept.old_logprobs is None  # the engine's (bfloat16) log-probs would stand for the old policy
    rescored = score_batch(model, None, batch, loss, micro_batch_size=4, temperature=1.0, sampler_differs=True)
    trainer = batch_logprobs(model, batch, 4, temperature=1.0)
    assert rescored.old_logprobs is not None and torch.allclose(rescored.old_logprobs, trainer)
    on_tokens = batch.loss_mask.bool()
    gap = (batch.engine_logprobs - trainer)[on_tokens].abs().max()
    assert gap > 1e-4  # bfloat16 rounding: the gap the re-scoring keeps out of the PPO ratio


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_state_dict_is_peft_s_merge_and_leaves_the_trainer_bit_identical(dtype):
    """What vLLM loads on ``update_weights`` (without ``enable_lora``): peft's merge, HF-named, in the
    model's dtype, while the trainer's frozen weights stay bit for bit what they were. peft's
    in-place ``merge_adapter`` / ``unmerge_adapter`` pair, which this replaced, rounds them."""
    from tracegym.engines.sampling_copy import merged_state_dict

    model = lora_model().to(dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_state_dict(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    reference = __import__("copy").deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys() and not any("lora_" in k or "base_layer" in k for k in merged)
    for key, value in reference.items():
        assert merged[key].dtype == value.dtype == dtype
        torch.testing.assert_close(merged[key].float(), value.float(), atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])

    # the pair it replaced: merge then unmerge in place does not give the frozen weights back
    with torch.no_grad():
        model.merge_adapter()
        model.unmerge_adapter()
    moved = [k for k, v in model.state_dict().items() if "base_layer" in k and not torch.equal(before[k], v)]
    assert moved, "merge/unmerge in place restored every weight exactly: the premise of this test is gone"


def test_merged_state_dict_of_other_models():
    """A plain model: its state, cloned. Trainable weights outside LoRA (``modules_to_save``): peft's
    own merge on a copy, so the saved module's trained weights are what the engine gets."""
    from peft import LoraConfig, get_peft_model

    from tracegym.engines.sampling_copy import merged_state_dict

    plain = load("tiny-random")[0]
    state = merged_state_dict(plain)
    assert state.keys() == plain.state_dict().keys()
    assert all(torch.equal(state[k], v) and state[k].data_ptr() != v.data_ptr() for k, v in plain.state_dict().items())

    model = get_peft_model(load("tiny-random")[0], LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    merged = merged_state_dict(model)
    reference = __import__("copy").deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], v) for k, v in reference.items())
    torch.testing.assert_close(merged["lm_head.weight"], plain.state_dict()["lm_head.weight"] + 1.0)
