"""The shared-prefix forwards: a micro-batch's common prefix runs once, and a step's (the prefix every
micro-batch of one step starts with, tracegym/train/step_prefix.py) runs once for all of them,
forward and backward; log-probs, entropies and accumulated gradients equal the plain forward's
(float rounding aside)."""

from __future__ import annotations

import pytest
import torch

from tracegym.config import LoraConfig
from tracegym.models import load
from tracegym.train.logprobs import MIN_SHARED_PREFIX, shared_prefix_length, token_logprobs, token_logprobs_and_entropy
from tracegym.train.lora import prepare_model
from tracegym.train.step_prefix import common_prefix_length, step_prefix


def _right_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] ids and attention mask of ``rows``, padded on the right with 0."""
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return ids, mask


def _batch(prefix_len: int, suffixes=(12, 7, 20, 3), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(5, 1000, (prefix_len,), generator=gen)
    return _right_padded([torch.cat([prefix, torch.randint(5, 1000, (n,), generator=gen)]) for n in suffixes])


def _lora_model():
    """tiny-random with a LoRA whose B is not zero (so the adapter takes part), in eval mode."""
    torch.manual_seed(0)
    model, _ = load("tiny-random")
    model = prepare_model(model, LoraConfig(r=4)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


def test_shared_prefix_length():
    ids, mask = _batch(30)
    assert shared_prefix_length(ids, mask, first_column=29) == 29  # no logit is needed inside the prefix
    assert shared_prefix_length(ids, mask, first_column=40) == 30
    assert shared_prefix_length(ids[:1], mask[:1], first_column=29) == 0  # one row: nothing to share
    short, short_mask = _batch(MIN_SHARED_PREFIX - 1)
    assert shared_prefix_length(short, short_mask, first_column=MIN_SHARED_PREFIX + 5) == 0
    ids[2, 20] += 1  # rows differ from position 20 on
    assert shared_prefix_length(ids, mask, first_column=29) == 20
    padded, padded_mask = _batch(30, suffixes=(12, 0))
    # the shortest row (30 tokens) keeps one token of its own after the prefix
    assert shared_prefix_length(padded, padded_mask, first_column=40) == 29


@pytest.mark.parametrize("first_column", [22, 29])
def test_shared_prefix_forward_equals_the_plain_one(first_column):
    model = _lora_model()
    ids, mask = _batch(30)
    results = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        logp, entropy = token_logprobs_and_entropy(model, ids, mask, 0.7, first_column=first_column, share_prefix=share)
        target = mask[:, 1:].float()
        ((logp * target).sum() + 0.1 * (entropy * target).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), entropy.detach(), grads))
    (lp0, en0, g0), (lp1, en1, g1) = results
    keep = mask[:, 1:].bool()
    torch.testing.assert_close(lp1[keep], lp0[keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(en1[keep], en0[keep], atol=1e-5, rtol=0)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        scale = g0[name].abs().max().clamp_min(1e-8)
        assert ((g1[name] - g0[name]).abs().max() / scale) < 1e-4, name


def test_split_by_computed_tokens_counts_a_shared_prompt_once():
    from tracegym.batch import make_batch, split_by_computed_tokens
    from tracegym.types import TrainingExample

    def example(prompt, completion):
        ids = tuple(prompt) + tuple(completion)
        mask = (0,) * len(prompt) + (1,) * len(completion)
        return TrainingExample(input_ids=ids, loss_mask=mask, weights=(1.0,) * len(ids), advantages=(0.5,) * len(ids),
                               logprobs=(0.0,) * len(ids))

    prompt_a, prompt_b = list(range(100, 130)), list(range(200, 230))  # 30-token prompts
    rows = [example(prompt_a, [7] * 10) for _ in range(4)] + [example(prompt_b, [8] * 10) for _ in range(4)]
    batch = make_batch(rows, pad_token_id=0, group_ids=[0, 0, 0, 0, 1, 1, 1, 1])
    # a group of 4 costs its prompt once plus 4 completions (about 30 + 4 x 10 tokens), not 4 x 40
    parts = split_by_computed_tokens(batch, 80)
    assert [p.size for p in parts] == [4, 4]
    assert all(p.normalizers == batch.normalizers for p in parts)
    # too small a budget for two rows: one row per part; rows never cross the order
    parts = split_by_computed_tokens(batch, 45)
    assert [p.size for p in parts] == [1] * 8
    assert [int(i) for p in parts for i in p.example_ids] == list(range(8))
    # a budget that spans both prompts shares nothing across them (their prefixes differ at token 0)
    assert [p.size for p in split_by_computed_tokens(batch, 150)] == [4, 4]  # 5 unshared rows would cost 200
    assert [p.size for p in split_by_computed_tokens(batch, 320)] == [8]


# --- the step prefix ----------------------------------------------------------------------------------


def _rows(system: torch.Tensor, tasks: list[torch.Tensor], suffixes: list[int], gen: torch.Generator):
    """Right-padded [B, L] ids and mask: row i = system + tasks[i % len(tasks)] + its own suffix."""
    return _right_padded([torch.cat([system, tasks[i % len(tasks)], torch.randint(5, 1000, (n,), generator=gen)])
                          for i, n in enumerate(suffixes)])


def test_common_prefix_length_over_sources():
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(5, 1000, (24,), generator=gen)
    a = _rows(system, [torch.tensor([1, 2, 3])], [5, 9], gen)
    b = _rows(system, [torch.tensor([4, 5])], [7], gen)
    assert common_prefix_length([(a[0], a[1], 40), (b[0], b[1], 40)]) == 24  # the tasks differ after the system
    assert common_prefix_length([(a[0], a[1], 40)]) == 27  # within a: the task too
    assert common_prefix_length([(a[0], a[1], 20), (b[0], b[1], 40)]) == 20  # a logit is needed from column 20
    assert common_prefix_length([(b[0], b[1], 40)]) == 0  # one row in all: nothing to share
    assert common_prefix_length([(b[0], b[1], 40), (b[0], b[1], 40)]) == 32  # the same row twice: one short of its 33
    short = _rows(system[: MIN_SHARED_PREFIX - 2], [torch.tensor([1])], [5, 6], gen)
    assert common_prefix_length([(short[0], short[1], 30)]) == 0


@pytest.mark.parametrize("micro", [1, 2, 3])
def test_step_prefix_gradients_equal_each_micro_batch_running_its_own(micro):
    """Three tasks with two rows each behind one 24-token system prompt, micro-batches of 1-3 rows
    (micro 2: each micro-batch's rows also share their task: the second level runs at batch 1)."""
    model = _lora_model()
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(5, 1000, (24,), generator=gen)
    tasks = [torch.randint(5, 1000, (n,), generator=gen) for n in (6, 9, 4)]
    ids, mask = _rows(system, [tasks[0], tasks[0], tasks[1], tasks[1], tasks[2], tasks[2]], [5, 11, 3, 8, 13, 2], gen)
    first = 28  # a logit from column 28 on (inside every row's task or suffix)
    results = []
    for shared in (False, True):
        model.zero_grad(set_to_none=True)
        prefix = step_prefix(model, [(ids, mask, first)]) if shared else None
        assert (prefix is not None) == shared and (prefix is None or prefix.length == 24)
        values = []
        for start in range(0, ids.shape[0], micro):
            part_ids, part_mask = ids[start : start + micro], mask[start : start + micro]
            logp = token_logprobs(model, part_ids, part_mask, 0.7, first_column=first, prefix=prefix)
            (logp * part_mask[:, 1:]).sum().backward()
            values.append(logp.detach())
        if prefix is not None:
            prefix.backward()
            assert all(leaf.grad is None for leaf in prefix.keys + prefix.values)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((torch.cat(values), grads))
    (lp0, g0), (lp1, g1) = results
    keep = mask[:, 1:].bool()
    keep[:, :first] = False
    torch.testing.assert_close(lp1[keep], lp0[keep], atol=1e-5, rtol=0)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        scale = g0[name].abs().max().clamp_min(1e-8)
        assert ((g1[name] - g0[name]).abs().max() / scale) < 1e-4, name


def test_a_step_prefix_that_is_never_backpropagated_leaves_out_the_prefix_gradient():
    """The premise of calling ``backward()``: without it, the prefix's share of the gradient is missing."""
    model = _lora_model()
    gen = torch.Generator().manual_seed(2)
    ids, mask = _rows(torch.randint(5, 1000, (24,), generator=gen), [torch.tensor([7])], [5, 9], gen)
    grads = []
    for call_backward in (True, False):
        model.zero_grad(set_to_none=True)
        prefix = step_prefix(model, [(ids, mask, 25)])
        for row in range(2):
            logp = token_logprobs(model, ids[row : row + 1], mask[row : row + 1], first_column=25, prefix=prefix)
            (logp * mask[row : row + 1, 1:]).sum().backward()
        if call_backward:
            prefix.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert not torch.allclose(grads[0], grads[1], atol=1e-6)


def test_no_step_prefix_in_train_mode_or_without_a_shared_prefix():
    model = _lora_model()
    gen = torch.Generator().manual_seed(3)
    ids, mask = _rows(torch.randint(5, 1000, (24,), generator=gen), [torch.tensor([7])], [5, 9], gen)
    other = ids.clone()
    other[1, 3] += 1  # the rows part at token 3
    assert step_prefix(model, [(other, mask, 25)]) is None
    model.train()
    assert step_prefix(model, [(ids, mask, 25)]) is None
    model.eval()
    prefix = step_prefix(model, [(ids, mask, 25)])
    assert prefix is not None and prefix.covers(ids, mask, 25) and not prefix.covers(other, mask, 25)
    assert not prefix.covers(ids, mask, 10)  # a logit needed inside the prefix


def test_sft_accumulation_and_policy_update_with_replay_match_without_the_step_prefix(monkeypatch):
    """The two training callers: SFT's accumulated gradient, and an RL update whose policy rows and
    replay rows share the system prompt (one optimizer step, so the trained LoRA weights compare)."""
    import tracegym.recipes.sft as sft
    import tracegym.train.policy_update as policy_update_module
    from tracegym.batch import make_batch
    from tracegym.types import TrainingExample

    gen = torch.Generator().manual_seed(4)
    system = tuple(torch.randint(5, 1000, (30,), generator=gen).tolist())

    def example(task_len: int, completion_len: int, advantage: float) -> TrainingExample:
        task = tuple(torch.randint(5, 1000, (task_len,), generator=gen).tolist())
        completion = tuple(torch.randint(5, 1000, (completion_len,), generator=gen).tolist())
        ids = system + task + completion
        mask = (0,) * (len(system) + task_len) + (1,) * completion_len
        return TrainingExample(input_ids=ids, loss_mask=mask, weights=(1.0,) * len(ids), advantages=(advantage,) * len(ids),
                               logprobs=(0.0,) * len(ids))

    examples = [example(3 + i, 4 + 2 * i, (-1.0) ** i) for i in range(5)]
    replay = make_batch([example(5, 6, 0.0), example(2, 9, 0.0)], pad_token_id=0)

    def run(shared: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if not shared:
            monkeypatch.setattr(sft, "step_prefix", lambda *a, **k: None)
            monkeypatch.setattr(policy_update_module, "step_prefix", lambda *a, **k: None)
        else:
            monkeypatch.undo()
        model = _lora_model()
        model.zero_grad(set_to_none=True)
        sft.accumulate_sft_gradients(model, examples, 2, torch.device("cpu"), 0)
        sft_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        from tracegym.algos.config import PolicyLossConfig

        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        policy_update_module.policy_update(model, make_batch(examples, pad_token_id=0), PolicyLossConfig(), optimizer,
                                           scheduler, epochs=1, micro_batch_size=2, temperature=1.0, max_grad_norm=None,
                                           replay=(replay, 0.5), old_from_forward=True)
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return sft_grads, trained

    plain_grads, plain_weights = run(False)
    shared_grads, shared_weights = run(True)
    assert plain_grads.keys() == shared_grads.keys() and len(plain_grads) > 0
    for name in plain_grads:
        scale = plain_grads[name].abs().max().clamp_min(1e-8)
        assert ((shared_grads[name] - plain_grads[name]).abs().max() / scale) < 1e-4, name
    start = {n: p.detach() for n, p in _lora_model().named_parameters() if p.requires_grad}
    for name in plain_weights:
        step = (plain_weights[name] - start[name]).abs().max().clamp_min(1e-8)
        assert ((shared_weights[name] - plain_weights[name]).abs().max() / step) < 1e-4, name
    assert any(float((plain_weights[n] - start[n]).abs().max()) > 0 for n in plain_weights)  # the update moved


def test_mutual_information_matrix_equal_with_the_common_prefix_run_once(monkeypatch):
    import tracegym.train.step_prefix as step_prefix_module
    from tracegym.train.health import cross_logprob_matrix

    model = _lora_model()
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(5, 1000, (24,), generator=gen).tolist()
    pairs = [(system + torch.randint(5, 1000, (n,), generator=gen).tolist(),
              torch.randint(5, 1000, (m,), generator=gen).tolist()) for n, m in ((4, 6), (7, 3), (5, 9))]
    built = []
    original = step_prefix_module.step_prefix
    monkeypatch.setattr(step_prefix_module, "step_prefix", lambda *a, **k: built.append(original(*a, **k)) or built[-1])
    shared = cross_logprob_matrix(model, pairs, micro_batch_size=2)
    assert len(built) == 1 and built[0] is not None and built[0].length == 24  # the system prompt, once for 3 x 3 rows
    monkeypatch.setattr(step_prefix_module, "step_prefix", lambda *a, **k: None)
    plain = cross_logprob_matrix(model, pairs, micro_batch_size=2)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)


def test_step_prefix_under_bfloat16_autocast_stays_within_bfloat16_rounding(monkeypatch):
    """Under ``model.autocast`` the prefix's keys and values come out of bfloat16 matmuls and go back
    to each micro-batch in the dtype the model made them in: SFT's loss is the plain one and its
    gradient differs by bfloat16 rounding only, as another micro-batch split differs (measured 0.5%
    and 0.6% of the largest entry)."""
    import tracegym.recipes.sft as sft
    from tracegym.train.precision import set_training_autocast
    from tracegym.types import TrainingExample

    gen = torch.Generator().manual_seed(4)
    system = tuple(torch.randint(5, 1000, (30,), generator=gen).tolist())

    def example(task_len: int, completion_len: int) -> TrainingExample:
        ids = system + tuple(torch.randint(5, 1000, (task_len + completion_len,), generator=gen).tolist())
        return TrainingExample(input_ids=ids, loss_mask=(0,) * (30 + task_len) + (1,) * completion_len,
                               weights=(1.0,) * len(ids), advantages=(0.0,) * len(ids), logprobs=(0.0,) * len(ids))

    examples = [example(3 + i, 4 + 2 * i) for i in range(5)]
    built = []
    original = sft.step_prefix

    def run(shared: bool) -> tuple[float, torch.Tensor]:
        monkeypatch.setattr(sft, "step_prefix", (lambda *a, **k: built.append(original(*a, **k)) or built[-1])
                            if shared else (lambda *a, **k: None))
        model = _lora_model()
        set_training_autocast(model, torch.bfloat16)
        out = sft.accumulate_sft_gradients(model, examples, 2, torch.device("cpu"), 0)
        return out["loss"], torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    plain_loss, plain = run(False)
    shared_loss, shared = run(True)
    assert len(built) == 1 and built[0] is not None and built[0].length == 30
    assert shared_loss == pytest.approx(plain_loss, rel=1e-3)
    assert float((shared - plain).abs().max() / plain.abs().max()) < 2e-2
    assert not torch.equal(shared, plain)  # bfloat16 did round differently: the comparison is not vacuous
