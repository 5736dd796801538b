"""The update's shared-prefix forward: a micro-batch's common prefix runs once, and log-probs,
entropies and gradients equal the plain forward's (float rounding aside)."""

from __future__ import annotations

import pytest
import torch

from tracegym.config import LoraConfig
from tracegym.models import load
from tracegym.train.logprobs import MIN_SHARED_PREFIX, shared_prefix_length, token_logprobs_and_entropy
from tracegym.train.lora import prepare_model


def _batch(prefix_len: int, suffixes=(12, 7, 20, 3), seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(5, 1000, (prefix_len,), generator=gen)
    rows = [torch.cat([prefix, torch.randint(5, 1000, (n,), generator=gen)]) for n in suffixes]
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return ids, mask


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
    torch.manual_seed(0)
    model, _ = load("tiny-random")
    model = prepare_model(model, LoraConfig(r=4)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
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
