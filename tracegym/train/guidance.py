"""Off-policy guidance for groups that all fail (LUFFY: Yan et al. 2025, "Learning to Reason under
Off-Policy Guidance", arXiv 2504.14945).

Why: a group whose samples all fail has equal rewards, so group-relative estimators give it no
signal, and a decision the policy has stopped making (e.g. a subtraction) cannot come back from its
own samples. With guidance, one successful off-policy trajectory of the task (the env's scripted
expert) joins such a group *before* advantages are computed: the group then has signal, the expert
gets a positive advantage and the failures negative ones, summing to 0 for grpo/rloo.

The expert's tokens were not sampled by the policy. LUFFY mixes them in with the importance ratio
``pi_theta / pi_expert`` (``pi_expert = 1`` for a deterministic expert, as in its code) passed
through the policy shaping ``f(x) = x / (x + gamma)`` instead of a clipped ratio; the gradient of
``f(pi) * A`` is ``A * gamma * pi / (pi + gamma)^2 * grad log pi``. The trainer's loss applies
``ratio * A`` with ratio 1 on the first pass, so multiplying the advantage of every expert token by
``shaping_weight(pi_old) = gamma * pi / (pi + gamma)^2`` gives LUFFY's gradient exactly (one PPO
pass; later passes keep the weight of the first). Unlike a plain ratio (``grad = pi * grad log
pi``), the shaping keeps a gradient on tokens the policy finds unlikely; gamma = 0.1 as in LUFFY.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import Tensor

from tracegym.config import GuidanceConfig
from tracegym.types import Trajectory, TrajectoryGroup

GUIDANCE_KEY = "guidance"  # Trajectory.info key marking an off-policy guidance trajectory


def all_failed(group: TrajectoryGroup) -> bool:
    """Every sample of the group failed (and there is at least one)."""
    return bool(group.trajectories) and not any(t.success for t in group.trajectories)


def needs_guidance(groups: Sequence[TrajectoryGroup], cfg: GuidanceConfig) -> list[int]:
    """Indices of the groups that get a guidance trajectory this step (``cfg.groups``: the all-failure
    ones, or every group)."""
    chosen = [g for g, group in enumerate(groups) if cfg.groups == "every" or all_failed(group)]
    return chosen if cfg.max_groups_per_step is None else chosen[: cfg.max_groups_per_step]


def add_guidance(
    groups: Sequence[TrajectoryGroup], guides: dict[str, Trajectory], chosen: Sequence[int] | None = None,
) -> tuple[list[TrajectoryGroup], int]:
    """Each chosen group (None: every group) whose task has a successful guide gets it appended
    (marked ``info["guidance"]``, with a sample index no other member has); returns the groups and
    how many were guided."""
    out, guided = [], 0
    picked = set(range(len(groups)) if chosen is None else chosen)
    for g, group in enumerate(groups):
        guide = guides.get(group.task_id) if g in picked else None
        if guide is not None and guide.success:
            index = max((t.sample_index for t in group.trajectories), default=-1) + 1
            marked = guide.model_copy(update={"info": {**guide.info, GUIDANCE_KEY: True}, "sample_index": index})
            group = group.model_copy(update={"trajectories": (*group.trajectories, marked)})
            guided += 1
        out.append(group)
    return out, guided


def is_guidance(trajectory: Trajectory) -> bool:
    """Whether ``trajectory`` is an off-policy guidance trajectory (not sampled by the policy)."""
    return bool(trajectory.info.get(GUIDANCE_KEY))


def without_guidance(groups: Sequence[TrajectoryGroup], advantages: Sequence[Sequence[Sequence[float]]]
                     ) -> tuple[list[TrajectoryGroup], list[list[list[float]]]]:
    """The policy's own episodes of each group and their advantages (guidance trajectories left out)."""
    out_groups, out_adv = [], []
    for group, adv in zip(groups, advantages):
        keep = [i for i, t in enumerate(group.trajectories) if not is_guidance(t)]
        out_groups.append(group.model_copy(update={"trajectories": tuple(group.trajectories[i] for i in keep)}))
        out_adv.append([list(adv[i]) for i in keep])
    return out_groups, out_adv


def shaping_weight(logprobs: Tensor, gamma: float) -> Tensor:
    """LUFFY's shaped importance weight per token, ``gamma * p / (p + gamma)^2`` with ``p = exp(logprobs)``."""
    p = logprobs.exp()
    return gamma * p / (p + gamma) ** 2


def guidance_rows(groups: Sequence[TrajectoryGroup], group_index: Sequence[int],
                  trajectory_index: Sequence[int]) -> list[bool]:
    """Per training example (``examples_from_groups`` order): whether it comes from a guidance trajectory."""
    return [bool(groups[g].trajectories[i].info.get(GUIDANCE_KEY)) for g, i in zip(group_index, trajectory_index)]


def shape_guidance(batch: Any, rows: Sequence[bool], gamma: float) -> Any:
    """``batch`` with the advantages of guidance rows multiplied by ``shaping_weight`` of the policy's
    log-probs before the update (``batch.old_logprobs``: the trainer re-scores batches holding rows
    without engine log-probs, as guidance rows are)."""
    if not any(rows):
        return batch
    if batch.old_logprobs is None:
        raise ValueError("guidance rows need the trainer's old log-probs (score_batch computes them for rows "
                         "without engine log-probs)")
    by_example = dict(zip(range(len(rows)), rows))
    mask = torch.tensor([by_example[int(e)] for e in batch.example_ids.tolist()], dtype=torch.bool)
    weight = torch.where(mask[:, None].to(batch.advantages.device),
                         shaping_weight(batch.old_logprobs.to(batch.advantages.device), gamma),
                         torch.ones_like(batch.advantages))
    return dataclasses.replace(batch, advantages=batch.advantages * weight)


__all__ = ["GUIDANCE_KEY", "GuidanceConfig", "add_guidance", "all_failed", "guidance_rows",
           "is_guidance", "needs_guidance", "shape_guidance", "shaping_weight", "without_guidance"]
