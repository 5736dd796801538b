"""The pieces of one RL step, shared by the RL, team, self-play and distillation recipes and by the
executors that sample ahead of the update:

- ``tasks.py``: which train tasks a step gets (a seeded, resumable order);
- ``policy.py``: the trainable policy, its renderer and its rollout engine;
- ``collect.py``: a step's groups (through the rollout strategy), what is dropped or added before
  advantages (over-long episodes, LUFFY guides, the probe set) and the rows' rollout metrics;
- ``scoring.py``: optional scoring passes (branching, KL in the reward, InfoPO), then the estimator;
- ``executors/``: where rollouts run relative to the update (local, threads, Ray).

The recipes (``tracegym.recipes.rl`` and friends) are the loops that call these in order.
"""
