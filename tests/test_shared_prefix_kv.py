"""The hf engine keeps a chunk's shared prompt prefix KV once (batch 1), not once per row: the
attention function equals sdpa over the concatenated keys, generation equals the plain path
(``prefix_cache=False``: same tokens, log-probs within 1e-4) over chunks, repeats and turns, and
the batch cache and the turn store hold the prefix once."""

from __future__ import annotations

import pytest
import torch

from tracegym.engines.hf import HFEngine
from tracegym.engines.shared_prefix import ATTENTION_NAME, SharedPrefix, shared_prefix_attention_forward
from tracegym.types import SamplingParams
from engine_compare import compare_generations, random_ids


SYSTEM = random_ids(48, 0)  # the "system prompt + tool schemas" every prompt starts with
# distinct first tokens, so the rows share exactly SYSTEM; lengths 1..19 so chunks pad differently
PROMPTS = [SYSTEM + [10 + i, *random_ids(n, i + 1)] for i, n in enumerate((0, 3, 18, 7, 11, 1, 5, 14))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, n=2, seed=5)


def _next_turns(prompts, outs, observation=(198, 4093, 198)):
    """Each prompt + its completion + an env answer: what an episode's next prompt looks like."""
    return [list(p) + list(g.token_ids) + list(observation) for p, gens in zip(prompts, outs) for g in gens]


def _spy(engine: HFEngine) -> list[dict]:
    """Record, after every forward pass, the rows, query length, shared prefix and the KV bytes held
    (batch cache + prefix) and the model's attention implementation during the pass."""
    calls: list[dict] = []
    forward = engine._forward

    def spying(names=None, prefix=None, **kw):
        implementation = []
        config = engine.model.config

        def hook(*_):
            implementation.append(config._attn_implementation)

        handle = engine.model.model.layers[0].register_forward_pre_hook(hook)
        try:
            logits = forward(names, prefix, **kw)
        finally:
            handle.remove()
        layers = kw["cache"].layers
        calls.append({
            "rows": kw["input_ids"].shape[0],
            "q": kw["input_ids"].shape[1],
            "prefix": prefix,
            "own": layers[0].keys.shape[2],
            "cache_bytes": sum(layer.keys.nbytes + layer.values.nbytes for layer in layers),
            "prefix_bytes": 0 if prefix is None else prefix.storage_nbytes,
            "implementation": implementation[0],
        })
        return logits

    engine._forward = spying
    return calls


# -- the attention function alone --------------------------------------------------------------
class _Attention(torch.nn.Module):
    """What the attention function reads from a transformers attention module."""

    layer_idx = 0
    num_key_value_groups = 3
    is_causal = True
    training = False


@pytest.mark.parametrize("q_len,masked", [(1, True), (5, True), (1, False), (9, False)])
def test_attention_equals_sdpa_over_the_concatenated_keys(q_len, masked):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, prefix_len, own_len = 3, 6, 2, 8, 7, 9
    query = torch.randn(batch, heads, q_len, dim, generator=gen)
    key, value = (torch.randn(batch, kv_heads, own_len, dim, generator=gen) for _ in range(2))
    prefix = SharedPrefix(tuple(range(prefix_len)), (torch.randn(kv_heads, prefix_len, dim, generator=gen),),
                          (torch.randn(kv_heads, prefix_len, dim, generator=gen),))
    module = _Attention()
    if masked:  # row 1 left-padded, row 2 with a hole (a kept turn's padding), causal over the own part
        keep = torch.ones(batch, own_len, dtype=torch.bool)
        keep[1, :3] = False
        keep[2, 2:4] = False
        causal = torch.ones(q_len, own_len, dtype=torch.bool).tril(own_len - q_len)
        mask = keep[:, None, None, :] & causal[None, None]  # [B, 1, q, S]
        full_mask = torch.cat([torch.ones(batch, 1, q_len, prefix_len, dtype=torch.bool), mask], dim=-1)
    else:  # what transformers passes with no padding: None (causal when q == S, everything when q == 1)
        mask = None
        own = torch.ones(q_len, own_len, dtype=torch.bool).tril(own_len - q_len)
        full_mask = torch.cat([torch.ones(q_len, prefix_len, dtype=torch.bool), own], dim=-1)[None, None]
    out, _ = shared_prefix_attention_forward(module, query, key, value, mask, scaling=0.3, shared_prefix_kv=prefix)
    full_keys = torch.cat([prefix.keys[0][None].expand(batch, -1, -1, -1), key], dim=2)
    full_values = torch.cat([prefix.values[0][None].expand(batch, -1, -1, -1), value], dim=2)
    ref, _ = sdpa_attention_forward(module, query, full_keys, full_values, full_mask, scaling=0.3)
    assert out.shape == ref.shape == (batch, q_len, heads, dim)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # without a prefix it is sdpa itself
    plain, _ = shared_prefix_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert torch.equal(plain, sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)[0])


# -- generation equals the plain path --------------------------------------------------------------
@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
@pytest.mark.parametrize("batch", [3, 16])
def test_generation_equals_the_plain_path(tiny_model, params, batch):
    model, _ = tiny_model
    plain = HFEngine(model, max_batch_size=batch, prefix_cache=False).generate(PROMPTS, params)
    for turn_cache_mb in (0, 1024):  # later chunks take SYSTEM from the turn store when it is on
        engine = HFEngine(model, max_batch_size=batch, turn_cache_mb=turn_cache_mb)
        calls = _spy(engine)
        assert compare_generations(engine.generate(PROMPTS, params), plain) < 1e-4
        shared = [c for c in calls if c["prefix"] is not None]
        assert shared and all(len(c["prefix"]) == len(SYSTEM) for c in shared)
        assert all(c["implementation"] == ATTENTION_NAME for c in shared)
        assert all(c["implementation"] == "sdpa" for c in calls if c["prefix"] is None)
        assert model.config._attn_implementation == "sdpa"  # switched only during the passes
        copied = HFEngine(model, max_batch_size=batch, turn_cache_mb=turn_cache_mb, share_prefix_kv=False)
        copied_calls = _spy(copied)
        assert compare_generations(copied.generate(PROMPTS, params), plain) < 1e-4
        assert all(c["prefix"] is None for c in copied_calls)
        assert engine.prefill_tokens == copied.prefill_tokens  # the same tokens computed, only stored once


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=6, n=4),
                                    SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=2)])
def test_repeated_prompts_share_all_but_their_last_token(tiny_model, params):
    model, _ = tiny_model
    for prompts in ([PROMPTS[2]], [PROMPTS[2], PROMPTS[4]]):
        engine = HFEngine(model)
        calls = _spy(engine)
        out = engine.generate(prompts, params)
        assert compare_generations(out, HFEngine(model, prefix_cache=False).generate(prompts, params)) < 1e-4
        expected = len(prompts[0]) - 1 if len(prompts) == 1 else len(SYSTEM)
        # a batch-1 pass computes the prefix, then the rows attend to it
        assert calls[0]["prefix"] is None and calls[0]["rows"] == 1 and calls[0]["q"] == expected
        assert len(calls[1]["prefix"]) == expected
        assert engine.prefill_tokens == expected + sum(len(p) - expected for p in prompts)
    if params.temperature > 0:
        assert len({g.token_ids for g in out[0]}) > 1  # the copies still sample apart


def test_the_batch_cache_holds_the_prefix_once(tiny_model):
    model, _ = tiny_model
    params = SamplingParams(temperature=0.0, max_tokens=6)
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    per_token = layers * 2 * kv_heads * (model.config.hidden_size // model.config.num_attention_heads) * 4
    held = {}
    for share in (True, False):
        engine = HFEngine(model, max_batch_size=8, turn_cache_mb=0, share_prefix_kv=share)
        calls = _spy(engine)
        engine.generate(PROMPTS, params)
        decode = [c for c in calls if c["q"] == 1]
        assert decode
        for c in decode:
            assert c["cache_bytes"] == per_token * c["rows"] * c["own"]
        first = decode[0]
        if share:  # the rows' own tokens only, plus one copy of the prefix
            assert first["own"] == max(len(p) for p in PROMPTS) - len(SYSTEM) + 1
            assert first["prefix_bytes"] == per_token * len(SYSTEM)
        else:  # [prefix | pad | suffix] in every row
            assert first["own"] == max(len(p) for p in PROMPTS) + 1 and first["prefix_bytes"] == 0
        held[share] = first["cache_bytes"] + first["prefix_bytes"]
    assert held[True] == per_token * (len(SYSTEM) + 8 * (max(len(p) for p in PROMPTS) - len(SYSTEM) + 1))
    assert held[False] == per_token * 8 * (max(len(p) for p in PROMPTS) + 1)


# -- the turn store --------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=6),
                                    SamplingParams(temperature=1.0, max_tokens=6, seed=4)])
def test_later_turns_keep_the_prefix_shared(tiny_model, params):
    model, _ = tiny_model
    engine, plain = HFEngine(model), HFEngine(model, prefix_cache=False)
    calls = _spy(engine)
    first = engine.generate(PROMPTS, params)
    assert compare_generations(first, plain.generate(PROMPTS, params)) < 1e-4
    prefix = calls[1]["prefix"]  # calls[0]: the batch-1 pass that computes it
    entries = list(engine._turns.values())
    assert len(entries) == len(PROMPTS) and all(e.prefix is prefix for e in entries)
    # the store counts the prefix once and each entry's own tokens
    assert engine._turn_bytes == sum(e.nbytes for e in entries) + prefix.storage_nbytes
    assert all(e.keys[0].shape[1] == len(e.tokens) - len(SYSTEM) for e in entries)

    second = _next_turns(PROMPTS, first)
    kept = sum(len(e.tokens) for e in entries)
    calls.clear()
    out = engine.generate(second, params)
    assert compare_generations(out, plain.generate(second, params)) < 1e-4
    assert engine.turn_tokens_reused == kept  # every row extends its own previous turn
    assert calls[0]["prefix"] is prefix and calls[0]["own"] == max(len(p) for p in second) - len(SYSTEM)
    # the third turn, with one fresh episode among them: SYSTEM still comes from the same memory
    third = _next_turns(second, out) + [SYSTEM + [4999, 7, 8]]
    calls.clear()
    assert compare_generations(engine.generate(third, params), plain.generate(third, params)) < 1e-4
    assert calls[0]["prefix"].storage_id == prefix.storage_id
    assert engine._turn_bytes == sum(e.nbytes for e in engine._turns.values()) + prefix.storage_nbytes

    # one row alone (the third turn's first prompt again: a part of its kept entry) copies that part,
    # prefix included, into its cache row: the plain layout
    calls.clear()
    before = engine.turn_tokens_reused
    alone = engine.generate(third[:1], params)
    assert compare_generations(alone, plain.generate(third[:1], params)) < 1e-4
    assert calls[0]["prefix"] is None and engine.turn_tokens_reused - before == len(third[0]) - 1
    fourth = _next_turns(third[:1], alone)
    assert compare_generations(engine.generate(fourth, params), plain.generate(fourth, params)) < 1e-4


def test_a_longer_common_start_than_the_kept_prefix(tiny_model):
    # two samples of one prompt continue: their common start (SYSTEM + the question + more) runs
    # past the kept prefix (SYSTEM), so the new prefix copies it and the kept tokens after it once
    model, _ = tiny_model
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=9)
    engine, plain = HFEngine(model), HFEngine(model, prefix_cache=False)
    first = engine.generate(PROMPTS[:3], params)
    assert compare_generations(first, plain.generate(PROMPTS[:3], params)) < 1e-4
    follow = _next_turns(PROMPTS[2:3], first[2:3])
    assert follow[0] != follow[1]
    calls = _spy(engine)
    reused, computed = engine.turn_tokens_reused, engine.prefill_tokens
    out = engine.generate(follow, SamplingParams(temperature=0.0, max_tokens=6))
    assert compare_generations(out, plain.generate(follow, SamplingParams(temperature=0.0, max_tokens=6))) < 1e-4
    common = len(PROMPTS[2])
    while follow[0][common] == follow[1][common]:
        common += 1
    assert len(calls[0]["prefix"]) == common > len(SYSTEM)
    # only each row's last sampled token and the env answer are computed
    assert engine.prefill_tokens - computed == 2 * 4
    assert engine.turn_tokens_reused - reused == sum(len(p) for p in follow) - 2 * 4


def _spy_peft(engine: HFEngine) -> list:
    """The prefix of every forward pass (a peft model's layers sit deeper than ``_spy`` looks)."""
    prefixes: list = []
    forward = engine._forward

    def spying(names=None, prefix=None, **kw):
        prefixes.append(prefix)
        return forward(names, prefix, **kw)

    engine._forward = spying
    return prefixes


def test_lora_model_shares_the_prefix_too():
    from tracegym.config import LoraConfig
    from tracegym.models import load
    from tracegym.train.lora import prepare_model

    model, _ = load("tiny-random")
    torch.manual_seed(0)  # lora_A is drawn from the global generator: the same weights whatever ran before
    model = prepare_model(model, LoraConfig(r=4)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    engine = HFEngine(model, max_batch_size=4)
    calls = _spy_peft(engine)
    out = engine.generate(PROMPTS, SAMPLED)
    assert compare_generations(out, HFEngine(model, max_batch_size=4, prefix_cache=False).generate(PROMPTS, SAMPLED)) < 1e-4
    assert any(prefix is not None for prefix in calls)
