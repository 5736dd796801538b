"""The rollout runner: environments x a policy -> token-exact ``Trajectory``s.

    result = await run_rollouts("calculator", tasks, engine, renderer, RolloutConfig(max_turns=3))
    result.trajectories, result.stats

Many episodes run at once (``tasks x samples_per_task``, at most ``concurrency`` alive). Each episode
is an asyncio task: reset the env, then per turn build the prompt, get a completion, step the env.

Three kinds of policy go through the same episode loop:

- a token engine (``hf``, ``vllm``: has ``generate``). Every episode waiting for the model is put into
  one ``engine.generate`` call (the *batcher*): it fires as soon as every live episode is waiting, or
  ``batch_wait_s`` after the first request when some episodes are still inside env steps. The
  blocking call runs in a worker thread, so env steps of the other episodes go on meanwhile.
  Prompts are built token-in, token-out: ``renderer.render_prompt`` for turn 0, then
  ``renderer.continue_prompt(previous_prompt, sampled_ids, env_messages)``; the sampled ids and
  their log-probs are recorded as they came from the engine.
- a message-level engine (``openai``: has ``chat(messages, tools, params) -> Message``). It sees the
  conversation as messages; the Turn's ``completion_ids`` are the renderer's encoding of the returned
  message (``renderer.encode_completion``) and ``completion_logprobs`` is None. Such trajectories
  serve SFT and evaluation, not on-policy RL.
- ``"expert"``: the env's scripted ``expert_action()``, recorded exactly like the message-level path,
  so expert trajectories are valid SFT data.

Limits and end reasons (``types.EndReason``): the env ends the task (``terminated``) or cuts it
(``truncated``); the runner's turn limit (``max_turns``); the per-episode generated-token budget
(``max_tokens``); the prompt no longer fits ``max_context`` (``context``); the wall-clock limit
(``timeout``). An env that raises (``env_error``), hangs (``timeout``) or an engine failure
(``engine_error``) never stops the run: the episode is recorded with its error, counted, logged and
either excluded from the result (``on_env_error="exclude"``, written to ``failed_writer`` if given)
or kept with reward 0 (``"zero_reward"``).

Envs must not block the event loop: a synchronous ``time.sleep`` inside ``async def step`` cannot be
interrupted by the timeout (``ToolEnv`` runs synchronous tools in threads for this reason).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from tracegym.envs.base import Env, Task
from tracegym.types import FinishReason, Generation, Message, SamplingParams, Trajectory, Turn

log = logging.getLogger(__name__)

__all__ = [
    "RolloutConfig",
    "RolloutStats",
    "RolloutResult",
    "LogprobGap",
    "run_rollouts",
    "run_rollouts_sync",
    "logprob_gap",
]


class RolloutConfig(BaseModel):
    """Limits and sampling of a rollout run."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    max_turns: int = Field(4, gt=0)
    """Turn limit T: assistant turns per episode (end reason ``max_turns``)."""
    max_tokens_per_turn: int = Field(256, gt=0)
    """Most tokens sampled in one assistant turn."""
    max_tokens_per_episode: int | None = Field(None, gt=0)
    """Generated-token budget of one episode (end reason ``max_tokens``); None: no budget."""
    max_context: int | None = Field(2048, gt=0)
    """Context window: prompt + completion never exceed it (end reason ``context``)."""
    episode_timeout_s: float | None = Field(None, gt=0)
    """Wall-clock limit of one episode, waiting for the model included (end reason ``timeout``)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold (1: off)."""
    seed: int | None = 0
    """Seed of the engine's sampler; each generate call gets a seed derived from it and the call
    index. None: not seeded."""
    samples_per_task: int = Field(1, gt=0)
    """Episodes K per task (a group, for GRPO-style advantages and pass@k)."""
    concurrency: int = Field(64, gt=0)
    """Episodes alive at once (also the largest generate batch)."""
    on_env_error: Literal["exclude", "zero_reward"] = "exclude"
    """Failed episodes (env error, timeout, engine error): left out of the result, or kept with reward 0."""
    measure_logprob_gap: bool = False
    """After the run, re-score the sampled tokens with a teacher-forced forward pass of the engine's
    model and report mean/max |engine log-prob - trainer log-prob| in the stats."""
    batch_wait_s: float = Field(0.05, ge=0)
    """How long the batcher waits for episodes still in env steps before calling the engine."""


@dataclass
class LogprobGap:
    """|engine log-prob - teacher-forced log-prob| over generated tokens."""

    mean: float
    max: float
    tokens: int


@dataclass
class RolloutStats:
    episodes: int = 0
    kept: int = 0
    failed: int = 0  # env_error + timeout + engine_error
    end_reasons: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # first few error texts
    success_rate: float = 0.0  # over kept episodes
    mean_reward: float = 0.0  # over kept episodes
    turns: int = 0
    generated_tokens: int = 0
    generate_calls: int = 0
    mean_batch_size: float = 0.0
    wall_time_s: float = 0.0
    episodes_per_s: float = 0.0
    tokens_per_s: float = 0.0
    logprob_gap: LogprobGap | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]  # kept episodes, ordered by (task, sample index)
    stats: RolloutStats
    failed: list[Trajectory] = field(default_factory=list)  # excluded episodes (on_env_error="exclude")


# --- internals ---------------------------------------------------------------------------------


class _EnvFailure(Exception):
    """The environment raised; the original exception is the cause."""


class _EngineFailure(Exception):
    """The engine (or the renderer on the policy side) failed for this episode."""


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    future: asyncio.Future


class _Batcher:
    """Gathers the prompts of all episodes waiting for the model into one ``generate`` call."""

    def __init__(self, engine: Any, params: SamplingParams, seed: int | None, wait_s: float):
        self.engine = engine
        self.params = params
        self.seed = seed
        self.wait_s = wait_s
        self.queue: list[_Request] = []
        self.wake = asyncio.Event()
        self.active = 0  # live episodes (started, not finished)
        self.calls = 0
        self.rows = 0

    async def generate(self, prompt: list[int], max_tokens: int) -> Generation:
        fut = asyncio.get_running_loop().create_future()
        self.queue.append(_Request(prompt, max_tokens, fut))
        self.wake.set()
        return await fut

    def episode_started(self) -> None:
        self.active += 1

    def episode_finished(self) -> None:
        self.active -= 1
        self.wake.set()

    def _prune(self) -> None:
        # requests of episodes that timed out while queued
        self.queue = [r for r in self.queue if not r.future.done()]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wake.wait()
            self.wake.clear()
            self._prune()
            if not self.queue:
                continue
            deadline = loop.time() + self.wait_s
            while len(self.queue) < self.active:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), remaining)
                except TimeoutError:
                    pass
                self._prune()
            batch, self.queue = self.queue, []
            if not batch:
                continue
            # one call for all; a row whose budget is below the call's max_tokens is cut afterwards
            # (its first k tokens are distributed exactly as with max_tokens=k)
            update: dict[str, Any] = {"max_tokens": max(r.max_tokens for r in batch)}
            if self.seed is not None:
                update["seed"] = (self.seed * 1_000_003 + self.calls) % (2**63)
            params = self.params.model_copy(update=update)
            self.calls += 1
            self.rows += len(batch)
            try:
                outs = await asyncio.to_thread(self.engine.generate, [r.prompt for r in batch], params)
                if len(outs) != len(batch):
                    raise RuntimeError(f"engine returned {len(outs)} results for {len(batch)} prompts")
            except Exception as exc:  # noqa: BLE001 - reported per episode, never fatal
                log.error("engine.generate failed for a batch of %d: %s", len(batch), _describe(exc))
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(_EngineFailure(_describe(exc)))
                continue
            for r, gens in zip(batch, outs):
                if not r.future.done():
                    r.future.set_result(_cut(gens[0], r.max_tokens))
            if self.queue:
                self.wake.set()


def _cut(gen: Generation, max_tokens: int) -> Generation:
    if len(gen.token_ids) <= max_tokens:
        return gen
    logprobs = gen.logprobs[:max_tokens] if gen.logprobs is not None else None
    return Generation(token_ids=gen.token_ids[:max_tokens], logprobs=logprobs, finish_reason="length", text=None)


def _numeric(info: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in info.items():
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


@dataclass
class _Episode:
    index: int
    task: Task
    sample_index: int
    env_name: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    generated: int = 0
    reward: float = 0.0
    last_info: dict[str, Any] = field(default_factory=dict)
    end_reason: str | None = None
    error: str | None = None
    started: float = 0.0
    finished: float = 0.0


class _Runner:
    def __init__(
        self,
        env_factory: Callable[[], Env],
        env_name: str | None,
        policy: Any,
        renderer: Any,
        config: RolloutConfig,
        policy_name: str,
    ):
        self.env_factory = env_factory
        self.env_name = env_name
        self.policy = policy
        self.renderer = renderer
        self.config = config
        self.policy_name = policy_name
        self.params = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            max_tokens=config.max_tokens_per_turn,
            stop_token_ids=tuple(renderer.stop_token_ids),
            seed=config.seed,
        )
        if isinstance(policy, str):
            if policy != "expert":
                raise ValueError(f"unknown policy {policy!r}: pass an engine or 'expert'")
            self.mode = "expert"
        elif hasattr(policy, "chat") and not getattr(policy, "returns_logprobs", False):
            self.mode = "message"
        elif hasattr(policy, "generate"):
            self.mode = "token"
        else:
            raise TypeError(f"policy must be an engine (generate), a chat engine (chat) or 'expert', got {policy!r}")
        self.batcher: _Batcher | None = None

    # -- one turn of the policy -------------------------------------------------------------------
    async def _policy_turn(
        self, ep: _Episode, env: Env, prompt: list[int], budget: int
    ) -> tuple[list[int], tuple[float, ...] | None, FinishReason, Message, tuple[str, ...]]:
        if self.mode == "token":
            assert self.batcher is not None
            gen = await self.batcher.generate(prompt, budget)
            try:
                parsed = self.renderer.parse_completion(gen.token_ids)
            except Exception as exc:  # noqa: BLE001
                raise _EngineFailure(f"renderer.parse_completion failed: {_describe(exc)}") from exc
            return list(gen.token_ids), gen.logprobs, gen.finish_reason, parsed.message, tuple(parsed.errors)
        errors: tuple[str, ...] = ()
        finish: FinishReason = "stop"
        if self.mode == "expert":
            try:
                message = env.expert_action()
            except Exception as exc:  # noqa: BLE001
                raise _EnvFailure(f"expert_action failed: {_describe(exc)}") from exc
        else:
            params = self.params.model_copy(update={"max_tokens": budget})
            # chat_with_errors (when the engine has it) also reports malformed tool calls
            call = getattr(self.policy, "chat_with_errors", None)
            try:
                if call is not None:
                    parsed = await asyncio.to_thread(call, list(ep.messages), ep.tools or None, params)
                    message, errors = parsed.message, tuple(parsed.errors)
                    finish = "stop" if parsed.ended_with_eot else "length"
                else:
                    message = await asyncio.to_thread(self.policy.chat, list(ep.messages), ep.tools or None, params)
            except Exception as exc:  # noqa: BLE001
                raise _EngineFailure(_describe(exc)) from exc
        try:
            completion_ids = list(self.renderer.encode_completion(message))
        except Exception as exc:  # noqa: BLE001
            raise _EngineFailure(f"renderer.encode_completion failed: {_describe(exc)}") from exc
        return completion_ids, None, finish, message, errors

    # -- one episode --------------------------------------------------------------------------------
    async def _episode(self, ep: _Episode) -> None:
        cfg = self.config
        try:
            env = self.env_factory()
        except Exception as exc:  # noqa: BLE001
            raise _EnvFailure(f"making the env failed: {_describe(exc)}") from exc
        ep.env_name = self.env_name or getattr(env, "name", type(env).__name__)
        try:
            try:
                ep.tools = list(env.tool_schemas())
                initial = await env.reset(ep.task)
            except Exception as exc:  # noqa: BLE001
                raise _EnvFailure(f"reset failed: {_describe(exc)}") from exc
            ep.messages = list(initial)
            try:
                prompt = list(self.renderer.render_prompt(ep.messages, ep.tools or None))
            except Exception as exc:  # noqa: BLE001
                raise _EngineFailure(f"renderer.render_prompt failed: {_describe(exc)}") from exc
            for _ in range(cfg.max_turns):
                budget = cfg.max_tokens_per_turn
                if cfg.max_tokens_per_episode is not None:
                    budget = min(budget, cfg.max_tokens_per_episode - ep.generated)
                if cfg.max_context is not None:
                    room = cfg.max_context - len(prompt)
                    if room <= 0:
                        ep.end_reason = "context"
                        return
                    budget = min(budget, room)
                completion_ids, logprobs, finish, message, parse_errors = await self._policy_turn(
                    ep, env, prompt, budget
                )
                ep.generated += len(completion_ids)
                try:
                    result = await env.step(message, parse_errors)
                except Exception as exc:  # noqa: BLE001
                    raise _EnvFailure(f"step {len(ep.turns) + 1} failed: {_describe(exc)}") from exc
                ep.reward += float(result.reward)
                ep.last_info = dict(result.info)
                ep.turns.append(
                    Turn(
                        prompt_ids=tuple(prompt),
                        completion_ids=tuple(completion_ids),
                        completion_logprobs=tuple(logprobs) if logprobs is not None else None,
                        finish_reason=finish,
                        message=message,
                        parse_errors=parse_errors,
                        env_messages=tuple(result.messages),
                        reward=float(result.reward),
                        metrics=_numeric(result.info),
                    )
                )
                ep.messages.append(message)
                ep.messages.extend(result.messages)
                if result.terminated:
                    ep.end_reason = "terminated"
                    return
                if result.truncated:
                    ep.end_reason = "truncated"
                    return
                if cfg.max_tokens_per_episode is not None and ep.generated >= cfg.max_tokens_per_episode:
                    ep.end_reason = "max_tokens"
                    return
                if len(ep.turns) >= cfg.max_turns:
                    break
                try:
                    prompt = list(self.renderer.continue_prompt(prompt, completion_ids, result.messages))
                except Exception as exc:  # noqa: BLE001
                    raise _EngineFailure(f"renderer.continue_prompt failed: {_describe(exc)}") from exc
            ep.end_reason = "max_turns"
        finally:
            try:
                env.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("env.close() raised: %s", _describe(exc))

    async def _guarded_episode(self, ep: _Episode, sem: asyncio.Semaphore, on_done: Callable[[_Episode], None]) -> None:
        async with sem:
            if self.batcher is not None:
                self.batcher.episode_started()
            ep.started = time.perf_counter()
            try:
                await asyncio.wait_for(self._episode(ep), self.config.episode_timeout_s)
            except TimeoutError:
                ep.end_reason = "timeout"
                ep.error = f"episode exceeded {self.config.episode_timeout_s}s"
            except _EnvFailure as exc:
                ep.end_reason = "env_error"
                ep.error = str(exc)
                log.debug("env error in %s:\n%s", ep.task.id, "".join(traceback.format_exception(exc)))
            except _EngineFailure as exc:
                ep.end_reason = "engine_error"
                ep.error = str(exc)
            except Exception as exc:  # noqa: BLE001 - a bug in the runner's callers must not kill the run
                ep.end_reason = "engine_error"
                ep.error = _describe(exc)
                log.error("unexpected error in episode %s: %s", ep.task.id, "".join(traceback.format_exception(exc)))
            finally:
                ep.finished = time.perf_counter()
                if self.batcher is not None:
                    self.batcher.episode_finished()
            if ep.error is not None:
                log.warning("episode %s/%d ended with %s: %s", ep.task.id, ep.sample_index, ep.end_reason, ep.error)
            on_done(ep)

    def trajectory(self, ep: _Episode) -> Trajectory:
        failed = ep.end_reason in ("env_error", "timeout", "engine_error")
        info: dict[str, Any] = {"wall_time_s": round(ep.finished - ep.started, 4)}
        if "reference_calls" in ep.task.data:
            info["reference_calls"] = ep.task.data["reference_calls"]
        zero = failed and self.config.on_env_error == "zero_reward"
        return Trajectory(
            env=ep.env_name or (self.env_name or ""),
            task_id=ep.task.id,
            split=ep.task.split,
            sample_index=ep.sample_index,
            tools=tuple(ep.tools),
            messages=tuple(ep.messages),
            turns=tuple(ep.turns),
            reward=0.0 if zero else ep.reward,
            success=False if failed else bool(ep.last_info.get("success", False)),
            metrics=_numeric(ep.last_info),
            end_reason=ep.end_reason or "engine_error",
            error=ep.error,
            policy=self.policy_name,
            info=info,
        )


def _progress_bar(total: int, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("rollout"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rates]}"),
        TimeElapsedColumn(),
        disable=not enabled,
        transient=False,
    )


async def run_rollouts(
    env: str | Callable[[], Env],
    tasks: Sequence[Task],
    policy: Any,
    renderer: Any,
    config: RolloutConfig | None = None,
    writer: Any | None = None,
    progress: bool = True,
    *,
    failed_writer: Any | None = None,
    env_options: dict[str, Any] | None = None,
    policy_name: str | None = None,
    gap_model: Any | None = None,
) -> RolloutResult:
    """Run ``len(tasks) * config.samples_per_task`` episodes and return their trajectories.

    Args:
        env: an env name for ``tracegym.envs.make`` (with ``env_options``) or a zero-argument factory
            returning a fresh ``Env`` per episode.
        tasks: the tasks; each runs ``samples_per_task`` times.
        policy: a token engine (``generate``), a message-level engine (``chat``) or ``"expert"``.
        renderer: the ``Renderer`` of the model's chat template.
        writer: optional ``TrajectoryWriter``; each kept trajectory is written when its episode ends.
        failed_writer: optional writer for excluded (failed) trajectories.
        policy_name: recorded in ``Trajectory.policy`` (default: the engine's name or "expert").
        gap_model: model for ``measure_logprob_gap`` (default: the engine's ``model`` attribute).
    """
    config = config or RolloutConfig()
    if isinstance(env, str):
        from tracegym.envs import make

        name, options = env, dict(env_options or {})
        factory: Callable[[], Env] = lambda: make(name, **options)  # noqa: E731
        env_name: str | None = name
    else:
        factory, env_name = env, None
    if policy_name is None:
        policy_name = policy if isinstance(policy, str) else str(getattr(policy, "model_name", None) or policy.name)
    runner = _Runner(factory, env_name, policy, renderer, config, policy_name)
    episodes = [
        _Episode(index=i * config.samples_per_task + k, task=task, sample_index=k)
        for i, task in enumerate(tasks)
        for k in range(config.samples_per_task)
    ]
    kept: dict[int, Trajectory] = {}
    failed: dict[int, Trajectory] = {}
    end_reasons: Counter[str] = Counter()
    errors: list[str] = []
    generated = 0
    t0 = time.perf_counter()

    with _progress_bar(len(episodes), progress) as bar:
        bar_task = bar.add_task("rollout", total=len(episodes), rates="")

        def on_done(ep: _Episode) -> None:
            nonlocal generated
            traj = runner.trajectory(ep)
            end_reasons[traj.end_reason] += 1
            generated += traj.num_generated_tokens
            is_failure = traj.end_reason in ("env_error", "timeout", "engine_error")
            if is_failure and len(errors) < 20:
                errors.append(f"{traj.task_id}/{traj.sample_index}: {traj.end_reason}: {traj.error}")
            if is_failure and config.on_env_error == "exclude":
                failed[ep.index] = traj
                if failed_writer is not None:
                    failed_writer.write(traj)
            else:
                kept[ep.index] = traj
                if writer is not None:
                    writer.write(traj)
            elapsed = max(time.perf_counter() - t0, 1e-9)
            done = len(kept) + len(failed)
            bar.update(bar_task, advance=1, rates=f"{done / elapsed:.2f} ep/s  {generated / elapsed:.1f} tok/s")

        sem = asyncio.Semaphore(config.concurrency)
        batcher_task: asyncio.Task | None = None
        if runner.mode == "token":
            runner.batcher = _Batcher(policy, runner.params, config.seed, config.batch_wait_s)
            batcher_task = asyncio.create_task(runner.batcher.run())
        try:
            await asyncio.gather(*(runner._guarded_episode(ep, sem, on_done) for ep in episodes))
        finally:
            if batcher_task is not None:
                batcher_task.cancel()
                try:
                    await batcher_task
                except asyncio.CancelledError:
                    pass

    wall = time.perf_counter() - t0
    trajectories = [kept[i] for i in sorted(kept)]
    stats = RolloutStats(
        episodes=len(episodes),
        kept=len(kept),
        failed=sum(end_reasons[r] for r in ("env_error", "timeout", "engine_error")),
        end_reasons=dict(end_reasons),
        errors=errors,
        success_rate=(sum(t.success for t in trajectories) / len(trajectories)) if trajectories else 0.0,
        mean_reward=(sum(t.reward for t in trajectories) / len(trajectories)) if trajectories else 0.0,
        turns=sum(len(t.turns) for t in list(kept.values()) + list(failed.values())),
        generated_tokens=generated,
        generate_calls=runner.batcher.calls if runner.batcher else 0,
        mean_batch_size=(runner.batcher.rows / runner.batcher.calls) if runner.batcher and runner.batcher.calls else 0.0,
        wall_time_s=wall,
        episodes_per_s=len(episodes) / wall if wall > 0 else 0.0,
        tokens_per_s=generated / wall if wall > 0 else 0.0,
    )
    if config.measure_logprob_gap:
        model = gap_model if gap_model is not None else getattr(policy, "model", None)
        if model is None:
            log.warning("measure_logprob_gap: no model to re-score with (pass gap_model=)")
        else:
            stats.logprob_gap = await asyncio.to_thread(
                logprob_gap, model, trajectories, config.temperature, config.top_p
            )
            log.info(
                "logprob gap: mean %.2e max %.2e over %d tokens",
                stats.logprob_gap.mean, stats.logprob_gap.max, stats.logprob_gap.tokens,
            )
    return RolloutResult(trajectories=trajectories, stats=stats, failed=[failed[i] for i in sorted(failed)])


def run_rollouts_sync(*args: Any, **kwargs: Any) -> RolloutResult:
    """``asyncio.run(run_rollouts(...))`` for callers without an event loop."""
    return asyncio.run(run_rollouts(*args, **kwargs))


# --- engine / trainer log-prob gap ---------------------------------------------------------------


def logprob_gap(
    model: Any, trajectories: Sequence[Trajectory], temperature: float = 1.0, top_p: float = 1.0
) -> LogprobGap:
    """Teacher-forced re-scoring of every sampled token.

    For each turn with engine log-probs, one forward pass of ``model`` on ``prompt + completion``
    gives the log-prob of each completion token under the same sampling transform the engine used
    (temperature, top-p; the unscaled softmax for greedy). Returns mean and max |difference|. For the
    hf engine on the same fp32 model this is ~1e-6; a large gap means the engine samples from a
    different distribution than the trainer scores (dtype, kernels, stale weights).
    """
    import torch

    from tracegym.engines.hf import sampling_logprobs

    total, worst, count = 0.0, 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            device = next(model.parameters()).device
            for traj in trajectories:
                for turn in traj.turns:
                    if turn.completion_logprobs is None or not turn.completion_ids:
                        continue
                    n = len(turn.completion_ids)
                    ids = torch.tensor([list(turn.prompt_ids) + list(turn.completion_ids)], device=device)
                    # keep logits of the last n+1 positions; position j predicts token j+1
                    logits = model(input_ids=ids, logits_to_keep=n + 1).logits[0, :-1]  # [n, V]
                    lp = sampling_logprobs(logits, temperature, top_p)
                    target = torch.tensor(turn.completion_ids, device=device)[:, None]
                    scored = lp.gather(-1, target).squeeze(-1).double().cpu()  # [n]
                    diff = (scored - torch.tensor(turn.completion_logprobs, dtype=torch.float64)).abs()
                    diff = torch.nan_to_num(diff, nan=float("inf"))
                    total += float(diff.sum())
                    worst = max(worst, float(diff.max()))
                    count += n
    finally:
        if was_training:
            model.train()
    return LogprobGap(mean=total / count if count else 0.0, max=worst, tokens=count)
