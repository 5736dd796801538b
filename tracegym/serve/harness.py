"""The ``harness`` rollout strategy: episodes played by a user's own agent code through a gateway.

An agent is an async function ``async def run(task, client) -> reward or answer`` (``client``: an
``openai.AsyncOpenAI`` whose base URL is one gateway session, serving the policy as model
``"policy"``; ``task``: a ``tracegym.envs.Task`` of the run's env). The strategy starts a ``Gateway`` (``gateway.py``) in front of the job's engine,
opens one session per episode (``samples_per_task`` per task), runs the agents concurrently (at
most ``concurrency`` at once; their calls meet in the engine's continuous batch) and merges every
session into a token-exact ``Trajectory`` (``sessions.py``): the same trajectories ``chains`` gives,
so ``tracegym rl``, ``eval`` and ``rollout`` score, group, train and report them alike.

    rollout: {strategy: harness, strategy_options: {agent: examples/harness/openai_sdk_agent.py:run}}
    tracegym eval ... --strategy harness --strategy-option agent=examples/harness/openai_sdk_agent.py:run

The reward: a number (or bool) the agent returns is the reward; a string is its final answer, which
the env verifies (``score_answer`` on the ``<answer>...</answer>`` part, or the whole string when
there is none): the agent never sees the reference. Every call samples at the rollout's temperature
and top_p, at most ``max_tokens_per_turn`` tokens, with a seed made from the run's seed, the session
and the call, whatever the agent's request says (``SessionSampling``).

What can go wrong fails that episode only: an agent that raises (``env_error``, the exception in
``error``), runs past ``timeout_s`` (``timeout``), returns something else than a number or a string
(``env_error``) or makes no model call (``env_error``). With ``on_env_error: exclude`` (the default)
the episode is left out and counted; with ``zero_reward`` a failed agent that made model calls keeps
its session as a trajectory at reward 0. ``gateway/token_breaks`` counts, per episode, the calls whose prompt does not extend
the previous call's tokens (the trajectory is cut there for training, never re-tokenized).

This lives beside the server (it needs it) and registers into the rollout layer's registry when
imported: ``tracegym rl``/``eval``/``rollout`` import it when the strategy is ``harness``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any, Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field

from tracegym.envs.episode import FAILED_END_REASONS
from tracegym.envs.tools import extract_answer
from tracegym.rollout.runner import RolloutResult, RolloutStats, env_factory
from tracegym.rollout.strategies import ROLLOUT_STRATEGIES, RolloutJob
from tracegym.serve.gateway import Gateway
from tracegym.serve.sessions import SessionSampling
from tracegym.types import Message, Trajectory

__all__ = ["HARNESS_MODEL", "HarnessOptions", "agent_problems", "harness", "load_agent", "verify_answer"]

Agent = Callable[[Any, Any], Awaitable[Any]]
HARNESS_MODEL = "policy"  # the model name an agent asks the gateway for


class HarnessOptions(BaseModel):
    """``rollout.strategy_options`` of ``strategy: harness``."""

    model_config = ConfigDict(extra="forbid")

    agent: str
    """``module:function`` or ``path/to/file.py:function`` (a path relative to the working directory)."""

    timeout_s: float = Field(300.0, gt=0)
    """Wall-clock limit of one agent run (its episode ends ``timeout``)."""

    concurrency: int | None = Field(None, gt=0)
    """Agents running at once (default: ``rollout.concurrency``)."""


def load_agent(spec: str) -> Agent:
    """The agent function named by ``module:function`` or ``file.py:function`` (a one-line error otherwise)."""
    from tracegym.plugins import load_plugins

    module_name, sep, function_name = spec.rpartition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"harness agent {spec!r}: expected 'module:function' or 'path/file.py:function'")
    (module,) = load_plugins([module_name], base_dir=Path.cwd())
    agent = getattr(module, function_name, None)
    if agent is None:
        raise ValueError(f"harness agent {spec!r}: {module_name} has no attribute {function_name!r}")
    if not inspect.iscoroutinefunction(agent):
        raise ValueError(f"harness agent {spec!r} must be an async function `async def {function_name}(task, client)`")
    return agent


def agent_problems(strategy: str, options: dict[str, Any] | None, where: str = "rollout.strategy_options") -> list[str]:
    """One line if ``strategy`` is ``harness`` and its agent cannot be loaded (checked before a
    model is loaded); [] otherwise. Importing this module registers the strategy."""
    agent = (options or {}).get("agent")
    if strategy != "harness" or not isinstance(agent, str):
        return []  # not a harness, or the options model reports the missing agent
    try:
        load_agent(agent)
    except Exception as exc:  # PluginError, ValueError: one line naming the agent
        return [f"{where}.agent: {exc}"]
    return []


async def verify_answer(env: Any, task: Any, answer: str) -> float:
    """The env's reward for a final ``answer`` to ``task`` (its ``score_answer``, after a reset)."""
    score = getattr(env, "score_answer", None)
    if score is None:
        raise TypeError(f"env {type(env).__name__} has no score_answer: the agent must return the reward itself")
    await env.reset(task)
    extracted = extract_answer(answer)
    return float(score(extracted if extracted is not None else answer.strip()))


async def _reward_of(outcome: Any, make_env: Callable[[], Any] | None, task: Any) -> tuple[float, str | None]:
    """``(reward, the answer when one was verified)``; TypeError for an outcome that is neither."""
    if isinstance(outcome, bool) or isinstance(outcome, (int, float)):
        reward = float(outcome)
        if not math.isfinite(reward):
            raise TypeError(f"the agent returned a non-finite reward {outcome!r}")
        return reward, None
    if isinstance(outcome, str):
        if make_env is None:
            raise TypeError("the agent returned an answer, but the job has no env to verify it")
        env = make_env()
        try:
            return await verify_answer(env, task, outcome), outcome
        finally:
            env.close()
    raise TypeError(f"the agent returned {type(outcome).__name__}: expected a reward (number) or an answer (str)")


def _failed(task: Any, sample_index: int, env_name: str, policy: str, end_reason: str, error: str) -> Trajectory:
    question = task.data.get("question") if isinstance(task.data, dict) else None
    messages = (Message(role="user", content=str(question)),) if question else ()
    return Trajectory(env=env_name, task_id=task.id, split=task.split, sample_index=sample_index, messages=messages,
                      end_reason=end_reason, error=error, policy=policy)  # type: ignore[arg-type]


@ROLLOUT_STRATEGIES.register("harness", options=HarnessOptions)
async def harness(job: RolloutJob, options: HarnessOptions) -> RolloutResult:
    """``samples_per_task`` runs of the agent per task, each one gateway session -> one trajectory."""
    agent = load_agent(options.agent)
    if isinstance(job.policy, str) or not hasattr(job.policy, "generate"):
        raise ValueError("strategy harness needs a token engine (hf, vllm): the gateway records sampled token ids")
    config = job.config
    make_env, env_name = env_factory(job.env, job.env_options)
    policy_name = job.policy_name or "policy"
    sampling = SessionSampling(temperature=config.temperature, top_p=config.top_p,
                               max_tokens=config.max_tokens_per_turn, seed=config.seed)
    episodes = [(task, k) for task in job.tasks for k in range(config.samples_per_task)]
    kept: dict[int, Trajectory] = {}
    failed: dict[int, Trajectory] = {}
    semaphore = asyncio.Semaphore(options.concurrency or config.concurrency)
    t0 = time.perf_counter()

    # the agent asks for model "policy" (HARNESS_MODEL) whatever the policy is; trajectories name the real one
    with Gateway(job.policy, job.renderer, HARNESS_MODEL, sampling=sampling, max_context=config.max_context) as gateway:

        def fail(index: int, task: Any, k: int, end_reason: str, error: str) -> None:
            """A failed agent: with ``on_env_error: zero_reward`` and model calls made, its session is
            kept at reward 0 (its sampled turns are real samples); otherwise it is excluded."""
            session = f"{task.id}/{k}"
            if config.on_env_error == "zero_reward" and gateway.sessions.get(session).calls:
                trajectory = gateway.finish(session, reward=0.0, success=False, task_id=task.id)
                kept[index] = trajectory.model_copy(update={"env": env_name or "harness", "split": task.split, "policy": policy_name,
                                                            "sample_index": k, "end_reason": end_reason, "error": error})
                return
            gateway.discard(session)
            failed[index] = _failed(task, k, env_name or "harness", policy_name, end_reason, error)

        async def one(index: int, task: Any, k: int) -> None:
            session = f"{task.id}/{k}"
            async with semaphore:
                client = gateway.client(session, timeout=options.timeout_s)
                try:
                    try:
                        outcome = await asyncio.wait_for(agent(task, client), options.timeout_s)
                        reward, answer = await _reward_of(outcome, make_env, task)
                    finally:
                        await client.close()
                except asyncio.TimeoutError:
                    return fail(index, task, k, "timeout", f"the agent ran past timeout_s={options.timeout_s:g}")
                except Exception as exc:  # the agent's own failure: this episode only
                    return fail(index, task, k, "env_error", f"{type(exc).__name__}: {exc}".strip())
                if not gateway.sessions.get(session).calls:
                    return fail(index, task, k, "env_error", "the agent made no model call")
                trajectory = gateway.finish(session, reward=reward, task_id=task.id,
                                            info={"answer": answer} if answer is not None else None)
                kept[index] = trajectory.model_copy(update={
                    "env": env_name or "harness", "split": task.split, "sample_index": k, "policy": policy_name,
                    "end_reason": "truncated" if trajectory.turns[-1].finish_reason == "length" else "terminated"})

        await asyncio.gather(*(one(i, task, k) for i, (task, k) in enumerate(episodes)))

    wall = time.perf_counter() - t0
    trajectories = [kept[i] for i in sorted(kept)]
    for writer, group in ((job.writer, trajectories), (job.failed_writer, [failed[i] for i in sorted(failed)])):
        if writer is not None:
            for trajectory in group:
                writer.write(trajectory)
    end_reasons = Counter(t.end_reason for t in [*trajectories, *failed.values()])
    generated = sum(t.num_generated_tokens for t in trajectories)
    breaks = sum(int(t.info.get("token_breaks", 0)) for t in trajectories)
    stats = RolloutStats(
        episodes=len(episodes), kept=len(trajectories), failed=sum(end_reasons[r] for r in FAILED_END_REASONS),
        end_reasons=dict(end_reasons),
        errors=[f"{t.task_id}/{t.sample_index}: {t.end_reason}: {t.error}" for t in list(failed.values())[:20]],
        success_rate=sum(t.success for t in trajectories) / len(trajectories) if trajectories else 0.0,
        mean_reward=sum(t.reward for t in trajectories) / len(trajectories) if trajectories else 0.0,
        turns=sum(len(t.turns) for t in trajectories), generated_tokens=generated, wall_time_s=wall,
        episodes_per_s=len(episodes) / wall if wall > 0 else 0.0, tokens_per_s=generated / wall if wall > 0 else 0.0,
        extra={"gateway/token_breaks": float(breaks),
               "gateway/episodes_with_breaks": float(sum(1 for t in trajectories if t.info.get("token_breaks")))},
    )
    return RolloutResult(trajectories=trajectories, stats=stats, failed=[failed[i] for i in sorted(failed)])
