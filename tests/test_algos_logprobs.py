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
        token_logprobs(model, ids, mask, first_column=first, fused_head=False)
        assert calls == [12 - first]  # the output layer saw only the kept positions
        token_logprobs(model, ids, mask, first_column=first)
        assert calls == [12 - first]  # fused: the output layer's weight is used chunk by chunk, no [B, L, V] call
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="first_column"):
        token_logprobs(model, ids, mask, first_column=11)


def _lora_copy(seed: int = 0, dtype: torch.dtype = torch.float64):
    """A tiny-random model with a fresh LoRA adapter whose B is random (so LoRA gradients flow), in ``dtype``."""
    from tracegym.config import LoraConfig
    from tracegym.models import load
    from tracegym.train.lora import prepare_model

    model, _ = load("tiny-random")
    model = prepare_model(model, LoraConfig(r=4, alpha=8), None).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    return model


@pytest.mark.parametrize("entropy_weight", [0.0, 0.3])
@pytest.mark.parametrize("rows_share_prefix", [False, True])
def test_fused_output_layer_equals_full_logits_in_values_and_gradients(entropy_weight: float, rows_share_prefix: bool):
    """The fused output layer (chunks of 3 positions: several chunks per row) against full logits in
    float64 weights: log-probs, entropies and every LoRA gradient agree to float32 rounding (both
    paths do the softmax arithmetic in float32, by design; a wrong formula is off by O(1)), with and without the
    entropy in the loss (unused, its backward is skipped), with and without a shared prefix."""
    from tracegym.train.logprobs import output_head, token_logprobs_and_entropy

    model = _lora_copy()
    assert output_head(model) is not None
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (3, 40), generator=gen)
    if rows_share_prefix:
        ids[:, :24] = ids[0, :24]  # a 24-token common prefix: computed once (MIN_SHARED_PREFIX 16)
    mask = torch.ones_like(ids)
    mask[2, 33:] = 0
    weights = torch.randn(3, 39, generator=gen, dtype=torch.float64) * mask[:, 1:]
    results = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        lp, h = token_logprobs_and_entropy(model, ids, mask, temperature=0.7, first_column=20, chunk_rows=3, fused_head=fused)
        ((lp * weights).sum() + entropy_weight * (h * weights).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp * mask[:, 1:], h * mask[:, 1:], grads))
    (lp_a, h_a, g_a), (lp_b, h_b, g_b) = results
    assert lp_a.dtype == torch.float32  # log-probs come out float32 either way
    torch.testing.assert_close(lp_b, lp_a, atol=1e-6, rtol=0)
    torch.testing.assert_close(h_b, h_a, atol=1e-6, rtol=0)
    assert g_a.keys() == g_b.keys() and len(g_a) == 28  # 2 layers x 7 projections x lora_A, lora_B
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], atol=1e-6 * float(g_a[name].abs().max()), rtol=0, msg=name)


def test_fused_output_layer_trains_the_output_weights_like_full_logits():
    """Full fine-tuning (the output layer tied to the embeddings trains): the weight gradient of the
    fused layer (accumulated chunk by chunk) equals autograd's through full logits."""
    from tracegym.models import load
    from tracegym.train.logprobs import token_logprobs

    model, _ = load("tiny-random")
    model = model.to(torch.float64).eval()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 1000, (2, 16), generator=gen)
    mask = torch.ones_like(ids)
    grads = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        token_logprobs(model, ids, mask, temperature=1.3, chunk_rows=5, fused_head=fused)[:, 4:].sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6 * float(grads[0][name].abs().max()), rtol=0, msg=name)


def test_fused_output_layer_under_bfloat16_autocast_matches_the_model():
    """Under ``model.autocast`` the fused layer multiplies in bfloat16 as the model's own output layer
    does, so its log-probs equal those from the model's bfloat16 logits (up to chunk shapes)."""
    from tracegym.train.logprobs import token_logprobs
    from tracegym.train.precision import set_training_autocast

    model = _lora_copy(dtype=torch.float32)
    set_training_autocast(model, torch.bfloat16)
    ids = torch.randint(3, 1000, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    fused = token_logprobs(model, ids, mask, first_column=5)
    full = token_logprobs(model, ids, mask, first_column=5, fused_head=False)
    torch.testing.assert_close(fused, full, atol=2e-2, rtol=0)
    set_training_autocast(model, None)
    exact = token_logprobs(model, ids, mask, first_column=5)
    assert (fused - exact).abs().max() > 1e-5  # it really ran in bfloat16


def test_models_the_fused_layer_cannot_reproduce_take_full_logits():
    """``output_head`` refuses what would change the logits: an unknown architecture (soft-capping,
    logit scaling may follow the output layer) and LoRA on the output layer itself."""
    from peft import LoraConfig as PeftLora, get_peft_model

    from tracegym.models import load
    from tracegym.train.logprobs import output_head, token_logprobs

    model, _ = load("tiny-random")
    assert output_head(model) is not None
    lora_head = get_peft_model(load("tiny-random")[0], PeftLora(r=2, target_modules=["q_proj", "lm_head"]))
    assert output_head(lora_head) is None
    other, _ = load("tiny-random")
    other.config.model_type = "gemma2"
    assert output_head(other) is None
    ids = torch.randint(3, 1000, (1, 8), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(token_logprobs(other, ids, torch.ones_like(ids)),
                               token_logprobs(model, ids, torch.ones_like(ids), fused_head=False))
