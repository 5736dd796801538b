"""The rollout runner: environments x a policy -> token-exact ``Trajectory``s.

    result = await run_rollouts("calculator", tasks, engine, renderer, RolloutConfig(max_turns=3))
    result.trajectories, result.stats

Many episodes run at once (``tasks x samples_per_task``, at most ``concurrency`` alive). Each episode
is an asyncio task running the one episode loop, ``tracegym.envs.episode.play_episode`` (reset, then
per turn: ask the policy, step the env, record a ``Turn``; limits, timeout, failure isolation, state
keys, non-finite rewards rejected). The runner gives that loop one policy object per episode
(``RenderedPolicy``) that keeps the prompt as token ids and gets completions from the engine.

Three kinds of policy go through it (told apart by ``policy.capabilities``, an
``EngineCapabilities``, or else the older ``returns_logprobs`` attribute):

- a token engine (``hf``, ``vllm``: has ``generate``). With ``batching="continuous"`` (the default)
  and an engine that offers it (hf: ``continuous_decoder``), each turn joins one running batch when
  it is ready and leaves it when it ends (``_StreamBatcher``; docs/rollouts.md). Otherwise every
  episode waiting for the model is put into one ``engine.generate`` call (``_Batcher``): it fires as
  soon as every live episode is waiting, or ``batch_wait_s`` after the first request when some
  episodes are still inside env steps; the blocking call runs in a worker thread, so env steps of
  the other episodes go on meanwhile.
  Prompts are built token-in, token-out: ``renderer.render_prompt`` for turn 0, then
  ``renderer.continue_prompt(previous_prompt, sampled_ids, env_messages)``; the sampled ids and
  their log-probs are recorded as they came from the engine.
- a message-level engine (``openai``: has ``chat(messages, tools, params) -> Message``). It sees the
  conversation as messages; the Turn's ``completion_ids`` are the renderer's encoding of the returned
  message (``renderer.encode_completion``) and ``completion_logprobs`` is None. Such trajectories
  serve SFT and evaluation, not on-policy RL.
- ``"expert"``: the env's scripted ``expert_action()``, recorded exactly like the message-level path,
  so expert trajectories are valid SFT data.

Limits and end reasons (``types.EndReason``, the same for every loop): the env ends the task
(``terminated``) or cuts it (``truncated``); the runner's turn limit (``max_turns``); the per-episode
generated-token budget (``max_tokens``); the prompt no longer fits ``max_context`` (``context``); the
wall-clock limit (``timeout``). An env that raises or returns a NaN/inf reward (``env_error``), hangs
(``timeout``), or a failure of the engine, renderer or expert (``engine_error``) never stops the run:
the episode is recorded with its error, counted, logged and either excluded from the result
(``on_env_error="exclude"``, written to ``failed_writer`` if given) or kept with reward 0
(``"zero_reward"``: ``zero_reward`` zeroes the episode reward and every turn reward, so the episode
reward stays the sum of the turn rewards and every estimator sees the same 0).

Envs must not block the event loop: a synchronous ``time.sleep`` inside ``async def step`` cannot be
interrupted by the timeout (``ToolEnv`` runs synchronous tools in threads for this reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Literal, Sequence

from pydantic import ConfigDict, Field

from tracegym.config import RolloutSettings
from tracegym.engines.base import BASE_ADAPTER
from tracegym.envs.base import Env, Task
from tracegym.envs.episode import (
    FAILED_END_REASONS,
    Action,
    ContextExhausted,
    Observation,
    PolicyError,
    TokenData,
    play_episode,
)
from tracegym.memory import release_memory
from tracegym.rollout.context import apply_context, expert_summary, needs_summary, rewrites_history
from tracegym.types import REWARD_PART_PREFIX, FinishReason, Generation, Message, SamplingParams, Trajectory

log = logging.getLogger(__name__)

__all__ = [
    "RolloutConfig",
    "RolloutStats",
    "RolloutResult",
    "LogprobGap",
    "PrefixedEpisode",
    "run_prefixed_episodes",
    "run_rollouts",
    "run_rollouts_sync",
    "logprob_gap",
    "env_factory",
    "cut_generation",
    "zero_reward",
    "batching",
    "EpisodeRunner",
    "RenderedPolicy",
]


class RolloutConfig(RolloutSettings):
    """Limits and sampling of a rollout run: ``RolloutSettings`` plus the seed, the group size and
    the batcher's wait."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    seed: int | None = 0
    """Seed of the engine's sampler; each generate call gets a seed derived from it and the call
    index. None: not seeded."""
    samples_per_task: int = Field(1, gt=0)
    """Episodes K per task (a group, for GRPO-style advantages and pass@k)."""
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
    generate_calls: int = 0  # per-turn: engine.generate calls; continuous: admissions into the batch
    mean_batch_size: float = 0.0  # per-turn: rows per call; continuous: rows per decode step
    wall_time_s: float = 0.0
    episodes_per_s: float = 0.0
    tokens_per_s: float = 0.0
    logprob_gap: LogprobGap | None = None
    extra: dict[str, float] = field(default_factory=dict)  # a strategy's own counters (tree rollouts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]  # kept episodes, ordered by (task, sample index)
    stats: RolloutStats
    failed: list[Trajectory] = field(default_factory=list)  # excluded episodes (on_env_error="exclude")


# --- internals ---------------------------------------------------------------------------------


class _EngineFailure(PolicyError):
    """The engine failed for the batch this episode's request was in."""


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    future: asyncio.Future
    adapter: str | None = None  # the LoRA adapter to sample with (team roles); None: the model as is


async def _wait_until(wake: asyncio.Event, ready: Callable[[], bool], seconds: float) -> None:
    """Return once ``ready()`` (checked again each time ``wake`` is set) or after ``seconds``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not ready():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), remaining)
        except TimeoutError:
            return


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

    async def generate(self, prompt: list[int], max_tokens: int, adapter: str | None = None,
                       seed_key: tuple[int, int] = (0, 0)) -> Generation:
        """``seed_key`` is not used: a generate call's seed comes from the run's seed and the call."""
        fut = asyncio.get_running_loop().create_future()
        self.queue.append(_Request(prompt, max_tokens, fut, adapter))
        self.wake.set()
        return await fut

    def episode_started(self) -> None:
        self.active += 1

    def episode_finished(self) -> None:
        self.active -= 1
        self.wake.set()

    @property
    def mean_batch_size(self) -> float:
        """Rows per generate call."""
        return self.rows / self.calls if self.calls else 0.0

    def _prune(self) -> None:
        # requests of episodes that timed out while queued
        self.queue = [r for r in self.queue if not r.future.done()]

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            self._prune()
            if not self.queue:
                continue

            def all_waiting() -> bool:
                self._prune()
                return len(self.queue) >= self.active

            await _wait_until(self.wake, all_waiting, self.wait_s)
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
                prompts = [r.prompt for r in batch]
                if any(r.adapter is not None for r in batch):  # team roles: one call, each row its adapter
                    outs = await asyncio.to_thread(self.engine.generate, prompts, params,
                                                   adapters=[r.adapter or BASE_ADAPTER for r in batch])
                else:
                    outs = await asyncio.to_thread(self.engine.generate, prompts, params)
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
                    r.future.set_result(cut_generation(gens[0], r.max_tokens))
            if self.queue:
                self.wake.set()


class _StreamBatcher:
    """Continuous batching (``RolloutConfig.batching="continuous"``, engines with
    ``continuous_decoder``: hf): each episode's turn joins one running batch as soon as it is ready
    and leaves it when it ends (``tracegym.engines.hf_continuous``), instead of waiting for one
    generate call of all waiting episodes.

    The decoder's steps run on the event loop's thread, between the episodes' coroutines: after a
    step, the episodes whose turn ended parse it, step their envs and queue their next turn while
    the loop waits for them (``wait_s`` at most), then the next step runs. The model thus runs on
    the thread that loaded it (from a worker thread a decode step measured 40% slower on 2 cores), and
    with envs that answer within ``wait_s`` the schedule, so the result, is the same in every run.

    Each turn is sampled with its own generator, seeded from the run's seed, the episode's index in
    the run and the turn (``seed_key``), so what an episode samples does not depend on which others
    shared its decode steps (up to float rounding)."""

    def __init__(self, engine: Any, params: SamplingParams, seed: int | None, wait_s: float):
        self.decoder = engine.continuous_decoder(params)
        self.seed = seed
        self.wait_s = wait_s
        self.active = 0  # live episodes (started, not finished)
        self.wake = asyncio.Event()
        self._delivered_seen = 0  # the decoder's delivered count at the last wait

    @property
    def calls(self) -> int:
        """Prefill passes that admitted rows into the batch."""
        return self.decoder.admissions

    @property
    def rows(self) -> int:
        return self.decoder.admitted_rows

    @property
    def mean_batch_size(self) -> float:
        """Rows per decode step."""
        return self.decoder.mean_batch_size

    def episode_started(self) -> None:
        self.active += 1

    def episode_finished(self) -> None:
        self.active -= 1
        self.wake.set()

    async def generate(self, prompt: list[int], max_tokens: int, adapter: str | None = None,
                       seed_key: tuple[int, int] = (0, 0)) -> Generation:
        if adapter is not None:
            raise PolicyError("continuous batching samples with the model's active adapter only (use batching: per_turn)")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()

        def done(generation: Generation | None, error: BaseException | None) -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(_EngineFailure(_describe(error)))
            elif generation is None:
                fut.set_exception(_EngineFailure("the request was dropped"))
            else:
                fut.set_result(generation)

        seed = None
        if self.seed is not None:
            episode, turn = seed_key
            seed = ((self.seed * 1_000_003 + episode) * 1_000_003 + turn) % (2**63)
        request = self.decoder.submit(prompt, max_tokens, seed, done)
        self.wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            request.cancel()  # the episode timed out: its row leaves the batch at the next step
            raise

    async def _gather(self) -> None:
        """Let the episodes run until each live one is queued or decoding (or ended), for ``wait_s``
        at most; only when turns were delivered since the last step (or at the start): an episode
        still in a slow env step does not hold every decode step back."""
        await asyncio.sleep(0)  # the delivered turns' episodes run first
        decoder = self.decoder
        if decoder.delivered == self._delivered_seen and decoder.decode_steps:
            return
        self._delivered_seen = decoder.delivered
        await _wait_until(self.wake, lambda: self.active <= len(decoder.queue) + len(decoder.rows), self.wait_s)

    async def run(self) -> None:
        decoder = self.decoder
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                while decoder.busy:
                    await self._gather()
                    decoder.step()  # blocks the loop for one decode step (~0.1-0.3 s on a CPU)
        finally:
            decoder.close()


def zero_reward(trajectory: Trajectory) -> Trajectory:
    """``trajectory`` with its episode reward and every turn's reward set to 0 (``on_env_error:
    zero_reward``, for every rollout strategy). Zeroing only ``Trajectory.reward`` would keep the turn
    rewards, so episode estimators (``grpo``) and per-turn ones (``turn_rloo``, ``gigpo``) would read
    different rewards for one episode; the invariant episode reward == sum of turn rewards holds
    (``tracegym.algos._groups.check_episode_rewards``)."""
    turns = tuple(turn.model_copy(update={"reward": 0.0}) if turn.reward != 0.0 else turn for turn in trajectory.turns)
    # the named reward parts (``reward/<part>``) add up to the reward too: zeroed with it
    metrics = {k: (0.0 if k.startswith(REWARD_PART_PREFIX) else v) for k, v in trajectory.metrics.items()}
    return trajectory.model_copy(update={"reward": 0.0, "turns": turns, "metrics": metrics})


def env_factory(env: "str | Callable[[], Env] | None", env_options: dict[str, Any] | None = None
                ) -> "tuple[Callable[[], Env] | None, str | None]":
    """``(factory, name)`` for an env given by registered name (made with ``env_options``) or as a
    zero-argument factory (name None); ``None`` stays ``None``."""
    if not isinstance(env, str):
        return env, None
    from tracegym.envs import make

    name, options = env, dict(env_options or {})
    return (lambda: make(name, **options)), name


def cut_generation(gen: Generation, max_tokens: int) -> Generation:
    """``gen`` cut to ``max_tokens`` tokens (finish reason ``length``), or unchanged when it fits."""
    if len(gen.token_ids) <= max_tokens:
        return gen
    logprobs = gen.logprobs[:max_tokens] if gen.logprobs is not None else None
    return Generation(token_ids=gen.token_ids[:max_tokens], logprobs=logprobs, finish_reason="length", text=None)


PolicyMode = Literal["token", "message", "expert"]


def _policy_mode(policy: Any) -> PolicyMode:
    """How the runner drives ``policy``: ``"expert"``, a message-level engine (``chat``) or a token
    engine (``generate``). Abilities come from ``policy.capabilities`` (``EngineCapabilities``),
    else from the older ``returns_logprobs`` attribute: an engine with ``chat`` that returns no
    sampled log-probs or no exact token ids is driven through ``chat``."""
    if isinstance(policy, str):
        if policy != "expert":
            raise ValueError(f"unknown policy {policy!r}: pass an engine or 'expert'")
        return "expert"
    caps = getattr(policy, "capabilities", None)
    if caps is not None:
        token_exact = bool(getattr(caps, "returns_logprobs", False)) and bool(getattr(caps, "exact_token_ids", True))
    else:
        token_exact = bool(getattr(policy, "returns_logprobs", False))
    if hasattr(policy, "chat") and not token_exact:
        return "message"
    if hasattr(policy, "generate"):
        return "token"
    raise TypeError(f"policy must be an engine (generate), a chat engine (chat) or 'expert', got {policy!r}")


class RenderedPolicy:
    """The runner's per-episode policy: keeps the episode's prompt as token ids and gets each
    turn's completion from the token engine (through the batcher), the message-level engine or the
    env's scripted expert.

    Prompts are token in, token out: ``render_prompt`` on turn 0, then
    ``continue_prompt(previous prompt, previous completion ids, the env's answer)``. A prompt with
    no room left in ``max_context`` raises ``ContextExhausted``; the turn's token budget is the least
    of ``max_tokens_per_turn``, the episode's budget left and the context room.

    ``prefix``: actions played verbatim on turns ``0 .. len(prefix)-1`` (their token data recorded
    as given, no engine call) before the policy samples; the next prompt continues from the last
    one's tokens (:func:`run_prefixed_episodes`).
    """

    def __init__(self, runner: EpisodeRunner, env: Env, prefix: Sequence[Action] = (), adapter: str | None = None,
                 episode_index: int = 0):
        self.runner = runner
        self.env = env
        self.episode_index = episode_index  # the episode's place in the run (seeds continuous batching)
        self.adapter = adapter  # a team role's LoRA adapter (token engines that take ``adapters=``)
        self.prompt: list[int] | None = None
        self.completion: list[int] = []
        self.prefix = tuple(prefix)

    def forget_last_turn(self) -> None:
        """The episode ended: the engine need not keep its last turn's keys/values for a next turn
        (the hf engine's turn store; a no-op for engines without one)."""
        forget = getattr(self.runner.policy, "forget_turn", None)
        if callable(forget) and self.prompt is not None and self.completion:
            forget(self.prompt + self.completion[:-1], self.adapter)

    def _next_prompt(self, obs: Observation) -> list[int]:
        renderer = self.runner.renderer
        context = self.runner.config.context
        if self.prompt is None or rewrites_history(obs.messages, context):  # a rewritten history: a new segment
            try:
                return list(renderer.render_prompt(apply_context(obs.messages, context), list(obs.tools) or None))
            except Exception as exc:  # noqa: BLE001
                raise PolicyError(f"renderer.render_prompt failed: {_describe(exc)}") from exc
        try:
            return list(renderer.continue_prompt(self.prompt, self.completion, list(obs.new_messages)))
        except Exception as exc:  # noqa: BLE001
            raise PolicyError(f"renderer.continue_prompt failed: {_describe(exc)}") from exc

    async def __call__(self, obs: Observation) -> Action:
        if obs.turn < len(self.prefix):
            forced = self.prefix[obs.turn]
            if forced.tokens is None:
                raise PolicyError(f"prefix action {obs.turn} has no token data")
            self.prompt, self.completion = list(forced.tokens.prompt_ids), list(forced.tokens.completion_ids)
            return forced
        cfg = self.runner.config
        prompt = self._next_prompt(obs)
        if needs_summary(obs.messages, len(prompt), cfg.context):
            return await self._summarize(obs)
        action = await self._complete(prompt, self._budget(prompt, cfg.max_tokens_per_turn, obs), obs)
        assert action.tokens is not None
        self.prompt, self.completion = prompt, list(action.tokens.completion_ids)
        return action

    def _budget(self, prompt: list[int], most: int, obs: Observation) -> int:
        """Tokens the next completion may have: ``most``, the episode's budget left, the context room."""
        cfg = self.runner.config
        budget = most if obs.token_budget is None else min(most, obs.token_budget)
        if cfg.max_context is not None:
            room = cfg.max_context - len(prompt)
            if room <= 0:
                raise ContextExhausted(f"prompt of {len(prompt)} tokens leaves no room in {cfg.max_context}")
            budget = min(budget, room)
        return budget

    async def _summarize(self, obs: Observation) -> Action:
        """``rollout.context: summarize``: the model answers ``summary_request`` with a summary of its
        history (a sampled turn; the env is not stepped). Its prompt extends the previous one token
        by token when the history was shown in full, so it joins that segment."""
        runner, context = self.runner, self.runner.config.context
        request = Message(role="user", content=context.summary_request)
        shown = apply_context(obs.messages, context) + [request]
        try:
            if self.prompt is not None and not rewrites_history(obs.messages, context):
                new = list(obs.new_messages) + [request]
                prompt = list(runner.renderer.continue_prompt(self.prompt, self.completion, new))
            else:
                prompt = list(runner.renderer.render_prompt(shown, list(obs.tools) or None))
        except Exception as exc:  # noqa: BLE001
            raise PolicyError(f"renderer failed on the summary prompt: {_describe(exc)}") from exc
        budget = self._budget(prompt, context.max_summary_tokens, obs)
        if runner.mode == "expert":  # scripted: the calls so far
            message = Message(role="assistant", content=expert_summary(obs.messages, context))
            completion = tuple(runner.renderer.encode_completion(message))
            action = Action(message=message, tokens=TokenData(prompt, completion, None, "stop"))
        else:
            # its own seed key (turn -1 - t), so the summary and the action after it draw different samples
            action = await self._complete(prompt, budget, replace(obs, messages=tuple(shown)), shown,
                                          seed_turn=-1 - obs.turn)
        assert action.tokens is not None
        self.prompt, self.completion = prompt, list(action.tokens.completion_ids)
        return replace(action, summary_request=request)

    async def _complete(self, prompt: list[int], budget: int, obs: Observation,
                        shown: list[Message] | None = None, seed_turn: int | None = None) -> Action:
        """One completion of ``prompt``; message-level engines get ``shown`` (default: the context
        policy's view of ``obs.messages``)."""
        runner = self.runner
        if runner.mode == "token":
            assert runner.batcher is not None
            turn = obs.turn if seed_turn is None else seed_turn
            gen = await runner.batcher.generate(prompt, budget, self.adapter, seed_key=(self.episode_index, turn))
            try:
                parsed = runner.renderer.parse_completion(gen.token_ids)
            except Exception as exc:  # noqa: BLE001
                raise PolicyError(f"renderer.parse_completion failed: {_describe(exc)}") from exc
            tokens = TokenData(prompt, tuple(gen.token_ids), gen.logprobs, gen.finish_reason)
            return Action(message=parsed.message, parse_errors=tuple(parsed.errors), tokens=tokens)
        errors: tuple[str, ...] = ()
        finish: FinishReason = "stop"
        if runner.mode == "expert":
            try:
                message = self.env.expert_action()
            except Exception as exc:  # noqa: BLE001
                raise PolicyError(f"expert_action failed: {_describe(exc)}") from exc
        else:
            params = runner.params.model_copy(update={"max_tokens": budget})
            tools = list(obs.tools) or None
            if shown is None:  # only a message-level engine reads the messages
                shown = apply_context(obs.messages, runner.config.context)
            # chat_with_errors (when the engine has it) also reports malformed tool calls
            call = getattr(runner.policy, "chat_with_errors", None)
            try:
                if call is not None:
                    parsed = await asyncio.to_thread(call, shown, tools, params)
                    message, errors = parsed.message, tuple(parsed.errors)
                    finish = "stop" if parsed.ended_with_eot else "length"
                else:
                    message = await asyncio.to_thread(runner.policy.chat, shown, tools, params)
            except Exception as exc:  # noqa: BLE001
                raise PolicyError(_describe(exc)) from exc
        try:
            completion_ids = tuple(runner.renderer.encode_completion(message))
        except Exception as exc:  # noqa: BLE001
            raise PolicyError(f"renderer.encode_completion failed: {_describe(exc)}") from exc
        return Action(message=message, parse_errors=errors, tokens=TokenData(prompt, completion_ids, None, finish))


class EpisodeRunner:
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
        self.mode = _policy_mode(policy)
        self.batcher: _Batcher | _StreamBatcher | None = None

    async def episode(
        self, task: Task, sample_index: int, sem: asyncio.Semaphore, *,
        make_env: Callable[[], Env] | None = None, prefix: Sequence[Action] = (), index: int = 0,
    ) -> Trajectory:
        """One episode through the shared loop; failed ones are zero-rewarded when configured.
        ``make_env`` replaces the runner's env factory, ``prefix`` is played first (``RenderedPolicy``);
        ``index``: the episode's place in the run (its sampling seeds under continuous batching)."""
        cfg = self.config
        async with sem:
            if self.batcher is not None:
                self.batcher.episode_started()
            policies: list[RenderedPolicy] = []

            def make_policy(env: Env) -> RenderedPolicy:
                policies.append(RenderedPolicy(self, env, prefix, episode_index=index))
                return policies[-1]

            try:
                traj = await play_episode(
                    make_env or self.env_factory, task, make_policy,
                    max_turns=cfg.max_turns, max_tokens=cfg.max_tokens_per_episode, timeout_s=cfg.episode_timeout_s,
                    sample_index=sample_index, env_name=self.env_name, policy_name=self.policy_name,
                )
            finally:
                if self.batcher is not None:
                    self.batcher.episode_finished()
                for policy in policies:
                    policy.forget_last_turn()
        if traj.error is not None:
            log.warning("episode %s/%d ended with %s: %s", task.id, sample_index, traj.end_reason, traj.error)
        if traj.end_reason in FAILED_END_REASONS and cfg.on_env_error == "zero_reward":
            traj = zero_reward(traj)
        return traj


def _progress_bar(total: int, enabled: bool, **kwargs: Any):
    """Episodes done/total with episodes/s and tok/s: a rich bar on a terminal, else a plain line at
    least every 30 s (``kwargs``: ``interval_s``, ``stream``, ``clock`` of ``ProgressBar``)."""
    # Imported here: the rollout module should not load the training package just to import it.
    from tracegym.train.logging import ProgressBar

    return ProgressBar(total, "rollout", enabled=enabled, unit="episode", **kwargs)


@contextlib.asynccontextmanager
async def batching(runner: EpisodeRunner, policy: Any, config: RolloutConfig, *,
                    continuous: bool = True) -> AsyncIterator[None]:
    """For a token engine: the batcher task, running while the block runs and cancelled after it
    (nothing for message-level policies): continuous batching (``_StreamBatcher``) when the config
    asks for it, ``continuous`` allows it (not for per-row adapters) and the engine offers it, else
    one ``generate`` call for every waiting episode (``_Batcher``)."""
    if runner.mode != "token":
        yield
        return
    if continuous and config.batching == "continuous" and callable(getattr(policy, "continuous_decoder", None)):
        runner.batcher = _StreamBatcher(policy, runner.params, config.seed, config.batch_wait_s)
    else:
        runner.batcher = _Batcher(policy, runner.params, config.seed, config.batch_wait_s)
    # An engine's store of earlier turns' keys/values (the hf engine's turn store) lives for one run:
    # the same run twice computes the same things (bit-identical log-probs), and a run never reuses
    # keys from before it (another run's episodes, or weights since changed in place).
    clear = getattr(policy, "clear_cache", None)
    if callable(clear):
        clear()
    task = asyncio.create_task(runner.batcher.run())
    try:
        yield
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        if callable(clear):
            clear()  # free the memory as the run ends
        release_memory()  # and hand the freed keys/values back to the system (tracegym/memory.py)


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
    factory, env_name = env_factory(env, env_options)
    if policy_name is None:
        policy_name = policy if isinstance(policy, str) else str(getattr(policy, "model_name", None) or policy.name)
    runner = EpisodeRunner(factory, env_name, policy, renderer, config, policy_name)
    episodes = [(task, k) for task in tasks for k in range(config.samples_per_task)]
    kept: dict[int, Trajectory] = {}
    failed: dict[int, Trajectory] = {}
    end_reasons: Counter[str] = Counter()
    errors: list[str] = []
    generated = 0
    t0 = time.perf_counter()

    with _progress_bar(len(episodes), progress) as bar:

        def on_done(index: int, traj: Trajectory) -> None:
            nonlocal generated
            end_reasons[traj.end_reason] += 1
            generated += traj.num_generated_tokens
            is_failure = traj.end_reason in FAILED_END_REASONS
            if is_failure and len(errors) < 20:
                errors.append(f"{traj.task_id}/{traj.sample_index}: {traj.end_reason}: {traj.error}")
            if is_failure and config.on_env_error == "exclude":
                failed[index] = traj
                if failed_writer is not None:
                    failed_writer.write(traj)
            else:
                kept[index] = traj
                if writer is not None:
                    writer.write(traj)
            bar.update(1, tokens=traj.num_generated_tokens)

        sem = asyncio.Semaphore(config.concurrency)

        async def one(index: int, task: Task, sample_index: int) -> None:
            on_done(index, await runner.episode(task, sample_index, sem, index=index))

        async with batching(runner, policy, config):
            await asyncio.gather(*(one(i, task, k) for i, (task, k) in enumerate(episodes)))

    wall = time.perf_counter() - t0
    trajectories = [kept[i] for i in sorted(kept)]
    stats = RolloutStats(
        episodes=len(episodes),
        kept=len(kept),
        failed=sum(end_reasons[r] for r in FAILED_END_REASONS),
        end_reasons=dict(end_reasons),
        errors=errors,
        success_rate=(sum(t.success for t in trajectories) / len(trajectories)) if trajectories else 0.0,
        mean_reward=(sum(t.reward for t in trajectories) / len(trajectories)) if trajectories else 0.0,
        turns=sum(len(t.turns) for t in list(kept.values()) + list(failed.values())),
        generated_tokens=generated,
        generate_calls=runner.batcher.calls if runner.batcher else 0,
        mean_batch_size=runner.batcher.mean_batch_size if runner.batcher else 0.0,
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


@dataclass(frozen=True)
class PrefixedEpisode:
    """One episode of :func:`run_prefixed_episodes`: ``task`` in an env from ``make_env`` (None: the
    run's env), whose first ``len(prefix)`` turns are the given actions, played verbatim (token data
    recorded as given, no engine call); the policy samples from then on."""

    task: Task
    prefix: tuple[Action, ...] = ()
    make_env: Callable[[], Env] | None = None
    sample_index: int = 0


async def run_prefixed_episodes(
    env: str | Callable[[], Env] | None,
    episodes: Sequence[PrefixedEpisode],
    policy: Any,
    renderer: Any,
    config: RolloutConfig | None = None,
    *,
    env_options: dict[str, Any] | None = None,
    policy_name: str = "policy",
) -> RolloutResult:
    """Play ``episodes`` through the same loop, policy and batcher as :func:`run_rollouts` (all waiting
    episodes share one ``generate`` call), each starting with its forced ``prefix`` (e.g. a recorded
    trajectory's first turns, to branch from there). ``env`` (a name with ``env_options``, or a
    factory) is used for episodes without their own ``make_env``.

    Unlike ``run_rollouts``, ``trajectories`` holds every episode in the order given, failed ones
    included (their ``end_reason`` says so; zero-rewarded with ``on_env_error="zero_reward"``);
    ``failed`` repeats the failed ones. Stats: episodes, failed, end reasons, sampled tokens (the
    prefixes' not counted), generate calls, batch size and wall time."""
    config = config or RolloutConfig()
    if config.context.policy == "summarize":  # a prefix is replayed per env turn; summaries are not env turns
        raise ValueError("run_prefixed_episodes (tree rollouts, mc_continuation): rollout.context summarize cannot "
                         "replay a prefix; use full, window or observation_masking")
    factory, env_name = env_factory(env, env_options)
    if factory is None and any(e.make_env is None for e in episodes):
        raise ValueError("run_prefixed_episodes: an episode without make_env needs env")
    runner = EpisodeRunner(factory, env_name, policy, renderer, config, policy_name)  # type: ignore[arg-type]
    if runner.mode != "token":
        raise ValueError("run_prefixed_episodes needs a token engine (generate)")
    sem = asyncio.Semaphore(config.concurrency)
    t0 = time.perf_counter()
    async with batching(runner, policy, config):
        trajectories = list(await asyncio.gather(*(
            runner.episode(e.task, e.sample_index, sem, make_env=e.make_env, prefix=e.prefix, index=i)
            for i, e in enumerate(episodes)
        )))
    wall = time.perf_counter() - t0
    failed = [t for t in trajectories if t.end_reason in FAILED_END_REASONS]
    # tokens the engine sampled: the forced prefix turns are not counted
    generated = sum(len(turn.completion_ids) for t, e in zip(trajectories, episodes) for turn in t.turns[len(e.prefix):])
    batcher = runner.batcher
    stats = RolloutStats(
        episodes=len(trajectories), kept=len(trajectories) - len(failed), failed=len(failed),
        end_reasons=dict(Counter(t.end_reason for t in trajectories)),
        errors=[f"{t.task_id}/{t.sample_index}: {t.end_reason}: {t.error}" for t in failed[:20]],
        turns=sum(len(t.turns) for t in trajectories), generated_tokens=generated,
        generate_calls=batcher.calls, mean_batch_size=batcher.mean_batch_size,
        wall_time_s=wall, episodes_per_s=len(trajectories) / wall if wall > 0 else 0.0,
        tokens_per_s=generated / wall if wall > 0 else 0.0,
    )
    return RolloutResult(trajectories=trajectories, stats=stats, failed=failed)


def run_rollouts_sync(*args: Any, **kwargs: Any) -> RolloutResult:
    """``asyncio.run(run_rollouts(...))`` for callers without an event loop."""
    return asyncio.run(run_rollouts(*args, **kwargs))


# --- engine / trainer log-prob gap ---------------------------------------------------------------


GAP_MAX_TURNS = 64  # turns re-scored by the gap check: a sanity check, not a second pass over the run


def logprob_gap(
    model: Any, trajectories: Sequence[Trajectory], temperature: float = 1.0, top_p: float = 1.0,
    max_turns: int | None = GAP_MAX_TURNS,
) -> LogprobGap:
    """Teacher-forced re-scoring of sampled tokens.

    For each turn with engine log-probs, one forward pass of ``model`` on ``prompt + completion``
    gives the log-prob of each completion token under the same sampling transform the engine used
    (temperature, top-p; the unscaled softmax for greedy). Returns mean and max |difference|. For the
    hf engine on the same fp32 model this is ~1e-6; a large gap means the engine samples from a
    different distribution than the trainer scores (dtype, kernels, stale weights).
    ``max_turns``: at most this many turns, evenly spaced over the run (None: all). One batch-1
    forward per turn costs about as much as sampling it (measured: 600 turns re-scored took 15 min
    after 5 min of rollouts), and a systematic gap shows on any of them.
    """
    import torch

    from tracegym.engines.sampling import sampling_logprobs

    turns = [turn for traj in trajectories for turn in traj.turns
             if turn.completion_logprobs is not None and turn.completion_ids]
    if max_turns is not None and len(turns) > max_turns:  # evenly spaced, first and last included
        step = (len(turns) - 1) / max(max_turns - 1, 1)
        turns = [turns[round(i * step)] for i in range(max_turns)]
    total, worst, count = 0.0, 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            device = next(model.parameters()).device
            for turn in turns:
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
