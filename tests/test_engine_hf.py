"""The hf engine on tiny-random: log-probs vs teacher forcing, greedy vs model.generate, stopping,
per-sequence finish, seeding, top-p, weight updates (state dict and LoRA)."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.engines import make_engine
from tracegym.engines.hf import HFEngine, sampling_logprobs
from tracegym.types import SamplingParams
from engine_compare import compare_generations, random_ids

PROMPTS = [[1, 9690, 198, 28120, 905, 2], [1, 4093, 198], [1, 4093, 198, 6004, 28, 1919, 314, 253, 1345, 30, 2, 198]]


@pytest.fixture(scope="module")
def tiny():
    from tracegym.models import load

    model, tokenizer = load("tiny-random")
    return model, tokenizer


def teacher_forced(model, prompt, completion, temperature, top_p):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # position j predicts token j+1
    lp = sampling_logprobs(logits, temperature, top_p)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_equal_a_teacher_forced_forward(tiny, temperature, top_p):
    model, _ = tiny
    engine = HFEngine(model)
    out = engine.generate(PROMPTS, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=12, n=2, seed=5))
    assert [len(g) for g in out] == [2, 2, 2]
    worst = 0.0
    for prompt, gens in zip(PROMPTS, out):
        for g in gens:
            assert len(g.token_ids) == len(g.logprobs) == 12 and g.finish_reason == "length"
            ref = teacher_forced(model, prompt, g.token_ids, temperature, top_p)
            worst = max(worst, (ref - torch.tensor(g.logprobs)).abs().max().item())
    assert worst < 1e-4


def test_greedy_equals_model_generate(tiny):
    model, _ = tiny
    engine = HFEngine(model)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10))
    for prompt, [g] in zip(PROMPTS, out):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                             min_new_tokens=10, eos_token_id=None, pad_token_id=0)
        assert list(g.token_ids) == ref[0, len(prompt):].tolist()
        # greedy log-prob: the argmax under the unscaled softmax
        ref_lp = teacher_forced(model, prompt, g.token_ids, 1.0, 1.0)
        assert torch.allclose(ref_lp, torch.tensor(g.logprobs), atol=1e-4)


def test_stop_token_and_per_sequence_finish(tiny):
    model, _ = tiny
    engine = HFEngine(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    free = engine.generate(PROMPTS, greedy)
    # stop on the 3rd greedy token of prompt 0 (if it does not also occur in the others' first tokens)
    stop = free[0][0].token_ids[2]
    first_hit = [g[0].token_ids.index(stop) if stop in g[0].token_ids else None for g in free]
    out = engine.generate(PROMPTS, greedy.model_copy(update={"stop_token_ids": (stop,)}))
    for hit, [g], [f] in zip(first_hit, out, free):
        if hit is None:
            assert g.finish_reason == "length" and g.token_ids == f.token_ids
        else:
            # the stop token is included, nothing after it; rows that stopped early left the batch
            # without changing the others
            assert g.finish_reason == "stop" and g.token_ids == f.token_ids[: hit + 1]
    assert out[0][0].finish_reason == "stop" and len(out[0][0].token_ids) <= 3
    # engine-level stop ids (the renderer's end-of-turn) act the same way
    out2 = HFEngine(model, stop_token_ids=[stop]).generate(PROMPTS, greedy)
    assert out2 == out


def test_finished_rows_leave_the_batch(tiny):
    model, _ = tiny
    engine = HFEngine(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    first = engine.generate(PROMPTS[:1], greedy)[0][0].token_ids[0]
    engine.forward_calls = 0
    out = engine.generate(PROMPTS, greedy.model_copy(update={"stop_token_ids": (first,)}))
    longest = max(len(g[0].token_ids) for g in out)
    assert engine.forward_calls == longest  # prefill + (longest - 1) decode steps
    assert out[0][0].token_ids == (first,)


def test_seeded_sampling_is_deterministic(tiny):
    model, _ = tiny
    engine = HFEngine(model)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=123, n=3)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    c = engine.generate(PROMPTS, params.model_copy(update={"seed": 124}))
    assert a == b and a != c
    # the n samples of one prompt differ from each other
    assert len({g.token_ids for g in a[0]}) == 3
    # greedy results do not depend on how rows are chunked (sampled ones share one generator per
    # call, so they are reproducible for a fixed max_batch_size); padding changes log-probs only
    # at float rounding level
    g1 = HFEngine(model, max_batch_size=1).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    g8 = HFEngine(model, max_batch_size=8).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    assert [g[0].token_ids for g in g1] == [g[0].token_ids for g in g8]
    for [a1], [a8] in zip(g1, g8):
        assert a1.logprobs == pytest.approx(a8.logprobs, abs=1e-5)


def test_tiny_top_p_is_greedy(tiny):
    model, _ = tiny
    engine = HFEngine(model)
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=6, seed=0))
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    assert [g[0].token_ids for g in sampled] == [g[0].token_ids for g in greedy]
    # only one token in the nucleus: its log-prob under the sampling distribution is 0
    assert all(lp == pytest.approx(0.0, abs=1e-6) for g in sampled for lp in g[0].logprobs)


def test_sampling_logprobs_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    lp = sampling_logprobs(logits, 1.0, 0.7)  # nucleus {0.5, 0.3} (mass before 0.2 is 0.8 >= 0.7)
    assert lp[0, 0].item() == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)
    assert lp[0, 1].item() == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    assert lp[0, 2].item() == float("-inf")
    lp = sampling_logprobs(logits, 2.0, 1.0)  # p^(1/2), renormalised
    z = sum(p**0.5 for p in (0.5, 0.3, 0.2))
    assert lp[0, 2].item() == pytest.approx(math.log(0.2**0.5 / z), abs=1e-6)
    assert torch.allclose(sampling_logprobs(logits, 0.0, 0.1), logits.log_softmax(-1))


def test_stop_strings_edge_cases_and_bad_params(tiny):
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer)
    free = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8))[0][0]
    piece = tokenizer.decode(free.token_ids[3:4])
    if piece.strip():
        cut = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, stop=(piece,)))[0][0]
        assert cut.finish_reason == "stop" and piece in cut.text and len(cut.token_ids) <= 4
    assert engine.generate(PROMPTS[:1], SamplingParams(max_tokens=0))[0][0].token_ids == ()
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(PROMPTS, SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="tokenizer"):
        HFEngine(model).generate(PROMPTS, SamplingParams(stop=("x",), max_tokens=2))


def test_update_weights_with_a_state_dict():
    from tracegym.models import load

    model, _ = load("tiny-random")
    trainer_model, _ = load("tiny-random")
    engine = HFEngine(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = engine.generate(PROMPTS, greedy)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.update_weights(trainer_model.state_dict())
    after = engine.generate(PROMPTS, greedy)
    assert after != before
    assert engine.model is model  # copied in place, not swapped
    assert after == HFEngine(trainer_model).generate(PROMPTS, greedy)
    with pytest.raises(KeyError, match="no parameter"):
        engine.update_weights({"not.a.weight": torch.zeros(1)})
    with pytest.raises(TypeError):
        engine.update_weights([1, 2])


def test_update_weights_with_a_lora_model():
    from peft import LoraConfig, get_peft_model

    from tracegym.models import load

    model, _ = load("tiny-random")
    engine = HFEngine(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    before = engine.generate(PROMPTS, greedy)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
    peft_model.train()
    engine.update_weights(peft_model)
    # a fresh adapter has B = 0: same outputs; the engine must not leave train mode changed
    assert engine.generate(PROMPTS, greedy) == before and peft_model.training
    # a "training step" on the adapter only: the engine sees it through the shared reference
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)
    after = engine.generate(PROMPTS, greedy)
    assert after != before
    with pytest.raises(ValueError, match="LoRA"):
        engine.update_weights(peft_model.state_dict())


def test_make_engine():
    engine = make_engine("hf", model="tiny-random")
    assert isinstance(engine, HFEngine) and engine.tokenizer is not None
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tgi", model="tiny-random")
    with pytest.raises(ValueError, match="model="):
        make_engine("hf", model=None)


def test_vllm_missing_gives_the_install_hint():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ImportError, match=r"pip install tracegym\[gpu\]"):
        make_engine("vllm", model="smollm2-135m")


# -- shared-prefix caching -------------------------------------------------------------------------
SHARED = random_ids(40, 0)  # a "system prompt + tool schemas" shared by every prompt below
# suffixes start with distinct tokens, so the common prefix is exactly SHARED; the first prompt is
# SHARED + 1 token (the cap min_len - 1 = 40 equals the common prefix)
SUFFIXES = [[7], [11, *random_ids(2, 1)], [13, *random_ids(6, 2)], [17, *random_ids(11, 3)]]
SHARED_PROMPTS = [SHARED + s for s in SUFFIXES]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, n=3, seed=11),
        SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=2),
    ],
)
def test_prefix_cache_equals_the_plain_path(tiny, params):
    model, _ = tiny
    cached, plain = HFEngine(model), HFEngine(model, prefix_cache=False)
    out = cached.generate(SHARED_PROMPTS, params)
    ref = plain.generate(SHARED_PROMPTS, params)
    assert compare_generations(out, ref) < 1e-4
    total = params.n * sum(len(p) for p in SHARED_PROMPTS)
    computed = 40 + sum(len(s) for s in SUFFIXES)  # the prefix once, each distinct suffix once
    assert plain.prefill_tokens == total and plain.prefix_tokens_reused == 0
    assert cached.prefill_tokens == computed and cached.prefix_tokens_reused == total - computed
    assert cached.forward_calls == plain.forward_calls + 1  # one extra pass: the shared prefix
    # and both equal a teacher-forced forward of each unpadded sequence
    for prompt, gens in zip(SHARED_PROMPTS, out):
        for g in gens:
            ref_lp = teacher_forced(model, prompt, g.token_ids, params.temperature, params.top_p)
            assert torch.allclose(ref_lp, torch.tensor(g.logprobs), atol=1e-4)


def test_prefix_cache_across_chunks_and_stops(tiny):
    model, _ = tiny
    greedy = SamplingParams(temperature=0.0, max_tokens=9, n=2)
    ref = HFEngine(model, prefix_cache=False).generate(SHARED_PROMPTS, greedy)
    # stop on a token some rows produce, so rows leave the batch mid-way
    stop = ref[2][0].token_ids[3]
    params = greedy.model_copy(update={"stop_token_ids": (stop,)})
    ref = HFEngine(model, prefix_cache=False).generate(SHARED_PROMPTS, params)
    assert any(g.finish_reason == "stop" for gens in ref for g in gens)
    for batch in (1, 3, 5, 8):
        engine = HFEngine(model, max_batch_size=batch, turn_cache_mb=0)
        assert compare_generations(engine.generate(SHARED_PROMPTS, params), ref) < 1e-4
        # batch 1: nothing to share within a chunk; otherwise each chunk reuses its prefix and repeats
        assert (engine.prefix_tokens_reused == 0) == (batch == 1)
        # with the turn store, a later chunk also takes SHARED from an earlier chunk's finished rows
        stored = HFEngine(model, max_batch_size=batch)
        assert compare_generations(stored.generate(SHARED_PROMPTS, params), ref) < 1e-4
        assert (stored.turn_tokens_reused > 0) == (batch < 8)  # 8 rows: one chunk at batch 8
        assert stored.prefix_tokens_reused >= engine.prefix_tokens_reused
    whole = HFEngine(model, max_batch_size=8)
    whole.generate(SHARED_PROMPTS, params)
    assert whole.prefill_tokens == 40 + sum(len(s) for s in SUFFIXES)


def test_a_prompt_that_is_a_prefix_of_another(tiny):
    model, _ = tiny
    short = SHARED[:30]
    prompts = [short, SHARED + [5, 6], SHARED]  # common prefix 30 = len(short): capped to 29
    params = SamplingParams(temperature=0.0, max_tokens=6)
    engine = HFEngine(model)
    out = engine.generate(prompts, params)
    assert compare_generations(out, HFEngine(model, prefix_cache=False).generate(prompts, params)) < 1e-4
    assert engine.prefill_tokens == 29 + (1 + 13 + 11)
    assert engine._shared_prefix_len(prompts, _dynamic_cache()) == 29


def test_identical_prompts_are_prefilled_once(tiny):
    model, _ = tiny
    prompt = PROMPTS[2]  # 12 tokens, below the shared-prefix threshold: only deduplication helps
    params = SamplingParams(temperature=0.8, max_tokens=7, n=4, seed=3)
    engine = HFEngine(model)
    out = engine.generate([prompt, prompt], params)
    ref = HFEngine(model, prefix_cache=False).generate([prompt, prompt], params)
    assert compare_generations(out, ref) < 1e-4
    assert engine.prefill_tokens == 12 and engine.prefix_tokens_reused == 7 * 12
    assert len({g.token_ids for gens in out for g in gens}) > 1  # the copies still sample apart
    # whole-prompt repeats and a shared prefix together: 2 distinct prompts x 3 samples
    engine = HFEngine(model)
    params = SamplingParams(temperature=0.0, max_tokens=5, n=3)
    out = engine.generate(SHARED_PROMPTS[1:3], params)
    assert compare_generations(out, HFEngine(model, prefix_cache=False).generate(SHARED_PROMPTS[1:3], params)) < 1e-4
    assert engine.prefill_tokens == 40 + 3 + 7


def _dynamic_cache(config=None):
    from transformers import DynamicCache

    return DynamicCache(config=config)


def test_shared_prefix_threshold_and_unsafe_caches(tiny):
    model, _ = tiny
    engine = HFEngine(model)
    assert engine._shared_prefix_len(SHARED_PROMPTS, _dynamic_cache(model.config)) == 40
    assert engine._shared_prefix_len(SHARED_PROMPTS[:1], _dynamic_cache()) == 0  # one prompt: nothing to share
    assert HFEngine(model, min_shared_prefix=41)._shared_prefix_len(SHARED_PROMPTS, _dynamic_cache()) == 0
    # short common prefixes are not worth a separate pass: same calls as the plain path
    engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.prefix_tokens_reused == 0 and engine.forward_calls == 2
    # sliding-window layers would see the hole between prefix and suffix differently: no split
    from transformers import MistralConfig

    sliding = MistralConfig(num_hidden_layers=2, sliding_window=8)
    assert engine._shared_prefix_len(SHARED_PROMPTS, _dynamic_cache(sliding)) == 0
    with pytest.raises(ValueError, match="min_shared_prefix"):
        HFEngine(model, min_shared_prefix=0)


# --- the previous-turn store: an episode's next turn prefills only its new tokens -------------------


def _next_turns(prompts, outs, observation=(198, 4093, 198)):
    """Each prompt + its completion + an env answer: what an episode's next prompt looks like."""
    return [list(p) + list(g.token_ids) + list(observation) for p, gens in zip(prompts, outs) for g in gens]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=6),
                                    SamplingParams(temperature=1.0, max_tokens=6, seed=4)])
def test_a_next_turn_reuses_the_previous_turns_keys_exactly(tiny, params):
    model, _ = tiny
    engine, plain = HFEngine(model), HFEngine(model, prefix_cache=False)
    first = engine.generate(PROMPTS, params)
    assert compare_generations(first, plain.generate(PROMPTS, params)) < 1e-4
    kept = sum(len(p) + len(g.token_ids) - 1 for p, gens in zip(PROMPTS, first) for g in gens)
    assert sorted(len(k) for _, k in engine._turns) == sorted(len(p) + len(g[0].token_ids) - 1 for p, g in zip(PROMPTS, first))
    second = _next_turns(PROMPTS, first)
    before = engine.prefill_tokens
    out = engine.generate(second, params)
    assert compare_generations(out, plain.generate(second, params)) < 1e-4  # same tokens, log-probs within 1e-4
    assert engine.turn_tokens_reused == kept
    assert engine.prefill_tokens - before == sum(len(p) for p in second) - kept  # only the new tokens
    for prompt, gens in zip(second, out):  # and a teacher-forced forward of each whole sequence agrees
        ref_lp = teacher_forced(model, prompt, gens[0].token_ids, params.temperature, params.top_p)
        assert torch.allclose(ref_lp, torch.tensor(gens[0].logprobs), atol=1e-4)
    # a third turn reuses the second's keys (each entry is taken out when used, the new one kept)
    third = _next_turns(second, out)
    assert compare_generations(engine.generate(third, params), plain.generate(third, params)) < 1e-4
    assert engine.turn_tokens_reused == kept + sum(len(p) + len(g[0].token_ids) - 1 for p, g in zip(second, out))


def test_the_turn_store_is_bounded_dropped_on_new_weights_and_misses_other_prompts(tiny):
    model, _ = tiny
    params = SamplingParams(temperature=0.0, max_tokens=4)
    engine = HFEngine(model)
    first = engine.generate(PROMPTS, params)
    assert len(engine._turns) == 3 and engine._turn_bytes == sum(e.nbytes for e in engine._turns.values())
    # a prompt that does not extend a kept turn (its first token differs) reuses nothing
    engine.generate([[7] + p[1:] for p in _next_turns(PROMPTS, first)], params)
    assert engine.turn_tokens_reused == 0
    # new weights: every kept turn is dropped
    engine.update_weights(model)
    assert not engine._turns and engine._turn_bytes == 0
    engine.generate(_next_turns(PROMPTS, first), params)
    assert engine.turn_tokens_reused == 0
    # a bound of the largest entry cannot hold all three: the oldest go first (LRU); 0 is off
    sizes = {len(k): e.nbytes for k, e in engine._turns.items()}
    bound = max(sizes.values())
    small = HFEngine(model, turn_cache_mb=bound / 2**20)
    small.generate(PROMPTS, params)
    assert 1 <= len(small._turns) < 3 and small._turn_bytes <= bound
    assert small._turn_bytes == sum(e.nbytes for e in small._turns.values())
    off = HFEngine(model, turn_cache_mb=0)
    off.generate(PROMPTS, params)
    assert not off._turns


def test_a_prompt_sharing_part_of_a_kept_turn_takes_that_part(tiny):
    # a tree branch forking at an earlier turn, or another episode's system prompt: the prompt
    # shares the first 40 tokens (SHARED) of a kept entry, then goes its own way
    model, _ = tiny
    params = SamplingParams(temperature=0.0, max_tokens=5)
    engine, plain = HFEngine(model), HFEngine(model, prefix_cache=False)
    engine.generate([SHARED_PROMPTS[3]], params)
    (kept,) = list(engine._turns)
    branch = SHARED + [19, *random_ids(5, 4)]
    out = engine.generate([branch], params)
    assert compare_generations(out, plain.generate([branch], params)) < 1e-4
    assert engine.turn_tokens_reused == 40 and engine.prefill_tokens == len(SHARED_PROMPTS[3]) + len(branch) - 40
    assert kept in engine._turns  # only a part was used: the entry stays for its own episode
    # under min_shared_prefix common tokens, nothing is taken
    short = SHARED[:10] + [23, *random_ids(20, 5)]
    engine.generate([short], params)
    assert engine.turn_tokens_reused == 40


def test_inverse_cdf_sampling_draws_each_token_with_its_probability():
    from tracegym.engines.sampling import sample_tokens

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.25, 0.0, 0.0, 0.0, 0.0, 0.75]])
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    draws = sample_tokens(probs.repeat(n, 1), torch.rand(2 * n, generator=gen, dtype=torch.float64))
    for row in range(2):
        counts = torch.bincount(draws[row::2], minlength=6).double() / n
        assert torch.allclose(counts, probs[row].double(), atol=0.01), counts
        assert counts[probs[row] == 0].sum() == 0  # a zero-probability token is never drawn
    # the edges: u = 0 takes the first token with probability, u just below 1 the last one
    edges = sample_tokens(probs, torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert edges.tolist() == [1, 5]
    assert sample_tokens(probs * 7.0, torch.tensor([0.55, 0.1], dtype=torch.float64)).tolist() == [3, 0]  # unnormalised
