"""ToolEnv and the tool decorator: schema generation (golden), argument validation, and every
error path of ToolEnv.step (unknown tool, bad arguments, raising tool, timeouts, parse errors)."""

from __future__ import annotations

import asyncio
import time
from typing import Literal, Optional

import pytest

from tracegym.envs import Task, ToolEnv, extract_answer, tool, tool_schema
from tracegym.envs.tools import validate_tool_arguments
from tracegym.types import Message, StepResult, ToolCall


def search(query: str, k: int = 3, mode: Literal["fast", "exact"] = "fast", tags: Optional[list[str]] = None,
           weights: dict[str, float] | None = None, threshold: float = 0.5, verbose: bool = False) -> list[str]:
    """Search the corpus for documents.

    Longer explanation that is not part of the description.

    Args:
        query (str): What to look for,
            over two lines.
        k: How many results.
        mode: Speed or precision.
        tags: Only documents with these tags.

    Returns:
        The document ids.
    """
    return []


SEARCH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the corpus for documents.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to look for, over two lines."},
                "k": {"type": "integer", "description": "How many results.", "default": 3},
                "mode": {"type": "string", "enum": ["fast", "exact"], "description": "Speed or precision.", "default": "fast"},
                "tags": {"type": "array", "items": {"type": "string"}, "description": "Only documents with these tags."},
                "weights": {"type": "object", "additionalProperties": {"type": "number"}},
                "threshold": {"type": "number", "default": 0.5},
                "verbose": {"type": "boolean", "default": False},
            },
            "required": ["query"],
        },
    },
}


def test_schema_golden_plain_function() -> None:
    assert tool_schema(search) == SEARCH_SCHEMA


def test_schema_of_method_drops_self_and_keeps_definition_order() -> None:
    class E(Box):
        @tool
        def second(self, b: int) -> int:
            """Second."""
            return b

    names = [s["function"]["name"] for s in E().tool_schemas()]
    assert names == ["add", "boom", "slow_async", "slow_sync", "echo", "finish", "second"]
    add = E().tool_schemas()[0]["function"]
    assert add["parameters"] == {
        "type": "object",
        "properties": {"a": {"type": "integer", "description": "First number."}, "b": {"type": "integer", "description": "Second number."}},
        "required": ["a", "b"],
    }
    assert add["description"] == "Add two integers."


def test_schema_rejects_unsupported_hints() -> None:
    def no_hint(x):  # type: ignore[no-untyped-def]
        """x."""

    def odd_hint(x: complex) -> None:
        """x."""

    def star(*args: int) -> None:
        """x."""

    with pytest.raises(TypeError, match="need a type hint"):
        tool_schema(no_hint)
    with pytest.raises(TypeError, match="unsupported type hint"):
        tool_schema(odd_hint)
    with pytest.raises(TypeError, match=r"\*args"):
        tool_schema(star)
    with pytest.raises(ValueError):
        tool(timeout=0)


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ({"query": "x"}, None),
        ({"query": "x", "threshold": 1}, None),  # an int is a valid number
        ({"query": "x", "tags": None}, None),  # Optional accepts null
        ({}, "missing required argument 'query'"),
        ({"query": 3}, "argument 'query': Input should be a valid string (got 3)"),
        ({"query": "x", "k": "3"}, "argument 'k': Input should be a valid integer (got '3')"),
        ({"query": "x", "k": True}, "argument 'k': Input should be a valid integer (got True)"),
        ({"query": "x", "k": 2.5}, "argument 'k'"),
        ({"query": "x", "mode": "slow"}, "argument 'mode': Input should be 'fast' or 'exact' (got 'slow')"),
        ({"query": "x", "tags": ["a", 1]}, "argument 'tags.1'"),
        ({"query": "x", "limit": 3}, "unknown argument 'limit' (allowed: query, k, mode, tags, weights, threshold, verbose)"),
        (["x"], "arguments must be a JSON object, got list"),
    ],
)
def test_argument_validation(arguments: object, problem: str | None) -> None:
    kwargs, message = validate_tool_arguments(search, arguments)
    if problem is None:
        assert message is None and kwargs is not None
    else:
        assert kwargs is None and message is not None and problem in message


def test_extract_answer_takes_the_last() -> None:
    assert extract_answer("I think <answer> 12 </answer> no, <answer>13</answer>") == "13"
    assert extract_answer("no answer here") is None
    assert extract_answer("<answer>multi\nline</answer>") == "multi\nline"


# --- a tool env with every kind of tool ----------------------------------------------------------


class Box(ToolEnv):
    name = "box"
    default_max_turns = 4

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return [Task(id=f"{split}-{seed}-{i}", split=split, data={"answer": "7"}) for i in range(n)]

    async def reset(self, task: Task) -> list[Message]:
        self.task = task
        return [Message(role="system", content="sys"), Message(role="user", content="go")]

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: First number.
            b: Second number.
        """
        return a + b

    @tool
    def boom(self) -> str:
        """Always fails."""
        raise ValueError("the tool broke")

    @tool(timeout=0.05)
    async def slow_async(self) -> str:
        """Sleeps past its timeout."""
        await asyncio.sleep(5)
        return "never"

    @tool(timeout=0.05)
    def slow_sync(self) -> str:
        """Blocks a worker thread past its timeout."""
        time.sleep(0.3)
        return "late"

    @tool
    def echo(self, data: dict) -> dict:
        """Return the data."""
        return {"got": data}

    @tool
    def finish(self) -> str:
        """End the episode with success."""
        self.end_episode(1.0, True, finished_by="tool")
        return "done"

    def score_answer(self, answer: str) -> float:
        return 1.0 if answer == self.task.data["answer"] else 0.0

    def expert_action(self) -> Message:
        return Message(role="assistant", content="<answer>7</answer>")


def _call(name: str, call_id: str = "c1", **arguments: object) -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name=name, arguments=arguments, id=call_id),))


async def _fresh(max_turns: int | None = None) -> Box:
    env = Box(max_turns=max_turns)
    await env.reset(env.tasks("train", 1)[0])
    return env


def test_successful_call_returns_result_with_ids() -> None:
    async def go() -> StepResult:
        env = await _fresh()
        return await env.step(_call("add", "id-9", a=2, b=40))

    result = asyncio.run(go())
    (message,) = result.messages
    assert message == Message(role="tool", content="42", tool_call_id="id-9", name="add")
    assert not result.terminated and not result.truncated and result.reward == 0.0
    assert result.info == {
        "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "parse_errors": 0, "tool_output_truncated": 0, "turns": 1,
    }


def test_dict_results_are_json() -> None:
    async def go() -> StepResult:
        env = await _fresh()
        return await env.step(_call("echo", data={"x": [1, 2]}))

    assert asyncio.run(go()).messages[0].content == '{"got": {"x": [1, 2]}}'


@pytest.mark.parametrize(
    "message, expected, counter",
    [
        (_call("nope"), "Error: unknown tool 'nope'. Available tools: add, boom, slow_async, slow_sync, echo, finish.", "tool_errors"),
        (_call("add", a=1), "Error: invalid arguments for tool 'add': missing required argument 'b'.", "tool_errors"),
        (_call("add", a=1, b=2, c=3), "Error: invalid arguments for tool 'add': unknown argument 'c' (allowed: a, b).", "tool_errors"),
        (_call("add", a="1", b=2), "Error: invalid arguments for tool 'add': argument 'a': Input should be a valid integer (got '1').", "tool_errors"),
        (_call("boom"), "Error: tool 'boom' failed: ValueError: the tool broke", "tool_errors"),
        (_call("slow_async"), "Error: tool 'slow_async' timed out after 0.05 s.", "tool_timeouts"),
        (_call("slow_sync"), "Error: tool 'slow_sync' timed out after 0.05 s.", "tool_timeouts"),
    ],
)
def test_every_error_path_is_a_tool_message(message: Message, expected: str, counter: str) -> None:
    async def go() -> StepResult:
        env = await _fresh()
        return await env.step(message)

    started = time.perf_counter()
    result = asyncio.run(go())
    assert time.perf_counter() - started < 2.0  # a timeout does not wait for the tool
    (reply,) = result.messages
    assert reply.role == "tool" and reply.content == expected
    assert reply.tool_call_id == "c1" and reply.name == message.tool_calls[0].name
    assert not result.terminated and not result.truncated
    assert result.info[counter] == 1 and result.info["tool_calls"] == 1
    assert result.info["tool_errors"] == 1  # a timeout is also an error


def test_parse_errors_become_tool_messages_and_calls_still_run() -> None:
    async def go() -> StepResult:
        env = await _fresh()
        return await env.step(_call("add", a=1, b=1), parse_errors=("invalid JSON in tool call: {oops",))

    result = asyncio.run(go())
    assert [m.content for m in result.messages] == ["Error: invalid JSON in tool call: {oops", "2"]
    assert result.info["parse_errors"] == 1 and result.info["tool_errors"] == 0
    assert not result.terminated


def test_parse_errors_alone_do_not_count_as_a_final_answer() -> None:
    async def go() -> StepResult:
        env = await _fresh()
        return await env.step(Message(role="assistant", content="<answer>7</answer>"), parse_errors=("bad call",))

    result = asyncio.run(go())
    assert not result.terminated and result.messages[0].content == "Error: bad call"


def test_final_answer_scoring_and_no_answer() -> None:
    async def go(text: str) -> StepResult:
        env = await _fresh()
        return await env.step(Message(role="assistant", content=text))

    right = asyncio.run(go("so <answer>7</answer>"))
    assert right.terminated and right.reward == 1.0 and right.info["success"] == 1
    wrong = asyncio.run(go("<answer>8</answer>"))
    assert wrong.terminated and wrong.reward == 0.0 and wrong.info["success"] == 0
    none = asyncio.run(go("I give up"))
    assert none.terminated and none.reward == 0.0 and none.info["no_answer"] == 1


def test_max_turns_truncates_and_counters_accumulate() -> None:
    async def go() -> list[StepResult]:
        env = await _fresh(max_turns=3)
        return [await env.step(_call("nope")) for _ in range(3)]

    results = asyncio.run(go())
    assert [(r.terminated, r.truncated) for r in results] == [(False, False), (False, False), (False, True)]
    assert results[-1].info["tool_errors"] == 3 and results[-1].info["turns"] == 3
    assert results[-1].info["success"] == 0


def test_answer_on_the_last_turn_terminates_not_truncates() -> None:
    async def go() -> StepResult:
        env = await _fresh(max_turns=1)
        return await env.step(Message(role="assistant", content="<answer>7</answer>"))

    result = asyncio.run(go())
    assert result.terminated and not result.truncated


def test_on_text_setting_both_flags_is_normalised_to_terminated() -> None:
    class Both(Box):
        def on_text(self, message: Message) -> StepResult:
            return StepResult(reward=1.0, terminated=True, truncated=True, info={"success": 1})

    class Cut(Box):
        def on_text(self, message: Message) -> StepResult:
            return StepResult(truncated=True)

    async def go(env: Box) -> StepResult:
        await env.reset(env.tasks("train", 1)[0])
        return await env.step(Message(role="assistant", content="hi"))

    both = asyncio.run(go(Both()))
    assert (both.terminated, both.truncated) == (True, False)
    cut = asyncio.run(go(Cut()))
    assert (cut.terminated, cut.truncated, cut.info["success"]) == (False, True, 0)


def test_end_episode_from_a_tool_skips_later_calls() -> None:
    message = Message(
        role="assistant",
        tool_calls=(ToolCall(name="finish", id="a"), ToolCall(name="add", arguments={"a": 1, "b": 2}, id="b")),
    )

    async def go() -> StepResult:
        env = await _fresh()
        return await env.step(message)

    result = asyncio.run(go())
    assert result.terminated and result.reward == 1.0
    assert result.info["success"] == 1 and result.info["finished_by"] == "tool"
    assert [m.content for m in result.messages] == ["done", "Error: not run, the episode ended at an earlier call."]
    assert result.messages[1].tool_call_id == "b"


def test_step_misuse_raises_clearly() -> None:
    async def before_reset() -> None:
        await Box().step(_call("add", a=1, b=2))

    with pytest.raises(RuntimeError, match="before reset"):
        asyncio.run(before_reset())

    async def after_end() -> None:
        env = await _fresh()
        await env.step(Message(role="assistant", content="<answer>7</answer>"))
        await env.step(Message(role="assistant", content="<answer>7</answer>"))

    with pytest.raises(RuntimeError, match="after the episode ended"):
        asyncio.run(after_end())

    with pytest.raises(ValueError, match="max_turns"):
        Box(max_turns=0)


def test_reset_restarts_counters_without_super_call() -> None:
    async def go() -> StepResult:
        env = await _fresh(max_turns=2)
        await env.step(_call("nope"))
        await env.step(_call("nope"))  # truncated here
        await env.reset(env.tasks("train", 1)[0])
        return await env.step(_call("add", a=1, b=1))

    result = asyncio.run(go())
    assert result.info["turns"] == 1 and result.info["tool_errors"] == 0 and not result.truncated


def test_missing_score_answer_is_a_clear_error() -> None:
    class NoScore(Box):
        score_answer = ToolEnv.score_answer  # type: ignore[assignment]

    async def go() -> None:
        env = NoScore()
        await env.reset(env.tasks("train", 1)[0])
        await env.step(Message(role="assistant", content="<answer>1</answer>"))

    with pytest.raises(NotImplementedError, match="score_answer or on_text"):
        asyncio.run(go())
