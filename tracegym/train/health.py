"""RL health monitors: signals that a run is collapsing, logged every step, warned about early.

Two failure modes of multi-turn agent RL, each with a cheap per-step signal:

* **Echo trap** (RAGEN: Wang et al. 2025, "RAGEN: Understanding Self-Evolution in LLM Agents via
  Multi-Turn Reinforcement Learning"): the policy settles on one behaviour per task, every sample
  of a group gets the same reward, group-relative advantages vanish and learning stops. RAGEN
  watches the within-group reward standard deviation: it collapses several steps before the mean
  reward does. :func:`group_health` logs it (``health/reward_std``) with the number of groups that
  still carry signal (``health/informative_groups``, ``health/informative_share``).
* **Template collapse** (RAGEN-2: Wang et al. 2026, "RAGEN-2: Reasoning Collapse in Agentic RL",
  arXiv 2604.06268): responses stay diverse (entropy looks healthy) but no longer depend on the
  task: the same template whatever the input. Entropy cannot see it; the mutual information between
  task prompt and response can. :func:`mutual_information_proxy` estimates it on the step's own
  samples by cross-scoring each group's first response under every other group's prompt
  (``health/mi``).

:class:`HealthMonitor` turns the logged values into one-line warnings when a signal stays below its
threshold for ``patience`` steps; :class:`HealthConfig` is its config section.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from typing import TYPE_CHECKING

import numpy as np
from pydantic import Field

# torch is imported inside the functions so that a config check that imports this module stays light
from tracegym.config import HealthConfig  # noqa: F401  (re-exported: the section lives with the other config sections)
from tracegym.types import TrajectoryGroup

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = [
    "DEFAULT_MIN_MUTUAL_INFORMATION",
    "DEFAULT_MIN_REWARD_STD",
    "HealthConfig",
    "HealthMonitor",
    "first_turn_pairs",
    "cross_logprob_matrix",
    "group_health",
    "mi_from_cross_logprobs",
    "mutual_information_proxy",
]

# Why these defaults: with 0/1 rewards a group's population std is sqrt(p (1 - p)); 0.05 is below
# what a single differing sample gives in a group of up to 100 (sqrt(1/100 * 99/100) = 0.0995), so
# averaged over groups it means almost every group is uniform. For MI (nats, at most log B = 2.08
# for B = 8 pairs) 0.05 is 2.4% of that ceiling: the responses are nearly interchangeable across
# prompts.
DEFAULT_MIN_REWARD_STD = 0.05
DEFAULT_MIN_MUTUAL_INFORMATION = 0.05


# --- echo trap: reward spread within groups --------------------------------------------------------


def group_health(groups: Sequence[TrajectoryGroup], advantages: Sequence[Sequence[Sequence[float]]]) -> dict[str, float]:
    """Within-group reward spread and the groups that carry signal, for one step.

    ``advantages[g][i][k]`` is the advantage of turn ``k`` of trajectory ``i`` of group ``g`` (what
    the estimators return); pass the groups the estimator saw (with KL in the reward, their rewards
    include the penalty). Returns:

    * ``health/reward_std``: mean over groups of the *population* standard deviation (``ddof=0``,
      as ``np.std``) of the group's episode rewards; a one-sample group counts as 0. With 0/1
      rewards a group's value is ``sqrt(p (1 - p))``, at most 0.5.
    * ``health/informative_groups``: groups with at least one non-zero advantage (the ones the
      update learns from, ``tracegym.algos.has_signal``); ``health/informative_share`` their share.

    An empty step gives 0 for all three.
    """
    if len(advantages) != len(groups):
        raise ValueError(f"{len(groups)} groups but advantages for {len(advantages)}")
    if not groups:
        return {"health/reward_std": 0.0, "health/informative_groups": 0.0, "health/informative_share": 0.0}
    stds = [float(np.std(group.rewards)) if len(group) else 0.0 for group in groups]
    informative = sum(any(a != 0.0 for turns in group_adv for a in turns) for group_adv in advantages)
    return {
        "health/reward_std": float(sum(stds) / len(stds)),
        "health/informative_groups": float(informative),
        "health/informative_share": informative / len(groups),
    }


# --- template collapse: mutual information between prompt and response ----------------------------


def mi_from_cross_logprobs(matrix: Tensor | Sequence[Sequence[float]] | np.ndarray) -> float:
    """The batch MI proxy from a ``[B, B]`` matrix ``L[i, j] = log p(y_i | x_j)`` (row: response i,
    column: prompt j; length-normalised log-probs, i.e. mean per response token):

        MI ~= mean_i [ L[i, i] - log( (1/B) sum_j exp L[i, j] ) ]

    The inner mean is the response's likelihood under the batch's prompt marginal, computed as
    ``logsumexp_j L[i, j] - log B``. 0 when every row is constant (responses that ignore the prompt);
    at most ``log B`` (each term is, since the inner mean is at least ``exp L[i, i] / B``); negative
    when responses are likelier under other prompts than their own. ``-inf`` entries are allowed
    off the diagonal.
    """
    import torch

    values = torch.as_tensor(matrix, dtype=torch.float64)
    if values.dim() != 2 or values.shape[0] != values.shape[1] or values.shape[0] == 0:
        raise ValueError(f"need a non-empty square [B, B] matrix, got shape {tuple(values.shape)}")
    size = values.shape[0]
    own = values.diagonal()  # [B]: log p(y_i | x_i)
    marginal = torch.logsumexp(values, dim=1) - math.log(size)  # [B]: log mean_j p(y_i | x_j)
    return float((own - marginal).mean())


def first_turn_pairs(groups: Sequence[TrajectoryGroup], max_pairs: int = 8) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(prompt ids, completion ids)`` of the first assistant turn of one trajectory per group: the
    first trajectory whose first turn has a non-empty prompt and completion, from up to ``max_pairs``
    groups, in group order. A group whose turn-0 prompt equals an earlier pair's is skipped (the same
    task twice would count as "responses that ignore the prompt" and bias the MI down)."""
    if max_pairs < 1:
        raise ValueError(f"max_pairs must be >= 1, got {max_pairs}")
    pairs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    seen_prompts: set[tuple[int, ...]] = set()
    for group in groups:
        if len(pairs) >= max_pairs:
            break
        for trajectory in group.trajectories:
            if trajectory.turns and trajectory.turns[0].prompt_ids and trajectory.turns[0].completion_ids:
                prompt = tuple(trajectory.turns[0].prompt_ids)
                if prompt not in seen_prompts:
                    seen_prompts.add(prompt)
                    pairs.append((prompt, tuple(trajectory.turns[0].completion_ids)))
                break
    return pairs


def cross_logprob_matrix(
    model: torch.nn.Module, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, pad_token_id: int = 0,
    micro_batch_size: int = 8, temperature: float = 1.0,
) -> Tensor:
    """``[B, B]`` float64 matrix ``L[i, j]`` = mean log-prob per token of response ``i`` after prompt
    ``j`` (teacher-forced), for the ``B`` pairs ``(prompt x_j, response y_j)``.

    B^2 forward passes of ``len(x_j) + len(y_i)`` tokens, no gradient, in eval mode (the model's
    mode is restored after). Two levels of shared prefix: what all B prompts share (an env's system
    prompt and tool schemas) runs once (``step_prefix``); then prompt by prompt, the B rows of one
    prompt, in micro-batches of ``micro_batch_size``, share the rest of that prompt, which
    ``token_logprobs`` runs once per micro-batch (docs/algorithms.md "Log-probs"). The cost is about
    one common prefix, B prompt remainders and B^2 responses.
    """
    import torch

    from tracegym.train.info_gain import mean_completion_logprobs
    from tracegym.train.step_prefix import step_prefix

    size = len(pairs)
    matrix = torch.empty(size, size, dtype=torch.float64)  # [B responses, B prompts]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            prompts = [torch.tensor(list(prompt), dtype=torch.long)[None] for prompt, _ in pairs]  # [1, len(x_j)] each
            # a logit is needed from each prompt's last token on: the prefix stops before it
            prefix = step_prefix(model, [(ids, torch.ones_like(ids), ids.shape[1] - 1) for ids in prompts])
            for j, (prompt, _) in enumerate(pairs):
                rows = [(tuple(prompt), tuple(response)) for _, response in pairs]  # response i after prompt j
                scores = mean_completion_logprobs(model, rows, temperature=temperature, micro_batch_size=micro_batch_size,
                                                  pad_token_id=pad_token_id, prefix=prefix)
                matrix[:, j] = torch.tensor(scores, dtype=torch.float64)
    finally:
        model.train(was_training)
    return matrix


def mutual_information_proxy(
    model: torch.nn.Module, groups: Sequence[TrajectoryGroup], *, pad_token_id: int = 0, max_pairs: int = 8,
    micro_batch_size: int = 8, temperature: float = 1.0,
) -> dict[str, float]:
    """RAGEN-2's cheap MI proxy between task prompt and response on this step's samples.

    Takes the first assistant turn of one trajectory per group (``first_turn_pairs``: prompt = the
    rendered turn-0 prompt ids, response = its completion ids; B = distinct prompts, at most
    ``max_pairs``), scores every response under every prompt (``cross_logprob_matrix``) and returns
    ``{"health/mi": mi_from_cross_logprobs(L), "health/mi_pairs": B}``; ``{}`` with fewer than 2
    pairs (MI over one prompt is 0 by construction, not a measurement). In nats, between ~0
    (responses ignore the prompt) and ``log B``.

    ``temperature`` scales the logits as in ``token_logprobs``: 1 scores the model's own
    distribution; the sampling temperature scores the distribution the engine sampled from.
    """
    pairs = first_turn_pairs(groups, max_pairs)
    if len(pairs) < 2:
        return {}
    matrix = cross_logprob_matrix(model, pairs, pad_token_id=pad_token_id, micro_batch_size=micro_batch_size,
                                  temperature=temperature)
    return {"health/mi": mi_from_cross_logprobs(matrix), "health/mi_pairs": float(len(pairs))}


# --- warnings --------------------------------------------------------------------------------------


class HealthMonitor:
    """Warns when a health signal stays below its threshold for ``patience`` consecutive steps.

    Watched: ``health/reward_std`` against ``min_reward_std`` (default 0.05: with 0/1 rewards a
    group's population std is sqrt(p (1 - p)), and a mean under 0.05 means nearly every group is
    uniform, so there is almost nothing to learn from) and ``health/mi`` against
    ``min_mutual_information`` (default 0.05 nats, 2.4% of the log 8 = 2.08 ceiling of 8 pairs:
    responses are nearly interchangeable across prompts). A threshold of None is not watched.

    ``update(step, row)`` reads the step's metrics row and returns the warning lines of this step:
    one per metric whose streak of values strictly below its threshold has just reached
    ``patience`` steps. A streak warns once; a value at or above the threshold ends it, and a new
    streak warns again. A row without the metric (or with a non-finite value) neither extends nor
    ends the streak (e.g. MI skipped for a step with under two prompts).

    ``state_dict()`` / ``load_state_dict()`` hold the open streaks as plain ints and bools (they go
    into the checkpoint's state), so a resumed run continues them.
    """

    def __init__(self, min_reward_std: float | None = DEFAULT_MIN_REWARD_STD,
                 min_mutual_information: float | None = DEFAULT_MIN_MUTUAL_INFORMATION, patience: int = 3) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.thresholds: dict[str, float] = {
            key: float(value) for key, value in (("health/reward_std", min_reward_std),
                                                 ("health/mi", min_mutual_information)) if value is not None
        }
        self.patience = patience
        # metric -> {"length": steps in the streak, "first_step": its first step, "warned": bool}
        self._streaks: dict[str, dict[str, Any]] = {}

    @classmethod
    def from_config(cls, cfg: HealthConfig) -> HealthMonitor:
        """The monitor of a ``HealthConfig`` (no MI threshold when MI is not computed)."""
        return cls(cfg.min_reward_std, cfg.min_mutual_information if cfg.mutual_information else None, cfg.patience)

    def update(self, step: int, row: Mapping[str, Any]) -> list[str]:
        """Take the metrics of ``step``; the warning lines it triggers (usually none)."""
        warnings = []
        for key, threshold in self.thresholds.items():
            value = row.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                continue  # not measured this step: the streak waits
            if value >= threshold:
                self._streaks.pop(key, None)
                continue
            streak = self._streaks.setdefault(key, {"length": 0, "first_step": int(step), "warned": False})
            streak["length"] += 1
            if streak["length"] >= self.patience and not streak["warned"]:
                streak["warned"] = True
                warnings.append(
                    f"health warning at step {step}: {key} = {value:.4g} has been below {threshold:g} for "
                    f"{streak['length']} consecutive steps (since step {streak['first_step']}); {_MEANING[key]}")
        return warnings

    def state_dict(self) -> dict[str, Any]:
        return {"streaks": {key: dict(streak) for key, streak in self._streaks.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._streaks = {key: {"length": int(s["length"]), "first_step": int(s["first_step"]), "warned": bool(s["warned"])}
                         for key, s in dict(state.get("streaks", {})).items()}


_MEANING = {
    "health/reward_std": "the samples of each task get the same reward, so advantages vanish "
                         "(RAGEN's echo trap; see health/informative_groups)",
    "health/mi": "responses barely depend on the task prompt (RAGEN-2's template collapse)",
}
