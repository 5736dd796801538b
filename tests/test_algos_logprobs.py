"""tracegym.train.logprobs: chunked log-probs and entropies against direct formulas."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.train.logprobs import logprobs_from_logits, token_entropy


def test_entropy_and_logprob_hand_computed():
    # logits [0, ln 3] -> p = [0.25, 0.75]; H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335
    # uniform over 4 -> H = ln 4 = 1.386294; log p(target 1) of the first row = ln 0.75 = -0.287682
    logits = torch.tensor([[[0.0, math.log(3.0), -1e9, -1e9], [1.0, 1.0, 1.0, 1.0]]])
    entropy = token_entropy(logits)
    torch.testing.assert_close(entropy, torch.tensor([[0.562335, 1.386294]]), atol=1e-6, rtol=0)
    logp = logprobs_from_logits(logits, torch.tensor([[1, 3]]))
    torch.testing.assert_close(logp, torch.tensor([[-0.287682, -1.386294]]), atol=1e-6, rtol=0)
    # temperature 0.5 doubles the logits: p = [1/10, 9/10] -> log p(1) = ln 0.9 = -0.105361
    assert logprobs_from_logits(logits, torch.tensor([[1, 3]]), temperature=0.5)[0, 0].item() == pytest.approx(-0.105361, abs=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
def test_chunked_values_and_gradients_match_log_softmax(chunk_rows: int):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 8, 50, generator=gen)
    targets = torch.randint(0, 50, (3, 7), generator=gen)
    logits_a = base.clone().requires_grad_()
    logits_b = base.clone().requires_grad_()
    # the non-contiguous slice [:, :-1] is what token_logprobs passes
    got = logprobs_from_logits(logits_a[:, :-1], targets, temperature=0.8, chunk_rows=chunk_rows)
    got_h = token_entropy(logits_a[:, :-1], temperature=0.8, chunk_rows=chunk_rows)
    scaled = logits_b[:, :-1] / 0.8
    ref = torch.log_softmax(scaled, -1).gather(-1, targets[..., None]).squeeze(-1)
    ref_h = -(torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_h, ref_h, atol=1e-6, rtol=1e-5)
    weights = torch.randn(3, 7, generator=gen)
    ((got + got_h) * weights).sum().backward()
    ((ref + ref_h) * weights).sum().backward()
    torch.testing.assert_close(logits_a.grad, logits_b.grad, atol=1e-6, rtol=1e-5)


def test_bfloat16_logits_give_float32_logprobs_and_bad_input_raises():
    logits = torch.randn(2, 5, 16).to(torch.bfloat16)
    out = logprobs_from_logits(logits, torch.zeros(2, 5, dtype=torch.long))
    assert out.dtype == torch.float32 and (out <= 0).all()
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(logits, torch.zeros(2, 5, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="do not match"):
        logprobs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long))


def test_first_column_skips_the_output_layer_but_changes_nothing_trained(tiny_model):
    """Log-probs and entropies from ``first_column`` on equal the full computation there (values and
    LoRA-free full gradients), and the model really computes fewer logits."""
    from tracegym.train.logprobs import token_logprobs, token_logprobs_and_entropy

    model, _ = tiny_model
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a right-padded row
    first = 6

    full_lp, full_h = token_logprobs_and_entropy(model, ids, mask, temperature=0.7)
    part_lp, part_h = token_logprobs_and_entropy(model, ids, mask, temperature=0.7, first_column=first)
    assert part_lp.shape == full_lp.shape == (2, 11)
    torch.testing.assert_close(part_lp[:, first:], full_lp[:, first:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part_h[:, first:], full_h[:, first:], rtol=1e-5, atol=1e-5)
    assert torch.equal(part_lp[:, :first], torch.zeros(2, first))

    # gradients of a loss on the kept columns are the same either way
    weight = model.get_input_embeddings().weight
    grads = []
    for column in (0, first):
        model.zero_grad(set_to_none=True)
        token_logprobs(model, ids, mask, first_column=column)[:, first:].sum().backward()
        grads.append(weight.grad.clone())
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)

    calls = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape[1]))
    try:
        token_logprobs(model, ids, mask, first_column=first)
    finally:
        handle.remove()
    assert calls == [12 - first]  # the output layer saw only the kept positions
    with pytest.raises(ValueError, match="first_column"):
        token_logprobs(model, ids, mask, first_column=11)
