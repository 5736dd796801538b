"""compute_policy_loss as the one composition step: any registered per-token loss gets the mask, TIS
weights, aggregation, KL and entropy terms; micro-batches add up to the full batch; custom losses
with their own options."""

from __future__ import annotations

import ast
import importlib.util
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from tracegym.algos import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossInputs,
    LossNormalizers,
    PolicyLossConfig,
    compute_policy_loss,
    policy_loss_problems,
)
from tracegym.algos.registry import NoOptions

ROOT = Path(__file__).resolve().parents[1]
LN = math.log


@dataclass
class Part:
    """A batch as compute_policy_loss sees it (the PolicyLossBatch protocol), without tracegym.batch."""

    loss_mask: torch.Tensor
    advantages: torch.Tensor
    engine_logprobs: torch.Tensor
    has_engine_logprobs: torch.Tensor
    normalizers: LossNormalizers
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def _part(old, adv, mask, engine=None, ref=None, recomputed=True) -> Part:
    return Part(
        loss_mask=mask,
        advantages=adv,
        engine_logprobs=old if engine is None else engine,
        has_engine_logprobs=torch.ones(mask.shape[0], dtype=torch.bool),
        normalizers=LossNormalizers.from_mask(mask),
        old_logprobs=old if recomputed else None,
        ref_logprobs=ref,
    )


# -- a CISPO-style loss with its own options, registered from the test ---------------------------
class CISPOOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    eps_high: float = Field(0.2, gt=0.0)


def cispo(inputs: LossInputs, opts: CISPOOptions):
    """-sg(min(r, 1 + eps_high)) * A * logp per token."""
    ratio = torch.exp(inputs.log_ratio()).detach()
    weight = ratio.clamp(max=1.0 + opts.eps_high)
    metrics = {"clip_frac_high": inputs.masked_mean((ratio > 1.0 + opts.eps_high).float())}
    return -weight * inputs.advantages * inputs.logprobs, {**metrics, **inputs.ratio_metrics(ratio)}


def plain_pg(inputs: LossInputs, opts: NoOptions):
    """A loss that knows nothing of TIS, masks or aggregation: -A * logp."""
    return -inputs.advantages * inputs.logprobs, {"toy_metric": 7.0}


def scaled_pg(inputs: LossInputs, *, scale: float = 1.0):
    """Options from keyword-only parameters (registered without an options model)."""
    return -scale * inputs.advantages * inputs.logprobs, {}


def bad_shape(inputs: LossInputs, opts: NoOptions):
    return (-inputs.advantages * inputs.logprobs).mean(), {}


@pytest.fixture
def test_losses():
    POLICY_LOSSES.register("test_cispo", options=CISPOOptions)(cispo)
    POLICY_LOSSES.register("test_plain_pg", options=NoOptions)(plain_pg)
    POLICY_LOSSES.register("test_bad_shape", options=NoOptions)(bad_shape)
    POLICY_LOSSES.register("test_scaled_pg")(scaled_pg)
    yield
    for name in ("test_cispo", "test_plain_pg", "test_bad_shape", "test_scaled_pg"):
        POLICY_LOSSES.unregister(name)


def test_custom_loss_with_its_own_options_through_compute_policy_loss(test_losses):
    # r = [1.5, 0.5, 1.1], A = [1, -1, 2], eps_high 0.2 -> detached weights w = min(r, 1.2) = [1.2, 0.5, 1.1]
    # logp = -1 + ln r = [-0.594535, -1.693147, -0.904690]; l = -w A logp = [0.713442, -0.846574, 1.990318]
    # token mean = 1.857186 / 3 = 0.619062; gradient -w A / 3 = [-0.4, 0.166667, -0.733333]
    old = torch.full((1, 3), -1.0)
    logprobs = (old + torch.tensor([[LN(1.5), LN(0.5), LN(1.1)]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    cfg = PolicyLossConfig(loss="test_cispo", eps_high=0.2, aggregation="token_mean")
    assert cfg.loss_options == CISPOOptions(eps_high=0.2)
    loss, m = compute_policy_loss(_part(old, adv, torch.ones(1, 3)), logprobs, None, cfg)
    assert loss.item() == pytest.approx(0.619062, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[-1.2 / 3, 0.5 / 3, -2.2 / 3]]), atol=1e-6, rtol=0)
    # the loss's metrics come back under their own names, next to the composition's
    assert m["clip_frac_high"] == pytest.approx(1 / 3)
    assert m["ratio_max"] == pytest.approx(1.5, abs=1e-6) and m["ratio_min"] == pytest.approx(0.5, abs=1e-6)
    assert m["policy_loss"] == pytest.approx(0.619062, abs=1e-6) and m["num_tokens"] == 3
    # eps_high 1.0 clips nothing: gradient -r A / 3
    wide = PolicyLossConfig(loss="test_cispo", eps_high=1.0)
    loss, _ = compute_policy_loss(_part(old, adv, torch.ones(1, 3)), logprobs, None, wide)
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[-1.5 / 3, 0.5 / 3, -2.2 / 3]]), atol=1e-6, rtol=0)
    # its options are validated by its own model, with the nearest key
    expected = r"unknown key 'policy_loss.eps_hi' for loss 'test_cispo'.*did you mean 'policy_loss.eps_high'"
    with pytest.raises(ValueError, match=expected):
        PolicyLossConfig(loss="test_cispo", eps_hi=0.2)
    (problem,) = policy_loss_problems({"loss": "test_cispo", "eps_high": -1})
    assert "'policy_loss.eps_high'" in problem and "greater than 0" in problem
    (problem,) = policy_loss_problems({"loss": "test_cispo", "clip_eps_low": 0.2})
    assert "allowed keys here: aggregation, entropy_coef, eps_high, fixed_length" in problem


def test_a_loss_that_knows_nothing_of_tis_still_gets_tis(test_losses):
    # old = [-1, -1], engine = [-1.5, -1]: raw w = exp(old - engine) = [e^0.5, 1] = [1.6487, 1]; cap 1.5 -> [1.5, 1]
    # l = -A logp with A = [1, 2], logp = [-1, -1]: [1, 2]; weighted token mean (1.5*1 + 1*2)/2 = 1.75
    # gradient -A w / 2 = [-0.75, -1]; a third, masked token (A = 5, engine far off) changes nothing
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    logprobs = old.clone().requires_grad_()
    adv = torch.tensor([[1.0, 2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    part = _part(old, adv, mask, engine=torch.tensor([[-1.5, -1.0, -9.0]]))
    loss, m = compute_policy_loss(part, logprobs, None, PolicyLossConfig(loss="test_plain_pg", tis_cap=1.5))
    assert loss.item() == pytest.approx(1.75, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[-0.75, -1.0, 0.0]]), atol=1e-6, rtol=0)
    assert m["toy_metric"] == 7.0 and m["tis_truncated_frac"] == pytest.approx(0.5)
    # without TIS: (1 + 2)/2
    loss, m = compute_policy_loss(part, logprobs, None, PolicyLossConfig(loss="test_plain_pg"))
    assert loss.item() == pytest.approx(1.5) and "tis_truncated_frac" not in m


def test_a_loss_with_keyword_only_options(test_losses):
    # -scale * A * logp with A = [1, 2], logp = [-1, -1], scale 3: (3 + 6)/2 = 4.5
    part = _part(torch.full((1, 2), -1.0), torch.tensor([[1.0, 2.0]]), torch.ones(1, 2))
    cfg = PolicyLossConfig(loss="test_scaled_pg", scale=3.0)
    logprobs = torch.full((1, 2), -1.0)
    assert compute_policy_loss(part, logprobs, None, cfg)[0].item() == pytest.approx(4.5)
    assert compute_policy_loss(part, logprobs, None, PolicyLossConfig(loss="test_scaled_pg"))[0].item() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="did you mean 'policy_loss.scale'"):
        PolicyLossConfig(loss="test_scaled_pg", scal=3.0)


def test_a_loss_must_return_a_per_token_loss(test_losses):
    part = _part(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"policy loss 'test_bad_shape' must return a per-token loss of shape \(1, 2\)"):
        compute_policy_loss(part, torch.zeros(1, 2), None, PolicyLossConfig(loss="test_bad_shape"))


def test_engine_logprobs_are_old_when_the_trainer_did_not_recompute():
    # old unknown -> the engine's log-probs [-1, -2]: r = exp([0, 0.5]) = [1, 1.6487]; A = 1, eps 0.2 -> [-1, -1.2]
    logprobs = torch.tensor([[-1.0, -1.5]])
    part = _part(torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2), torch.ones(1, 2), recomputed=False)
    loss, m = compute_policy_loss(part, logprobs, None, PolicyLossConfig())
    assert loss.item() == pytest.approx(-1.1, abs=1e-6)
    assert m["ratio_max"] == pytest.approx(math.exp(0.5), abs=1e-6)


LOSSES = {
    "ppo_clip": {"clip_eps_high": 0.28, "dual_clip_c": 3.0, "entropy_clip": True},
    "gspo": {"clip_eps_low": 0.05, "clip_eps_high": 0.06},
    "policy_gradient": {},
}


SPLIT = (slice(0, 1), slice(1, 5))  # 1 sequence / 6 tokens and 3 sequences / 9 tokens (+ an empty row)


def _split(part: Part, rows: slice) -> Part:
    """Rows of ``part``, trimmed to their longest trained row (as split_microbatches does), full normalizers kept."""
    mask = part.loss_mask[rows]
    width = int(mask.nonzero()[:, 1].max()) + 1
    cut = lambda t: None if t is None else t[rows, :width]  # noqa: E731
    return replace(
        part,
        loss_mask=cut(part.loss_mask),
        advantages=cut(part.advantages),
        engine_logprobs=cut(part.engine_logprobs),
        has_engine_logprobs=part.has_engine_logprobs[rows],
        old_logprobs=cut(part.old_logprobs),
        ref_logprobs=cut(part.ref_logprobs),
    )


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_microbatch_losses_and_gradients_add_up_to_the_full_batch(loss: str, aggregation: str):
    gen = torch.Generator().manual_seed(5)
    mask = torch.tensor(
        [
            [0, 1, 1, 1, 1, 1, 1],  # 6 trained tokens, the full width
            [0, 0, 1, 0, 0, 0, 0],  # 1
            [0, 1, 1, 1, 1, 1, 0],  # 5
            [0, 0, 0, 1, 1, 1, 0],  # 3
            [0, 0, 0, 0, 0, 0, 0],  # none: counts in no denominator
        ],
        dtype=torch.float32,
    )
    b, t = mask.shape
    old = -torch.rand(b, t, generator=gen) * 2
    adv = torch.randn(b, 1, generator=gen).expand(b, t).clone()
    ref = old + 0.2 * torch.randn(b, t, generator=gen)
    engine = old + 0.3 * torch.randn(b, t, generator=gen)
    current = (old + 0.3 * torch.randn(b, t, generator=gen)).requires_grad_()
    entropy = torch.rand(b, t, generator=gen) * 3
    cfg = PolicyLossConfig(
        loss=loss, aggregation=aggregation, fixed_length=16, kl_coef=0.1, entropy_coef=0.01, tis_cap=1.2, **LOSSES[loss]
    )
    full = _part(old, adv, mask, engine=engine, ref=ref)

    full_loss, _ = compute_policy_loss(full, current, entropy, cfg)
    (full_grad,) = torch.autograd.grad(full_loss, current)
    total = 0.0
    for rows in SPLIT:
        part = _split(full, rows)
        width = part.loss_mask.shape[1]
        loss_part, _ = compute_policy_loss(part, current[rows, :width], entropy[rows, :width], cfg)
        loss_part.backward()
        total += loss_part.item()
    assert total == pytest.approx(full_loss.item(), abs=1e-6)
    torch.testing.assert_close(current.grad, full_grad, atol=1e-7, rtol=1e-5)
    assert full_grad.abs().sum() > 0

    # fault injection: each part normalised by its own tokens/sequences, averaged over the parts
    # (the classic accumulation bug), is not the same loss
    local = 0.0
    for rows in SPLIT:
        part = _split(full, rows)
        part = replace(part, normalizers=LossNormalizers.from_mask(part.loss_mask))
        width = part.loss_mask.shape[1]
        local += compute_policy_loss(part, current[rows, :width], entropy[rows, :width], cfg)[0].item() / len(SPLIT)
    assert local != pytest.approx(full_loss.item(), abs=1e-4)


def test_compose_does_not_import_the_batch_module():
    tree = ast.parse((ROOT / "tracegym" / "algos" / "compose.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(name and name.startswith("tracegym.batch") for name in imported), imported


def test_example_cispo_plugin_registers_my_cispo():
    spec = importlib.util.spec_from_file_location("cispo_loss_example", ROOT / "examples" / "plugins" / "cispo_loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        # same numbers as the in-test CISPO above, with eps_high 0.2
        old = torch.full((1, 3), -1.0)
        logprobs = (old + torch.tensor([[LN(1.5), LN(0.5), LN(1.1)]])).requires_grad_()
        cfg = PolicyLossConfig(loss="my_cispo", eps_high=0.2)
        loss, m = compute_policy_loss(_part(old, torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)), logprobs, None, cfg)
        assert loss.item() == pytest.approx(0.619062, abs=1e-6)
        (grad,) = torch.autograd.grad(loss, logprobs)
        torch.testing.assert_close(grad, torch.tensor([[-1.2 / 3, 0.5 / 3, -2.2 / 3]]), atol=1e-6, rtol=0)
        assert m["clip_frac_high"] == pytest.approx(1 / 3)
    finally:
        POLICY_LOSSES.unregister("my_cispo")
