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
