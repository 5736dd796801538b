"""Continuous batching (``tracegym.engines.hf_continuous``): rows join and leave one running batch.

The slot cache against per-row reference tensors; the decoder against each request decoded alone by
``HFEngine.generate`` with the same seed (same tokens, log-probs within 1e-4) while rows of other
lengths, later turns and non-sharing prompts join mid-batch; cancellation and a failing forward
pass; and the rollout runner with ``batching="continuous"``: seeded, reproducible, teacher-forced
log-probs within 1e-4, a failing engine failing only its episodes."""

from __future__ import annotations

import pytest
import torch

from engine_compare import random_ids
from tracegym.engines.hf import HFEngine
from tracegym.engines.hf_continuous import ContinuousDecoder, SlotKVCache
from tracegym.types import SamplingParams

SYSTEM = random_ids(40, 0)
PROMPTS = [SYSTEM + [10 + i, *random_ids(n, i + 1)] for i, n in enumerate((0, 9, 3, 17, 6, 1))]
OBSERVATION = [198, 4093, 198, 11]


# -- the slot cache --------------------------------------------------------------------------------
def test_slot_cache_rows_of_any_length_join_write_and_leave():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    cache = SlotKVCache(config, max_rows=4)
    gen = torch.Generator().manual_seed(0)
    heads, dim = 2, 8

    def row(n):
        return [(torch.randn(heads, n, dim, generator=gen), torch.randn(heads, n, dim, generator=gen)) for _ in range(2)]

    reference = [row(3), row(7)]  # per row, per layer (keys, values) [Hkv, n, D]
    cache.add_rows(reference, cols_needed=8)
    assert cache.rows == 2 and cache.length == 7 and cache.lens.tolist() == [3, 7]

    def step():
        new = [(torch.randn(cache.rows, heads, 1, dim, generator=gen), torch.randn(cache.rows, heads, 1, dim, generator=gen))
               for _ in range(2)]
        for layer_idx, layer in enumerate(cache.layers):
            keys, values = layer.update(*new[layer_idx], layer_idx)
            assert keys.shape[2] == cache.length + 1
        for b in range(cache.rows):  # each row's token goes after its own tokens
            for layer_idx in range(2):
                reference[b][layer_idx] = tuple(torch.cat([old, fresh[b]], dim=1) for old, fresh in
                                                zip(reference[b][layer_idx], new[layer_idx]))
        cache.advance()

    def check():
        assert cache.lens.tolist() == [ref[0][0].shape[1] for ref in reference]
        mask = cache.filled_mask().bool()
        for layer_idx, layer in enumerate(cache.layers):
            assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()  # masked columns too
            for b, ref in enumerate(reference):
                assert torch.equal(layer.keys[b][:, mask[b]], ref[layer_idx][0])
                assert torch.equal(layer.values[b][:, mask[b]], ref[layer_idx][1])

    step()
    check()
    reference.append(row(12))  # longer than the running rows: they expose new (zeroed) columns
    cache.add_rows(reference[-1:], cols_needed=14)
    check()
    for _ in range(9):  # past the columns reserved: the buffers grow, the rows stay
        step()
    check()
    decode_mask = cache.decode_mask()
    assert decode_mask.shape == (3, 1, 1, cache.length + 1) and decode_mask.sum(-1).flatten().tolist() == [
        n + 1 for n in cache.lens.tolist()]
    order = cache.keep([1, 2])  # the first row leaves: the last row moves into its slot, the other stays
    assert order == [2, 1]
    reference = [reference[i] for i in order]
    check()
    assert cache.length == max(cache.lens.tolist())
    longest = max(range(2), key=lambda i: reference[i][0][0].shape[1])
    assert cache.keep([longest]) == [longest]  # the longest row stays, alone
    reference = [reference[longest]]
    check()
    shortest_left = cache.keep([])
    assert shortest_left == [] and cache.rows == 0 and cache.length == 0


def _resident_kb(buffer: torch.Tensor) -> float:
    """Resident KB of a slot buffer's pages (``mincore``; the buffer starts a page-aligned map)."""
    import ctypes
    import mmap

    pages = -(-buffer.numel() * buffer.element_size() // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(buffer.data_ptr()), pages * mmap.PAGESIZE, vector) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vector) * mmap.PAGESIZE / 1024


def test_slot_cache_hands_back_the_memory_of_rows_that_left():
    """A slot's pages stay resident once written; rows that leave give theirs back (the released
    columns read as zeros), so resident memory follows the live rows, not the longest rows served."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    cache = SlotKVCache(config, max_rows=4)
    gen = torch.Generator().manual_seed(0)
    heads, dim, column_kb = 2, 8, 8 * 4 / 1024  # fp32: a column of one head is 32 bytes

    def row(n):
        return [(torch.randn(heads, n, dim, generator=gen), torch.randn(heads, n, dim, generator=gen)) for _ in range(2)]

    rows = [row(1500), row(20), row(300), row(1200)]
    cache.add_rows(rows, cols_needed=1600)
    keys = cache.layers[0]._k
    written = _resident_kb(keys)
    assert written >= (1500 + 20 + 300 + 1200) * heads * column_kb  # every written column resident
    assert cache.keep([1, 2]) == [2, 1]  # row 2 moves into slot 0; slots 2 and 3 are free
    live = _resident_kb(keys)  # before any read below maps pages again
    tail = -(-300 * 32 // 4096) * 4096 // 32  # slot 0's columns from the first whole page after its row
    assert live <= (tail + 20 + 128) * heads * column_kb, (written, live)  # the live rows' pages only
    for layer_idx, layer in enumerate(cache.layers):
        for slot, source in enumerate((2, 1)):  # the live rows are intact
            assert torch.equal(layer._k[slot, :, : rows[source][0][0].shape[1]], rows[source][layer_idx][0])
            assert torch.equal(layer._v[slot, :, : rows[source][0][0].shape[1]], rows[source][layer_idx][1])
        assert not layer._k[2:].any() and not layer._v[2:].any()  # the free slots read as zeros again
        # row 0's old keys: gone from the first whole page after the moved row (before it: masked, finite)
        assert not layer._k[0, :, tail:].any() and layer._k[0, :, 300:tail].any()
    assert written > 5 * live


# -- the decoder against each request alone ---------------------------------------------------------
def _engine(tiny_model, **options) -> HFEngine:
    model, tokenizer = tiny_model
    return HFEngine(model, tokenizer, max_batch_size=options.pop("max_batch_size", 6), **options)


def _alone(engine: HFEngine, prompt, params: SamplingParams, max_tokens: int, seed: int):
    [[generation]] = engine.generate([prompt], params.model_copy(update={"max_tokens": max_tokens, "seed": seed}))
    return generation


def _drive(decoder: ContinuousDecoder, schedule: dict[int, list[tuple[list[int], int, int]]]) -> dict[int, object]:
    """Step ``decoder``, submitting ``schedule[step]`` (prompt, max_tokens, seed) before step ``step``;
    returns seed -> Generation. Records the batch sizes it saw."""
    results: dict[int, object] = {}
    sizes: list[int] = []

    def done_for(seed):
        def done(generation, error):
            assert error is None
            results[seed] = generation
        return done

    step = 0
    while step <= max(schedule) or decoder.rows or decoder.queue:
        for prompt, max_tokens, seed in schedule.get(step, []):
            decoder.submit(prompt, max_tokens, seed, done_for(seed))
        decoder.step()
        sizes.append((len(decoder.rows), decoder.admissions))
        step += 1
        assert step < 500
    decoder.sizes = sizes  # type: ignore[attr-defined]
    return results


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=8),
                                    SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8)],
                         ids=["greedy", "sampled"])
def test_rows_joining_a_running_batch_sample_what_they_sample_alone(tiny_model, params):
    engine = _engine(tiny_model)
    # turn 0 of four episodes (two with the same prompt), then a fifth and sixth joining mid-batch
    # with other budgets, then next turns of the first ones (kept turns from the store, longer rows)
    schedule = {0: [(PROMPTS[0], 6, 100), (PROMPTS[1], 9, 101), (PROMPTS[1], 4, 102), (PROMPTS[2], 12, 103)],
                2: [(PROMPTS[3], 5, 104)], 3: [(PROMPTS[4], 7, 105), (PROMPTS[5], 3, 106)]}
    decoder = engine.continuous_decoder(params, admit_fraction=0.0)
    first = _drive(decoder, schedule)
    # rows joined while others decoded; the last request waited a step for room (6 rows at most)
    assert decoder.admissions == 4 and decoder.prefix is not None
    assert [rows for rows, _ in decoder.sizes[:5]] == [4, 4, 5, 5, 6]
    worst = 0.0
    expected = {}
    for step_requests in schedule.values():
        for prompt, max_tokens, seed in step_requests:
            expected[seed] = _alone(engine, prompt, params, max_tokens, seed)
    for seed, generation in first.items():
        assert generation.token_ids == expected[seed].token_ids, seed
        assert generation.finish_reason == expected[seed].finish_reason
        worst = max(worst, max(abs(a - b) for a, b in zip(generation.logprobs, expected[seed].logprobs)))
    assert worst < 1e-4

    # next turns: each prompt extends a finished row (its keys come from the turn store)
    engine.clear_cache()
    decoder = engine.continuous_decoder(params, admit_fraction=0.0)
    turn0 = _drive(decoder, {0: [(PROMPTS[i], 5, 200 + i) for i in range(4)]})
    reused = engine.turn_tokens_reused
    later = {1: [], 4: []}
    for i in range(4):
        prompt = PROMPTS[i] + list(turn0[200 + i].token_ids) + OBSERVATION
        later[1 if i % 2 else 4].append((prompt, 6, 300 + i))
    later[0] = [(PROMPTS[5], 10, 310)]  # a fresh episode decoding while the others come back
    second = _drive(decoder, later)
    assert engine.turn_tokens_reused > reused  # the kept turns were used
    for requests in later.values():
        for prompt, max_tokens, seed in requests:
            alone = _alone(engine, prompt, params, max_tokens, seed)
            assert second[seed].token_ids == alone.token_ids
            assert max(abs(a - b) for a, b in zip(second[seed].logprobs, alone.logprobs)) < 1e-4


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=8),
                                    SamplingParams(temperature=0.9, max_tokens=8)], ids=["greedy", "sampled"])
def test_rows_sharing_part_or_none_of_the_batch_prefix_join_it(tiny_model, params):
    """The batch's prefix is its first prompts' common start; a later row attends to the part its own
    prompt starts with (all, some, none) and keeps the rest as its own tokens."""
    engine = _engine(tiny_model)
    decoder = engine.continuous_decoder(params, admit_fraction=0.0)
    stranger = random_ids(30, 77)  # shares nothing with SYSTEM
    partial = SYSTEM[:25] + random_ids(12, 78)  # shares 25 of its tokens
    schedule = {0: [(PROMPTS[0], 6, 1), (PROMPTS[2], 6, 2)], 1: [(stranger, 5, 3), (PROMPTS[3], 4, 4)],
                2: [(partial, 7, 5)], 3: [(PROMPTS[0][:30], 5, 6)]}
    results = _drive(decoder, schedule)
    assert decoder.admissions == 4 and len(decoder.prefix) == len(SYSTEM)  # one batch throughout
    assert max(rows for rows, _ in decoder.sizes) == 6
    for requests in schedule.values():
        for prompt, max_tokens, seed in requests:
            alone = _alone(engine, prompt, params, max_tokens, seed)
            assert results[seed].token_ids == alone.token_ids, seed
            assert max(abs(a - b) for a, b in zip(results[seed].logprobs, alone.logprobs)) < 1e-4


def test_two_prompts_extending_one_kept_turn_join_in_different_passes(tiny_model):
    """Two prompts admitted together may both extend the same kept turn whole (an episode whose own
    turn was not kept falls back to a sibling's with the same start). When their new parts differ
    enough in length they prefill in separate passes, and the first pass must not consume the turn
    the second still reads (it used to: "too many indices for tensor of dimension 1", every episode
    of the admission failed; seen in RL on 3-call problems, timing-dependent)."""
    engine = _engine(tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    decoder = engine.continuous_decoder(params, admit_fraction=0.0)
    first = _drive(decoder, {0: [(PROMPTS[0], 4, 1)]})  # its turn is kept
    turn = PROMPTS[0] + list(first[1].token_ids)
    short, long = turn + OBSERVATION, turn + random_ids(150, 79)  # new parts of ~5 and ~151 tokens
    kept = engine.turn_tokens_reused
    # a long row keeps the batch running, so the pair joins it behind its SYSTEM prefix, in one admission
    schedule = {0: [(PROMPTS[5], 30, 2)], 3: [(short, 5, 3), (long, 5, 4)]}
    results = _drive(decoder, schedule)
    assert engine.turn_tokens_reused - kept >= 2 * (len(turn) - 1 - len(SYSTEM))  # both rows used the kept turn
    assert decoder.admissions == 2 + 1  # the first drive's one, then the running row's and the pair's
    for prompt, max_tokens, seed in schedule[3]:
        alone = _alone(engine, prompt, params, max_tokens, seed)
        assert results[seed].token_ids == alone.token_ids, seed
        assert max(abs(a - b) for a, b in zip(results[seed].logprobs, alone.logprobs)) < 1e-4


def test_cancelled_rows_leave_and_a_failing_forward_fails_only_the_batch(tiny_model):
    engine = _engine(tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    decoder = engine.continuous_decoder(params, admit_fraction=0.0)
    outcomes: dict[int, tuple] = {}

    def done_for(key):
        return lambda generation, error: outcomes.__setitem__(key, (generation, error))

    decoder.submit(PROMPTS[0], 8, 1, done_for(1))
    cancelled = decoder.submit(PROMPTS[1], 8, 2, done_for(2))
    decoder.step()
    cancelled.cancel()
    decoder.step()
    assert outcomes[2] == (None, None) and len(decoder.rows) == 1
    real_forward = engine._forward

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    engine._forward = broken
    decoder.step()
    generation, error = outcomes[1]
    assert generation is None and "injected fault" in str(error) and not decoder.rows
    engine._forward = real_forward  # the decoder serves the next requests
    decoder.submit(PROMPTS[2], 4, 3, done_for(3))
    while 3 not in outcomes:
        decoder.step()
    assert outcomes[3][0].token_ids == _alone(engine, PROMPTS[2], params, 4, 3).token_ids


def test_an_admission_failing_in_its_second_pass_leaves_the_running_batch_as_it_was(tiny_model):
    """Rows a failed admission's earlier pass added leave again: the running row decodes on exactly,
    and every request of the admission is answered once, with the error."""
    engine = _engine(tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    decoder = engine.continuous_decoder(params, admit_fraction=0.0)
    outcomes: dict[int, list] = {}

    def done_for(key):
        return lambda generation, error: outcomes.setdefault(key, []).append((generation, error))

    decoder.submit(PROMPTS[5], 12, 1, done_for(1))
    decoder.step()
    real_prefill, passes = engine._prefill_suffixes, []

    def second_pass_fails(*args, **kwargs):
        passes.append(1)
        if len(passes) == 2:
            raise RuntimeError("injected fault")
        return real_prefill(*args, **kwargs)

    engine._prefill_suffixes = second_pass_fails
    decoder.submit(PROMPTS[2], 6, 2, done_for(2))  # a short new part and a long one: two passes
    decoder.submit(PROMPTS[2] + random_ids(150, 80), 6, 3, done_for(3))
    decoder.step()
    engine._prefill_suffixes = real_prefill
    assert len(passes) == 2 and len(decoder.rows) == 1 and decoder.cache.rows == 1
    while 1 not in outcomes:
        decoder.step()
    for key in (2, 3):
        [(generation, error)] = outcomes[key]
        assert generation is None and "injected fault" in str(error)
    [(generation, error)] = outcomes[1]
    assert error is None and generation.token_ids == _alone(engine, PROMPTS[5], params, 12, 1).token_ids


# -- the rollout runner -----------------------------------------------------------------------------
def _calculator_rollout(smollm2_like, batching: str, seed: int = 3, **config):
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    engine, renderer, tasks = smollm2_like
    cfg = RolloutConfig(max_turns=3, max_tokens_per_turn=10, samples_per_task=2, temperature=1.0, seed=seed,
                        concurrency=6, batching=batching, **config)
    return run_rollouts_sync("calculator", tasks, engine, renderer, cfg, progress=False)


@pytest.fixture
def calculator_tiny(tiny_model):
    from tracegym.envs import make
    from tracegym.render import get_renderer

    model, tokenizer = tiny_model
    renderer = get_renderer("smollm2-135m", tokenizer)
    engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids, max_batch_size=6)
    return engine, renderer, make("calculator").tasks("train", n=4, seed=0)


def test_rollouts_with_continuous_batching_are_seeded_and_exact(calculator_tiny):
    from tracegym.rollout import logprob_gap

    engine = calculator_tiny[0]
    result = _calculator_rollout(calculator_tiny, "continuous", measure_logprob_gap=True)
    stats = result.stats
    assert stats.kept == 8 and stats.failed == 0
    assert stats.logprob_gap is not None and stats.logprob_gap.max < 1e-4
    assert 1 <= stats.mean_batch_size <= 6 and stats.generate_calls >= 1
    again = _calculator_rollout(calculator_tiny, "continuous")
    assert [t.turns for t in again.trajectories] == [t.turns for t in result.trajectories]
    other = _calculator_rollout(calculator_tiny, "continuous", seed=4)
    assert [t.turns for t in other.trajectories] != [t.turns for t in result.trajectories]
    # every turn is what the engine samples for that prompt alone, with the turn's seed
    params = SamplingParams(temperature=1.0, max_tokens=10, stop_token_ids=tuple(calculator_tiny[1].stop_token_ids))
    for index, traj in enumerate(result.trajectories):
        for turn_index, turn in enumerate(traj.turns):
            seed = ((3 * 1_000_003 + index) * 1_000_003 + turn_index) % 2**63
            alone = _alone(engine, list(turn.prompt_ids), params, 10, seed)
            assert alone.token_ids == turn.completion_ids
    assert logprob_gap(engine.model, result.trajectories, 1.0, 1.0).max < 1e-4


def test_a_failing_engine_fails_only_the_episodes_in_its_batch(calculator_tiny):
    engine = calculator_tiny[0]
    real_forward = engine._forward
    calls = {"n": 0}

    def sometimes_broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # a decode step of the first batch
            raise RuntimeError("injected fault")
        return real_forward(*args, **kwargs)

    engine._forward = sometimes_broken
    try:
        result = _calculator_rollout(calculator_tiny, "continuous", on_env_error="zero_reward")
    finally:
        engine._forward = real_forward
    stats = result.stats
    # the six episodes of the first batch fail; the two that start afterwards play on
    assert stats.episodes == 8 and stats.end_reasons.get("engine_error", 0) == 6 and stats.failed == 6
    assert all("injected fault" in e for e in stats.errors)


def test_per_turn_batching_runs_one_generate_call_per_turn(calculator_tiny):
    engine = calculator_tiny[0]
    calls = []
    real_generate = engine.generate
    engine.generate = lambda prompts, params, **kw: calls.append(len(prompts)) or real_generate(prompts, params, **kw)
    try:
        result = _calculator_rollout(calculator_tiny, "per_turn")
    finally:
        engine.generate = real_generate
    assert result.stats.kept == 8 and result.stats.generate_calls == len(calls) >= 2
    assert result.stats.mean_batch_size == pytest.approx(sum(calls) / len(calls))


def test_episode_timeouts_drop_their_rows(calculator_tiny):
    engine = calculator_tiny[0]
    real_forward = engine._forward

    def slow(*args, **kwargs):
        import time

        time.sleep(0.05)
        return real_forward(*args, **kwargs)

    engine._forward = slow
    try:
        result = _calculator_rollout(calculator_tiny, "continuous", episode_timeout_s=0.3, on_env_error="zero_reward")
    finally:
        engine._forward = real_forward
    assert result.stats.episodes == 8 and result.stats.end_reasons.get("timeout", 0) >= 1


def test_admission_passes_minimise_padding_plus_pass_cost():
    import itertools

    from tracegym.engines.hf_continuous import PASS_COST_TOKENS, _length_buckets

    def cost(buckets, lengths):
        return sum(PASS_COST_TOKENS + len(b) * max(lengths[i] for i in b) for b in buckets)

    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        lengths = torch.randint(1, 120, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist()
        buckets = _length_buckets(lengths)
        assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
        # brute force over every partition of the sorted rows into consecutive runs
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        best = min(cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], lengths)
                   for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k))
        assert cost(buckets, lengths) == best
    assert _length_buckets([30] * 6) == [list(range(6))]  # equal lengths: one pass
    assert len(_length_buckets([200, 200, 10, 10, 10, 10])) == 2  # long and short rows apart


def test_an_ended_episode_leaves_no_kept_turn_behind(calculator_tiny):
    """The turn store keeps a finished turn for the episode's next one; once the episode ends nothing
    will extend it, so the runner drops it instead of letting it hold memory until evicted."""
    engine = calculator_tiny[0]
    found: list[bool] = []
    real_forget = engine.forget_turn

    def spy(tokens, adapter=None):
        found.append((adapter, tuple(tokens)) in engine._turns)
        real_forget(tokens, adapter)
        assert (adapter, tuple(tokens)) not in engine._turns

    engine.forget_turn = spy
    try:
        result = _calculator_rollout(calculator_tiny, "continuous")
    finally:
        engine.forget_turn = real_forget
    assert len(found) == result.stats.episodes == 8
    assert all(found)  # each episode's last turn was still kept until then
