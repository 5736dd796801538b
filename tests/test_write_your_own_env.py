"""The "Write your own environment" example in docs/environments.md is real: extracted, executed,
and held to the same check_env as the built-ins."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from tracegym.envs import list_envs, make, unregister
from tracegym.envs.check import check_env
from tracegym.envs.episode import run_episodes

DOC = Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def _example_code() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Write your own environment"):]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "no python block in the 'Write your own environment' section"
    return match.group(1)


@pytest.fixture()
def letter_count_env():
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(_example_code(), str(DOC), "exec"), namespace)
    yield namespace["LetterCountEnv"]
    unregister("letter_count")


def test_example_is_short() -> None:
    assert len(_example_code().splitlines()) < 40


def test_example_registers_and_passes_check_env(letter_count_env: type) -> None:
    assert "letter_count" in list_envs()
    report = check_env("letter_count", n_tasks=20)
    assert report.ok and report.expert_success_rate == 1.0
    schema = make("letter_count").tool_schemas()
    assert schema == [{
        "type": "function",
        "function": {
            "name": "count",
            "description": "Count how often `letter` occurs in `text`.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}, "letter": {"type": "string"}},
                "required": ["text", "letter"],
            },
        },
    }]


def test_example_expert_and_wrong_answers(letter_count_env: type) -> None:
    env = make("letter_count")
    tasks = env.tasks("test", 50, seed=3)
    results = asyncio.run(run_episodes(lambda: make("letter_count"), tasks, lambda e: e.expert_action))
    assert all(r.success and [m.role for m in r.messages].count("assistant") == 2 for r in results)
    expected = tasks[0].data["word"].count(tasks[0].data["letter"])
    assert results[0].messages[-1].content == f"<answer>{expected}</answer>"

    from tracegym.types import Message

    async def answer(text: str) -> float:
        await env.reset(tasks[0])
        return (await env.step(Message(role="assistant", content=text))).reward

    assert asyncio.run(answer(f"<answer>{expected}</answer>")) == 1.0
    assert asyncio.run(answer(f"<answer>{expected + 1}</answer>")) == 0.0
    assert asyncio.run(answer(str(expected))) == 0.0  # no answer tags, no reward
