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
    plain_forward = model.lm_head.forward
    model.lm_head.forward = lambda hidden: calls.append(hidden.shape[1]) or plain_forward(hidden)  # counts, no hook
    try:
        token_logprobs(model, ids, mask, first_column=first, fused_head=False)
        assert calls == [12 - first]  # the output layer saw only the kept positions
        token_logprobs(model, ids, mask, first_column=first)
        assert calls == [12 - first]  # fused: the output layer's weight is used chunk by chunk, no [B, L, V] call
    finally:
        del model.lm_head.forward
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
        loss = (lp * weights).sum()
        if entropy_weight:  # else the entropy stays out of the graph: its gradient arrives as None
            loss = loss + entropy_weight * (h * weights).sum()
        loss.backward()
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


def test_fused_output_layer_under_bfloat16_autocast_multiplies_in_bfloat16():
    """Under autocast the fused function multiplies in bfloat16 as the model's own output layer
    would (autocast's linear): its log-probs, entropies and hidden-state gradients equal those of a
    bfloat16 ``F.linear`` with float32 softmax arithmetic, and differ from a float32 head's by far
    more than float rounding. The weight is scaled up so that bfloat16 rounding shows."""
    from tracegym.train.logprobs import _FusedHeadLogprobEntropy

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, 16, generator=gen)
    weight = torch.randn(300, 16, generator=gen) * 3.0
    targets = torch.randint(0, 300, (10,), generator=gen)
    upstream = torch.randn(10, generator=gen)

    def reference(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = hidden.clone().requires_grad_()
        z = torch.nn.functional.linear(h.to(dtype), weight.to(dtype)).float() / 0.8
        logp = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
        ((logp + 0.5 * entropy) * upstream).sum().backward()
        return logp.detach(), entropy.detach(), h.grad

    h = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = _FusedHeadLogprobEntropy.apply(h, weight, None, targets, 0.8, 4, True)
    ((logp + 0.5 * entropy) * upstream).sum().backward()
    bf16, fp32 = reference(torch.bfloat16), reference(torch.float32)
    torch.testing.assert_close(logp, bf16[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, bf16[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad, bf16[2], atol=2e-2, rtol=2e-2)  # bfloat16 matmul in the backward too
    assert (logp - fp32[0]).abs().max() > 1e-2  # really bfloat16: far from the float32 head


def test_fused_output_layer_with_a_bias_and_an_entropy_only_loss():
    """A biased output layer (no supported model has one; the function supports it) against autograd
    through full logits: values and the hidden, weight and bias gradients of a loss on the entropy
    alone (the log-prob output unused: its gradient arrives as None)."""
    from tracegym.train.logprobs import _FusedHeadLogprobEntropy

    gen = torch.Generator().manual_seed(5)
    hidden, weight, bias = (torch.randn(7, 12, generator=gen, dtype=torch.float64), torch.randn(
        40, 12, generator=gen, dtype=torch.float64), torch.randn(40, generator=gen, dtype=torch.float64))
    targets = torch.randint(0, 40, (7,), generator=gen)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    _, entropy = _FusedHeadLogprobEntropy.apply(*leaves, targets, 1.5, 3, True)
    (entropy * torch.arange(7.0)).sum().backward()
    expected = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    z = torch.nn.functional.linear(*expected).float() / 1.5
    reference = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    (reference * torch.arange(7.0)).sum().backward()
    torch.testing.assert_close(entropy, reference, atol=1e-6, rtol=0)
    for got, want in zip(leaves, expected):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5 * float(want.grad.abs().max()), rtol=0)


def test_models_the_fused_layer_cannot_reproduce_take_full_logits():
    """``output_head`` refuses what would change the logits: an unknown architecture (soft-capping,
    logit scaling may follow the output layer), LoRA on the output layer itself, a hooked output
    layer, aLoRA; such a model goes through its own output layer."""
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
    hooked, _ = load("tiny-random")
    hooked.lm_head.register_forward_hook(lambda m, i, o: None)
    assert output_head(hooked) is None  # a hook (offloading, a user's) expects the layer to be called
    alora = get_peft_model(load("tiny-random")[0], PeftLora(r=2, target_modules=["q_proj"]))
    assert output_head(alora) is not None
    alora.peft_config["default"].alora_invocation_tokens = [5, 6]  # aLoRA: PeftModel.forward computes its offsets
    assert output_head(alora) is None
    ids = torch.randint(3, 1000, (1, 8), generator=torch.Generator().manual_seed(4))
    calls = []
    plain_forward = other.lm_head.forward
    other.lm_head.forward = lambda hidden: calls.append(1) or plain_forward(hidden)
    torch.testing.assert_close(token_logprobs(other, ids, torch.ones_like(ids)),
                               token_logprobs(model, ids, torch.ones_like(ids), fused_head=False))
    assert calls == [1]  # the refused model went through its own output layer
