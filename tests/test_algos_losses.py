"""Policy losses (per token), aggregation, SFT loss, compute_policy_loss and PolicyLossConfig against
hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.algos import (
    POLICY_LOSSES,
    GSPOOptions,
    LossInputs,
    LossNormalizers,
    PolicyLossConfig,
    PPOClipOptions,
    aggregate,
    compute_policy_loss,
    kl_per_token,
    policy_loss_problems,
    sft_loss,
)
from tracegym.batch import Batch

LN = math.log


def _per_token(name, logprobs, old, adv, mask=None, entropy=None, **options):
    """The registered loss's per-token loss [B, T] and metrics."""
    mask = torch.ones_like(adv) if mask is None else mask
    inputs = LossInputs(logprobs=logprobs, old_logprobs=old, advantages=adv, mask=mask, entropy=entropy)
    return POLICY_LOSSES.entry(name)(inputs, options)


def _token_mean(name, logprobs, old, adv, mask=None, **options):
    per_token, metrics = _per_token(name, logprobs, old, adv, mask, **options)
    mask = torch.ones_like(adv) if mask is None else mask
    return aggregate(per_token, mask, "token_mean"), metrics


def test_ppo_clip_hand_computed_values_metrics_and_gradients():
    # ratios r = exp(logp - old) = [1.5, 0.5, 1.1, 0.7, 1.5], advantages [1, -1, 2, -2, -1], eps 0.2
    # token 0: max(-1*1.5, -1*1.2) = -1.2   (A>0, r>1.2: clipped high, zero gradient)
    # token 1: max( 1*0.5,  1*0.8) =  0.8   (A<0, r<0.8: clipped low, zero gradient)
    # token 2: max(-2*1.1, -2*1.1) = -2.2   (inside the range: gradient -A*r = -2.2)
    # token 3: max( 2*0.7,  2*0.8) =  1.6   (clipped low)
    # token 4: max( 1*1.5,  1*1.2) =  1.5   (A<0 and r>1.2 is NOT clipped: gradient -A*r = 1.5)
    # token mean = (-1.2 + 0.8 - 2.2 + 1.6 + 1.5) / 5 = 0.5 / 5 = 0.1
    old = torch.zeros(1, 5)
    logprobs = torch.tensor([[LN(1.5), LN(0.5), LN(1.1), LN(0.7), LN(1.5)]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0, -2.0, -1.0]])
    per_token, metrics = _per_token("ppo_clip", logprobs, old, adv)
    torch.testing.assert_close(per_token.detach(), torch.tensor([[-1.2, 0.8, -2.2, 1.6, 1.5]]), atol=1e-6, rtol=0)
    loss = aggregate(per_token, torch.ones(1, 5), "token_mean")
    assert loss.item() == pytest.approx(0.1, abs=1e-6)
    assert metrics["clip_frac_low"] == pytest.approx(2 / 5)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5)
    assert metrics["ratio_min"] == pytest.approx(0.5, abs=1e-6)
    assert metrics["ratio_max"] == pytest.approx(1.5, abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.7 + 1.5) / 5, abs=1e-6)
    # approx_kl = mean(r - 1 - log r)
    expected_kl = sum(r - 1 - LN(r) for r in (1.5, 0.5, 1.1, 0.7, 1.5)) / 5
    assert metrics["approx_kl"] == pytest.approx(expected_kl, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # d loss / d logp_t = (-A_t r_t) / 5 on unclipped tokens, 0 on clipped ones
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -2.2 / 5, 0.0, 1.5 / 5]]), atol=1e-6, rtol=0)


def test_ppo_metrics_count_only_masked_tokens():
    # same tokens as above, the last two masked out: clip fractions over 3 tokens, ratio max 1.5 -> 1.5, min 0.5
    old = torch.zeros(1, 5)
    logprobs = torch.tensor([[LN(1.5), LN(0.5), LN(1.1), LN(9.0), LN(0.01)]])
    adv = torch.tensor([[1.0, -1.0, 2.0, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])
    _, m = _per_token("ppo_clip", logprobs, old, adv, mask)
    assert m["clip_frac_low"] == pytest.approx(1 / 3) and m["clip_frac_high"] == pytest.approx(1 / 3)
    assert (m["ratio_min"], m["ratio_max"]) == (pytest.approx(0.5), pytest.approx(1.5))


def test_ppo_clip_higher_and_dual_clip():
    # clip-higher eps_low 0.2, eps_high 0.28, A = 1: r = 1.25 -> -1.25 (inside), r = 1.5 -> -1.28 (clipped)
    logprobs = torch.tensor([[LN(1.25), LN(1.5)]])
    per_token, m = _per_token("ppo_clip", logprobs, torch.zeros(1, 2), torch.ones(1, 2), clip_eps_high=0.28)
    torch.testing.assert_close(per_token, torch.tensor([[-1.25, -1.28]]), atol=1e-6, rtol=0)
    assert m["clip_frac_high"] == pytest.approx(0.5)
    # symmetric 0.2 clips both: (-1.2 - 1.2)/2
    loss, _ = _token_mean("ppo_clip", logprobs, torch.zeros(1, 2), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    # dual clip c = 3, A = -1: r = 5 -> min(max(5, 1.2), 3) = 3 with zero gradient; r = 2 -> 2 (below the cap)
    logprobs = torch.tensor([[LN(5.0), LN(2.0)]], requires_grad=True)
    loss, m = _token_mean("ppo_clip", logprobs, torch.zeros(1, 2), -torch.ones(1, 2), dual_clip_c=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2, abs=1e-5)
    assert m["dual_clip_frac"] == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0 / 2]]), atol=1e-5, rtol=0)
    # without the dual clip the first token costs 5
    loss, m = _token_mean("ppo_clip", logprobs.detach(), torch.zeros(1, 2), -torch.ones(1, 2))
    assert loss.item() == pytest.approx((5.0 + 2.0) / 2, abs=1e-5)
    assert "dual_clip_frac" not in m


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "policy_gradient"])
def test_on_policy_loss_is_minus_advantage_per_token(name: str):
    gen = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(3, 6, generator=gen) * 3
    adv = torch.randn(3, 6, generator=gen)
    mask = (torch.rand(3, 6, generator=gen) > 0.3).float()
    mask[0, 0] = 1.0
    per_token, metrics = _per_token(name, logprobs.clone().requires_grad_(), logprobs, adv, mask)
    # every token (masked or not: the loss does not mask) is -A at ratio 1
    torch.testing.assert_close(per_token.detach(), -adv, atol=1e-6, rtol=0)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics.get("clip_frac_low", 0.0) == 0.0 and metrics.get("clip_frac_high", 0.0) == 0.0


def test_aggregation_modes_hand_computed():
    # row 0: tokens with loss [1, 3] (third column masked out: its 100 must not count); row 1: [4]
    per_token = torch.tensor([[1.0, 3.0, 100.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(8 / 3)  # (1+3+4)/3
    assert aggregate(per_token, mask, "sequence_mean").item() == pytest.approx(3.0)  # (4/2 + 4/1)/2
    assert aggregate(per_token, mask, "sequence_sum").item() == pytest.approx(4.0)  # (4 + 4)/2
    # fixed length 4: (4/4 + 4/4) / 2 = 1
    assert aggregate(per_token, mask, "fixed_length_sum", fixed_length=4).item() == pytest.approx(1.0)
    # no fallback to the batch's padded length (3): that would depend on the longest sample
    with pytest.raises(ValueError, match="fixed_length"):
        aggregate(per_token, mask, "fixed_length_sum")
    # token weights scale the numerator only: weights [2, 1] on row 0 -> (2 + 3 + 4)/3
    w = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert aggregate(per_token, mask, "token_mean", token_weights=w).item() == pytest.approx(3.0)
    assert aggregate(per_token, mask, "sequence_sum", token_weights=w).item() == pytest.approx((5 + 4) / 2)
    # full-batch normalizers replace the local denominators: 10 tokens, 4 sequences
    norm = LossNormalizers(num_tokens=10, num_sequences=4, weight_sum=10, max_target_length=8)
    assert aggregate(per_token, mask, "token_mean", normalizers=norm).item() == pytest.approx(0.8)
    assert aggregate(per_token, mask, "sequence_mean", normalizers=norm).item() == pytest.approx(1.5)
    assert aggregate(per_token, mask, "sequence_sum", normalizers=norm).item() == pytest.approx(2.0)
    assert aggregate(per_token, mask, "fixed_length_sum", normalizers=norm, fixed_length=4).item() == pytest.approx(8 / 4 / 4)
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(per_token, mask, "sum")


# A trajectory split by its template into two rows (a: 2 + 3 trained tokens) and an unsplit one (b: 1 token),
# and the same trajectories as one row each: the split must not change any sequence-level quantity.
SPLIT_MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
SPLIT_IDS = torch.tensor([7, 7, 3])  # any ids: rows sharing one are one trajectory
WHOLE_MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0]])


def _as_whole(split: torch.Tensor) -> torch.Tensor:
    """[3, 5] values on the split rows -> [2, 5] on the whole rows (a's two rows concatenated, b as is)."""
    whole = torch.zeros(2, 5, dtype=split.dtype)
    whole[0] = torch.cat([split[0, :2], split[1, :3]])
    whole[1] = split[2]
    return whole


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "sequence_sum", "fixed_length_sum"])
def test_a_trajectory_split_into_rows_aggregates_as_one_sequence(mode: str):
    per_token = torch.tensor([[1.0, 3.0, 9.0, 9.0, 9.0], [2.0, 4.0, 6.0, 9.0, 9.0], [5.0, 9.0, 9.0, 9.0, 9.0]], requires_grad=True)
    whole = _as_whole(per_token.detach()).requires_grad_(True)
    split_loss = aggregate(per_token, SPLIT_MASK, mode, fixed_length=4, trajectory_ids=SPLIT_IDS)
    whole_loss = aggregate(whole, WHOLE_MASK, mode, fixed_length=4)
    # by hand: a = [1, 3, 2, 4, 6] (sum 16, n 5), b = [5]; two sequences
    expected = {"token_mean": 21 / 6, "sequence_mean": (16 / 5 + 5) / 2, "sequence_sum": 21 / 2, "fixed_length_sum": 21 / 4 / 2}
    assert split_loss.item() == pytest.approx(expected[mode]) and whole_loss.item() == pytest.approx(expected[mode])
    split_loss.backward()
    whole_loss.backward()
    # every token gets the gradient weight it has in the unsplit trajectory (a: 1/(5*2) each under sequence_mean;
    # per row it was 1/(2*3) and 1/(3*3), and a weighed 2/3 of the batch instead of 1/2)
    torch.testing.assert_close(_as_whole(per_token.grad) * WHOLE_MASK, whole.grad * WHOLE_MASK)
    # without ids every row is a sequence, as before
    per_row = {"token_mean": 21 / 6, "sequence_mean": (4 / 2 + 12 / 3 + 5) / 3, "sequence_sum": 21 / 3, "fixed_length_sum": 21 / 4 / 3}
    assert aggregate(per_token, SPLIT_MASK, mode, fixed_length=4).item() == pytest.approx(per_row[mode])


def test_sequence_mean_of_a_micro_batch_divides_by_the_whole_trajectory():
    # row 1 (a's second part) alone in a micro-batch: its tokens are divided by a's 5 tokens (2 of them elsewhere,
    # trajectory_rest_sizes) and by the full batch's 2 sequences
    per_token = torch.tensor([[2.0, 4.0, 6.0, 0.0, 0.0]])
    norm = LossNormalizers.from_mask(SPLIT_MASK, trajectory_ids=SPLIT_IDS)
    assert norm.num_sequences == 2.0
    part = aggregate(per_token, SPLIT_MASK[1:2], "sequence_mean", normalizers=norm, trajectory_ids=SPLIT_IDS[1:2],
                     trajectory_rest_sizes=torch.tensor([2.0]))
    assert part.item() == pytest.approx(12 / 5 / 2)


def test_gspo_ratio_is_one_per_trajectory_over_all_its_rows():
    torch.manual_seed(0)
    logprobs = (torch.randn(3, 5) * 0.01).requires_grad_(True)
    old = torch.zeros(3, 5)
    advantages = torch.tensor([[1.0] * 5, [1.0] * 5, [-0.5] * 5])
    opts = {"clip_eps_low": 0.2, "clip_eps_high": 0.2}
    split = LossInputs(logprobs=logprobs, old_logprobs=old, advantages=advantages, mask=SPLIT_MASK, trajectory_ids=SPLIT_IDS)
    split_tokens, _ = POLICY_LOSSES.entry("gspo")(split, opts)
    whole_logprobs = _as_whole(logprobs.detach()).requires_grad_(True)
    whole = LossInputs(logprobs=whole_logprobs, old_logprobs=torch.zeros(2, 5), advantages=_as_whole(advantages),
                       mask=WHOLE_MASK)
    whole_tokens, _ = POLICY_LOSSES.entry("gspo")(whole, opts)
    # s_a = exp(mean of a's 5 log-ratios) on both of a's rows (per row it was two different ratios)
    s_a = torch.exp(torch.cat([logprobs[0, :2], logprobs[1, :3]]).mean()).item()
    assert split_tokens[0, 0].item() == pytest.approx(-s_a) and split_tokens[1, 2].item() == pytest.approx(-s_a)
    torch.testing.assert_close(_as_whole(split_tokens.detach()) * WHOLE_MASK, whole_tokens.detach() * WHOLE_MASK)
    # the same total gradient per token under sequence_mean as the unsplit trajectory
    aggregate(split_tokens, SPLIT_MASK, "sequence_mean", trajectory_ids=SPLIT_IDS).backward()
    aggregate(whole_tokens, WHOLE_MASK, "sequence_mean").backward()
    torch.testing.assert_close(_as_whole(logprobs.grad) * WHOLE_MASK, whole_logprobs.grad * WHOLE_MASK)
    # without ids each row keeps its own ratio, exactly as before
    per_row, _ = _per_token("gspo", logprobs.detach(), old, advantages, SPLIT_MASK, **opts)
    assert per_row[0, 0].item() == pytest.approx(-math.exp(logprobs[0, :2].mean().item()))


def _batch(logprobs_old, advantages, mask, engine=None, ref=None, old=None) -> Batch:
    b, t = mask.shape
    return Batch(
        input_ids=torch.zeros(b, t + 1, dtype=torch.long),
        attention_mask=torch.ones(b, t + 1, dtype=torch.long),
        loss_mask=mask,
        weights=mask.clone(),
        advantages=advantages,
        engine_logprobs=engine if engine is not None else logprobs_old,
        has_engine_logprobs=torch.ones(b, dtype=torch.bool),
        example_ids=torch.arange(b),
        group_ids=torch.zeros(b, dtype=torch.long),
        normalizers=LossNormalizers.from_mask(mask),
        old_logprobs=old,
        ref_logprobs=ref,
    )


@pytest.mark.parametrize("name", ["ppo_clip", "policy_gradient"])
def test_policy_loss_under_each_aggregation_on_policy(name: str):
    # on policy the per-token loss is -A: row 0 A = [-1, -3] (2 tokens), row 1 A = [-4] -> as above
    adv = torch.tensor([[-1.0, -3.0, 7.0], [-4.0, 5.0, 0.0]])  # 7 and 5 are masked out
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    lp = torch.full((2, 3), -1.0)
    expect = {"token_mean": 8 / 3, "sequence_mean": 3.0, "sequence_sum": 4.0, "fixed_length_sum": 1.0}
    for mode, value in expect.items():
        cfg = PolicyLossConfig(loss=name, aggregation=mode, fixed_length=4)
        loss, m = compute_policy_loss(_batch(lp, adv, mask), lp, None, cfg)
        assert loss.item() == pytest.approx(value), mode
        assert m["policy_loss"] == pytest.approx(value) and m["loss"] == pytest.approx(value)
        assert m["num_tokens"] == 3


def test_gspo_sequence_ratio_hand_computed():
    # token log ratios [0.2, -0.1] -> sequence log ratio 0.05, s = exp(0.05) = 1.051271; A = 1
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[0.2, -0.1]])
    adv = torch.ones(1, 2)
    per_token, m = _per_token("gspo", logprobs, old, adv, clip_eps_low=0.2, clip_eps_high=0.2)
    torch.testing.assert_close(per_token, torch.full((1, 2), -1.051271), atol=1e-6, rtol=0)
    assert m["ratio_mean"] == pytest.approx(1.051271, abs=1e-6)
    # approx_kl comes from the token log-ratios: mean(e^0.2 - 1 - 0.2, e^-0.1 - 1 + 0.1)
    assert m["approx_kl"] == pytest.approx((math.expm1(0.2) - 0.2 + math.expm1(-0.1) + 0.1) / 2, abs=1e-6)
    # eps_high 0.04 clips s at 1.04
    per_token, m = _per_token("gspo", logprobs, old, adv, clip_eps_low=3e-4, clip_eps_high=0.04)
    torch.testing.assert_close(per_token, torch.full((1, 2), -1.04), atol=1e-6, rtol=0)
    assert m["clip_frac_high"] == pytest.approx(1.0)
    # GSPO's own defaults (3e-4 / 4e-4): s = 1.051271 is clipped at 1.0004
    assert GSPOOptions() == GSPOOptions(clip_eps_low=3e-4, clip_eps_high=4e-4)
    per_token, _ = _per_token("gspo", logprobs, old, adv)
    torch.testing.assert_close(per_token, torch.full((1, 2), -1.0004), atol=1e-6, rtol=0)


def test_gspo_token_form_has_the_gradient_of_sequence_gspo():
    # Direct GSPO: J = -(1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(logp - old)) with gradient.
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 5, generator=gen) * 2
    logprobs = (old + 0.1 * torch.randn(4, 5, generator=gen)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    seq_adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    adv = seq_adv[:, None].expand(4, 5)
    eps = 0.05
    s = torch.exp(((logprobs - old) * mask).sum(-1) / mask.sum(-1))
    direct = -torch.minimum(s * seq_adv, s.clamp(1 - eps, 1 + eps) * seq_adv).mean()
    (g_direct,) = torch.autograd.grad(direct, logprobs)
    batch = _batch(old, adv, mask, old=old)
    cfg = PolicyLossConfig(loss="gspo", aggregation="sequence_mean", clip_eps_low=eps, clip_eps_high=eps)
    loss, _ = compute_policy_loss(batch, logprobs, None, cfg)
    (g_token,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() == pytest.approx(direct.item(), abs=1e-6)
    torch.testing.assert_close(g_token, g_direct, atol=1e-6, rtol=1e-5)
    assert (g_direct != 0).any()  # some sequences are inside the clip range


def test_entropy_aware_clip_widens_for_high_entropy_tokens():
    # entropy [0.1, 3.0], reference 1, scales clamp([0.1, 3], 0.5, 2) = [0.5, 2] -> eps_high [0.1, 0.4]
    # r = 1.2 and A = 1 at both: token 0 clipped at 1.1 -> -1.1; token 1 inside -> -1.2; mean -1.15
    logprobs = torch.full((1, 2), LN(1.2))
    entropy = torch.tensor([[0.1, 3.0]])
    per_token, m = _per_token("ppo_clip", logprobs, torch.zeros(1, 2), torch.ones(1, 2), entropy=entropy, entropy_clip=True)
    torch.testing.assert_close(per_token, torch.tensor([[-1.1, -1.2]]), atol=1e-6, rtol=0)
    assert m["clip_frac_high"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="ppo_clip: entropy_clip"):
        _per_token("ppo_clip", logprobs, torch.zeros(1, 2), torch.ones(1, 2), entropy_clip=True)
    # through the composition: a missing entropy fails the same way
    batch = _batch(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss(batch, logprobs, None, PolicyLossConfig(entropy_clip=True))
    loss, _ = compute_policy_loss(batch, logprobs, entropy, PolicyLossConfig(entropy_clip=True))
    assert loss.item() == pytest.approx(-1.15, abs=1e-6)


def test_sft_loss_hand_computed():
    # nll [1, 2, 3] (4th token masked), weights [1, 2, 0.5]: weighted = (1 + 4 + 1.5)/3.5; token mean = 6.5/3
    logprobs = torch.tensor([[-1.0, -2.0, -3.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights = torch.tensor([[1.0, 2.0, 0.5, 7.0]])
    loss, m = sft_loss(logprobs, mask, weights)
    assert loss.item() == pytest.approx(6.5 / 3.5)
    loss, _ = sft_loss(logprobs, mask, weights, reduction="token_mean")
    assert loss.item() == pytest.approx(6.5 / 3)
    assert m["nll"] == pytest.approx(2.0) and m["num_tokens"] == 3
    # without weights both are the plain token mean (1+2+3)/3 = 2
    assert sft_loss(logprobs, mask)[0].item() == pytest.approx(2.0)


def test_compute_policy_loss_composes_kl_entropy_and_tis():
    # one row, 2 tokens, on policy (old = new = -1), A = [1, 2] -> policy loss -(1+2)/2 = -1.5
    # ref = [-1.5, -0.5]: log r = ref - logp = [-0.5, 0.5]
    # k3 = e^{log r} - 1 - log r = [0.106531, 0.148721] -> mean 0.127626; k2 = (log r)^2/2 = [0.125, 0.125]
    # entropy [0.4, 0.8] -> mean 0.6; TIS: engine = [-1.5, -1.0]: w = min(exp([0.5, 0]), 1.5) = [1.5, 1]
    lp = torch.full((1, 2), -1.0)
    adv = torch.tensor([[1.0, 2.0]])
    mask = torch.ones(1, 2)
    ref = torch.tensor([[-1.5, -0.5]])
    entropy = torch.tensor([[0.4, 0.8]])
    batch = _batch(lp, adv, mask, engine=torch.tensor([[-1.5, -1.0]]), ref=ref, old=lp)
    loss, m = compute_policy_loss(batch, lp, entropy, PolicyLossConfig())
    assert loss.item() == pytest.approx(-1.5)
    assert m["entropy"] == pytest.approx(0.6)
    assert "kl_ref" not in m and "tis_weight_mean" not in m
    cfg = PolicyLossConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    loss, m = compute_policy_loss(batch, lp, entropy, cfg)
    assert loss.item() == pytest.approx(-1.5 + 0.1 * 0.127626 - 0.01 * 0.6, abs=1e-6)
    assert m["kl_ref"] == pytest.approx(0.127626, abs=1e-6)
    assert m["policy_loss"] == pytest.approx(-1.5) and m["loss"] == pytest.approx(loss.item())
    assert m["entropy_loss"] == pytest.approx(-0.6)
    loss, _ = compute_policy_loss(batch, lp, entropy, PolicyLossConfig(kl_coef=0.1, kl_estimator="k2"))
    assert loss.item() == pytest.approx(-1.5 + 0.1 * 0.125, abs=1e-6)
    # TIS: -(1.5*1 + 1*2)/2 = -1.75; one of two tokens truncated (raw exp(0.5) = 1.6487 > 1.5)
    loss, m = compute_policy_loss(batch, lp, None, PolicyLossConfig(tis_cap=1.5))
    assert loss.item() == pytest.approx(-1.75, abs=1e-6)
    assert m["tis_truncated_frac"] == pytest.approx(0.5)
    assert m["tis_weight_mean"] == pytest.approx(1.25)
    # TIS weights the policy term only, not the KL term: -1.75 + 0.1 * 0.127626
    loss, _ = compute_policy_loss(batch, lp, None, PolicyLossConfig(tis_cap=1.5, kl_coef=0.1))
    assert loss.item() == pytest.approx(-1.75 + 0.1 * 0.127626, abs=1e-6)
    # in-reward KL is the recipe's job: the loss ignores it
    loss, _ = compute_policy_loss(batch, lp, None, PolicyLossConfig(kl_coef=0.1, kl_penalty="reward"))
    assert loss.item() == pytest.approx(-1.5)
    loss, _ = compute_policy_loss(batch, lp, None, PolicyLossConfig(kl_coef=0.1, kl_estimator="k1", kl_penalty="reward"))
    assert loss.item() == pytest.approx(-1.5)


def test_compute_policy_loss_kl_gradient_and_errors():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    batch = _batch(lp.detach(), torch.zeros(1, 2), torch.ones(1, 2), ref=ref)
    loss, _ = compute_policy_loss(batch, lp, None, PolicyLossConfig(kl_coef=1.0, kl_estimator="k3"))
    (grad,) = torch.autograd.grad(loss, lp)
    # d k3 / d logp = d/dlogp [e^{ref-logp} - 1 - (ref - logp)] = 1 - e^{ref-logp}; token mean /2
    expected = (1 - torch.exp(ref - lp.detach())) / 2
    torch.testing.assert_close(grad, expected)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(_batch(lp.detach(), torch.zeros(1, 2), torch.ones(1, 2)), lp, None, PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="old_logprobs"):
        compute_policy_loss(batch, lp, None, PolicyLossConfig(tis_cap=2.0))
    with pytest.raises(ValueError, match="entropy"):
        compute_policy_loss(batch, lp, None, PolicyLossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="shape"):
        compute_policy_loss(batch, lp[:, :1], None, PolicyLossConfig())
    no_engine = _batch(lp.detach(), torch.zeros(1, 2), torch.ones(1, 2))
    no_engine.has_engine_logprobs[:] = False
    with pytest.raises(ValueError, match="no engine log-probs"):
        compute_policy_loss(no_engine, lp, None, PolicyLossConfig())
    # with trainer-recomputed old log-probs the engine's are not needed
    compute_policy_loss(no_engine.with_logprobs(old=lp.detach()), lp, None, PolicyLossConfig())


def test_policy_loss_config_flat_keys_and_loss_options():
    cfg = PolicyLossConfig(loss="ppo_clip", clip_eps_high=0.28, aggregation="token_mean", tis_cap=2.0)
    assert isinstance(cfg.loss_options, PPOClipOptions)
    assert cfg.loss_options.clip_eps_high == 0.28 and cfg.loss_options.clip_eps_low == 0.2
    assert cfg.tis_cap == 2.0
    # dumps flat, as written in YAML, and round-trips
    dumped = cfg.model_dump()
    assert dumped["clip_eps_high"] == 0.28 and "loss_options" not in dumped
    assert PolicyLossConfig(**dumped) == cfg
    assert PolicyLossConfig(loss="ppo_clip", loss_options=PPOClipOptions(clip_eps_high=0.28), tis_cap=2.0) == cfg
    assert PolicyLossConfig(clip_eps_low=0.1).loss_options.eps_high == 0.1
    assert isinstance(PolicyLossConfig(loss="gspo").loss_options, GSPOOptions)
    assert PolicyLossConfig(loss="gspo").loss_options.clip_eps_low == 3e-4
    assert policy_loss_problems({"loss": "gspo", "clip_eps_high": 1e-3, "aggregation": "sequence_mean"}) == []


def test_policy_loss_config_validation():
    with pytest.raises(ValueError, match="Did you mean 'gspo'"):
        PolicyLossConfig(loss="gpso")
    with pytest.raises(ValueError, match=r"unknown key 'policy_loss.clip_eps'.*did you mean 'policy_loss.clip_eps_low'"):
        PolicyLossConfig(clip_eps=0.2)
    with pytest.raises(ValueError):
        PolicyLossConfig(dual_clip_c=0.5)
    with pytest.raises(ValueError):
        PolicyLossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="entropy_clip_min_scale"):
        PolicyLossConfig(entropy_clip_min_scale=3.0)
    # gspo has its own options: ppo's dual clip is not one of them
    with pytest.raises(ValueError, match=r"unknown key 'policy_loss.dual_clip_c' for loss 'gspo'"):
        PolicyLossConfig(loss="gspo", dual_clip_c=3.0)
    assert {"ppo_clip", "gspo", "policy_gradient"} <= set(POLICY_LOSSES.names())
    assert kl_per_token(torch.zeros(2), torch.zeros(2), "k2").tolist() == [0.0, 0.0]


@pytest.mark.parametrize("key, value", [("dual_clip_c", 3.0), ("entropy_clip", True), ("clip_eps_low", 0.2)])
def test_policy_gradient_has_no_options(key, value):
    with pytest.raises(ValueError, match=rf"unknown key 'policy_loss.{key}' for loss 'policy_gradient'"):
        PolicyLossConfig(loss="policy_gradient", **{key: value})
    (problem,) = policy_loss_problems({"loss": "policy_gradient", key: value})
    assert f"'policy_loss.{key}'" in problem and "'policy_gradient'" in problem and "(an option of " in problem
    assert "'ppo_clip'" in problem.split("(an option of ")[1].split(")")[0]
    assert "allowed keys here: aggregation, entropy_coef, fixed_length" in problem
    # and the loss itself refuses options
    with pytest.raises(ValueError):
        POLICY_LOSSES.entry("policy_gradient").parse_options({key: value})


def test_policy_loss_problems_lists_every_problem_readably():
    problems = policy_loss_problems({"loss": "ppo", "clip_eps_low": 2, "kl_coef": -1})
    assert len(problems) == 3, problems
    assert any("'policy_loss.loss'" in p and "ppo_clip" in p for p in problems)
    assert any("'policy_loss.clip_eps_low'" in p and "less than 1" in p for p in problems)
    assert any("'policy_loss.kl_coef'" in p for p in problems)
    (problem,) = policy_loss_problems({"clip_eps": 0.2})
    assert problem.startswith("unknown key 'policy_loss.clip_eps'") and "did you mean 'policy_loss.clip_eps_low'?" in problem
    assert "allowed keys here: aggregation, clip_eps_high, clip_eps_low, dual_clip_c" in problem
    assert policy_loss_problems("ppo_clip") == ["'policy_loss' must be a mapping of options, got str"]
    assert policy_loss_problems({}) == []


def test_check_policy_loss_raises_config_error():
    from tracegym.commands.rl import check_policy_loss
    from tracegym.config import ConfigError

    check_policy_loss({"loss": "ppo_clip", "clip_eps_high": 0.28, "tis_cap": 2.0})
    with pytest.raises(ConfigError) as info:
        check_policy_loss({"loss": "policy_gradient", "dual_clip_c": 3.0})
    assert info.value.source == "policy_loss"
    assert "unknown key 'policy_loss.dual_clip_c' for loss 'policy_gradient'" in str(info.value)


def test_fixed_length_sum_requires_fixed_length():
    with pytest.raises(ValueError, match="fixed_length_sum' needs fixed_length"):
        PolicyLossConfig(aggregation="fixed_length_sum")
    assert policy_loss_problems({"aggregation": "fixed_length_sum"})[0].startswith("invalid 'policy_loss':")
    assert PolicyLossConfig(aggregation="fixed_length_sum", fixed_length=512).fixed_length == 512
