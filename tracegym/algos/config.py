"""``PolicyLossConfig``: which loss ``compute_policy_loss`` composes, and the shared terms around it.

Read from the ``policy_loss:`` section of an RL run config (``RLConfig.policy_loss``). Keys are
flat: the common keys below are fields of ``PolicyLossConfig``; every other key is an option of
the chosen loss, validated by that loss's options model (``POLICY_LOSSES.options(loss)``) and
available as ``cfg.loss_options``::

    policy_loss:
      loss: ppo_clip          # ppo_clip | gspo | policy_gradient | decoupled_ppo | a plugin's loss
      clip_eps_high: 0.28     # ppo_clip's own option (clip-higher, DAPO)
      dual_clip_c: 3.0        # ppo_clip's own option (dual clip)
      aggregation: token_mean # token_mean | sequence_mean | sequence_sum | fixed_length_sum
      tis_cap: 2.0            # truncated importance sampling against the engine's log-probs

In Python: ``PolicyLossConfig(loss="ppo_clip", clip_eps_high=0.28)``. ``policy_loss_problems(dict)``
lists every problem of such a section as readable lines (``[]`` when it is valid).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from tracegym.algos.registry import POLICY_LOSSES, NoOptions

DEFAULT_LOSS = "ppo_clip"


class PolicyLossCommon(BaseModel):
    """The keys every policy loss shares (``PolicyLossConfig`` adds the loss's own options)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    loss: str = DEFAULT_LOSS
    """Registered policy loss: ``ppo_clip`` (token ratios, PPO), ``gspo`` (sequence ratio, the
    length-normalised geometric mean of token ratios), ``policy_gradient`` (no clipping),
    ``decoupled_ppo`` (AReaL's decoupled PPO for stale, asynchronously sampled batches: PPO-clip
    against the trainer's start-of-step policy, each token weighted by ``pi_prox / pi_behav``), or
    one a plugin registers. Its own options are further keys of this section."""

    aggregation: Literal["token_mean", "sequence_mean", "sequence_sum", "fixed_length_sum"] = "token_mean"
    """How per-token losses become one number: mean over all trained tokens (``token_mean``); mean
    per sequence then over sequences (``sequence_mean``); token sum per sequence, mean over
    sequences (``sequence_sum``); token sum per sequence over the constant ``fixed_length``, mean
    over sequences (``fixed_length_sum``, Dr. GRPO)."""

    fixed_length: int | None = Field(None, gt=0)
    """The constant of ``fixed_length_sum`` (e.g. the generation token budget); required by it."""

    kl_coef: float = Field(0.0, ge=0.0)
    """Weight beta of the KL penalty to the reference policy; 0 turns it off (no reference model)."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman, "Approximating KL divergence"), ``r = pi_ref / pi``:
    k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r. As a loss term (``kl_penalty: loss``)
    what counts is the gradient: k3's expected gradient is that of KL(pi_ref || pi) (as in
    DeepSeekMath's GRPO), k2's that of KL(pi || pi_ref), and k1's is zero, so k1 is rejected there."""

    kl_penalty: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes: added to the loss (``compute_policy_loss`` does it), or taken off
    the rewards before advantages are estimated (``tracegym.recipes.rl.kl_in_reward``: ``kl_coef`` times
    the episode's summed per-token KL off its last turn's reward and its episode reward)."""

    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus: the loss minus ``entropy_coef`` times the aggregated token entropy. 0: off."""

    tis_cap: float | None = Field(None, gt=0.0)
    """Truncated importance sampling: each token's loss is multiplied by
    ``min(exp(old_logprob - engine_logprob), tis_cap)`` to correct for the engine/trainer mismatch
    (Yao et al. 2025), for every loss. Needs trainer-recomputed ``old_logprobs``. Typical: 2.0. None: off.
    Not with ``decoupled_ppo``: it weighs every token by that same ratio itself (``behav_weight_cap``)."""

    log_ratio_limit: float = Field(20.0, gt=0.0)
    """Log-ratios are clamped to +-this before ``exp`` so one bad token cannot overflow to inf."""

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        if value not in POLICY_LOSSES:
            try:
                POLICY_LOSSES.entry(value)
            except KeyError as error:  # pydantic reports ValueErrors, with the registered names
                raise ValueError(error.args[0]) from None
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> "PolicyLossCommon":
        if self.kl_penalty == "loss" and self.kl_estimator == "k1":
            raise ValueError(
                "kl_estimator 'k1' with kl_penalty 'loss' has zero expected gradient (E_pi[grad log pi] = 0): "
                "the penalty would do nothing; use kl_estimator: k3 (or k2) in the loss, or kl_penalty: reward for k1"
            )
        if self.aggregation == "fixed_length_sum" and self.fixed_length is None:
            raise ValueError(
                "aggregation 'fixed_length_sum' needs fixed_length (e.g. the generation token budget, "
                "rollout.max_tokens_per_turn times the turns); a batch's padded length is not a constant"
            )
        return self


COMMON_KEYS: tuple[str, ...] = tuple(PolicyLossCommon.model_fields)


def _loss_model(name: Any, keys: Any = ()) -> tuple[str | None, type[BaseModel] | None]:
    """The options model of loss ``name``. For an unknown name (reported by the ``loss`` field), that
    of the registered loss whose options know most of ``keys`` (ties: a name containing the given
    one, then the nearest name), so the values of those keys are still checked; ``(None, None)``
    when no loss knows any of them."""
    if isinstance(name, str) and name in POLICY_LOSSES:
        return name, POLICY_LOSSES.options(name)
    keys = set(keys)
    near = difflib.get_close_matches(str(name), POLICY_LOSSES.names(), n=len(POLICY_LOSSES), cutoff=0.0)
    scored = [(len(keys & set(POLICY_LOSSES.options(n).model_fields)), str(name) in n, -near.index(n), n) for n in near]
    if not scored or max(scored)[0] == 0:
        return None, None
    best = max(scored)[-1]
    return best, POLICY_LOSSES.options(best)


def _message(err: Mapping[str, Any]) -> str:
    msg = str(err["msg"])
    return msg[len("Value error, ") :] if msg.startswith("Value error, ") else msg


def _value_problems(exc: ValidationError, loss: str | None = None) -> list[str]:
    """Readable lines for a pydantic error of the section (keys as ``policy_loss.<key>``)."""
    problems = []
    for err in exc.errors():
        key = ".".join(["policy_loss", *(str(part) for part in err["loc"])])
        given = f", got {err['input']!r}" if err.get("loc") and not isinstance(err.get("input"), dict) else ""
        of = f" (option of loss {loss!r})" if loss and err.get("loc") else ""
        if not err.get("loc"):
            problems.append(f"invalid '{key}': {_message(err)}")
        else:
            problems.append(f"bad value for '{key}'{of}: {_message(err)}{given}")
    return problems


def _unknown_key_problem(key: str, loss: str, allowed: list[str]) -> str:
    near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.0)
    hint = f"; did you mean 'policy_loss.{near[0]}'?" if near else ""
    owners = [n for n in POLICY_LOSSES.names() if n != loss and key in POLICY_LOSSES.options(n).model_fields]
    elsewhere = f" (an option of {', '.join(repr(o) for o in owners)}, not of {loss!r})" if owners else ""
    return f"unknown key 'policy_loss.{key}' for loss {loss!r}{elsewhere}{hint} allowed keys here: {', '.join(allowed)}"


def _parse_loss_options(loss: str, model: type[BaseModel], values: Mapping[str, Any]) -> tuple[BaseModel | None, list[str]]:
    """Validate ``values`` (the non-common keys) with ``model``, the options of ``loss``."""
    allowed = sorted({*COMMON_KEYS, *model.model_fields})
    problems = [_unknown_key_problem(str(k), loss, allowed) for k in values if k not in model.model_fields]
    if problems:
        return None, problems
    try:
        return model.model_validate(dict(values)), []
    except ValidationError as exc:
        return None, _value_problems(exc, loss)


def _flag(model: type[BaseModel] | None, name: str) -> bool:
    """A class flag of a loss's options model (``needs_old_logprobs``, ``applies_behaviour_weights``)."""
    return bool(getattr(model, name, False)) if model is not None else False


def _combination_problems(loss: str, model: type[BaseModel] | None, tis_cap: Any) -> list[str]:
    """Problems of the common keys together with the chosen loss (each valid on its own)."""
    if tis_cap is not None and _flag(model, "applies_behaviour_weights"):
        return [
            f"invalid 'policy_loss': tis_cap with loss {loss!r}, which already weighs every token by "
            "pi_old / pi_engine (its behaviour weight): TIS would apply the same ratio twice; drop tis_cap "
            "(the loss's own cap, e.g. behav_weight_cap, bounds the weight)"
        ]
    return []


def policy_loss_problems(options: Any) -> list[str]:
    """Every problem of a ``policy_loss`` section (flat keys), one readable line each; ``[]`` when
    valid. Unknown keys are named ``policy_loss.<key>`` with the nearest valid key (among the
    common keys and the chosen loss's options) and the allowed keys."""
    if not isinstance(options, Mapping):
        return [f"'policy_loss' must be a mapping of options, got {type(options).__name__}"]
    common = {k: v for k, v in options.items() if k in COMMON_KEYS}
    rest = {k: v for k, v in options.items() if k not in COMMON_KEYS}
    problems: list[str] = []
    parsed: PolicyLossCommon | None = None
    try:
        parsed = PolicyLossCommon.model_validate(common)
    except ValidationError as exc:
        problems += _value_problems(exc)
    loss, model = _loss_model(options.get("loss", DEFAULT_LOSS), rest)
    if model is not None and loss is not None:
        problems += _parse_loss_options(loss, model, rest)[1]
        if parsed is not None and loss == parsed.loss:  # the named loss, not a stand-in for an unknown name
            problems += _combination_problems(loss, model, parsed.tis_cap)
    elif rest:  # an unknown loss and keys no registered loss knows
        problems += [f"unknown key 'policy_loss.{k}': no registered policy loss has this option" for k in rest]
    return problems


class PolicyLossConfig(PolicyLossCommon):
    """The policy-loss section: the common keys (fields) and the chosen loss's validated options
    (``loss_options``), given flat. Unknown keys are errors naming the nearest valid key."""

    loss_options: SerializeAsAny[BaseModel] = Field(default_factory=NoOptions)
    """The chosen loss's options model instance, validated from the keys that are not common keys
    (built by the validator; pass it directly as an instance or a dict, or give its keys flat)."""

    @model_validator(mode="before")
    @classmethod
    def _split_flat_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        name = data.get("loss", DEFAULT_LOSS)
        if not isinstance(name, str) or name not in POLICY_LOSSES:
            # the ``loss`` field reports the unknown name; drop the loss's keys so that is the error
            return {k: v for k, v in data.items() if k in COMMON_KEYS}
        model = POLICY_LOSSES.options(name)
        given = data.pop("loss_options", None)
        rest = {k: data.pop(k) for k in list(data) if k not in COMMON_KEYS}
        if isinstance(given, model) and not rest:
            data["loss_options"] = given
            return data
        if isinstance(given, BaseModel):
            given = given.model_dump(exclude_unset=True)
        if given is not None and not isinstance(given, Mapping):
            raise ValueError(f"loss_options must be a {model.__name__} or a mapping, got {type(given).__name__}")
        both = sorted(set(given or {}) & set(rest))
        if both:
            raise ValueError(f"option(s) {', '.join(both)} given both flat and in loss_options")
        options, problems = _parse_loss_options(name, model, {**(given or {}), **rest})
        if problems:
            raise ValueError("\n".join(problems))
        data["loss_options"] = options
        return data

    @model_validator(mode="after")
    def _check_loss_combination(self) -> "PolicyLossConfig":
        problems = _combination_problems(self.loss, type(self.loss_options), self.tis_cap)
        if problems:
            raise ValueError(problems[0].removeprefix("invalid 'policy_loss': "))
        return self

    @property
    def loss_needs_old_logprobs(self) -> bool:
        """The chosen loss needs trainer-recomputed ``old_logprobs`` (its options model's class flag
        ``needs_old_logprobs``, e.g. ``decoupled_ppo``'s proximal policy)."""
        return _flag(type(self.loss_options), "needs_old_logprobs")

    @property
    def needs_old_logprobs(self) -> bool:
        """The update needs the trainer's own log-probs of the old policy, whatever the sampler
        recorded: TIS compares them with the engine's, and some losses (``loss_needs_old_logprobs``)
        use them as their proximal policy."""
        return self.tis_cap is not None or self.loss_needs_old_logprobs

    @model_serializer(mode="wrap")
    def _flat(self, handler: Any, info: Any) -> dict[str, Any]:
        """Dump flat, as written in YAML: the common keys and the loss's options side by side."""
        out = handler(self)
        out.pop("loss_options", None)
        out.update(self.loss_options.model_dump(mode=info.mode))
        return out


__all__ = ["COMMON_KEYS", "PolicyLossCommon", "PolicyLossConfig", "policy_loss_problems"]
