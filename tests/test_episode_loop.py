"""The one episode loop (``tracegym.envs.episode.play_episode``): turns, limits, end reasons, failure
isolation and non-finite rewards, each checked with a small hand-written env and policy."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Sequence

import pytest

from tracegym.envs.base import Env, Task
from tracegym.envs.episode import (
    FAILED_END_REASONS,
    Action,
    ContextExhausted,
    Observation,
    PolicyError,
    TokenData,
    play_episode,
    run_episode,
    run_episodes,
)
from tracegym.render.call_errors import failure_metrics
from tracegym.types import Message, StepResult, Trajectory


class Counter(Env):
    """Each step answers ``obs<n>``; ends after ``finish_at`` steps; rewards come from ``rewards``."""

    name = "counter"

    def __init__(self, finish_at: int | None = 3, rewards: Sequence[float] | None = None, hang_at: int | None = None):
        self.finish_at, self.rewards, self.hang_at = finish_at, list(rewards or []), hang_at
        self.steps = 0
        self.closed = False
        self.seen_errors: list[tuple[str, ...]] = []

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return [Task(id=f"c{i}", split=split) for i in range(n)]

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    async def reset(self, task: Task) -> list[Message]:
        self.task = task
        return [Message(role="system", content="count"), Message(role="user", content=f"task {task.id}")]

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        self.steps += 1
        self.seen_errors.append(tuple(parse_errors))
        if self.hang_at == self.steps:
            await asyncio.Event().wait()
        done = self.finish_at is not None and self.steps >= self.finish_at
        reward = self.rewards[self.steps - 1] if self.steps <= len(self.rewards) else 0.5
        return StepResult(
            messages=(Message(role="user", content=f"obs{self.steps}"),),
            reward=reward, terminated=done, info={"success": done, "steps": self.steps, "text": "dropped"},
        )

    def expert_action(self) -> Message:
        return Message(role="assistant", content="next")

    def close(self) -> None:
        self.closed = True


class Tokens:
    """A token policy: ``size`` completion ids per turn (at most the budget), prompt = turn index."""

    def __init__(self, size: int = 3):
        self.size = size
        self.observations: list[Observation] = []

    async def __call__(self, obs: Observation) -> Action:
        self.observations.append(obs)
        n = self.size if obs.token_budget is None else min(self.size, obs.token_budget)
        ids = tuple(range(10, 10 + n))
        return Action(
            message=Message(role="assistant", content=f"turn {obs.turn}"), parse_errors=("bad",) if obs.turn == 0 else (),
            tokens=TokenData(prompt_ids=(obs.turn,), completion_ids=ids, completion_logprobs=[-0.1] * n,
                             finish_reason="stop" if n == self.size else "length"),
        )


def play(env: Env, policy: Any, **kw: Any) -> Trajectory:
    return asyncio.run(play_episode(lambda: env, Task(id="c0"), lambda _env: policy, **kw))


def test_token_policy_turns_rewards_and_observations() -> None:
    env, policy = Counter(finish_at=3, rewards=[0.0, 0.25, 1.0]), Tokens()
    t = play(env, policy, policy_name="p", sample_index=2)
    assert t.end_reason == "terminated" and t.error is None and t.success and env.closed
    assert (t.env, t.task_id, t.sample_index, t.policy) == ("counter", "c0", 2, "p")
    assert [turn.reward for turn in t.turns] == [0.0, 0.25, 1.0] and t.reward == 1.25
    assert [turn.prompt_ids for turn in t.turns] == [(0,), (1,), (2,)]
    assert t.turns[0].completion_ids == (10, 11, 12) and t.turns[0].completion_logprobs == (-0.1,) * 3
    assert t.turns[0].parse_errors == ("bad",) and env.seen_errors[0] == ("bad",)
    assert t.turns[1].env_messages == (Message(role="user", content="obs2"),)
    assert t.turns[2].metrics == {"success": 1.0, "steps": 3.0}
    # the episode's failed calls by reason: turn 0's error text "bad" names none of them
    assert t.metrics == {"success": 1.0, "steps": 3.0, **failure_metrics({"other": 1})}
    # what the policy saw: the conversation so far, and the env's last answer
    assert [len(o.messages) for o in policy.observations] == [2, 4, 6]
    assert policy.observations[0].new_messages == policy.observations[0].messages
    assert policy.observations[2].new_messages == (Message(role="user", content="obs2"),)
    assert all(o.token_budget is None for o in policy.observations)


def test_max_turns_and_max_tokens() -> None:
    t = play(Counter(finish_at=None), Tokens(), max_turns=4)
    assert t.end_reason == "max_turns" and len(t.turns) == 4 and not t.success
    policy = Tokens(size=3)
    t = play(Counter(finish_at=None), policy, max_turns=10, max_tokens=7)
    assert t.end_reason == "max_tokens" and [len(x.completion_ids) for x in t.turns] == [3, 3, 1]
    assert [o.token_budget for o in policy.observations] == [7, 4, 1]
    assert t.turns[-1].finish_reason == "length" and t.num_generated_tokens == 7


def test_context_exhausted_ends_with_context_and_keeps_the_turns() -> None:
    class Full(Tokens):
        async def __call__(self, obs: Observation) -> Action:
            if obs.turn == 2:
                raise ContextExhausted("no room")
            return await super().__call__(obs)

    t = play(Counter(finish_at=None), Full())
    assert t.end_reason == "context" and t.error is None and len(t.turns) == 2
    assert "context" not in FAILED_END_REASONS


def test_policy_failures_are_engine_errors() -> None:
    class Boom(Tokens):
        async def __call__(self, obs: Observation) -> Action:
            if obs.turn == 1:
                raise RuntimeError("server gone")
            return await super().__call__(obs)

    env = Counter(finish_at=None)
    t = play(env, Boom())
    assert t.end_reason == "engine_error" and t.error == "RuntimeError: server gone"
    assert len(t.turns) == 1 and env.closed and not t.success

    async def ready_text(obs: Observation) -> Action:
        raise PolicyError("engine said no")

    assert play(Counter(), ready_text).error == "engine said no"

    async def not_an_action(obs: Observation) -> Any:
        return Message(role="assistant", content="hi")

    t = play(Counter(), not_an_action)
    assert t.end_reason == "engine_error" and "expected Action" in t.error

    async def user_message(obs: Observation) -> Action:
        return Action(message=Message(role="user", content="hi"))

    assert play(Counter(), user_message).end_reason == "engine_error"

    async def mixed(obs: Observation) -> Action:
        tokens = TokenData((), (1,)) if obs.turn == 0 else None
        return Action(message=Message(role="assistant", content="x"), tokens=tokens)

    t = play(Counter(finish_at=None), mixed)
    assert t.end_reason == "engine_error" and "mixed" in t.error

    async def bad_logprobs(obs: Observation) -> Action:
        return Action(message=Message(role="assistant"), tokens=TokenData((1,), (1, 2), completion_logprobs=(-1.0,)))

    env = Counter()
    t = play(env, bad_logprobs)
    assert t.end_reason == "engine_error" and "1 log-probs for 2 completion tokens" in t.error and t.turns == ()
    assert env.steps == 0  # a malformed action never reaches the env

    def broken_factory(env: Env) -> Any:
        raise KeyError("no policy")

    t = asyncio.run(play_episode(Counter, Task(id="c0"), broken_factory))
    assert t.end_reason == "engine_error" and t.error.startswith("making the policy failed: KeyError")


def test_env_failures_are_env_errors() -> None:
    class BadReset(Counter):
        async def reset(self, task: Task) -> list[Message]:
            raise OSError("disk gone")

    class BadKey(Counter):
        def state_key(self) -> Any:
            raise ValueError("no key")

    class WrongKey(Counter):
        def state_key(self) -> Any:
            return (1, 2)

    class NoStepResult(Counter):
        async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> Any:
            return {"reward": 1.0}

    def no_env() -> Env:
        raise ImportError("missing extra")

    assert play(BadReset(), Tokens()).error == "reset failed: OSError: disk gone"
    assert play(BadKey(), Tokens()).error == "state_key failed: ValueError: no key"
    assert play(WrongKey(), Tokens()).error == "state_key() returned tuple, expected str or None"
    assert play(NoStepResult(), Tokens()).error == "step 1 returned dict, expected StepResult"
    t = asyncio.run(play_episode(no_env, Task(id="c0"), lambda env: Tokens(), env_name="named"))
    assert t.end_reason == "env_error" and t.error == "making the env failed: ImportError: missing extra"
    assert t.env == "named" and t.messages == ()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_an_env_error_not_a_record(bad: float) -> None:
    env = Counter(finish_at=None, rewards=[0.5, bad])
    t = play(env, Tokens())
    assert t.end_reason == "env_error" and t.end_reason in FAILED_END_REASONS and not t.success
    assert "c0" in t.error and repr(bad) in t.error and "non-finite reward" in t.error
    assert [turn.reward for turn in t.turns] == [0.5] and t.reward == 0.5  # the bad step is not recorded
    row = json.loads(t.model_dump_json())
    assert row["reward"] == 0.5 and all(turn["reward"] is not None for turn in row["turns"])
    # the message-level entry point rejects it the same way
    t = asyncio.run(run_episode(Counter(finish_at=None, rewards=[bad]), Task(id="c7"), lambda: Message(role="assistant")))
    assert t.end_reason == "env_error" and "c7" in t.error and repr(bad) in t.error and t.reward == 0.0


def test_timeout_keeps_what_happened_so_far() -> None:
    env = Counter(finish_at=None, hang_at=3)
    t = play(env, Tokens(), timeout_s=0.2)
    assert t.end_reason == "timeout" and t.error == "episode timed out after 0.2 s"
    assert len(t.turns) == 2 and t.messages[-1] == Message(role="assistant", content="turn 2") and env.closed


def test_message_only_policies_record_no_token_turns() -> None:
    env = Counter(finish_at=2)
    t = asyncio.run(run_episode(env, Task(id="c0"), env.expert_action, policy_name="expert"))
    assert t.end_reason == "terminated" and t.turns == () and t.num_generated_tokens == 0
    assert [m.role for m in t.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert not env.closed  # run_episode leaves the caller's env open

    # an async message policy that reads the conversation; an Action passes through unchanged
    async def reads(messages: list[Message]) -> Action:
        return Action(message=Message(role="assistant", content=str(len(messages))))

    t = asyncio.run(run_episode(Counter(finish_at=2), Task(id="c0"), reads))
    assert [m.content for m in t.messages if m.role == "assistant"] == ["2", "4"]
    t = asyncio.run(run_episode(Counter(), Task(id="c0"), lambda: "text"))
    assert t.end_reason == "engine_error" and "expected Message, ParsedCompletion or Action" in t.error


def test_run_episodes_isolates_and_orders() -> None:
    made: list[Counter] = []

    def factory() -> Env:
        if len(made) == 1:
            made.append(Counter())
            raise RuntimeError("flaky")
        env = Counter(finish_at=2, rewards=[0.0, 1.0 if len(made) != 2 else math.nan])
        made.append(env)
        return env

    tasks = [Task(id=f"c{i}") for i in range(4)]
    out = asyncio.run(run_episodes(factory, tasks, lambda env: env.expert_action, concurrency=1, policy_name="x"))
    assert [t.task_id for t in out] == ["c0", "c1", "c2", "c3"]
    assert [t.end_reason for t in out] == ["terminated", "env_error", "env_error", "terminated"]
    assert [t.success for t in out] == [True, False, False, True] and all(t.policy == "x" for t in out)
    assert all(env.closed for env in made if env.steps)
