"""Preallocated KV buffers (``tracegym.engines.kv_buffers``): the layer alone gives exactly what
transformers' ``DynamicLayer`` gives, generation with buffers equals generation without (same tokens,
log-probs within 1e-5) on every prefill path, and decode writes in place, never reallocating."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from tracegym.engines.hf import HFEngine
from tracegym.engines.kv_buffers import KVBufferCache, KVBufferLayer
from tracegym.types import SamplingParams
from engine_compare import compare_generations, random_ids


def _kv(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values [rows, 2, length, 4] (values with another head size, as some models)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, length, 4, generator=gen), torch.randn(rows, 2, length, 3, generator=gen)


# -- the layer alone -------------------------------------------------------------------------------
@pytest.mark.parametrize("reserve", [0, 9, 40])
def test_the_layer_equals_a_dynamic_layer(reserve):
    # the engine's sequence of calls: prefill, repeated-index copy, decode, rows leaving, plus repeat,
    # reorder and crop; reserve 0 and 9 make the updates outgrow the buffers
    ours, ref = KVBufferLayer(), DynamicLayer()
    ours.reserve(reserve)
    ops = [
        ("update", _kv(3, 5, 0)),
        ("select", torch.tensor([0, 0, 1, 2, 2])),  # identical prompts to their rows
        ("update", _kv(5, 1, 1)),
        ("update", _kv(5, 1, 2)),
        ("select", torch.tensor([0, 2, 3])),  # rows 1 and 4 finished
        ("update", _kv(3, 1, 3)),
        ("select", torch.tensor([1, 2])),
        ("update", _kv(2, 1, 4)),
        ("repeat", 3),
        ("update", _kv(6, 2, 5)),
        ("reorder", torch.tensor([5, 0, 3, 1, 2, 4])),
        ("crop", -2),
        ("update", _kv(6, 1, 6)),
        ("select", torch.tensor([1, 4, 5])),
        ("update", _kv(3, 1, 7)),
    ]
    for op, arg in ops:
        if op == "update":
            got, want = ours.update(*arg), ref.update(*arg)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
            assert got[0].data_ptr() == ours.keys.data_ptr()  # the views are what update returns
        elif op == "select":
            ours.batch_select_indices(arg), ref.batch_select_indices(arg)
        elif op == "repeat":
            ours.batch_repeat_interleave(arg), ref.batch_repeat_interleave(arg)
        elif op == "reorder":
            ours.reorder_cache(arg), ref.reorder_cache(arg)
        else:
            ours.crop(arg), ref.crop(arg)
        assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
        assert ours.get_seq_length() == ref.get_seq_length()
        assert ours.get_mask_sizes(1) == ref.get_mask_sizes(1)
        # views of the buffers: same memory, the buffer's strides
        assert ours.keys.untyped_storage().data_ptr() == ours._key_buffer.untyped_storage().data_ptr()
        assert ours.keys.stride() == ours._key_buffer.stride()
    ours.reset()
    assert ours.get_seq_length() == 0 and ours.capacity == 0 and ours.keys is None


def test_reserved_decode_writes_in_place_and_overflow_grows_geometrically():
    layer = KVBufferLayer()
    layer.reserve(8)
    layer.update(*_kv(4, 5, 0))
    key_ptr, value_ptr = layer._key_buffer.data_ptr(), layer._value_buffer.data_ptr()
    for step in range(3):  # up to the reservation: no allocation
        layer.update(*_kv(4, 1, step + 1))
        assert (layer._key_buffer.data_ptr(), layer._value_buffer.data_ptr()) == (key_ptr, value_ptr)
    layer.batch_select_indices(torch.tensor([1, 3]))  # rows leaving: compacted in place
    assert layer._key_buffer.data_ptr() == key_ptr and layer.keys.shape == (2, 2, 8, 4)
    before = layer.keys.clone()
    layer.update(*_kv(2, 1, 9))  # past the reservation: doubled, the filled part moved
    assert layer.capacity == 16 and layer._key_buffer.data_ptr() != key_ptr
    assert torch.equal(layer.keys[:, :, :8], before)
    layer.reserve(40)  # a larger reservation grows held buffers now
    assert layer.capacity == 40 and torch.equal(layer.keys[:, :, :8], before)
    with pytest.raises(ValueError, match="rows"):  # one row must not broadcast over two
        layer.update(*_kv(1, 1, 10))


def test_the_cache_swaps_plain_layers_only():
    from transformers import LlamaConfig, MistralConfig

    cache = KVBufferCache(LlamaConfig(num_hidden_layers=3), headroom=7)
    assert [type(layer) for layer in cache.layers] == [KVBufferLayer] * 3
    cache.reserve(5)
    cache.update(*_kv(2, 4, 0), 0)
    assert cache.layers[0].capacity == 12 and cache.get_seq_length() == 4
    sliding = KVBufferCache(MistralConfig(num_hidden_layers=2, sliding_window=8))
    assert not any(isinstance(layer, KVBufferLayer) for layer in sliding.layers)
    lazy = KVBufferCache(headroom=3)  # no config: layers made on first use get the reservation too
    lazy.reserve(10)
    lazy.update(*_kv(2, 4, 0), 1)
    assert [type(layer) for layer in lazy.layers] == [KVBufferLayer] * 2 and lazy.layers[1].capacity == 13


# -- generation equals DynamicCache's --------------------------------------------------------------
SYSTEM = random_ids(40, 0)  # a common "system prompt": the shared-prefix paths run
SHARED_PROMPTS = [SYSTEM + [10 + i, *random_ids(n, i + 1)] for i, n in enumerate((0, 3, 18, 7, 11, 1))]
PLAIN_PROMPTS = [random_ids(n, 20 + n) for n in (3, 12, 7, 25, 1, 9)]  # nothing shared, lengths differ
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, n=2, seed=5)


def _engines(model, **kw) -> tuple[HFEngine, HFEngine]:
    return HFEngine(model, preallocate_kv=True, **kw), HFEngine(model, preallocate_kv=False, **kw)


def _stopping(params: SamplingParams, out) -> SamplingParams:
    """``params`` with a stop token some rows sample early: rows leave the batch mid-decode."""
    return params.model_copy(update={"stop_token_ids": (out[0][0].token_ids[2],)})


@pytest.mark.parametrize("params", [GREEDY, SAMPLED])
@pytest.mark.parametrize("prompts", [SHARED_PROMPTS, PLAIN_PROMPTS], ids=["shared", "plain"])
@pytest.mark.parametrize("options", [{}, {"share_prefix_kv": False}, {"prefix_cache": False}],
                         ids=["default", "copied-prefix", "no-prefix-cache"])
def test_generation_equals_the_dynamic_cache(tiny_model, params, prompts, options):
    model, _ = tiny_model
    for batch in (3, 16):  # several chunks of different prompt lengths, and one
        ours, ref = _engines(model, max_batch_size=batch, turn_cache_mb=0, **options)
        first = ref.generate(prompts, params)
        assert compare_generations(ours.generate(prompts, params), first) < 1e-5
        stop = _stopping(params, first)
        out = ref.generate(prompts, stop)
        assert any(g.finish_reason == "stop" for gens in out for g in gens)
        assert compare_generations(ours.generate(prompts, stop), out) < 1e-5
        assert ours.prefill_tokens == ref.prefill_tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=6, n=4),
                                    SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=2)])
def test_identical_prompts(tiny_model, params):
    model, _ = tiny_model
    for prompts in ([SHARED_PROMPTS[2]], [SHARED_PROMPTS[2], SHARED_PROMPTS[4]], [PLAIN_PROMPTS[1]] * 2):
        ours, ref = _engines(model)
        assert compare_generations(ours.generate(prompts, params), ref.generate(prompts, params)) < 1e-5


def _next_turns(prompts, outs, observation=(198, 4093, 198)):
    """Each prompt + its completion + an env answer: what an episode's next prompt looks like."""
    return [list(p) + list(g.token_ids) + list(observation) for p, gens in zip(prompts, outs) for g in gens]


@pytest.mark.parametrize("share_prefix_kv", [True, False])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, max_tokens=6, seed=4)])
def test_turns_through_the_turn_store(tiny_model, share_prefix_kv, params):
    model, _ = tiny_model
    ours, ref = _engines(model, max_batch_size=4, share_prefix_kv=share_prefix_kv)
    prompts = SHARED_PROMPTS + PLAIN_PROMPTS[:2]
    for _turn in range(3):
        out = ref.generate(prompts, params)
        assert compare_generations(ours.generate(prompts, params), out) < 1e-5
        assert ours.turn_tokens_reused == ref.turn_tokens_reused and ours.prefill_tokens == ref.prefill_tokens
        # kept turns are copies of their rows, not views keeping a chunk's buffers alive
        for entry in ours._turns.values():
            assert all(k.untyped_storage().nbytes() == k.nbytes for k in (*entry.keys, *entry.values))
        prompts = _next_turns(prompts, out)
    assert ours.turn_tokens_reused > 0


def test_lora_model():
    from tracegym.config import LoraConfig
    from tracegym.models import load
    from tracegym.train.lora import prepare_model

    model, _ = load("tiny-random")
    model = prepare_model(model, LoraConfig(r=4)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    ours, ref = _engines(model, max_batch_size=4)
    assert compare_generations(ours.generate(SHARED_PROMPTS, SAMPLED), ref.generate(SHARED_PROMPTS, SAMPLED)) < 1e-5
    follow = _next_turns(SHARED_PROMPTS[:2], ref.generate(SHARED_PROMPTS[:2], GREEDY))
    ours.generate(SHARED_PROMPTS[:2], GREEDY)
    assert compare_generations(ours.generate(follow, GREEDY), ref.generate(follow, GREEDY)) < 1e-5


def test_mixed_adapters():
    from tracegym.config import LoraConfig
    from tracegym.models import load
    from tracegym.train.adapter_pool import AdapterPool

    torch.manual_seed(0)
    base, _ = load("tiny-random")
    pool = AdapterPool(base, {"planner": LoraConfig(r=4, alpha=8), "solver": LoraConfig(r=4, alpha=8)})
    with torch.no_grad():
        for i, name in enumerate(pool.names):
            gen = torch.Generator().manual_seed(100 + i)
            for key, p in pool.parameters(name).items():
                if "lora_B" in key:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    prompts = SHARED_PROMPTS[:4] + PLAIN_PROMPTS[:2]
    names = ["planner", "solver", "__base__", "planner", "solver", "planner"]
    ours, ref = _engines(pool.model, max_batch_size=4)
    for params in (GREEDY, SAMPLED):
        out = ref.generate(prompts, params, adapters=names)
        assert compare_generations(ours.generate(prompts, params, adapters=names), out) < 1e-5


# -- decode never reallocates ----------------------------------------------------------------------
def test_decode_writes_into_the_buffers_reserved_at_prefill(tiny_model):
    model, _ = tiny_model
    params = SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=3)
    first = HFEngine(model, max_batch_size=5).generate(SHARED_PROMPTS, params)
    params = _stopping(params, first)  # rows leave mid-decode: compacted in place
    for options in ({}, {"share_prefix_kv": False}, {"prefix_cache": False}):
        engine = HFEngine(model, max_batch_size=5, **options)
        chunks: list[dict] = []  # per chunk: its cache, state after prefill, each decode step's state
        prefill, forward = engine._prefill, engine._forward

        def state(cache) -> dict:
            layers = cache.layers
            return {"buffers": [(layer._key_buffer.data_ptr(), layer._value_buffer.data_ptr()) for layer in layers],
                    "capacity": layers[0].capacity, "length": layers[0].get_seq_length(),
                    "rows": layers[0].keys.shape[0]}

        def spying_prefill(prompts, cache, names=None):
            out = prefill(prompts, cache, names)
            chunks.append({"cache": cache, "prefilled": state(cache), "decode": []})
            return out

        def spying_forward(names=None, prefix=None, **kw):
            logits = forward(names, prefix, **kw)
            if chunks and kw["cache"] is chunks[-1]["cache"]:  # after the chunk's prefill: a decode step
                chunks[-1]["decode"].append(state(kw["cache"]))
            return logits

        engine._prefill, engine._forward = spying_prefill, spying_forward
        out = engine.generate(SHARED_PROMPTS, params)
        assert any(g.finish_reason == "stop" for gens in out for g in gens)
        shrunk = False
        for chunk in chunks:
            prefilled, decode = chunk["prefilled"], chunk["decode"]
            # reserved once: own length after prefill + max_tokens; decode never moves the buffers
            assert prefilled["capacity"] == prefilled["length"] + params.max_tokens
            assert all(c["buffers"] == prefilled["buffers"] and c["capacity"] == prefilled["capacity"] for c in decode)
            shrunk |= bool(decode) and decode[-1]["rows"] < prefilled["rows"]
        assert shrunk
