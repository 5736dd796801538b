"""Batch building (alignment, padding, groups), micro-batching, and gradient-accumulation
equivalence on a tiny random causal LM for every aggregation mode and the SFT loss."""

from __future__ import annotations

import pytest
import torch

from tracegym.algos import PolicyLossConfig, compute_policy_loss, sft_loss
from tracegym.algos.aggregation import LossNormalizers
from tracegym.batch import Batch, make_batch, merge_microbatch_rows, split_microbatches
from tracegym.train.logprobs import token_logprobs, token_logprobs_and_entropy
from tracegym.types import TrainingExample

PAD = 0


def _example(ids, mask, adv=0.0, weight=1.0, logprob=-1.0, source="env/task/0#0", has_logprobs=True) -> TrainingExample:
    n = len(ids)
    return TrainingExample(
        input_ids=tuple(ids),
        loss_mask=tuple(mask),
        weights=tuple(weight * m for m in mask),
        advantages=tuple(adv * m for m in mask),
        logprobs=tuple(logprob * m for m in mask),
        has_logprobs=has_logprobs,
        source=source,
    )


def test_make_batch_pads_right_and_aligns_to_targets():
    a = _example([5, 6, 7, 8], [0, 0, 1, 1], adv=2.0, source="calc/t1/0#0")
    b = _example([9, 10, 11], [0, 1, 1], adv=-1.0, source="calc/t1/1#0", has_logprobs=False)
    c = _example([3, 4], [0, 1], adv=0.5, source="calc/t2/0#0")
    batch = make_batch([a, b, c], pad_token_id=PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, PAD], [3, 4, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
    # column t belongs to token t+1: a's tokens 7, 8 (indices 2, 3) are columns 1, 2
    assert batch.loss_mask.tolist() == [[0, 1, 1], [1, 1, 0], [1, 0, 0]]
    assert batch.advantages.tolist() == [[0, 2, 2], [-1, -1, 0], [0.5, 0, 0]]
    assert batch.engine_logprobs.tolist() == [[0, -1, -1], [-1, -1, 0], [-1, 0, 0]]
    assert batch.has_engine_logprobs.tolist() == [True, False, True]
    assert batch.group_ids.tolist() == [0, 0, 1]  # same env/task -> same group
    assert batch.normalizers == LossNormalizers(num_tokens=5, num_sequences=3, weight_sum=5, max_target_length=3)
    assert batch.lengths.tolist() == [4, 3, 2]
    explicit = make_batch([a, b, c], pad_token_id=PAD, group_ids=[4, 5, 4])
    assert explicit.group_ids.tolist() == [4, 5, 4]


def test_make_batch_rejects_bad_examples():
    with pytest.raises(ValueError, match="at least 2"):
        make_batch([_example([1], [1])], PAD)
    bad = TrainingExample(input_ids=(1, 2, 3), loss_mask=(0, 1), weights=(0, 1, 1), advantages=(0, 0, 0), logprobs=(0, 0, 0))
    with pytest.raises(ValueError, match="lengths"):
        make_batch([bad], PAD)
    with pytest.raises(ValueError, match="at least one"):
        make_batch([], PAD)
    with pytest.raises(ValueError, match="group ids"):
        make_batch([_example([1, 2], [0, 1])], PAD, group_ids=[0, 1])


def _random_examples(seed: int, count: int = 7, vocab: int = 32) -> list[TrainingExample]:
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(count):
        n = int(torch.randint(4, 14, (1,), generator=gen))
        ids = torch.randint(1, vocab, (n,), generator=gen).tolist()
        prompt = int(torch.randint(1, n - 1, (1,), generator=gen))
        mask = [0] * prompt + [1] * (n - prompt)
        if n - prompt > 3:
            mask[prompt + 1] = 0  # a tool-result hole inside the completion
        weights = torch.rand(n, generator=gen).add(0.5).tolist()
        adv = float(torch.randn(1, generator=gen))
        # engine log-probs a little off the model's, so ratios differ from 1 and some tokens clip
        logprobs = (-torch.rand(n, generator=gen) * 4).tolist()
        examples.append(
            TrainingExample(
                input_ids=tuple(ids),
                loss_mask=tuple(mask),
                weights=tuple(w * m for w, m in zip(weights, mask)),
                advantages=tuple(adv * m for m in mask),
                logprobs=tuple(lp * m for lp, m in zip(logprobs, mask)),
                has_logprobs=True,
                source=f"env/task{i // 3}/{i % 3}#0",
            )
        )
    return examples


def test_split_microbatches_rows_budget_sorting_and_merge():
    batch = make_batch(_random_examples(0, count=7), PAD)
    parts = split_microbatches(batch, 3)
    assert [p.size for p in parts] == [3, 3, 1]
    assert torch.cat([p.example_ids for p in parts]).tolist() == list(range(7))
    for p in parts:
        assert p.normalizers == batch.normalizers  # full-batch denominators travel with each part
        assert p.seq_length == int(p.lengths.max())  # trimmed to the longest row
        assert p.loss_mask.shape == (p.size, p.seq_length - 1)
    sorted_parts = split_microbatches(batch, 3, sort_by_length=True)
    lengths = [int(x) for p in sorted_parts for x in p.lengths]
    assert lengths == sorted(lengths, reverse=True)
    padded_plain = sum(p.size * p.seq_length for p in parts)
    padded_sorted = sum(p.size * p.seq_length for p in sorted_parts)
    assert padded_sorted <= padded_plain
    budget_parts = split_microbatches(batch, max_tokens=30)
    assert sorted(torch.cat([p.example_ids for p in budget_parts]).tolist()) == list(range(7))
    for p in budget_parts:
        assert p.size * p.seq_length <= 30 or p.size == 1
    # merge per-part values back into the batch's row order
    values = [p.loss_mask * (p.example_ids[:, None] + 1) for p in sorted_parts]
    merged = merge_microbatch_rows(batch, sorted_parts, values)
    torch.testing.assert_close(merged, batch.loss_mask * (torch.arange(7)[:, None] + 1))
    with pytest.raises(ValueError, match="exactly one"):
        split_microbatches(batch)
    with pytest.raises(ValueError, match="expected"):
        batch.with_logprobs(old=torch.zeros(7, 2))
    moved = batch.with_logprobs(ref=batch.engine_logprobs).to("cpu")
    assert moved.ref_logprobs is not None and moved.old_logprobs is None and moved.normalizers == batch.normalizers


def test_make_batch_groups_the_rows_of_a_split_trajectory():
    from tracegym.batch import GroupExamples, split_by_computed_tokens

    # calc/t1/0 was split by its template (#0, #1); the last row repeats its source but starts again at #0
    # (another trajectory of the same sample, e.g. a resampled group): a trajectory of its own
    rows = [_example([5, 6, 7], [0, 1, 1], source="calc/t1/0#0"), _example([5, 6, 8, 9], [0, 0, 1, 1], source="calc/t1/0#1"),
            _example([5, 7], [0, 1], source="calc/t1/1#0"), _example([4, 4], [0, 1], source=""),
            _example([5, 6, 7], [0, 1, 1], source="calc/t1/0#0")]
    batch = make_batch(rows, PAD)
    assert batch.trajectory_ids.tolist() == [0, 0, 1, 2, 3]
    # the trained size of the rest of each row's trajectory: the other part's 2 tokens, 0 for unsplit rows
    assert batch.trajectory_rest_sizes.tolist() == [2.0, 2.0, 0.0, 0.0, 0.0]
    assert batch.normalizers.num_sequences == 4.0  # trajectories, not the 5 rows
    # ids given explicitly (examples_from_groups knows them) win; a different group never continues a trajectory
    assert make_batch(rows, PAD, trajectory_ids=[9, 9, 9, 1, 2]).normalizers.num_sequences == 3.0
    assert make_batch(rows, PAD, group_ids=[0, 1, 1, 2, 0]).trajectory_ids.tolist() == [0, 1, 2, 3, 4]
    data = GroupExamples(examples=rows, group_index=[0, 0, 0, 1, 2], trajectory_index=[0, 0, 1, 0, 0])
    assert data.trajectory_ids == [0, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="trajectory ids"):
        make_batch(rows, PAD, trajectory_ids=[0])
    # the splitters never cut a trajectory's rows apart (a part may hold more rows than asked)
    for parts in (split_microbatches(batch, 1), split_microbatches(batch, 1, sort_by_length=True),
                  split_microbatches(batch, max_tokens=4), split_by_computed_tokens(batch, 4)):
        assert sorted(p.example_ids.tolist() for p in parts if 0 in p.example_ids.tolist()) == [[0, 1]]
        assert sorted(e for p in parts for e in p.example_ids.tolist()) == [0, 1, 2, 3, 4]
        assert all(p.trajectory_rest_sizes.tolist() == [2.0, 2.0] for p in parts if 0 in p.example_ids.tolist())
    assert [p.size for p in split_microbatches(batch, 1)] == [2, 1, 1, 1]
    assert [p.size for p in split_microbatches(batch, 1, keep_trajectories=False)] == [1, 1, 1, 1, 1]


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).float()
    model.eval()  # no dropout: forward passes are deterministic
    return model


def _grads(model) -> list[torch.Tensor]:
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=False)
    return grads


def _rl_loss(model, part: Batch, cfg: PolicyLossConfig) -> torch.Tensor:
    logprobs, entropy = token_logprobs_and_entropy(model, part.input_ids, part.attention_mask)
    loss, _ = compute_policy_loss(part, logprobs, entropy, cfg)
    return loss


CONFIGS = {
    "token_mean": PolicyLossConfig(aggregation="token_mean", clip_eps_high=0.28, dual_clip_c=3.0),
    "sequence_mean": PolicyLossConfig(aggregation="sequence_mean"),
    "fixed_length_sum": PolicyLossConfig(aggregation="fixed_length_sum", fixed_length=16),
    "sequence_sum": PolicyLossConfig(aggregation="sequence_sum", clip_eps_high=0.28),
    "gspo": PolicyLossConfig(loss="gspo", aggregation="sequence_mean", clip_eps_low=0.05),
    "all_terms": PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, entropy_clip=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_microbatch_gradients_sum_to_full_batch_gradient(tiny_model, name: str):
    cfg = CONFIGS[name]
    batch = make_batch(_random_examples(1), PAD)
    with torch.no_grad():
        current = token_logprobs(tiny_model, batch.input_ids, batch.attention_mask)
    # old log-probs differ from the current ones so ratios spread over the clip boundaries
    noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(2)) * 0.3
    batch = batch.with_logprobs(old=current + noise, ref=current - noise)

    tiny_model.zero_grad(set_to_none=False)
    full_loss = _rl_loss(tiny_model, batch, cfg)
    full_loss.backward()
    full = _grads(tiny_model)

    total = 0.0
    for part in split_microbatches(batch, 2, sort_by_length=True):
        loss = _rl_loss(tiny_model, part, cfg)
        loss.backward()
        total += loss.item()
    accumulated = _grads(tiny_model)
    assert total == pytest.approx(full_loss.item(), abs=1e-5)
    for g_full, g_acc in zip(full, accumulated):
        torch.testing.assert_close(g_acc, g_full, atol=1e-6, rtol=1e-4)

    # fault injection: per-part local normalisation (the classic accumulation bug) is not equivalent
    parts = split_microbatches(batch, 2, sort_by_length=True)
    for part in parts:
        local = Batch(**{**part.__dict__, "normalizers": LossNormalizers.from_mask(part.loss_mask, part.weights)})
        (_rl_loss(tiny_model, local, cfg) / len(parts)).backward()
    wrong = _grads(tiny_model)
    assert any(not torch.allclose(w, f, atol=1e-6, rtol=1e-4) for w, f in zip(wrong, full))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_microbatch_gradients_sum_to_full_batch_gradient_with_split_trajectories(tiny_model, name: str):
    # rows 0-1 and 3-5 are parts of two trajectories their template split (#0, #1, #2): one sequence each, for the
    # full batch and for every micro-batch of one or two rows (GSPO's ratio needs all of a trajectory's rows)
    parts_of = ["env/a/0#0", "env/a/0#1", "env/a/1#0", "env/b/0#0", "env/b/0#1", "env/b/0#2", "env/b/1#0"]
    examples = [ex.model_copy(update={"source": source}) for ex, source in zip(_random_examples(1), parts_of)]
    cfg = CONFIGS[name]
    batch = make_batch(examples, PAD)
    assert batch.trajectory_ids.tolist() == [0, 0, 1, 2, 2, 2, 3] and batch.normalizers.num_sequences == 4.0
    with torch.no_grad():
        current = token_logprobs(tiny_model, batch.input_ids, batch.attention_mask)
    noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(2)) * 0.3
    batch = batch.with_logprobs(old=current + noise, ref=current - noise)

    tiny_model.zero_grad(set_to_none=False)
    full_loss = _rl_loss(tiny_model, batch, cfg)
    full_loss.backward()
    full = _grads(tiny_model)
    for size in (1, 2):
        total = 0.0
        for part in split_microbatches(batch, size, sort_by_length=True):
            loss = _rl_loss(tiny_model, part, cfg)
            loss.backward()
            total += loss.item()
        accumulated = _grads(tiny_model)
        assert total == pytest.approx(full_loss.item(), abs=1e-5)
        for g_full, g_acc in zip(full, accumulated):
            torch.testing.assert_close(g_acc, g_full, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("reduction", ["weighted_mean", "token_mean"])
def test_microbatch_gradients_equal_full_batch_for_sft(tiny_model, reduction: str):
    batch = make_batch(_random_examples(3), PAD)

    def loss_of(part: Batch) -> torch.Tensor:
        logprobs = token_logprobs(tiny_model, part.input_ids, part.attention_mask)
        return sft_loss(logprobs, part.loss_mask, part.weights, reduction=reduction, normalizers=part.normalizers)[0]

    tiny_model.zero_grad(set_to_none=False)
    loss_of(batch).backward()
    full = _grads(tiny_model)
    for part in split_microbatches(batch, max_tokens=24):
        loss_of(part).backward()
    for g_full, g_acc in zip(full, _grads(tiny_model)):
        torch.testing.assert_close(g_acc, g_full, atol=1e-6, rtol=1e-4)


def test_token_logprobs_match_log_softmax_of_the_model(tiny_model):
    batch = make_batch(_random_examples(4, count=3), PAD)
    with torch.no_grad():
        logits = tiny_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        for temperature in (1.0, 0.7):
            reference = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
            got = token_logprobs(tiny_model, batch.input_ids, batch.attention_mask, temperature=temperature, chunk_rows=5)
            assert got.shape == batch.loss_mask.shape
            torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
        # padding does not change real tokens' values: a row alone equals the row in the batch
        alone = token_logprobs(tiny_model, batch.input_ids[2:3, : batch.lengths[2]], batch.attention_mask[2:3, : batch.lengths[2]])
        real = int(batch.lengths[2]) - 1
        torch.testing.assert_close(alone[0], token_logprobs(tiny_model, batch.input_ids, batch.attention_mask)[2, :real], atol=1e-5, rtol=0)
