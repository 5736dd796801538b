"""Run a registered advantage estimator on groups, and check what it returns.

An estimator maps ``TrajectoryGroup``s to one advantage per assistant turn of every trajectory::

    advantages = compute_advantages("rloo", groups)          # list (per group) of [trajectory][turn]
    advantages[g][i][k]                                       # turn k of trajectory i of group g

Episode-level estimators (GRPO, Dr. GRPO, RLOO, REINFORCE) put the episode's value on every turn;
``turn_rloo`` gives each turn its own. The renderer then puts a turn's advantage on exactly the
tokens sampled in that turn (``Renderer.build_examples(trajectory, advantage=[A_0, ...])``).
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Sequence

from pydantic import BaseModel, ValidationError

from tracegym.algos._groups import EstimatorResult, TurnAdvantages, check_episode_rewards
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.types import TrajectoryGroup


def estimator_problems(name: str, options: dict[str, Any] | None) -> list[str]:
    """Readable problems of ``advantage.estimator`` / ``advantage.options`` ([] when valid)."""
    if name not in ADVANTAGE_ESTIMATORS:
        try:
            ADVANTAGE_ESTIMATORS.entry(name)
        except KeyError as error:
            return [f"bad value for 'advantage.estimator': {error.args[0]}"]
    entry = ADVANTAGE_ESTIMATORS.entry(name)
    try:
        entry.parse_options(options)
    except ValidationError as error:
        return _option_problems(error, entry.options, f"advantage.options (estimator {name!r})")
    return []


def _option_problems(error: ValidationError, model: type[BaseModel], where: str) -> list[str]:
    allowed = sorted(model.model_fields)
    problems = []
    for err in error.errors():
        key = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.0) if allowed else []
            hint = f"; did you mean {near[0]!r}?" if near else ""
            problems.append(f"unknown key {key!r} in {where}{hint} allowed keys: {', '.join(allowed) or 'none'}")
        else:
            problems.append(f"bad value for {key!r} in {where}: {err['msg']}, got {err.get('input')!r}")
    return problems


def estimate(
    name: str, groups: Sequence[TrajectoryGroup], options: dict[str, Any] | BaseModel | None = None
) -> EstimatorResult:
    """Run the estimator registered as ``name`` with ``options``: advantages ``[group][trajectory][turn]``
    and the estimator's metrics (an estimator returns either the bare list or an ``EstimatorResult``).

    Raises ``KeyError`` for an unknown name (with the registered names), ``ValueError`` for bad
    options, ``ValueError`` when a trajectory's episode reward is not the sum of its turn rewards
    (episode and per-turn estimators would read different rewards), and ``ValueError`` when the
    estimator returns the wrong shape or a non-finite value (naming the group, trajectory and turn),
    so a buggy plugin cannot train on garbage.
    """
    entry = ADVANTAGE_ESTIMATORS.entry(name)
    try:
        opts = entry.parse_options(options)
    except ValidationError as error:
        raise ValueError("; ".join(_option_problems(error, entry.options, f"estimator {name!r} options"))) from None
    check_episode_rewards(groups)  # one pass over the turns: cheap next to any estimator
    out = entry(list(groups), opts)
    metrics: dict[str, float] = {}
    weights = None
    if isinstance(out, EstimatorResult):
        out, metrics, weights = out.advantages, {k: float(v) for k, v in out.metrics.items()}, out.weights
    check_advantages(name, groups, out)
    if weights is not None:
        check_advantages(name, groups, weights, what="token weights")
        bad = [w for group in weights for turns in group for w in turns if float(w) < 0]
        if bad:
            raise ValueError(f"estimator {name!r} returned negative token weights (e.g. {bad[0]})")
        weights = [[[float(w) for w in turns] for turns in group] for group in weights]
    return EstimatorResult([[[float(a) for a in turns] for turns in group] for group in out], metrics, weights)


def compute_advantages(
    name: str, groups: Sequence[TrajectoryGroup], options: dict[str, Any] | BaseModel | None = None
) -> list[TurnAdvantages]:
    """The advantages of ``estimate`` (``[group][trajectory][turn]``), without the metrics."""
    return estimate(name, groups, options).advantages


def check_advantages(name: str, groups: Sequence[TrajectoryGroup], advantages: Any, what: str = "advantages") -> None:
    """Raise ``ValueError`` unless ``advantages`` (or the token weights: ``what``) has one finite value
    per turn of every trajectory."""
    if not isinstance(advantages, (list, tuple)) or len(advantages) != len(groups):
        got = len(advantages) if isinstance(advantages, (list, tuple)) else type(advantages).__name__
        raise ValueError(f"estimator {name!r} returned {got} groups for {len(groups)}")
    for g, (group, values) in enumerate(zip(groups, advantages)):
        if len(values) != len(group.trajectories):
            raise ValueError(
                f"estimator {name!r}: group {g} (task {group.task_id}) has {len(group.trajectories)} trajectories "
                f"but {len(values)} rows of {what}"
            )
        for i, (traj, turns) in enumerate(zip(group.trajectories, values)):
            if len(turns) != len(traj.turns):
                raise ValueError(
                    f"estimator {name!r}: task {group.task_id} sample {traj.sample_index} has {len(traj.turns)} turns "
                    f"but {len(turns)} {what}"
                )
            for k, a in enumerate(turns):
                if not math.isfinite(float(a)):
                    raise ValueError(f"estimator {name!r}: task {group.task_id} sample {i} turn {k}: {what.rstrip('s')} {a}")


def has_signal(advantages: TurnAdvantages) -> bool:
    """Whether any turn of the group has a non-zero advantage (all-zero groups teach nothing)."""
    return any(a != 0.0 for turns in advantages for a in turns)


__all__ = [
    "EstimatorResult",
    "TurnAdvantages",
    "check_advantages",
    "compute_advantages",
    "estimate",
    "estimator_problems",
    "has_signal",
]
