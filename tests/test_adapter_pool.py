"""Many LoRA adapters on one base: mixed-role batches equal single-adapter runs, a step on one adapter
leaves the others bit-identical, optimizer states are disjoint, save/load and state round-trips."""

from __future__ import annotations

import torch

from tracegym.config import LoraConfig, OptimConfig
from tracegym.engines.hf import HFEngine
from tracegym.models import load
from tracegym.train.adapter_pool import BASE_ADAPTER, AdapterPool
from tracegym.types import SamplingParams

PROMPTS = [[1, 422, 3055, 28, 44, 900], [1, 422, 3055, 28, 71], [1, 5, 6, 7, 8, 9, 10, 11], [1, 422, 3055, 28, 44, 900]]


def _pool(seed: int = 0, optim: bool = True) -> AdapterPool:
    torch.manual_seed(seed)
    base, _ = load("tiny-random")
    cfg = LoraConfig(r=4, alpha=8)
    pool = AdapterPool(base, {"planner": cfg, "solver": cfg}, optim=OptimConfig(lr=1e-2) if optim else None,
                       total_steps=10)
    # make the adapters differ from the base and from each other (B starts at zero)
    with torch.no_grad():
        for i, name in enumerate(pool.names):
            gen = torch.Generator().manual_seed(100 + i)
            for key, p in pool.parameters(name).items():
                if "lora_B" in key:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return pool


def _logits(model, ids, **kw):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), **kw).logits[0]


def test_mixed_batch_rows_equal_single_adapter_rows():
    pool = _pool()
    model = pool.model.eval()
    names = ["planner", "solver", BASE_ADAPTER, "solver"]
    ids = torch.tensor([PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[0]])
    with torch.inference_mode():
        mixed = model(input_ids=ids, adapter_names=names).logits  # [4, L, V]
    for row, name in enumerate(names):
        if name == BASE_ADAPTER:
            with model.disable_adapter():
                single = _logits(model, PROMPTS[0])
        else:
            model.set_adapter(name)
            single = _logits(model, PROMPTS[0])
        torch.testing.assert_close(mixed[row], single, atol=1e-5, rtol=0)
    # the adapters really differ, so the check above can fail
    assert not torch.allclose(mixed[0], mixed[1], atol=1e-3) and not torch.allclose(mixed[0], mixed[2], atol=1e-3)


def test_engine_mixed_adapters_equal_per_adapter_calls():
    pool = _pool()
    names = ["planner", "solver", BASE_ADAPTER, "solver"]
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=11)
    mixed = HFEngine(pool.model, max_batch_size=8, pad_token_id=0).generate(PROMPTS, params, adapters=names)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    mixed_greedy = HFEngine(pool.model, max_batch_size=8).generate(PROMPTS, greedy, adapters=names)
    for row, name in enumerate(names):
        # greedy rows are what each adapter alone produces
        alone = HFEngine(pool.model, max_batch_size=8).generate([PROMPTS[row]], greedy, adapters=[name])[0][0]
        assert mixed_greedy[row][0].token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(mixed_greedy[row][0].logprobs), torch.tensor(alone.logprobs),
                                   atol=1e-4, rtol=0)
        # the sampled log-probs are the adapter's own, teacher-forced
        gen = mixed[row][0]
        if name == BASE_ADAPTER:
            with pool.model.disable_adapter():
                logits = _logits(pool.model, PROMPTS[row] + list(gen.token_ids))
        else:
            pool.model.set_adapter(name)
            logits = _logits(pool.model, PROMPTS[row] + list(gen.token_ids))
        n = len(gen.token_ids)
        lp = torch.log_softmax(logits[len(PROMPTS[row]) - 1: len(PROMPTS[row]) - 1 + n], -1)
        scored = lp.gather(-1, torch.tensor(gen.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(scored, torch.tensor(gen.logprobs), atol=1e-4, rtol=0)


def test_turn_store_never_crosses_adapters():
    pool = _pool()
    engine = HFEngine(pool.model, max_batch_size=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    first = engine.generate([PROMPTS[0]], greedy, adapters=["planner"])[0][0]
    follow = PROMPTS[0] + list(first.token_ids) + [198, 44]
    # the solver continues the planner's conversation: it must not reuse the planner's keys/values
    via_store = engine.generate([follow], greedy, adapters=["solver"])[0][0]
    fresh = HFEngine(pool.model, max_batch_size=8, prefix_cache=False).generate([follow], greedy, adapters=["solver"])[0][0]
    assert via_store.token_ids == fresh.token_ids
    torch.testing.assert_close(torch.tensor(via_store.logprobs), torch.tensor(fresh.logprobs), atol=1e-4, rtol=0)
    assert engine.turn_tokens_reused == 0
    # the planner's own next turn does reuse them
    engine.generate([follow], greedy, adapters=["planner"])
    assert engine.turn_tokens_reused > 0


def test_unknown_adapter_is_refused():
    pool = _pool(optim=False)
    engine = HFEngine(pool.model)
    try:
        engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2), adapters=["critic"])
    except ValueError as exc:
        assert "critic" in str(exc) and "planner" in str(exc)
    else:
        raise AssertionError("an unknown adapter must be refused")


def _one_step(pool: AdapterPool, name: str) -> None:
    with pool.training(name) as model:
        opt = pool.optimizers[name]
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=torch.tensor([PROMPTS[2]])).logits
        loss = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(PROMPTS[2][1:])[:, None]).mean().neg()
        loss.backward()
        opt.step()
        pool.schedulers[name].step()


def test_step_on_one_adapter_leaves_the_other_bit_identical():
    pool = _pool()
    before = {n: {k: v.clone() for k, v in pool.parameters(n).items()} for n in pool.names}
    _one_step(pool, "planner")
    assert any(not torch.equal(before["planner"][k], v) for k, v in pool.parameters("planner").items())
    assert all(torch.equal(before["solver"][k], v) for k, v in pool.parameters("solver").items())
    # optimizer states are adapter-local: disjoint parameter sets, and only the planner's has moments
    planner_ids = {id(p) for g in pool.optimizers["planner"].param_groups for p in g["params"]}
    solver_ids = {id(p) for g in pool.optimizers["solver"].param_groups for p in g["params"]}
    assert planner_ids and solver_ids and not planner_ids & solver_ids
    assert planner_ids == {id(p) for p in pool.parameters("planner").values()}
    assert pool.optimizers["planner"].state and not pool.optimizers["solver"].state
    assert pool.schedulers["planner"].last_epoch == 1 and pool.schedulers["solver"].last_epoch == 0


def test_save_load_round_trip_restores_logits(tmp_path):
    pool = _pool()
    _one_step(pool, "solver")
    pool.model.set_adapter("solver")
    want = _logits(pool.model, PROMPTS[0])
    pool.save("solver", tmp_path / "solver")
    assert (tmp_path / "solver" / "adapter_config.json").is_file()
    other = _pool(seed=5)
    other.load("solver", tmp_path / "solver")
    other.model.set_adapter("solver")
    torch.testing.assert_close(_logits(other.model, PROMPTS[0]), want, atol=1e-6, rtol=0)
    # a saved adapter also starts a new pool (init)
    base, _ = load("tiny-random")
    fresh = AdapterPool(base, {"solver": LoraConfig(r=4, alpha=8)}, init={"solver": tmp_path / "solver"})
    torch.testing.assert_close(_logits(fresh.model, PROMPTS[0]), want, atol=1e-6, rtol=0)


def test_state_dict_round_trip_continues_exactly():
    a = _pool()
    _one_step(a, "planner")
    state = a.state_dict()
    b = _pool(seed=3)
    b.load_state_dict(state)
    _one_step(a, "planner")
    _one_step(b, "planner")
    for name in a.names:
        for (k, va), vb in zip(a.parameters(name).items(), b.parameters(name).values()):
            assert torch.equal(va, vb), k


def test_memory_report_counts_adapters_not_models():
    pool = _pool()
    _one_step(pool, "planner")
    report = pool.memory_report()
    assert report["adapter_mb/planner"] == report["adapter_mb/solver"] > 0
    assert report["adapter_mb/planner"] < 0.2 * report["base_mb"]
    # AdamW: two moments per weight (plus one step counter per tensor)
    assert 2 * report["adapter_mb/planner"] <= report["optimizer_mb/planner"] < 2.01 * report["adapter_mb/planner"]
    assert report["optimizer_mb/solver"] == 0.0
