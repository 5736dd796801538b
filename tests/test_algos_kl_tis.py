"""KL estimators against closed forms on known categoricals; KL in the reward; TIS truncation."""

from __future__ import annotations

import math

import pytest
import torch

from tracegym.algos import (
    PolicyLossConfig,
    kl_per_token,
    policy_loss_problems,
    truncated_importance_weights,
)

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


def _expected_loss_gradient(estimator: str) -> torch.Tensor:
    """E_{x ~ pi}[grad_theta k(log pi_theta(x), log q(x))] over the logits theta, exactly: the
    samples are fixed (no score-function term), as when the estimator is a loss term on sampled
    tokens. pi = softmax(theta) = P."""
    theta = P.log().clone().requires_grad_()
    logp = torch.log_softmax(theta, dim=-1)
    per_sample = kl_per_token(logp, Q.log(), estimator)  # k at every category x
    (grad,) = torch.autograd.grad((logp.exp().detach() * per_sample).sum(), theta)
    return grad


def _grad_of(divergence) -> torch.Tensor:
    theta = P.log().clone().requires_grad_()
    (grad,) = torch.autograd.grad(divergence(torch.log_softmax(theta, dim=-1), Q.log()), theta)
    return grad


def test_kl_estimators_as_loss_terms_follow_these_gradients():
    forward = _grad_of(lambda logp, logq: (logp.exp() * (logp - logq)).sum())  # grad KL(pi || ref)
    reverse = _grad_of(lambda logp, logq: (logq.exp() * (logq - logp)).sum())  # grad KL(ref || pi)
    assert not torch.allclose(forward, reverse, atol=1e-3)  # the two directions differ here
    # k1: E_pi[grad log pi] = grad sum_x pi(x) = 0: no gradient at all
    torch.testing.assert_close(_expected_loss_gradient("k1"), torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0)
    # k2: (log p - log q) grad log p, in expectation grad KL(pi || ref)
    torch.testing.assert_close(_expected_loss_gradient("k2"), forward, atol=1e-12, rtol=0)
    # k3: (1 - q/p) grad log p, in expectation -sum_x q grad log p = grad KL(ref || pi), not grad KL(pi || ref)
    torch.testing.assert_close(_expected_loss_gradient("k3"), reverse, atol=1e-12, rtol=0)
    assert not torch.allclose(_expected_loss_gradient("k3"), forward, atol=1e-3)


def test_k1_in_the_loss_is_rejected():
    with pytest.raises(ValueError, match="zero expected gradient.*k3.*kl_penalty: reward"):
        PolicyLossConfig(kl_coef=0.1, kl_estimator="k1")
    with pytest.raises(ValueError, match="zero expected gradient"):
        PolicyLossConfig(kl_estimator="k1", kl_penalty="loss")
    (problem,) = policy_loss_problems({"kl_coef": 0.1, "kl_estimator": "k1"})
    assert "k1" in problem and "kl_penalty: reward" in problem
    # k1 in the reward is fine (the value matters there, and it is unbiased), as are k2/k3 in the loss
    assert PolicyLossConfig(kl_coef=0.1, kl_estimator="k1", kl_penalty="reward").kl_estimator == "k1"
    assert policy_loss_problems({"kl_coef": 0.1, "kl_estimator": "k2"}) == []


def test_kl_per_token_k1_hand_values_and_unknown_estimator():
    # logp - ref = [0.5, 0.25, 9 (masked)]: k1 summed over the sampled tokens = 0.75, what the RL recipe's
    # kl_in_reward (the one KL-in-reward implementation, tests/test_rl.py) takes times beta off the episode
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.25, -10.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert float((kl_per_token(logprobs, ref, "k1") * mask).sum()) == pytest.approx(0.75)
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
