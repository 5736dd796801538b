"""MAGRPO: multi-agent GRPO with a joint reward and a group baseline per role.

Source: Liu et al. 2025, "LLM Collaboration With Multi-Agent Reinforcement Learning" (MAGRPO; anchor
``OpenMLRL/CoMLRL: comlrl/trainers/reinforce/magrpo.py``). G joint samples of a team from the same
history share one joint reward ``R^(g)``; every agent i gets ``A^(g) = R^(g) - mean_g R`` on its own
actions and maximises ``E[A^(g) log pi_i(a_i^(g) | h_i)]`` with its own parameters (its adapter).

Here each role's trajectories of one task form a group (``tracegym.rollout.team.group_by_role``),
so the baseline is the mean joint reward of the G samples of that task, per role (the "align" mode:
G samples, not G^N). With equal joint rewards in every role's trajectory the advantages are equal
across roles of one episode; per-role rewards (``TeamStep.role_rewards``) make them differ.
"""

from __future__ import annotations

from typing import Sequence

from tracegym.algos._groups import TurnAdvantages, broadcast_to_turns, episode_rewards
from tracegym.algos.dr_grpo import dr_grpo_advantages
from tracegym.algos.registry import ADVANTAGE_ESTIMATORS
from tracegym.types import TrajectoryGroup


def check_single_role(groups: Sequence[TrajectoryGroup]) -> None:
    """A group must hold one role's trajectories only (a baseline across roles mixes policies)."""
    for group in groups:
        roles = {t.info.get("role") for t in group.trajectories}
        if len(roles) > 1:
            raise ValueError(f"group {group.task_id} mixes roles {sorted(map(str, roles))}: group team "
                             "trajectories with tracegym.rollout.team.group_by_role")


@ADVANTAGE_ESTIMATORS.register("magrpo")
def magrpo(groups: Sequence[TrajectoryGroup]) -> list[TurnAdvantages]:
    """``A = R - mean_g R`` per (task, role) group; every turn of a role's episode gets it."""
    check_single_role(groups)
    rewards, ids = episode_rewards(groups)
    return broadcast_to_turns(groups, dr_grpo_advantages(rewards, ids))
