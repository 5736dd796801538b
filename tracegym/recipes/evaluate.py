"""Evaluate a policy on held-out tasks and write ``eval.json`` + plots: the library form of
``tracegym eval``, shared by the command, the demo and anyone scripting evaluations.

All episodes run once at the largest turn budget; every smaller T is scored from the same episodes.
Failed episodes (env error, engine error, timeout) stay in the sample as unsolved: dropping them
would bias pass@k upwards when failures go with hard tasks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from tracegym.config import InjectionConfig
from tracegym.data.store import TrajectoryWriter
from tracegym.envs.injection import env_source
from tracegym.eval import summarize, write_eval
from tracegym.render.trajectory_examples import BuildStats, build_examples
from tracegym.rollout import RolloutConfig, RolloutResult
from tracegym.rollout.strategies import RolloutJob, run_strategy_sync
from tracegym.types import Trajectory


def context_figures(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Mean prompt tokens per turn, mean longest prompt per episode and mean segments per episode
    (the training examples ``build_examples`` cuts an episode into: a new one wherever a turn's
    prompt does not extend the previous turn's tokens)."""
    with_turns = [t for t in trajectories if t.turns]
    if not with_turns:
        return {}
    stats = BuildStats()
    for trajectory in with_turns:
        build_examples(trajectory, stats=stats)
    turns = [t for trajectory in with_turns for t in trajectory.turns]
    return {"prompt_tokens_per_turn": round(sum(len(t.prompt_ids) for t in turns) / len(turns), 1),
            "max_prompt_tokens_per_episode": round(sum(max(len(t.prompt_ids) for t in tr.turns) for tr in with_turns)
                                                   / len(with_turns), 1),
            "segments_per_episode": round(stats.examples / len(with_turns), 3)}


def evaluate_to_dir(
    env: str,
    tasks: Sequence[Any],
    policy: Any,
    renderer: Any,
    config: RolloutConfig,
    ks: Sequence[int],
    turns: Sequence[int],
    out: str | Path,
    *,
    env_options: dict[str, Any] | None = None,
    policy_name: str | None = None,
    split: str = "test",
    gap_model: Any | None = None,
    bootstrap: int = 1000,
    extra: dict[str, Any] | None = None,
    progress: bool = True,
    plots: bool = True,
    injection: InjectionConfig | None = None,
    strategy: str = "chains",
    strategy_options: Any = None,
    attempts: int = 1,
    reflect: bool = False,
) -> tuple[dict[str, Any], RolloutResult, dict[str, Path]]:
    """Run ``config.samples_per_task`` episodes per task and write ``out/eval.json``, the task-ordered
    ``trajectories.jsonl`` and the plots. Returns (summary, rollout result, written files).
    ``injection``: the episodes run in ``InjectionEnv`` around the env (eval.json then has ``asr``,
    ``utility_clean``, ``utility_injected``, ... and the settings under ``injection``). ``strategy``:
    the rollout strategy that samples the episodes (``tracegym.rollout.strategies``; chains only
    on a team env). ``attempts`` > 1: a failed episode is followed by up to ``attempts - 1`` more on
    its task that see the earlier outcomes (and, with ``reflect``, the model's reflection on each;
    ``tracegym.rollout.attempts``): the first attempts are scored as usual, the later ones go to
    ``attempts.jsonl`` and eval.json's ``attempts`` (pass@(attempt a) for a = 1..attempts)."""
    if config.max_turns < max(turns):
        raise ValueError(f"max_turns {config.max_turns} is below the largest turn budget {max(turns)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from tracegym.envs import make
    from tracegym.envs.team import TeamEnv

    probe = make(env, **(env_options or {}))
    team = isinstance(probe, TeamEnv)
    probe.close()
    if team and injection is not None:
        raise ValueError(f"prompt injections are not supported on the team env {env!r}")
    if team and strategy != "chains":
        raise ValueError(f"rollout strategy {strategy!r} is not supported on the team env {env!r} (chains only)")
    if attempts > 1 and (team or strategy != "chains" or injection is not None):
        raise ValueError("attempts > 1 runs single-agent chains without prompt injections (got "
                         f"{'a team env' if team else 'strategy ' + repr(strategy) if strategy != 'chains' else 'injections'})")
    tried = None
    # Streamed as episodes end (a crash keeps what ran), rewritten in task order by write_eval.
    with TrajectoryWriter(out / "trajectories.jsonl") as writer:
        if team:  # the same policy plays every role; one trajectory per role per episode
            from tracegym.recipes.team import episode_heads
            from tracegym.rollout.team import run_team_rollouts_sync

            result = run_team_rollouts_sync(env, tasks, policy, renderer, config, env_options=env_options,
                                            writer=writer, policy_name=policy_name or "policy")
            writer.write_all(result.failed)
        elif attempts > 1:
            import asyncio

            from tracegym.rollout.attempts import run_attempts

            tried = asyncio.run(run_attempts(env, tasks, policy, renderer, config, attempts, reflect=reflect,
                                             env_options=env_options, policy_name=policy_name, progress=progress,
                                             writer=writer))
            assert tried.first is not None
            result = tried.first
        else:
            source, options = env_source(env, env_options, injection)
            job = RolloutJob(source, tasks, policy, renderer, config, env_options=options, writer=writer,
                             failed_writer=writer, policy_name=policy_name, gap_model=gap_model, progress=progress)
            if strategy == "harness":
                import tracegym.serve.harness  # noqa: F401  (registers the strategy: it lives beside the gateway it needs)
            result = run_strategy_sync(strategy, job, strategy_options)
    order = {task.id: i for i, task in enumerate(tasks)}
    episodes = sorted(result.trajectories + result.failed, key=lambda t: (order[t.task_id], t.sample_index))
    scored = episodes
    if team:
        # one outcome per team episode (its first role's trajectory carries the team's success); the
        # turn budget T of pass@(k,T) is the whole episode's (every role's turns): only T = max_turns
        scored = episode_heads(episodes)
        turns = [config.max_turns]
    summary = summarize(scored, ks=list(ks), turns=list(turns), env=env,
                        model=policy_name or (scored[0].policy if scored else None),
                        split=split, n_bootstrap=bootstrap)
    summary.update(run_settings(config, strategy, result, env_options, injection))
    if tried is not None:
        summary["attempts"] = attempts_summary(tried, attempts, reflect, bootstrap)
        with TrajectoryWriter(out / "attempts.jsonl") as later:
            later.write_all([t for chain in tried.chains for t in chain[1:]])
    summary.update(extra or {})
    written = write_eval(out, summary, episodes, plots=plots)
    return summary, result, written


def run_settings(config: RolloutConfig, strategy: str, result: RolloutResult, env_options: dict[str, Any] | None,
                 injection: InjectionConfig | None) -> dict[str, Any]:
    """eval.json's record of how the episodes ran: env options, injections, sampling, rollout figures."""
    return {
        "env_options": dict(env_options or {}),
        **({"injection": injection.model_dump(mode="json")} if injection is not None else {}),
        "sampling": {"temperature": config.temperature, "top_p": config.top_p, "seed": config.seed,
                     "max_tokens_per_turn": config.max_tokens_per_turn,
                     "max_tokens_per_episode": config.max_tokens_per_episode,
                     "max_context": config.max_context, "episode_timeout_s": config.episode_timeout_s,
                     "context": config.context.model_dump()},
        "rollout": {"strategy": strategy, "episodes": result.stats.episodes, "failed": result.stats.failed,
                    "wall_time_s": round(result.stats.wall_time_s, 3),
                    "generated_tokens": result.stats.generated_tokens,
                    # what prompts cost under the context policy: the mean prompt length of a turn, the
                    # longest prompt, and the segments (fresh renderings) an episode became
                    **context_figures(result.trajectories)},
    }


def attempts_summary(tried: Any, attempts: int, reflect: bool, bootstrap: int) -> dict[str, Any]:
    """eval.json's ``attempts``: pass@(attempt a) with CIs, attempts played, tokens, reflections."""
    from tracegym.rollout.attempts import pass_at_attempts

    return {"n": attempts, "reflect": reflect, "chains": len(tried.chains),
            "pass_at_attempt": pass_at_attempts(tried.chains, attempts, bootstrap),
            "played": {str(a): len(tried.attempts(a)) for a in range(1, attempts + 1)},
            "generated_tokens": tried.generated_tokens, "reflection_tokens": tried.reflection_tokens,
            "reflections": [text for chain in tried.reflections for text in chain][:20]}
