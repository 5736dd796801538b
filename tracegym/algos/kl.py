"""KL penalty to a reference policy: per-token estimators k1, k2, k3 and the two ways to apply them.

Source: John Schulman, "Approximating KL divergence" (blog, 2020). With tokens ``x ~ pi`` and
``r = pi_ref(x) / pi(x)``:

- ``k1 = -log r``: unbiased for ``KL(pi || pi_ref)``, high variance, can be negative.
- ``k2 = (log r)^2 / 2``: biased (its expectation is an f-divergence that matches KL to second
  order), low variance, non-negative.
- ``k3 = (r - 1) - log r``: unbiased (since ``E_pi[r] = 1``), low variance, non-negative.

Used in the reward (``PolicyLossConfig.kl_penalty = "reward"``) only the *value* matters: a detached
penalty on the return, and k1 (the log-likelihood ratio) is the usual choice. The one implementation
is ``tracegym.recipes.rl.kl_in_reward``: ``beta * sum_t m_t kl_per_token(...)`` over every sampled
token of an episode (all rows of a trajectory its template split), taken off its last turn's reward
and its episode reward before the estimator runs.

Used in the loss (``kl_penalty = "loss"``) what matters is the *gradient*: the tokens are fixed
samples of ``pi`` and the gradient flows through ``logp = log pi(x)`` only (no score-function
term for the sampling). Per sample, ``grad k1 = grad logp``, ``grad k2 = (logp - logq) grad logp``,
``grad k3 = (1 - q/p) grad logp`` (``p = pi(x)``, ``q = pi_ref(x)``); in expectation over ``x ~ pi``:

- k1: ``sum_x grad p(x) = 0``: no gradient at all (so ``k1`` with ``kl_penalty: loss`` is rejected);
- k2: ``sum_x (log p - log q) grad p = grad KL(pi || pi_ref)``;
- k3: ``sum_x (p - q) grad log p = -sum_x q grad log p = grad KL(pi_ref || pi)``, the reverse
  direction (as GRPO in DeepSeekMath uses it), although its *value* estimates ``KL(pi || pi_ref)``.

``tests/test_algos_kl_tis.py`` checks these three identities exactly on a categorical distribution.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def _log_r(logprobs: Tensor, ref_logprobs: Tensor, limit: float) -> Tensor:
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ in shape")
    return (ref_logprobs - logprobs).clamp(-limit, limit)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor, limit: float = 20.0) -> Tensor:
    """``k1 = -log r = log pi(x) - log pi_ref(x)``, elementwise."""
    return -_log_r(logprobs, ref_logprobs, limit)


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor, limit: float = 20.0) -> Tensor:
    """``k2 = (log r)^2 / 2``, elementwise."""
    return 0.5 * _log_r(logprobs, ref_logprobs, limit).square()


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, limit: float = 20.0) -> Tensor:
    """``k3 = exp(log r) - 1 - log r``, elementwise (``expm1`` keeps it accurate near r = 1)."""
    log_r = _log_r(logprobs, ref_logprobs, limit)
    return torch.expm1(log_r) - log_r


KL_ESTIMATORS: dict[str, Callable[..., Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """The chosen estimator of ``KL(pi || pi_ref)`` at every token, same shape as the inputs (for its
    gradient as a loss term see the module docstring)."""
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}") from None
    return fn(logprobs, ref_logprobs)
