"""The ``memory`` env option (``tracegym.envs.memory``): ``remember``/``recall`` across episodes,
scoped per env or task family, persisted, and never leaking what test episodes wrote."""

from __future__ import annotations

import asyncio
import json

import pytest

from tracegym.envs import make
from tracegym.envs.registry import EnvOptionError, check_env_options
from tracegym.types import Message, ToolCall


def _calls(*calls: tuple[str, dict]) -> Message:
    return Message(role="assistant", tool_calls=tuple(ToolCall(name=n, arguments=a, id=f"c{i}") for i, (n, a) in enumerate(calls)))


def _play(env, task, *messages: Message):
    async def go():
        first = await env.reset(task)
        return first, [await env.step(m) for m in messages]
    return asyncio.run(go())


def test_notes_carry_across_episodes_in_call_order_and_persist(tmp_path):
    store = tmp_path / "memory.jsonl"
    env = make("calculator", num_calls=1, memory={"store": str(store), "scope": "env"})
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["calculate", "remember", "recall"]
    first, task2 = env.tasks("train", 2)
    opening, (wrote,) = _play(env, first, _calls(("remember", {"text": "Multiply before you subtract; 37 * 24 = 888."})))
    assert "remember(text)" in opening[0].content and wrote.messages[0].content == "Remembered." and not wrote.terminated
    # a mixed turn: the env's tool and the memory, each answered in the order of the calls
    _, (mixed,) = _play(env, task2, _calls(("calculate", {"expression": "2 + 2"}), ("recall", {"query": "subtract multiply"})))
    assert [m.name for m in mixed.messages] == ["calculate", "recall"]
    assert mixed.messages[0].content.strip().startswith("4") and "37 * 24 = 888" in mixed.messages[1].content
    assert mixed.info["memory/recalled"] == 1
    # the file holds the note; a new process-level store (a resumed run) reads it back
    assert [json.loads(line)["text"] for line in store.read_text().splitlines()] == ["Multiply before you subtract; 37 * 24 = 888."]
    from tracegym.envs.memory import MemoryStore

    assert MemoryStore(store).search("subtract", "calculator", ["train"], 3) == ["Multiply before you subtract; 37 * 24 = 888."]
    # the inner env still ends the episode on a final answer
    _, (done,) = _play(env, task2, Message(role="assistant", content="<answer>1</answer>"))
    assert done.terminated


def test_test_episodes_never_read_what_test_episodes_wrote(tmp_path):
    options = {"store": str(tmp_path / "m.jsonl"), "scope": "env"}
    env = make("calculator", num_calls=1, memory=options)
    train, test = env.tasks("train", 1)[0], env.tasks("test", 2)
    _play(env, train, _calls(("remember", {"text": "train note about apples"})))
    _play(env, test[0], _calls(("remember", {"text": "test answer is 42 apples"})))
    _, (seen,) = _play(env, test[1], _calls(("recall", {"query": "apples"})))
    assert "train note" in seen.messages[0].content and "42" not in seen.messages[0].content
    _, (in_training,) = _play(env, train, _calls(("recall", {"query": "apples answer"})))
    assert "42" not in in_training.messages[0].content
    reading = make("calculator", num_calls=1, memory={**options, "read_test_writes": True})
    _, (learned,) = _play(reading, test[1], _calls(("recall", {"query": "apples answer"})))
    assert "test answer is 42" in learned.messages[0].content


def test_scope_family_keeps_families_apart_and_bad_options_are_one_line(tmp_path):
    from tracegym.envs.memory import MemoryStore

    store = MemoryStore(None)
    store.add("shop note", "web/shop", "train", "t1")
    store.add("booking note", "web/booking", "train", "t2")
    assert store.search("note", "web/shop", ["train"], 3) == ["shop note"]
    assert store.search("zzz-unknown", "web/booking", ["train"], 3) == ["booking note"]  # no word known: newest
    with pytest.raises(EnvOptionError, match="option 'memory': top_k"):
        make("calculator", memory={"top_k": 0})
    with pytest.raises(EnvOptionError, match="option 'memory': scop"):
        check_env_options("calculator", {"memory": {"scop": "env"}})
    check_env_options("calculator", {"memory": {"store": "x.jsonl"}, "num_calls": 2})
    env = make("calculator", memory=True)
    _, (bad,) = _play(env, env.tasks("train", 1)[0], _calls(("remember", {"note": "x"})))
    assert bad.messages[0].content.startswith("Error: remember takes one argument, 'text'")
    with pytest.raises(Exception, match="cannot branch: its memory store is shared"):
        env.snapshot()
