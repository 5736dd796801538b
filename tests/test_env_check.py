"""check_env catches each kind of broken env (fault injection), and the message-level episode loop
isolates failures: an env that raises, a policy that raises or a hanging tool ends only its episode."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Sequence

import pytest

from tracegym.envs import Env, Task, ToolEnv, tool
from tracegym.envs.check import CheckReport, EnvCheckError, check_env, schema_problems
from tracegym.envs.episode import run_episode, run_episodes
from tracegym.types import Message, ParsedCompletion, StepResult, ToolCall


class Doubling(ToolEnv):
    """A correct env: double a number with a tool, then answer."""

    name = "doubling"
    default_max_turns = 5

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        rng, found = random.Random(seed), {}
        while len(found) < n:
            x = rng.randint(0, 10**6)
            if ("test" if x % 5 == 0 else "train") == split:
                found[f"t{x}"] = Task(id=f"t{x}", split=split, data={"x": x})
        return list(found.values())

    async def reset(self, task: Task) -> list[Message]:
        self.task, self.doubled = task, None
        return [Message(role="system", content="Double it."), Message(role="user", content=f"x = {task.data['x']}")]

    @tool
    def double(self, x: int) -> int:
        """Double a number.

        Args:
            x: The number.
        """
        self.doubled = 2 * x
        return self.doubled

    def score_answer(self, answer: str) -> float:
        return 1.0 if answer == str(2 * self.task.data["x"]) else 0.0

    def expert_action(self) -> Message:
        if self.doubled is None:
            return Message(role="assistant", tool_calls=(ToolCall(name="double", arguments={"x": self.task.data["x"]}),))
        return Message(role="assistant", content=f"<answer>{self.doubled}</answer>")


def _failures(env_class: type[Env]) -> CheckReport:
    return check_env(env_class, n_tasks=6, raise_on_failure=False)


def test_a_correct_env_passes_every_check() -> None:
    report = check_env(Doubling, n_tasks=10)
    assert report.ok and report.expert_success_rate == 1.0
    assert report.passed == ["determinism", "disjoint_splits", "tool_schemas", "bad_calls", "isolation", "expert", "truncation"]


def test_unseeded_tasks_fail_determinism() -> None:
    class Unseeded(Doubling):
        def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
            return super().tasks(split, n, seed=random.randrange(10**9))

    report = _failures(Unseeded)
    assert "differ between two instances" in report.failures["determinism"][0]


def test_seed_ignored_fails_determinism() -> None:
    class SeedIgnored(Doubling):
        def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
            return super().tasks(split, n, seed=0)

    assert any("give the same train tasks" in p for p in _failures(SeedIgnored).failures["determinism"])


def test_shared_content_between_splits_fails() -> None:
    class Leaky(Doubling):
        def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
            # Different ids, same problems: the leak an id-only check would miss.
            return [Task(id=f"{split}-{t.id}", split=split, data=t.data) for t in super().tasks("train", n, seed)]

    problems = _failures(Leaky).failures["disjoint_splits"]
    assert any("share 6 task contents" in p for p in problems)
    assert any("initial prompts" in p for p in problems)


def test_bad_schemas_fail() -> None:
    class BadSchema(Doubling):
        def tool_schemas(self) -> list[dict[str, Any]]:
            good = super().tool_schemas()[0]
            broken = {"type": "function", "function": {"name": "double", "parameters": {"type": "object", "properties": {"x": {"type": "int"}}, "required": ["y"]}}}
            return [good, broken]

    problems = _failures(BadSchema).failures["tool_schemas"]
    assert "tool 'double'.parameters.x: unknown type 'int'" in problems
    assert "tool 'double'.parameters: required argument 'y' is not in properties" in problems
    assert "duplicate tool names: double" in problems


def test_schema_problems_unit() -> None:
    assert schema_problems(Doubling().tool_schemas()) == []
    assert schema_problems("nope") == ["tool_schemas() must return a list, got str"]
    assert schema_problems([{"type": "function", "function": {"name": "bad name", "parameters": {"type": "object"}}}]) == [
        "tool[0]: invalid tool name 'bad name'"
    ]
    assert schema_problems([{"name": "x"}]) == ['tool[0]: must be {"type": "function", "function": {...}}']


def test_shared_state_fails_isolation() -> None:
    class Shared(Doubling):
        shared: dict[str, Any] = {}  # class-level state: every instance sees the last reset

        async def reset(self, task: Task) -> list[Message]:
            Shared.shared["task"] = task
            return await super().reset(task)

        def expert_action(self) -> Message:
            self.task = Shared.shared["task"]
            return super().expert_action()

    assert "interleaved episodes differ" in _failures(Shared).failures["isolation"][0]


def test_a_weak_expert_fails() -> None:
    class Weak(Doubling):
        def expert_action(self) -> Message:
            return Message(role="assistant", content="<answer>-1</answer>")

    report = _failures(Weak)
    assert report.expert_success_rate == 0.0
    assert "expert solved 0/6 test tasks, below 95%" in report.failures["expert"]
    with pytest.raises(EnvCheckError, match="expert solved 0/6"):
        check_env(Weak, n_tasks=6)


def test_reward_out_of_range_and_both_flags_fail() -> None:
    class Greedy(Doubling):
        async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
            result = await super().step(message, parse_errors)
            if result.terminated:  # a hand-written step that gets both wrong
                return StepResult(reward=2.0, terminated=True, truncated=True, info={"success": 1})
            return result

    problems = _failures(Greedy).failures["expert"]
    assert any("reward 2.0 outside reward_range (0.0, 1.0)" in p for p in problems)
    assert any("terminated and truncated both set" in p for p in problems)


class RawEnv(Env):
    """A hand-written Env (no ToolEnv): crashes on an unknown tool and never truncates."""

    name = "raw"
    crash_on_unknown = True

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return Doubling().tasks(split, n, seed)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return Doubling().tool_schemas()

    async def reset(self, task: Task) -> list[Message]:
        self.task, self.done = task, False
        return [Message(role="user", content=f"x = {task.data['x']}")]

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        if message.tool_calls and message.tool_calls[0].name != "double" and self.crash_on_unknown:
            raise KeyError(message.tool_calls[0].name)
        if message.content:
            return StepResult(reward=1.0, terminated=True, info={"success": 1})
        return StepResult(messages=(Message(role="tool", content="Error: no"),))

    def expert_action(self) -> Message:
        return Message(role="assistant", content="<answer>x</answer>")


def test_crash_on_unknown_tool_fails_bad_calls() -> None:
    assert any("unknown tool: step raised KeyError" in p for p in _failures(RawEnv).failures["bad_calls"])


def test_no_turn_limit_fails_truncation() -> None:
    class Endless(RawEnv):
        crash_on_unknown = False

    report = _failures(Endless)
    assert report.failures["truncation"] == ["an agent that never finishes was not truncated within 1000 turns"]
    # It also ignores parse errors: a malformed call is neither shown to the model nor survived.
    assert report.failures["bad_calls"] == [
        "malformed call: no 'Error: ...' tool message in []",
        "malformed call: the episode was terminated by a bad call",
    ]


# --- the episode loop -----------------------------------------------------------------------------


class Faulty(Doubling):
    """Doubling with a fault chosen by the task: raise in step/reset, a hanging or slow tool, a broken policy."""

    async def reset(self, task: Task) -> list[Message]:
        if task.data.get("fault") == "reset":
            raise OSError("disk gone")
        return await super().reset(task)

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        if self.task.data.get("fault") == "step":
            raise RuntimeError("env exploded")
        return await super().step(message, parse_errors)

    @tool(timeout=60.0)
    async def hang(self) -> str:
        """Never returns in time."""
        await asyncio.sleep(30)
        return "late"

    @tool(timeout=0.05)
    def slow(self) -> str:
        """Sleeps past its own timeout."""
        time.sleep(0.2)
        return "late"

    def expert_action(self) -> Message:
        fault = self.task.data.get("fault")
        if fault == "policy":
            raise ValueError("policy bug")
        if fault in ("hang", "slow") and self.turn == 0:
            return Message(role="assistant", tool_calls=(ToolCall(name=fault, id="f"),))
        return super().expert_action()


def _tasks(*faults: str | None) -> list[Task]:
    return [Task(id=f"e{i}", data={"x": i, **({"fault": f} if f else {})}) for i, f in enumerate(faults)]


def test_failures_end_only_their_own_episode() -> None:
    tasks = _tasks(None, "step", None, "hang", "reset", "policy", "slow", None)
    started = time.perf_counter()
    results = asyncio.run(run_episodes(Faulty, tasks, lambda env: env.expert_action, concurrency=8, timeout_s=0.5))
    elapsed = time.perf_counter() - started
    assert elapsed < 5.0  # the hanging tool (30 s) did not hold anything up
    by_id = {r.task_id: r for r in results}
    assert [r.task_id for r in results] == [t.id for t in tasks]
    for ok in ("e0", "e2", "e7"):
        assert by_id[ok].success and by_id[ok].end_reason == "terminated" and by_id[ok].error is None
    assert by_id["e1"].end_reason == "env_error" and by_id["e1"].error == "step 1 failed: RuntimeError: env exploded"
    assert by_id["e3"].end_reason == "timeout" and by_id["e3"].error == "episode timed out after 0.5 s"
    assert by_id["e3"].messages[-1].tool_calls[0].name == "hang"  # what happened before the hang is kept
    assert by_id["e4"].end_reason == "env_error" and by_id["e4"].error == "reset failed: OSError: disk gone"
    # a policy that raises is an engine error (one end-reason vocabulary with the rollout runner)
    assert by_id["e5"].end_reason == "engine_error" and by_id["e5"].error == "ValueError: policy bug"
    assert all(not by_id[bad].success for bad in ("e1", "e3", "e4", "e5"))
    # A tool past its own timeout is an error message; the episode goes on and is solved.
    slow = by_id["e6"]
    assert slow.success and slow.error is None and slow.metrics["tool_timeouts"] == 1
    assert slow.messages[3].content == "Error: tool 'slow' timed out after 0.05 s."


def test_failing_make_env_is_isolated() -> None:
    calls = iter(range(100))

    def flaky() -> Env:
        if next(calls) == 1:
            raise RuntimeError("no env today")
        return Doubling()

    results = asyncio.run(run_episodes(flaky, _tasks(None, None, None), lambda env: env.expert_action, concurrency=1))
    assert [r.success for r in results] == [True, False, True]
    assert results[1].end_reason == "env_error"
    assert results[1].error == "making the env failed: RuntimeError: no env today"


def test_runner_turn_limit_and_policy_forms() -> None:
    env = Doubling(max_turns=50)
    lost = Message(role="assistant", tool_calls=(ToolCall(name="nope"),))
    result = asyncio.run(run_episode(env, _tasks(None)[0], lambda: lost, max_turns=3))
    assert result.end_reason == "max_turns" and not result.success
    assert [m.role for m in result.messages].count("assistant") == 3
    assert result.turns == ()  # a message-only policy records no token turns

    seen: list[int] = []

    def reads_conversation(messages: list[Message]) -> ParsedCompletion:
        seen.append(len(messages))
        return ParsedCompletion(message=Message(role="assistant", content="<answer>0</answer>"), errors=("bad call",))

    result = asyncio.run(run_episode(Doubling(), _tasks(None)[0], reads_conversation, max_turns=2))
    # Parse errors are not a final answer: the env shows them and the episode goes on to the limit.
    assert seen == [2, 4] and result.end_reason == "max_turns"
    assert result.messages[3].content == "Error: bad call"


def test_run_episode_returns_a_trajectory() -> None:
    env = Doubling()
    task = env.tasks("test", 1)[0]
    trajectory = asyncio.run(run_episode(env, task, env.expert_action, policy_name="expert"))
    assert trajectory.success and trajectory.reward == 1.0 and trajectory.error is None
    assert trajectory.env == "doubling" and trajectory.task_id == task.id and trajectory.split == "test"
    assert trajectory.end_reason == "terminated" and trajectory.policy == "expert"
    assert trajectory.tools == tuple(env.tool_schemas())
    assert [m.role for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory.metrics["tool_calls"] == 1.0 and trajectory.turns == ()


def test_an_env_that_crashes_is_reported_not_raised() -> None:
    report = _failures(RawEnv)
    assert report.failures["truncation"] == ["raised KeyError: '__tracegym_check_no_such_tool__'"]
