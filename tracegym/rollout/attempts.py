"""Test-time learning across attempts (``tracegym eval --attempts N [--reflect]``).

Each of a task's ``samples_per_task`` chains is played up to ``attempts`` times. Attempt 1 is an
ordinary episode. A chain whose attempt fails plays the same task again in a fresh env, and the
task's opening user message then ends with the outcome of each earlier attempt of that chain: its
reward, how it ended, its last message and the env's last reply. With ``reflect`` the model first
writes a reflection on each failed attempt (one sampled completion of the failed transcript plus
``REFLECT_REQUEST``), shown beside that outcome: Reflexion's loop (Shinn et al., 2023) with the
env's verifier as the feedback. A chain stops at its first success.

pass@(attempt a) is the share of a task's chains solved within ``a`` attempts, averaged over tasks
(with a bootstrap CI over tasks): it is reported next to pass@k, which counts independent samples
that never see each other. The first attempts are exactly ``tracegym eval``'s ordinary episodes
(same seeds), so pass@(attempt 1) equals pass@1 of the same run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from tracegym.envs.base import EnvWrapper, Task
from tracegym.rollout.runner import RolloutConfig, RolloutResult, env_factory, run_rollouts
from tracegym.types import Message, SamplingParams, Trajectory

__all__ = ["FEEDBACK_KEY", "REFLECT_REQUEST", "AttemptsResult", "FeedbackEnv", "outcome_text", "pass_at_attempts",
           "run_attempts"]

FEEDBACK_KEY = "_attempt_feedback"
"""Key of ``Task.data`` that carries the feedback of earlier attempts into :class:`FeedbackEnv`."""

REFLECT_REQUEST = ("Your attempt did not solve the task. In two or three sentences, say what went wrong and what "
                   "you will do differently next time. Do not call a tool.")
"""The user message a reflection answers (after the failed attempt's whole transcript)."""

_CUT = 300  # characters of a message quoted in an outcome


def _quote(message: Message | None) -> str:
    if message is None:
        return "(none)"
    text = message.content.strip()
    calls = "; ".join(f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})" for c in message.tool_calls)
    text = " ".join(x for x in (text, f"[calls {calls}]" if calls else "") if x) or "(empty)"
    return text if len(text) <= _CUT else text[:_CUT] + "..."


def outcome_text(trajectory: Trajectory, attempt: int, reflection: str | None = None) -> str:
    """What a later attempt is told about ``trajectory`` (attempt number ``attempt``, failed)."""
    messages = list(trajectory.messages)
    mine = [i for i, m in enumerate(messages) if m.role == "assistant"]
    last = messages[mine[-1]] if mine else None
    reply = next((m for m in reversed(messages[mine[-1] + 1:] if mine else []) if m.role != "assistant"), None)
    text = (f"Attempt {attempt} did not solve this task (reward {trajectory.reward:.2f}, ended: {trajectory.end_reason}). "
            f"Its last message: {_quote(last)} The environment's last reply: {_quote(reply)}")
    return text + (f"\nYour reflection on attempt {attempt}: {reflection.strip()}" if reflection else "")


class FeedbackEnv(EnvWrapper):
    """``inner`` whose opening user message ends with ``task.data[FEEDBACK_KEY]`` (the earlier
    attempts' outcomes); the inner env gets the task without that key and does everything else."""

    def branch_refusal(self) -> str | None:
        return "a later attempt's prompt carries the earlier attempts' outcomes"

    async def reset(self, task: Task) -> list[Message]:
        feedback = task.data.get(FEEDBACK_KEY)
        inner_task = task.model_copy(update={"data": {k: v for k, v in task.data.items() if k != FEEDBACK_KEY}})
        messages = list(await self.inner.reset(inner_task))
        if not feedback:
            return messages
        note = f"Earlier attempts at this task:\n{feedback}\nTry again."
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        if users:
            i = users[-1]
            messages[i] = messages[i].model_copy(update={"content": f"{messages[i].content}\n\n{note}"})
        else:
            messages.append(Message(role="user", content=note))
        return messages


@dataclass
class AttemptsResult:
    """``chains[i]``: the attempts of chain i (task-major, then sample), in order, up to its first
    success. ``reflections[i]``: the reflection written after each failed attempt ("" without ``reflect``)."""

    chains: list[list[Trajectory]]
    reflections: list[list[str]] = field(default_factory=list)
    generated_tokens: int = 0  # every attempt's (the reflections' apart)
    reflection_tokens: int = 0
    first: RolloutResult | None = None  # the first attempts' run (an ordinary evaluation's episodes)

    def attempts(self, a: int) -> list[Trajectory]:
        """The a-th attempts (1-based) of the chains that got that far."""
        return [c[a - 1] for c in self.chains if len(c) >= a]


def _reflections(policy: Any, renderer: Any, failed: Sequence[Trajectory], params: SamplingParams,
                 max_context: int | None) -> tuple[list[str], int]:
    """One reflection per failed attempt, sampled in one call: the transcript plus ``REFLECT_REQUEST``.
    A transcript too long for ``max_context`` with the reflection's tokens gets none ("")."""
    conversations = [list(t.messages) + [Message(role="user", content=REFLECT_REQUEST)] for t in failed]
    if hasattr(policy, "generate"):
        prompts = [renderer.render_prompt(c, list(t.tools) or None) for c, t in zip(conversations, failed)]
        fits = [i for i, p in enumerate(prompts) if max_context is None or len(p) + params.max_tokens <= max_context]
        outputs = policy.generate([prompts[i] for i in fits], params) if fits else []
        texts = [""] * len(prompts)
        for i, out in zip(fits, outputs):
            texts[i] = renderer.parse_completion(list(out[0].token_ids)).message.content
        return texts, sum(len(out[0].token_ids) for out in outputs)
    if hasattr(policy, "chat"):
        return [policy.chat(c, list(t.tools) or None, params).content for c, t in zip(conversations, failed)], 0
    raise ValueError("--reflect needs a model (a token or chat engine), not the scripted expert")


async def run_attempts(
    env: Any,
    tasks: Sequence[Task],
    policy: Any,
    renderer: Any,
    config: RolloutConfig,
    attempts: int,
    *,
    reflect: bool = False,
    reflect_tokens: int = 64,
    env_options: dict[str, Any] | None = None,
    policy_name: str | None = None,
    progress: bool = False,
    writer: Any | None = None,
) -> AttemptsResult:
    """Play every task's ``config.samples_per_task`` chains for up to ``attempts`` attempts (see the
    module docstring). Attempt a > 1 runs with the sampling seed ``config.seed + 7919 * (a - 1)``;
    failed episodes (env errors) count as failed attempts. ``writer`` gets the first attempts as
    they end (later ones are in the result's chains)."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    make_inner, _ = env_factory(env, env_options)
    assert make_inner is not None
    first = await run_rollouts(make_inner, tasks, policy, renderer, config, writer, progress=progress,
                               failed_writer=writer, policy_name=policy_name)
    order = {task.id: i for i, task in enumerate(tasks)}
    firsts = sorted(first.trajectories + first.failed, key=lambda t: (order[t.task_id], t.sample_index))
    chains = [[t.model_copy(update={"info": {**t.info, "attempt": 1}})] for t in firsts]
    reflections: list[list[str]] = [[] for _ in chains]
    task_of = {t.id: t for t in tasks}
    generated, reflection_tokens = sum(t.num_generated_tokens for t in firsts), 0
    params = SamplingParams(temperature=config.temperature, top_p=config.top_p, max_tokens=reflect_tokens,
                            stop_token_ids=tuple(renderer.stop_token_ids), seed=config.seed)
    for a in range(2, attempts + 1):
        open_chains = [i for i, c in enumerate(chains) if not c[-1].success]
        if not open_chains:
            break
        if reflect:
            texts, used = await asyncio.to_thread(_reflections, policy, renderer, [chains[i][-1] for i in open_chains],
                                                  params.model_copy(update={"seed": config.seed + 104729 * a}),
                                                  config.max_context)
            reflection_tokens += used
            for i, text in zip(open_chains, texts):
                reflections[i].append(text)
        retried = []
        for i in open_chains:
            notes = [outcome_text(t, k + 1, reflections[i][k] if reflect else None) for k, t in enumerate(chains[i])]
            task = task_of[chains[i][0].task_id]
            retried.append(task.model_copy(update={"data": {**task.data, FEEDBACK_KEY: "\n".join(notes)}}))
        # zero_reward keeps a failed episode in ``trajectories``, which then follow ``retried``'s order
        # (one task can have several open chains, so the order is what maps an episode to its chain)
        round_config = config.model_copy(update={"samples_per_task": 1, "seed": config.seed + 7919 * (a - 1),
                                                 "on_env_error": "zero_reward"})
        result = await run_rollouts(lambda: FeedbackEnv(make_inner()), retried, policy, renderer, round_config,
                                    progress=progress, policy_name=policy_name)
        assert len(result.trajectories) == len(retried)
        for i, trajectory in zip(open_chains, result.trajectories):
            generated += trajectory.num_generated_tokens
            chains[i].append(trajectory.model_copy(update={"sample_index": chains[i][0].sample_index,
                                                           "info": {**trajectory.info, "attempt": a}}))
    return AttemptsResult(chains, reflections, generated, reflection_tokens, first)


def pass_at_attempts(chains: Sequence[Sequence[Trajectory]], attempts: int, n_bootstrap: int = 1000,
                     seed: int = 0) -> dict[str, dict[str, Any]]:
    """pass@(attempt a) for a = 1..attempts: per task, the share of its chains solved within a
    attempts; the mean over tasks with a 95% bootstrap CI over tasks. ``{"a": {"value", "ci"}}``."""
    by_task: dict[str, list[Sequence[Trajectory]]] = {}
    for chain in chains:
        by_task.setdefault(chain[0].task_id, []).append(chain)
    out = {}
    rng = np.random.default_rng(seed)
    for a in range(1, attempts + 1):
        per_task = np.array([np.mean([any(t.success for t in c[:a]) for c in cs]) for cs in by_task.values()])
        if len(per_task) == 0:
            out[str(a)] = {"value": 0.0, "ci": [0.0, 0.0]}
            continue
        means = per_task[rng.integers(0, len(per_task), (n_bootstrap, len(per_task)))].mean(axis=1)
        out[str(a)] = {"value": float(per_task.mean()),
                       "ci": [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]}
    return out
