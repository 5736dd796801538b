"""Decoupled PPO (AReaL): equal to PPO-clip when pi_prox == pi_behav, hand-computed behaviour
weights with their cap (mask / clamp), rows without behaviour log-probs, the errors that name the
fix, micro-batch additivity and the config round trip."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import yaml

from tracegym.algos import (
    AGGREGATIONS,
    POLICY_LOSSES,
    DecoupledPPOOptions,
    LossInputs,
    LossNormalizers,
    PolicyLossConfig,
    aggregate,
    behaviour_weights,
    compute_policy_loss,
    policy_loss_problems,
)
from tracegym.batch import Batch, split_microbatches

LN = math.log


def _batch(old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, engine: torch.Tensor,
           has_engine: torch.Tensor | None = None, recomputed: bool = True) -> Batch:
    """A Batch whose ``old_logprobs`` are pi_prox and ``engine_logprobs`` pi_behav, all [B, T]."""
    b, t = mask.shape
    return Batch(
        input_ids=torch.zeros(b, t + 1, dtype=torch.long),
        attention_mask=torch.ones(b, t + 1, dtype=torch.long),
        loss_mask=mask,
        weights=mask.clone(),
        advantages=adv,
        engine_logprobs=engine,
        has_engine_logprobs=torch.ones(b, dtype=torch.bool) if has_engine is None else has_engine,
        example_ids=torch.arange(b),
        group_ids=torch.zeros(b, dtype=torch.long),
        normalizers=LossNormalizers.from_mask(mask),
        old_logprobs=old if recomputed else None,
    )


def _random_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old [4, 6], adv [4, 6], mask [4, 6], current [4, 6] with grad): ratios up to ~exp(+-0.6) so
    some tokens are clipped and some are not."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=gen) * 3
    adv = torch.randn(4, 6, generator=gen)
    mask = (torch.rand(4, 6, generator=gen) > 0.25).float()
    mask[:, 0] = 1.0  # every row trains on at least one token
    mask[3, 3:] = 0.0  # rows of different lengths
    current = (old + 0.3 * torch.randn(4, 6, generator=gen)).requires_grad_()
    return old, adv, mask, current


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("options", [{}, {"clip_eps_high": 0.28, "dual_clip_c": 3.0}, {"clip_eps_low": 0.1}])
def test_equals_ppo_clip_when_the_proximal_policy_is_the_behaviour_policy(aggregation: str, options: dict):
    old, adv, mask, current = _random_case(7)
    # pi_prox == pi_behav: every w = exp(0) = 1, exactly; a row without behaviour log-probs changes nothing
    batch = _batch(old, adv, mask, engine=old.clone(), has_engine=torch.tensor([True, True, False, True]))
    results = {}
    for loss in ("ppo_clip", "decoupled_ppo"):
        cfg = PolicyLossConfig(loss=loss, aggregation=aggregation, fixed_length=8, **options)
        value, metrics = compute_policy_loss(batch, current, None, cfg)
        (grad,) = torch.autograd.grad(value, current)
        results[loss] = (value.detach(), grad, metrics)
    (ppo_value, ppo_grad, ppo_m), (dec_value, dec_grad, dec_m) = results["ppo_clip"], results["decoupled_ppo"]
    assert torch.equal(dec_value, ppo_value)
    assert torch.equal(dec_grad, ppo_grad)
    assert (ppo_grad != 0).any() and ppo_m["clip_frac_low"] + ppo_m["clip_frac_high"] > 0  # both regimes occur
    for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max", "approx_kl"):
        assert dec_m[key] == ppo_m[key], key
    assert dec_m["behav_weight_mean"] == 1.0 and dec_m["behav_masked_frac"] == 0.0
    assert dec_m["behav_weight_raw_max"] == 1.0 and dec_m["behav_approx_kl"] == 0.0


# The hand-computed case: pi_prox = 0 (old log-probs), so rho = exp(logp) and w = exp(-behaviour).
# row 0: rho [1.5, 0.5, 1.1], A [ 1, -1,  2], w [2, 0.5, 1]
# row 1: rho [0.7, 1.0, 1.3], A [-2,  1, -1], w [4, 6,   1.25]     (6 > cap 5)
# ppo_clip per token, eps 0.2:  max(-A rho, -A clip(rho, 0.8, 1.2))
#   row 0: max(-1.5, -1.2) = -1.2 (clipped high) | max(0.5, 0.8) = 0.8 (clipped low) | -2.2 (inside)
#   row 1: max(1.4, 1.6) = 1.6 (clipped low)     | -1.0 (inside)     | max(1.3, 1.2) = 1.3 (A<0, rho>1.2: not clipped)
# times w, mask mode:  [-2.4, 0.4, -2.2], [6.4, 0 (masked), 1.625]  -> token mean 3.825 / 6 = 0.6375
# clamp mode: row 1 token 1 gets w = 5: -5.0                          -> token mean -1.175 / 6
RHO = [[1.5, 0.5, 1.1], [0.7, 1.0, 1.3]]
ADV = [[1.0, -1.0, 2.0], [-2.0, 1.0, -1.0]]
W = [[2.0, 0.5, 1.0], [4.0, 6.0, 1.25]]


def _hand_case():
    current = torch.tensor([[LN(r) for r in row] for row in RHO], requires_grad=True)
    behaviour = torch.tensor([[-LN(w) for w in row] for row in W])
    return current, torch.zeros(2, 3), behaviour, torch.tensor(ADV), torch.ones(2, 3)


def test_hand_computed_example_mask_mode():
    current, prox, behaviour, adv, mask = _hand_case()
    inputs = LossInputs(logprobs=current, old_logprobs=prox, advantages=adv, mask=mask, behaviour_logprobs=behaviour)
    per_token, m = POLICY_LOSSES.entry("decoupled_ppo")(inputs, {})
    torch.testing.assert_close(per_token.detach(), torch.tensor([[-2.4, 0.4, -2.2], [6.4, 0.0, 1.625]]), atol=1e-5, rtol=0)
    assert m["behav_weight_mean"] == pytest.approx((2 + 0.5 + 1 + 4 + 0 + 1.25) / 6, abs=1e-6)
    assert m["behav_masked_frac"] == pytest.approx(1 / 6) and m["behav_clamped_frac"] == 0.0
    assert m["behav_weight_raw_max"] == pytest.approx(6.0, abs=1e-5)
    expected_kl = sum(w - 1 - LN(w) for row in W for w in row) / 6  # k3 of KL(pi_behav || pi_prox)
    assert m["behav_approx_kl"] == pytest.approx(expected_kl, abs=1e-5)
    # the PPO metrics are those of rho: 2 tokens clipped low (A<0, rho<0.8), 1 clipped high
    assert m["clip_frac_low"] == pytest.approx(2 / 6) and m["clip_frac_high"] == pytest.approx(1 / 6)
    assert (m["ratio_min"], m["ratio_max"]) == (pytest.approx(0.5, abs=1e-6), pytest.approx(1.5, abs=1e-6))

    # through the composition with a Batch: pi_prox from old_logprobs, pi_behav from engine_logprobs
    loss, cm = compute_policy_loss(_batch(prox, adv, mask, behaviour), current, None, PolicyLossConfig(loss="decoupled_ppo"))
    assert loss.item() == pytest.approx(3.825 / 6, abs=1e-5)
    assert cm["behav_masked_frac"] == pytest.approx(1 / 6) and cm["policy_loss"] == pytest.approx(loss.item())
    (grad,) = torch.autograd.grad(loss, current)
    # d l_t / d logp_t = w_t (-A_t rho_t) on unclipped tokens, 0 on clipped and masked ones; token mean / 6
    expected = torch.tensor([[0.0, 0.0, 1.0 * -2.2], [0.0, 0.0, 1.25 * 1.3]]) / 6
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


def test_hand_computed_example_clamp_mode_and_no_cap():
    current, prox, behaviour, adv, mask = _hand_case()
    batch = _batch(prox, adv, mask, behaviour)
    cfg = PolicyLossConfig(loss="decoupled_ppo", behav_weight_mode="clamp")
    loss, m = compute_policy_loss(batch, current, None, cfg)
    assert loss.item() == pytest.approx(-1.175 / 6, abs=1e-5)
    assert m["behav_clamped_frac"] == pytest.approx(1 / 6) and m["behav_masked_frac"] == 0.0
    assert m["behav_weight_mean"] == pytest.approx((2 + 0.5 + 1 + 4 + 5 + 1.25) / 6, abs=1e-5)
    (grad,) = torch.autograd.grad(loss, current)
    # the clamped token (rho 1, inside the clip range) now has gradient 5 * (-A rho) = -5
    expected = torch.tensor([[0.0, 0.0, -2.2], [0.0, -5.0, 1.25 * 1.3]]) / 6
    torch.testing.assert_close(grad, expected, atol=1e-5, rtol=0)
    # a lower cap catches more tokens: cap 3 masks w = 4 and w = 6
    loss, m = compute_policy_loss(batch, current, None, PolicyLossConfig(loss="decoupled_ppo", behav_weight_cap=3.0))
    assert loss.item() == pytest.approx((-2.4 + 0.4 - 2.2 + 0 + 0 + 1.625) / 6, abs=1e-5)
    assert m["behav_masked_frac"] == pytest.approx(2 / 6)
    # no cap: every weight applies, 6 * -1.0 on the token the cap masked
    loss, m = compute_policy_loss(batch, current, None, PolicyLossConfig(loss="decoupled_ppo", behav_weight_cap=None))
    assert loss.item() == pytest.approx((3.825 - 6.0) / 6, abs=1e-5)
    assert m["behav_masked_frac"] == 0.0 and m["behav_clamped_frac"] == 0.0


def test_cap_boundary_and_masked_tokens_keep_their_place_in_the_denominator():
    # w = 4.9 (kept) and 5.1 (masked) against cap 5; rho = 1, A = 1 -> per token -w or 0
    prox = torch.zeros(1, 2)
    behaviour = torch.tensor([[-LN(4.9), -LN(5.1)]])
    weights, m = behaviour_weights(prox, behaviour, torch.ones(1, 2), cap=5.0, mode="mask")
    torch.testing.assert_close(weights, torch.tensor([[4.9, 0.0]]), atol=1e-5, rtol=0)
    loss, _ = compute_policy_loss(_batch(prox, torch.ones(1, 2), torch.ones(1, 2), behaviour), torch.zeros(1, 2), None,
                                  PolicyLossConfig(loss="decoupled_ppo"))
    # token mean over both trained tokens (as AReaL divides by the loss-mask count), not over the kept one
    assert loss.item() == pytest.approx(-4.9 / 2, abs=1e-5)
    # tokens off the loss mask get weight 1 and count in no metric, however stale
    weights, m = behaviour_weights(prox, behaviour, torch.tensor([[1.0, 0.0]]), cap=5.0)
    torch.testing.assert_close(weights, torch.tensor([[4.9, 1.0]]), atol=1e-5, rtol=0)
    assert m["behav_masked_frac"] == 0.0 and m["behav_weight_raw_max"] == pytest.approx(4.9, abs=1e-5)
    with pytest.raises(ValueError, match="behav_weight_mode"):
        behaviour_weights(prox, behaviour, torch.ones(1, 2), cap=5.0, mode="drop")  # type: ignore[arg-type]


def test_rows_without_behaviour_logprobs_get_weight_one():
    # row 1 is a scripted expert turn: its engine log-probs are 0 (unknown); taken at face value
    # they would give w = exp(-3 - 0) = 0.05 (and exp(+3) = 20 on the last token: masked)
    current, _, behaviour, adv, mask = _hand_case()
    prox = torch.tensor([[0.0, 0.0, 0.0], [-3.0, -3.0, 3.0]])
    current = (current.detach() + prox).requires_grad_()  # same rho as the hand case
    engine = torch.cat([behaviour[:1], torch.zeros(1, 3)])
    batch = _batch(prox, adv, mask, engine, has_engine=torch.tensor([True, False]))
    cfg = PolicyLossConfig(loss="decoupled_ppo")
    loss, m = compute_policy_loss(batch, current, None, cfg)
    # row 0 weighted as before: [-2.4, 0.4, -2.2]; row 1 is plain PPO-clip: [1.6, -1.0, 1.3]
    assert loss.item() == pytest.approx((-2.4 + 0.4 - 2.2 + 1.6 - 1.0 + 1.3) / 6, abs=1e-5)
    assert m["behav_weight_mean"] == pytest.approx((2 + 0.5 + 1 + 3) / 6, abs=1e-5)
    assert m["behav_masked_frac"] == 0.0
    assert m["behav_weight_raw_max"] == pytest.approx(2.0, abs=1e-5)  # from row 0 only
    # the same through LossInputs directly, and no row flags means every row is known
    inputs = LossInputs(logprobs=current, old_logprobs=prox, advantages=adv, mask=mask, behaviour_logprobs=engine,
                        has_behaviour_logprobs=torch.tensor([True, False]))
    per_token, _ = POLICY_LOSSES.entry("decoupled_ppo")(inputs, {})
    torch.testing.assert_close(per_token[1].detach(), torch.tensor([1.6, -1.0, 1.3]), atol=1e-5, rtol=0)
    per_token, _ = POLICY_LOSSES.entry("decoupled_ppo")(dataclasses.replace(inputs, has_behaviour_logprobs=None), {})
    torch.testing.assert_close(per_token[1].detach(), torch.tensor([1.6 * math.exp(-3), -1.0 * math.exp(-3), 0.0]),
                               atol=1e-5, rtol=0)


def test_missing_logprobs_give_errors_that_name_the_fix():
    current, prox, behaviour, adv, mask = _hand_case()
    inputs = LossInputs(logprobs=current, old_logprobs=prox, advantages=adv, mask=mask)
    fix = r"decoupled_ppo needs the sampler's log-probs.*behaviour_logprobs=batch.engine_logprobs"
    with pytest.raises(ValueError, match=fix):
        POLICY_LOSSES.entry("decoupled_ppo")(inputs, {})
    cfg = PolicyLossConfig(loss="decoupled_ppo")
    # a batch-like part without engine log-probs: the composition passes None, the loss refuses
    no_engine = dataclasses.replace(_batch(prox, adv, mask, behaviour), engine_logprobs=None)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        compute_policy_loss(no_engine, current, None, cfg)
    # no trainer-recomputed pi_prox: refused (the engine's in its place would make every w = 1)
    not_recomputed = _batch(prox, adv, mask, behaviour, recomputed=False)
    with pytest.raises(ValueError, match=r"'decoupled_ppo' needs batch.old_logprobs.*needs_old_logprobs"):
        compute_policy_loss(not_recomputed, current, None, cfg)
    compute_policy_loss(not_recomputed, current, None, PolicyLossConfig())  # ppo_clip still falls back to the engine's
    with pytest.raises(ValueError, match=r"has_behaviour_logprobs must be \[B\]"):
        LossInputs(logprobs=current, old_logprobs=prox, advantages=adv, mask=mask, behaviour_logprobs=behaviour,
                   has_behaviour_logprobs=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="one shape"):
        LossInputs(logprobs=current, old_logprobs=prox, advantages=adv, mask=mask, behaviour_logprobs=behaviour[:, :2])


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_microbatches_add_up_to_the_full_batch(aggregation: str):
    old, adv, mask, current = _random_case(11)
    gen = torch.Generator().manual_seed(12)
    engine = old + 0.8 * torch.randn(4, 6, generator=gen)  # stale sampler: some w above the cap
    batch = _batch(old, adv, mask, engine, has_engine=torch.tensor([True, False, True, True]))
    cfg = PolicyLossConfig(loss="decoupled_ppo", aggregation=aggregation, behav_weight_cap=2.0)
    full, m = compute_policy_loss(batch, current, None, cfg)
    assert 0 < m["behav_masked_frac"] < 1
    (full_grad,) = torch.autograd.grad(full, current)
    total = 0.0
    for part in split_microbatches(batch, 2):
        rows = part.example_ids
        part_loss, _ = compute_policy_loss(part, current[rows, : part.loss_mask.shape[1]], None, cfg)
        part_loss.backward()
        total += part_loss.item()
    assert total == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(current.grad, full_grad, atol=1e-7, rtol=1e-5)


def test_config_round_trip_from_yaml(tmp_path):
    from tracegym.commands.rl import check_policy_loss
    from tracegym.config import RLConfig, dump_config, load_config

    path = tmp_path / "rl.yaml"
    path.write_text(
        "policy_loss:\n  loss: decoupled_ppo\n  clip_eps_high: 0.28\n  behav_weight_cap: 3.0\n"
        "  aggregation: sequence_mean\n",
        encoding="utf-8",
    )
    rl = load_config(RLConfig, path, overrides=["policy_loss.behav_weight_mode=clamp"])
    check_policy_loss(rl.policy_loss)
    cfg = PolicyLossConfig.model_validate(rl.policy_loss)
    assert isinstance(cfg.loss_options, DecoupledPPOOptions)
    opts = cfg.loss_options
    assert (opts.behav_weight_cap, opts.behav_weight_mode) == (3.0, "clamp")
    assert (opts.clip_eps_high, opts.clip_eps_low) == (0.28, 0.2)
    assert cfg.aggregation == "sequence_mean" and cfg.needs_old_logprobs and cfg.loss_needs_old_logprobs
    # the resolved config file and the flat dump both come back to the same config
    again = load_config(RLConfig, dump_config(rl, tmp_path / "run"))
    assert PolicyLossConfig.model_validate(again.policy_loss) == cfg
    dumped = yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert dumped["behav_weight_mode"] == "clamp" and "loss_options" not in dumped
    assert PolicyLossConfig(**dumped) == cfg
    # defaults: cap 5, mask; the flags do not leak into ppo_clip
    defaults = PolicyLossConfig(loss="decoupled_ppo").loss_options
    assert defaults == DecoupledPPOOptions(behav_weight_cap=5.0, behav_weight_mode="mask")
    assert not PolicyLossConfig().needs_old_logprobs and PolicyLossConfig(tis_cap=2.0).needs_old_logprobs


def test_config_errors():
    from tracegym.commands.rl import check_policy_loss
    from tracegym.config import ConfigError

    problems = policy_loss_problems({"loss": "decoupled_ppo", "behav_weight_cap": 0.5, "behav_weight_mode": "drop"})
    assert len(problems) == 2, problems
    assert any("'policy_loss.behav_weight_cap'" in p and "greater than 1" in p for p in problems)
    assert any("'policy_loss.behav_weight_mode'" in p and "'mask' or 'clamp'" in p for p in problems)
    # TIS weighs by the same ratio pi_old / pi_engine: the pair is refused, in both validators
    (problem,) = policy_loss_problems({"loss": "decoupled_ppo", "tis_cap": 2.0})
    assert "tis_cap" in problem and "twice" in problem
    with pytest.raises(ValueError, match="twice"):
        PolicyLossConfig(loss="decoupled_ppo", tis_cap=2.0)
    with pytest.raises(ConfigError, match="twice"):
        check_policy_loss({"loss": "decoupled_ppo", "tis_cap": 2.0})
    # ppo_clip does not know the behaviour options
    unknown = r"unknown key 'policy_loss.behav_weight_cap' for loss 'ppo_clip' \(an option of 'decoupled_ppo'"
    with pytest.raises(ValueError, match=unknown):
        PolicyLossConfig(behav_weight_cap=5.0)
    assert policy_loss_problems({"loss": "decoupled_ppo", "dual_clip_c": 3.0, "behav_weight_cap": None}) == []
