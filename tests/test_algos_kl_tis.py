"""KL estimators against closed forms on known categoricals; KL in the reward; TIS truncation."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.algos import kl_penalized_advantages, kl_penalized_rewards, kl_per_token, truncated_importance_weights

P = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)  # the policy pi (samples come from it)
Q = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)  # the reference pi_ref
# KL(P||Q) = 0.5 ln 2 + 0.3 ln 1.2 + 0.2 ln 0.4 = 0.346574 + 0.054696 - 0.183258 = 0.218011
TRUE_KL = 0.5 * math.log(2.0) + 0.3 * math.log(1.2) + 0.2 * math.log(0.4)
# E_P[k2] = 0.5 * sum p (ln q/p)^2 = 0.5 * (0.5*0.480453 + 0.3*0.033241 + 0.2*0.839589) = 0.5 * 0.418117 = 0.209058
TRUE_K2 = 0.5 * sum(p * math.log(q / p) ** 2 for p, q in zip(P.tolist(), Q.tolist()))


def test_closed_form_constants():
    assert TRUE_KL == pytest.approx(0.218011, abs=1e-6)
    assert TRUE_K2 == pytest.approx(0.209058, abs=1e-6)


def test_exact_expectations_over_the_categorical():
    logp, logq = P.log(), Q.log()
    expectation = {name: float((P * kl_per_token(logp, logq, name)).sum()) for name in ("k1", "k2", "k3")}
    assert expectation["k1"] == pytest.approx(TRUE_KL, abs=1e-12)  # unbiased
    assert expectation["k3"] == pytest.approx(TRUE_KL, abs=1e-12)  # unbiased: E_p[q/p] = 1
    assert expectation["k2"] == pytest.approx(TRUE_K2, abs=1e-12)  # biased, close for small KL
    assert expectation["k2"] != pytest.approx(TRUE_KL, abs=1e-3)


def test_monte_carlo_k3_is_unbiased_and_lower_variance_than_k1():
    gen = torch.Generator().manual_seed(0)
    samples = torch.multinomial(P, 200_000, replacement=True, generator=gen)
    logp, logq = P.log()[samples], Q.log()[samples]
    k1, k3 = kl_per_token(logp, logq, "k1"), kl_per_token(logp, logq, "k3")
    # standard errors are about 0.4/sqrt(2e5) ~ 1e-3; 5e-3 is a 5-sigma band
    assert k1.mean().item() == pytest.approx(TRUE_KL, abs=5e-3)
    assert k3.mean().item() == pytest.approx(TRUE_KL, abs=5e-3)
    assert k3.var().item() < k1.var().item()
    assert (k3 >= 0).all() and (k1 < 0).any()  # k3 never negative, k1 can be


def test_kl_penalized_rewards_and_advantages():
    # logp - ref = [0.5, 0.25, 9 (masked)] -> k1 sum = 0.75; beta 0.2 -> 1.0 - 0.15 = 0.85
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.25, -10.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = kl_penalized_rewards(torch.tensor([1.0]), logprobs, ref, mask, beta=0.2)
    assert out.item() == pytest.approx(0.85)
    # per-token, reward-to-go of k1: [0.75, 0.25, 0] -> A - 0.2 * [0.75, 0.25] = [0.85, 0.95], masked unchanged
    adv = torch.ones(1, 3)
    out = kl_penalized_advantages(adv, logprobs, ref, mask, beta=0.2)
    torch.testing.assert_close(out, torch.tensor([[0.85, 0.95, 1.0]]))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_per_token(logprobs, ref, "k4")


def test_truncated_importance_weights_hand_computed():
    # old - engine = [0.5, -0.5, 2.0, 3.0 (masked)] -> raw w = [1.648721, 0.606531, 7.389056]; cap 2
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    engine = torch.tensor([[-1.5, -0.5, -3.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, m = truncated_importance_weights(old, engine, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.648721, 0.606531, 2.0, 1.0]]), atol=1e-6, rtol=0)
    assert m["tis_truncated_frac"] == pytest.approx(1 / 3)
    assert m["tis_raw_weight_max"] == pytest.approx(7.389056, abs=1e-5)
    assert m["tis_weight_mean"] == pytest.approx((1.648721 + 0.606531 + 2.0) / 3, abs=1e-6)
    assert m["engine_logprob_abs_diff"] == pytest.approx(1.0)
    # rows without engine log-probs (scripted experts) get weight 1 and do not count
    w, m = truncated_importance_weights(old, engine, mask, cap=2.0, rows_with_engine_logprobs=torch.tensor([False]))
    assert torch.all(w == 1.0) and m["tis_truncated_frac"] == 0.0
    with pytest.raises(ValueError, match="positive"):
        truncated_importance_weights(old, engine, mask, cap=0.0)
