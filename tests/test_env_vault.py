"""The ``vault`` memory probe: a building's code never changes, the keeper tells it only on some
train visits, so on a test visit only memory (``remember`` on a train visit, ``recall`` now) gives
the code; the expert with ``expert_memory`` shows that use, and test visits never read test writes."""

from __future__ import annotations

import asyncio

import pytest

from tracegym.envs import make
from tracegym.envs.check import check_env
from tracegym.environments.vault import vault_code
from tracegym.types import Message, ToolCall


def test_tasks_codes_and_the_keeper():
    env = make("vault", families=4, candidates=5)
    train, test = env.tasks("train", 12, seed=1), env.tasks("test", 8, seed=1)
    assert [t.data["keeper"] for t in train] == [True] * 4 + [True, False] * 4
    assert not any(t.data["keeper"] for t in test)
    for task in train + test:
        assert task.data["answer"] == vault_code(task.data["family"]) and task.data["answer"] in task.data["candidates"]
        assert len(set(task.data["candidates"])) == 5
    assert {t.data["family"] for t in test} == {t.data["family"] for t in train}  # the same buildings...
    assert [t.data["candidates"] for t in test[:4]] != [t.data["candidates"] for t in train[:4]]  # ...other decoys
    assert check_env("vault").ok
    with pytest.raises(ValueError, match="families"):
        make("vault", families=0)


def test_the_keeper_answers_only_at_the_desk_and_one_try_decides():
    env = make("vault")
    present, absent = env.tasks("train", 1)[0], env.tasks("test", 1)[0]

    async def play(task, *messages):
        await env.reset(task)
        return [await env.step(m) for m in messages]

    ask = Message(role="assistant", tool_calls=(ToolCall(name="ask_keeper", arguments={}, id="a"),))
    told = asyncio.run(play(present, ask))[0].messages[0].content
    assert present.data["answer"] in told
    assert asyncio.run(play(absent, ask))[0].messages[0].content == "Nobody is at the desk."
    wrong = next(c for c in absent.data["candidates"] if c != absent.data["answer"])
    (result,) = asyncio.run(play(absent, Message(role="assistant", content=f"<answer>{wrong}</answer>")))
    assert result.terminated and result.reward == 0.0
    (result,) = asyncio.run(play(absent, Message(role="assistant", content=f"<answer>{absent.data['answer']}</answer>")))
    assert result.terminated and result.reward == 1.0


def test_the_memory_expert_remembers_then_recalls_and_test_writes_stay_unread(tmp_path):
    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    options = {"families": 3, "expert_memory": True, "memory": {"store": str(tmp_path / "memory.jsonl")}}
    renderer = get_renderer("tiny-random", load_tokenizer("tiny-random"))
    config = RolloutConfig(samples_per_task=1, max_turns=4, max_context=None, concurrency=1)  # visits in order
    tasks = make("vault", families=3).tasks("train", 9)
    train = run_rollouts_sync("vault", tasks, "expert", renderer, config, env_options=options, progress=False)
    assert train.stats.success_rate == 1.0
    calls = [[c.name for m in t.messages if m.role == "assistant" for c in m.tool_calls] for t in train.trajectories]
    assert calls[:3] == [["ask_keeper", "remember"]] * 3  # first visits: the keeper, then a note
    recalled = [t for t in train.trajectories if any(m.name == "recall" for m in t.messages)]
    assert [t.task_id for t in recalled] == [t.id for t in tasks if not t.data["keeper"]]
    for trajectory in recalled:  # every later visit without the keeper finds the note of its building
        note = next(m.content for m in trajectory.messages if m.name == "recall")
        code = trajectory.messages[-1].content if trajectory.messages[-1].role == "assistant" else ""
        assert "Vault code of" in note and code.removeprefix("<answer>").removesuffix("</answer>") in note
    test = run_rollouts_sync("vault", make("vault", families=3).tasks("test", 3), "expert", renderer, config,
                             env_options=options, progress=False)
    notes = [next(m.content for m in t.messages if m.name == "recall") for t in test.trajectories]
    assert all("Vault code of" in n for n in notes)
    # a test visit that writes a note: the next test visit does not read it
    from tracegym.envs.memory import memory_store

    store = memory_store(str(tmp_path / "memory.jsonl"))
    store.add("Vault code of Amber Hall: 0000", "vault/Amber Hall", "test", "vault-test-0-0")
    assert not any("0000" in text for text in store.search("vault code of Amber Hall", "vault/Amber Hall", ("train",), 5))
