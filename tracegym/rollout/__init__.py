"""Rollouts: environments x a policy -> token-exact trajectories.

- ``runner.py``: the runner (``run_rollouts``, ``RolloutConfig``, ``RolloutResult``): many episodes of
  the one episode loop at once, batched into the engine;
- ``tree.py``: tree rollouts (branch at turn boundaries, a tree per task);
- ``team.py``: team episodes (several roles, one adapter each);
- ``branches.py``: replaying a prefix of an episode and branching from it (Monte Carlo continuation);
- ``strategies.py``: ``ROLLOUT_STRATEGIES``, the registry ``rollout.strategy`` names (``chains``,
  ``tree``, and any a ``--plugin`` file registers), used alike by ``tracegym rl``, ``eval`` and
  ``rollout``.

Submodules import from each other (``tracegym.rollout.runner``), never from this package, so that
importing any one of them never runs this file half-way.
"""

from tracegym.rollout.runner import *  # noqa: F401,F403
from tracegym.rollout.runner import __all__ as _runner_all

__all__ = list(_runner_all)
