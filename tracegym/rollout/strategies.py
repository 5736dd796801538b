"""Rollout strategies: how a group of episodes per task is sampled, by name.

A strategy is an async function ``(job, options) -> RolloutResult`` registered in
``ROLLOUT_STRATEGIES`` (the registry code the estimators and losses use: options validated by a
pydantic model or taken from keyword-only parameters, nearest-name errors). ``tracegym rl``
(``rollout.strategy`` / ``rollout.strategy_options``), ``tracegym eval`` and ``tracegym rollout``
(``--strategy NAME --strategy-option KEY=VALUE``) all run the one named. Built in:

- ``chains``: ``config.samples_per_task`` independent episodes per task (the runner, unchanged);
- ``tree``: the group is the leaves of one tree per task, branched at turn boundaries
  (``tracegym.rollout.tree``; options: ``TreeConfig``).

A user's strategy in a plain module, loaded with ``--plugin FILE``::

    @ROLLOUT_STRATEGIES.register("my_strategy")
    async def my_strategy(job: RolloutJob, *, tries: int = 2) -> RolloutResult:
        return await run_rollouts(job.env, job.tasks, job.policy, job.renderer, job.config, **job.runner_options())

(``examples/plugins/retry_errors_rollout.py`` is a whole one.) A strategy returns episodes by task
then sample index, ``config.samples_per_task`` per task (what RL groups and pass@k count).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Sequence

from tracegym.algos.registry import Registry
from tracegym.config import TreeConfig
from tracegym.rollout.runner import RolloutConfig, RolloutResult, run_rollouts
from tracegym.rollout.tree import run_tree_rollouts

__all__ = ["ROLLOUT_STRATEGIES", "RolloutJob", "run_strategy", "run_strategy_sync", "strategy_problems"]

ROLLOUT_STRATEGIES: Registry = Registry("rollout strategy", "async fn(job: RolloutJob, options) -> RolloutResult")


@dataclass(frozen=True)
class RolloutJob:
    """What a strategy is asked to run: ``config.samples_per_task`` episodes per task of ``env`` (a
    name with ``env_options``, or a factory) with ``policy`` (an engine or ``"expert"``)."""

    env: Any
    tasks: Sequence[Any]
    policy: Any
    renderer: Any
    config: RolloutConfig
    env_options: dict[str, Any] | None = None
    writer: Any | None = None  # every episode as it ends (trajectories.jsonl)
    failed_writer: Any | None = None  # the excluded ones (env errors, timeouts)
    policy_name: str | None = None
    gap_model: Any | None = None  # teacher-forced re-scoring of the sampled tokens (the log-prob gap)
    progress: bool = False

    def runner_options(self) -> dict[str, Any]:
        """The keyword arguments of ``run_rollouts`` this job carries."""
        return {"writer": self.writer, "failed_writer": self.failed_writer, "progress": self.progress,
                "env_options": self.env_options, "policy_name": self.policy_name, "gap_model": self.gap_model}


@ROLLOUT_STRATEGIES.register("chains")
async def chains(job: RolloutJob) -> RolloutResult:
    """Independent episodes: ``samples_per_task`` chains per task."""
    return await run_rollouts(job.env, job.tasks, job.policy, job.renderer, job.config, **job.runner_options())


@ROLLOUT_STRATEGIES.register("tree", options=TreeConfig)
async def tree(job: RolloutJob, options: TreeConfig) -> RolloutResult:
    """One tree of ``samples_per_task`` leaves per task; the trees' counters go to ``stats.extra``."""
    result, stats = await run_tree_rollouts(job.env, job.tasks, job.policy, job.renderer, job.config, options,
                                            job.config.samples_per_task, env_options=job.env_options,
                                            writer=job.writer, policy_name=job.policy_name or "policy")
    result.stats.extra = stats.metrics()
    return result


def strategy_problems(name: str, options: dict[str, Any] | None) -> list[str]:
    """One line per problem with a strategy name or its options ([] when both are fine)."""
    return ROLLOUT_STRATEGIES.problems(name, options, "rollout.strategy", "rollout.strategy_options")


async def run_strategy(name: str, job: RolloutJob, options: Any = None) -> RolloutResult:
    """Run the strategy ``name`` (KeyError with the registered names and the nearest one if unknown)."""
    return await ROLLOUT_STRATEGIES.entry(name)(job, options)


def run_strategy_sync(name: str, job: RolloutJob, options: Any = None) -> RolloutResult:
    """``asyncio.run(run_strategy(...))`` for callers without an event loop."""
    return asyncio.run(run_strategy(name, job, options))
