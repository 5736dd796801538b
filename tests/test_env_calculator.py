"""The calculator env: safe evaluator, generated problems (checked by replaying their chains),
answer scoring, check_env, and the expert's solve rate."""

from __future__ import annotations

import asyncio
import random

import pytest

from tracegym.envs import make
from tracegym.environments.calculator import CalculatorEnv, evaluate_expression, format_number, generate_problem, parse_number
from tracegym.envs.check import check_env
from tracegym.envs.episode import run_episodes
from tracegym.types import Message, ToolCall


@pytest.mark.parametrize(
    "expression, value",
    [
        ("37 * 24 - 129", 759),
        ("(37 * 24 - 129) % 5", 4),
        ("888 // 5", 177),
        ("7 / 2", 3.5),
        ("-3 + +4", 1),
        ("2 ** 10", 1024),
        ("1.5 * 4", 6.0),
        ("12,345 + 1", 12346),
        ("6 × 7 ÷ 2", 21.0),
        ("2 ^ 3", 8),
    ],
)
def test_evaluator_values(expression: str, value: float) -> None:
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize(
    "expression, error",
    [
        ("__import__('os').system('ls')", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("(1).real", "unsupported syntax"),
        ("True + 1", "unsupported syntax"),
        ("9 ** 9 ** 9", "power too large"),
        ("10 ** 31", "power too large"),
        ("1" * 201, "longer than 200"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("3 +", "cannot parse"),
        ("", "empty expression"),
        ("(-8) ** 0.5", "not a real number"),
    ],
)
def test_evaluator_refuses(expression: str, error: str) -> None:
    with pytest.raises((ValueError, ZeroDivisionError), match=error):
        evaluate_expression(expression)


def test_number_formatting_and_parsing() -> None:
    assert format_number(12.0) == "12" and format_number(3.5) == "3.5" and format_number(7) == "7"
    assert format_number(1 / 3) == "0.333333333333"
    assert parse_number("1,234") == 1234 and parse_number("$56") == 56 and parse_number("9 pens") == 9
    assert parse_number("-2.5") == -2.5
    assert parse_number("no idea") is None and parse_number("3 or 4") is None


@pytest.mark.parametrize("num_calls", [1, 2, 3, 5, 8])
def test_problems_replay_to_their_answer(num_calls: int) -> None:
    rng = random.Random(num_calls)
    for _ in range(50):
        problem = generate_problem(rng, num_calls)
        calls = problem["reference_calls"]
        assert len(calls) == len(problem["templates"]) == num_calls
        # Replay the chain with the evaluator: each call's result feeds the next template.
        value = None
        for template, call in zip(problem["templates"], calls):
            expression = template.replace("{x}", format_number(value)) if value is not None else template
            assert expression == call["arguments"]["expression"]
            value = evaluate_expression(expression)
            assert value >= 0 and value == int(value)
        assert value == problem["answer"]
        first = problem["templates"][0].split(" * ")
        assert len(first) == 2 and all(12 <= int(x) <= 99 for x in first)  # a 2-digit x 2-digit product


def test_example_problem_is_stable() -> None:
    # Golden: the generator is part of the dataset definition; a change here changes every split.
    task = CalculatorEnv(num_calls=3).tasks("test", 1, seed=0)[0]
    assert task.id == "calc-019169e064ff" and task.split == "test"
    assert task.data["question"] == (
        "A factory makes 15 crates of 51 bolts each. It packs the bolts into packs of 36, keeping only full "
        "packs. It sells every one of the packs for 46 dollars. How many dollars are there now?"
    )
    # By hand: 15 * 51 = 765; 765 // 36 = 21 (21 * 36 = 756); 21 * 46 = 966.
    assert task.data["answer"] == 966
    assert [c["arguments"]["expression"] for c in task.data["reference_calls"]] == ["15 * 51", "765 // 36", "21 * 46"]
    replay = CalculatorEnv(num_calls=3).tasks("test", 1, seed=0)[0]
    assert replay == task


def test_num_calls_option() -> None:
    assert (CalculatorEnv(num_calls=3).min_calls, CalculatorEnv(num_calls=3).max_calls) == (3, 3)
    env = CalculatorEnv(num_calls="2..5")
    assert (env.min_calls, env.max_calls, env.max_turns) == (2, 5, 9)
    counts = {t.data["num_calls"] for t in env.tasks("train", 200)}
    assert counts == {2, 3, 4, 5}
    assert CalculatorEnv(num_calls=[1, 2]).max_calls == 2
    for bad in (0, "x", (3, 1), (1, 2, 3), 13, True):
        with pytest.raises(ValueError):
            CalculatorEnv(num_calls=bad)  # type: ignore[arg-type]


def test_scoring_and_tool_errors() -> None:
    async def go() -> list:
        env = CalculatorEnv(num_calls=1)
        task = env.tasks("train", 1)[0]
        await env.reset(task)
        out = []
        out.append(await env.step(Message(role="assistant", tool_calls=(ToolCall(name="calculate", arguments={"expression": "1/0"}, id="a"),))))
        out.append(await env.step(Message(role="assistant", tool_calls=(ToolCall(name="calculate", arguments={"expression": "2*3"}, id="b"),))))
        out.append(await env.step(Message(role="assistant", content=f"<answer>{task.data['answer']:,}</answer>")))
        return out

    error, ok, final = asyncio.run(go())
    assert error.messages[0].content == "Error: tool 'calculate' failed: ZeroDivisionError: division by zero"
    assert ok.messages[0].content == "6"
    assert final.terminated and final.reward == 1.0 and final.info["success"] == 1
    assert final.info["tool_calls"] == 2 and final.info["tool_errors"] == 1


def test_wrong_answer_scores_zero() -> None:
    async def go() -> float:
        env = CalculatorEnv()
        task = env.tasks("train", 1)[0]
        await env.reset(task)
        return (await env.step(Message(role="assistant", content=f"<answer>{task.data['answer'] + 1}</answer>"))).reward

    assert asyncio.run(go()) == 0.0


def test_check_env_passes() -> None:
    report = check_env("calculator", n_tasks=30)
    assert report.ok and report.expert_success_rate == 1.0
    assert check_env(lambda: make("calculator", num_calls=6), n_tasks=10).ok


def test_expert_solves_200_test_tasks() -> None:
    env = make("calculator")
    tasks = env.tasks("test", 200, seed=0)
    results = asyncio.run(run_episodes(lambda: make("calculator"), tasks, lambda e: e.expert_action))
    solved = sum(r.success for r in results)
    assert solved >= 190, solved
    # The expert's calls are exactly the reference calls.
    for task, result in zip(tasks[:20], results[:20]):
        made = [{"name": c.name, "arguments": c.arguments} for m in result.messages if m.role == "assistant" for c in m.tool_calls]
        assert made == task.data["reference_calls"]
        assert sum(m.role == "assistant" for m in result.messages) == task.data["num_calls"] + 1
