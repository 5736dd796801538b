"""A rollout strategy from a plugin file: chains, where an episode that failed for an env, engine or
timeout error is played again (up to ``retries`` times), so a flaky tool server does not shrink RL
groups or count as unsolved in pass@k. The retry keeps the failed episode's sample index.

    tracegym rollout --plugin examples/plugins/retry_errors_rollout.py --strategy retry_errors \\
        --strategy-option retries=3 --env calculator --tasks 8 --samples 4 --out runs/retry
    rollout: {strategy: retry_errors, strategy_options: {retries: 3}}      # in an RL config
"""

from collections import defaultdict

from tracegym.rollout import RolloutResult, run_rollouts
from tracegym.rollout.strategies import ROLLOUT_STRATEGIES, RolloutJob


async def _replay(job: RolloutJob, failed: list, attempt: int) -> RolloutResult:
    """The failed episodes' tasks again, as many samples each as failed, with a fresh seed."""
    wanted = defaultdict(list)  # task id -> the sample indices to fill
    for episode in failed:
        wanted[episode.task_id].append(episode.sample_index)
    tasks = {task.id: task for task in job.tasks}
    kept, still_failed = [], []
    for count in sorted({len(v) for v in wanted.values()}):  # one runner call per number of samples
        ids = [task_id for task_id, slots in wanted.items() if len(slots) == count]
        config = job.config.model_copy(update={"samples_per_task": count, "seed": (job.config.seed or 0) + 7919 * attempt})
        again = await run_rollouts(job.env, [tasks[i] for i in ids], job.policy, job.renderer, config,
                                   writer=job.writer, progress=False, env_options=job.env_options,
                                   policy_name=job.policy_name)
        for episodes, into in ((again.trajectories, kept), (again.failed, still_failed)):
            into += [e.model_copy(update={"sample_index": sorted(wanted[e.task_id])[e.sample_index]}) for e in episodes]
    return RolloutResult(kept, again.stats, still_failed)


@ROLLOUT_STRATEGIES.register("retry_errors")
async def retry_errors(job: RolloutJob, *, retries: int = 2) -> RolloutResult:
    result = await run_rollouts(job.env, job.tasks, job.policy, job.renderer, job.config, **job.runner_options())
    episodes, failed, replayed = list(result.trajectories), list(result.failed), 0
    for attempt in range(1, retries + 1):
        if not failed:
            break
        replayed += len(failed)
        again = await _replay(job, failed, attempt)
        episodes, failed = episodes + again.trajectories, again.failed
    order = {task.id: i for i, task in enumerate(job.tasks)}
    episodes.sort(key=lambda e: (order[e.task_id], e.sample_index))
    stats = result.stats  # the first pass's speed figures; the counts of the episodes returned
    stats.kept, stats.failed, stats.extra = len(episodes), len(failed), {**stats.extra, "retry/replayed": float(replayed)}
    stats.success_rate = sum(e.success for e in episodes) / max(len(episodes), 1)
    stats.mean_reward = sum(e.reward for e in episodes) / max(len(episodes), 1)
    return RolloutResult(episodes, stats, failed)
