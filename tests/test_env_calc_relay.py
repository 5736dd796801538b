"""The calc_relay team env: calculator tasks split between a planner (sees the problem, no tools) and
a solver (calculator, answers, does not see the problem); the expert team; errors and limits."""

from __future__ import annotations

import asyncio

import pytest

from tracegym.envs import make
from tracegym.envs.episode import message_policy
from tracegym.envs.team import TeamStep, is_team_env, play_team_episode
from tracegym.environments.calc_relay import CalcRelayEnv, describe_chain
from tracegym.environments.calculator import CalculatorEnv
from tracegym.types import Message, ToolCall


def _expert_policies(env):
    return {r: message_policy((lambda r=r: env.expert_action(r))) for r in env.roles}


def _play_expert(task, **options):
    return asyncio.run(play_team_episode(lambda: make("calc_relay", **options), task, _expert_policies))


def _call(expression: str, call_id: str = "c") -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name="calculate", arguments={"expression": expression}, id=call_id),))


def _say(text: str) -> Message:
    return Message(role="assistant", content=text)


async def _started(**options) -> tuple[CalcRelayEnv, dict]:
    env = CalcRelayEnv(**options)
    task = env.tasks("train", 1)[0]
    views = await env.reset(task)
    return env, {"task": task, "views": views}


def test_make_and_roles() -> None:
    env = make("calc_relay")
    assert isinstance(env, CalcRelayEnv) and is_team_env(env)
    assert env.roles == ("planner", "solver")
    assert env.tool_schemas("planner") == []
    assert [s["function"]["name"] for s in env.tool_schemas("solver")] == ["calculate"]
    assert (env.min_calls, env.max_calls, env.planner_turns, env.max_turns) == (1, 1, 1, 4)  # num_calls + 3
    assert make("calc_relay", num_calls="2..4").max_turns == 7
    assert make("calc_relay", num_calls=2, planner_turns=2).max_turns == 6
    for bad in ({"num_calls": 0}, {"planner_turns": 0}, {"max_turns": 0}, {"test_fraction": 1.0}):
        with pytest.raises(ValueError):
            make("calc_relay", **bad)


@pytest.mark.parametrize("options", [{}, {"num_calls": "1..4"}, {"num_calls": 3, "test_fraction": 0.5}])
def test_tasks_are_the_calculators(options: dict) -> None:
    relay = CalcRelayEnv(**options)
    calc = CalculatorEnv(**{"num_calls": 1, **options})
    for split in ("train", "test"):
        assert relay.tasks(split, 30, seed=3) == calc.tasks(split, 30, seed=3)


def test_tasks_deterministic_and_splits_disjoint() -> None:
    env = CalcRelayEnv(num_calls="1..3")
    train, test = env.tasks("train", 100, seed=0), env.tasks("test", 50, seed=0)
    assert train == CalcRelayEnv(num_calls="1..3").tasks("train", 100, seed=0)
    assert train != env.tasks("train", 100, seed=1)
    assert len({t.id for t in train}) == 100 and all(t.split == "train" for t in train)
    assert all(t.split == "test" for t in test)
    assert not {t.id for t in train} & {t.id for t in test}
    assert not {t.data["question"] for t in train} & {t.data["question"] for t in test}


def test_describe_chain() -> None:
    assert describe_chain(["37 * 24", "{x} - 129", "{x} // 5", "{x} % 7", "{x} + 300", "{x} * 3"]) == (
        "Compute 37 * 24. Then subtract 129 from the result (result - 129). Then divide the result by 5, keeping only "
        "the whole part (result // 5). Then take the remainder of the result divided by 7 (result % 7). Then add 300 "
        "to the result (result + 300). Then multiply the result by 3 (result * 3). Give the final result as your answer."
    )
    assert describe_chain(["2 * 3", "({x} + 1) * 2"]) == "Compute 2 * 3. Then compute (the result + 1) * 2. Give the final result as your answer."
    with pytest.raises(ValueError):
        describe_chain([])


@pytest.mark.parametrize("options", [{"num_calls": "1..4"}, {"num_calls": 2, "planner_turns": 2}])
def test_expert_team_solves_the_tasks(options: dict) -> None:
    tasks = CalcRelayEnv(**options).tasks("test", 40, seed=0)
    rewards = []
    for task in tasks:
        trajectories = _play_expert(task, **options)
        assert [t.policy for t in trajectories] == ["planner", "solver"]
        assert len({t.info["episode_id"] for t in trajectories}) == 1
        assert all(t.end_reason == "terminated" for t in trajectories)
        assert trajectories[0].reward == trajectories[1].reward
        assert trajectories[1].metrics["tool_calls"] == task.data["num_calls"]
        rewards.append(trajectories[1].reward)
    assert sum(rewards) / len(rewards) == 1.0  # the brief asks for >= 0.95; the scripted team never fails


def test_roles_see_only_their_part() -> None:
    task = CalcRelayEnv(num_calls=3).tasks("train", 1)[0]
    planner, solver = _play_expert(task, num_calls=3)
    question = task.data["question"]
    # The planner reads the problem and has no tools; the solver never sees the problem text.
    assert question in planner.messages[1].content and planner.tools == ()
    assert all(question not in m.content for m in solver.messages)
    first_sentence = question.split(". ")[0]
    assert all(first_sentence not in m.content for m in solver.messages)
    assert [s["function"]["name"] for s in solver.tools] == ["calculate"]
    # The planner's words reach the solver as a user message; the solver's tool results stay with it.
    assert solver.messages[1] == Message(role="user", content=f"Planner: {describe_chain(task.data['templates'])}")
    assert not any(m.role == "tool" for m in planner.messages)
    assert sum(m.role == "tool" for m in solver.messages) == 3
    assert solver.messages[-1].content == f"<answer>{task.data['answer']}</answer>"
    assert planner.info["role"] == "planner" and solver.info["role"] == "solver"
    assert planner.success and solver.success and planner.metrics["success"] == 1.0


def test_initial_views() -> None:
    async def go():
        env, s = await _started(num_calls=2)
        return env, s

    env, s = asyncio.run(go())
    views = s["views"]
    assert set(views) == {"planner", "solver"}
    assert [m.role for m in views["planner"]] == ["system", "user"]
    assert views["planner"][1].content == f"Problem: {s['task'].data['question']}"
    assert [m.role for m in views["solver"]] == ["system"]
    assert s["task"].data["question"] not in views["solver"][0].content
    assert env.next_role() == "planner"


def test_wrong_answer_scores_zero_and_no_answer_ends() -> None:
    async def go(final: str) -> TeamStep:
        env, s = await _started()
        await env.step("planner", _say("Compute it."))
        assert env.next_role() == "solver"
        return await env.step("solver", _say(final.format(answer=s["task"].data["answer"])))

    wrong = asyncio.run(go("<answer>{answer}1</answer>"))
    assert wrong.terminated and wrong.reward == 0.0 and wrong.info["success"] == 0
    silent = asyncio.run(go("I think it is {answer}."))  # no answer tags: ends unanswered
    assert silent.terminated and silent.reward == 0.0 and silent.info["no_answer"] == 1
    right = asyncio.run(go("<answer>{answer:,}</answer>"))  # scored like the calculator: "1,234" counts
    assert right.terminated and right.reward == 1.0 and right.info["success"] == 1


def test_bad_expression_is_an_error_and_the_episode_goes_on() -> None:
    async def go() -> list[TeamStep]:
        env, s = await _started(max_turns=10)  # room for the mistakes
        steps = [await env.step("planner", _say("Compute 2 * 3."))]
        steps.append(await env.step("solver", _call("1/0", "a")))
        steps.append(await env.step("solver", Message(role="assistant"), ("bad JSON in tool call",)))
        steps.append(await env.step("solver", _call("2 * 3", "b")))
        assert env.next_role() == "solver"
        steps.append(await env.step("solver", _say(f"<answer>{s['task'].data['answer']}</answer>")))
        assert env.next_role() is None
        return steps

    plan, error, parse, ok, final = asyncio.run(go())
    assert plan.views == {"solver": (Message(role="user", content="Planner: Compute 2 * 3."),)} and plan.reward == 0.0
    assert error.views["solver"][0].content == "Error: tool 'calculate' failed: ZeroDivisionError: division by zero"
    assert not error.terminated and not error.truncated and set(error.views) == {"solver"}
    assert parse.views["solver"] == (Message(role="tool", content="Error: bad JSON in tool call"),) and not parse.terminated
    assert ok.views["solver"][0].content == "6" and not ok.terminated
    assert final.terminated and final.reward == 1.0
    assert (final.info["tool_calls"], final.info["tool_errors"], final.info["parse_errors"]) == (2, 1, 1)
    assert (final.info["turns"], final.info["solver_turns"], final.info["planner_turns"]) == (5, 4, 1)


def test_planner_tool_calls_are_refused_but_its_text_is_passed_on() -> None:
    async def go() -> TeamStep:
        env, _ = await _started()
        msg = Message(role="assistant", content="Multiply 3 by 4.",
                      tool_calls=(ToolCall(name="calculate", arguments={"expression": "3*4"}, id="p"),))
        return await env.step("planner", msg)

    step = asyncio.run(go())
    assert step.views["solver"] == (Message(role="user", content="Planner: Multiply 3 by 4."),)
    assert step.views["planner"][0].role == "tool" and step.views["planner"][0].content.startswith("Error: the planner has no tools")
    assert step.info["planner_tool_calls"] == 1 and step.info["tool_calls"] == 0


def test_planner_turns_and_turn_order() -> None:
    async def go() -> None:
        env, _ = await _started(planner_turns=2)
        first = await env.step("planner", _say("Step one."))
        assert first.views["planner"][0].role == "user" and "1 more message" in first.views["planner"][0].content
        assert env.next_role() == "planner"
        with pytest.raises(ValueError, match="planner"):
            await env.step("solver", _say("<answer>1</answer>"))
        second = await env.step("planner", _say("Step two."))
        assert "planner" not in second.views and second.views["solver"][0].content == "Planner: Step two."
        assert env.next_role() == "solver"

    asyncio.run(go())


def test_max_turns_truncates() -> None:
    async def go() -> list[TeamStep]:
        env, _ = await _started(max_turns=3)
        steps = [await env.step("planner", _say("Go."))]
        steps.append(await env.step("solver", _call("1 + 1")))
        steps.append(await env.step("solver", _call("2 + 2")))
        assert env.next_role() is None
        with pytest.raises(RuntimeError):
            await env.step("solver", _call("3 + 3"))
        return steps

    steps = asyncio.run(go())
    assert not steps[1].truncated
    assert steps[2].truncated and not steps[2].terminated and steps[2].reward == 0.0 and steps[2].info["success"] == 0


def test_step_before_reset_raises() -> None:
    env = CalcRelayEnv()
    assert env.next_role() is None
    with pytest.raises(RuntimeError):
        asyncio.run(env.step("planner", _say("hi")))
    with pytest.raises(RuntimeError):
        env.expert_action("planner")
