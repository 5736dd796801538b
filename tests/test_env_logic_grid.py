"""The logic-grid envs: generated puzzles checked by an independent brute force (one solution with
all clues, the answer open to either role alone), the views each role gets, the team episode loop
with the expert team, every step rule of the team env, and the single-agent baseline."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from tracegym.envs import make
from tracegym.envs.check import check_env
from tracegym.envs.episode import message_policy, run_episodes
from tracegym.envs.team import TeamEnv, TeamStep, play_team_episode
from tracegym.environments.logic_grid import LogicGridEnv, LogicGridSoloEnv, normalize_answer
from tracegym.types import Message, ToolCall

# --- an independent model of the puzzle -----------------------------------------------------------


def _assignments(data: dict[str, Any]):
    """Every assignment as {category: {value: house (1-based)}}, by plain permutations."""
    values = data["values"]
    cats = list(values)
    n = data["houses"]
    for perms in itertools.product(*(itertools.permutations(range(1, n + 1)) for _ in cats)):
        yield {c: dict(zip(values[c], p)) for c, p in zip(cats, perms)}


def _holds(clue: dict[str, Any], world: dict[str, dict[str, int]]) -> bool:
    x = world[clue["x"][0]][clue["x"][1]]
    kind = clue["kind"]
    if kind == "at":
        return x == clue["house"]
    if kind == "not_at":
        return x != clue["house"]
    y = world[clue["y"][0]][clue["y"][1]]
    if kind == "same":
        return x == y
    if kind == "left":
        return x + 1 == y
    assert kind == "next", kind
    return abs(x - y) == 1


def _answer_in(data: dict[str, Any], world: dict[str, dict[str, int]]) -> str:
    given_cat, given_value = data["question_given"]
    house = world[given_cat][given_value]
    return next(v for v, h in world[data["question_asked"]].items() if h == house)


def _brute_force(data: dict[str, Any]) -> tuple[list[dict], dict[str, set[str]], list[int]]:
    """(worlds fitting all clues, {role: answers possible under that role's clues alone},
    [for each clue: how many worlds fit all the other clues])."""
    clues = data["clues"]
    fitting, answers, without = [], {"alice": set(), "bob": set()}, [0] * len(clues)
    for world in _assignments(data):
        truth = [_holds(c, world) for c in clues]
        for role in answers:
            if all(t for t, c in zip(truth, clues) if c["role"] == role):
                answers[role].add(_answer_in(data, world))
        false = [i for i, t in enumerate(truth) if not t]
        if not false:
            fitting.append(world)
            without = [k + 1 for k in without]
        elif len(false) == 1:
            without[false[0]] += 1
    return fitting, answers, without


# --- tasks ----------------------------------------------------------------------------------------


def test_tasks_deterministic_and_splits_disjoint() -> None:
    env = LogicGridEnv()
    train = env.tasks("train", 30, seed=0)
    assert [t.model_dump() for t in train] == [t.model_dump() for t in LogicGridEnv().tasks("train", 30, seed=0)]
    assert [t.id for t in env.tasks("train", 30, seed=1)] != [t.id for t in train]
    test = env.tasks("test", 30, seed=0)
    assert len({t.id for t in train}) == 30 and len({t.id for t in test}) == 30
    assert not {t.id for t in train} & {t.id for t in test}
    assert not {t.data["question"] + str(t.data["clues"]) for t in train} & {t.data["question"] + str(t.data["clues"]) for t in test}
    assert all(t.split == "train" for t in train) and all(t.split == "test" for t in test)
    # The solo env draws the very same tasks.
    assert [t.model_dump() for t in LogicGridSoloEnv().tasks("test", 30, seed=0)] == [t.model_dump() for t in test]


@pytest.mark.parametrize("houses, n", [(3, 40), (4, 15)])
def test_each_puzzle_has_one_solution_and_needs_both_roles(houses: int, n: int) -> None:
    for task in LogicGridEnv(houses=houses).tasks("test", n, seed=3):
        data = task.data
        assert data["houses"] == houses and {c["role"] for c in data["clues"]} == {"alice", "bob"}
        fitting, answers, without = _brute_force(data)
        assert len(fitting) == 1, task.id
        solution = fitting[0]
        for cat, row in data["solution"].items():  # the stored solution is that world
            assert [solution[cat][v] for v in row] == list(range(1, houses + 1))
        assert _answer_in(data, solution) == data["answer"]
        assert len(answers["alice"]) >= 2 and len(answers["bob"]) >= 2, (task.id, answers)
        assert data["answer"] in answers["alice"] and data["answer"] in answers["bob"]
        # No clue is implied by the others (minimal): dropping any one leaves several solutions.
        assert all(count > 1 for count in without), (task.id, without)


def test_generation_is_fast() -> None:
    import time

    started = time.perf_counter()
    LogicGridEnv(houses=4).tasks("train", 100, seed=11)
    LogicGridEnv(houses=(3, 4)).tasks("train", 100, seed=11)
    assert time.perf_counter() - started < 2.0


# --- views ----------------------------------------------------------------------------------------


def test_golden_views_hold_only_own_clues() -> None:
    env = LogicGridEnv()
    task = env.tasks("test", 1, seed=0)[0]
    views = asyncio.run(env.reset(task))
    assert set(views) == {"alice", "bob"}
    for role, partner in (("alice", "bob"), ("bob", "alice")):
        system, user = views[role]
        assert system.role == "system" and user.role == "user"
        assert f"You are {role.title()}" in system.content and "`answer`" in system.content
        mine, theirs = task.data["role_clues"][role], task.data["role_clues"][partner]
        assert mine and theirs and not set(mine) & set(theirs)
        assert all(c in user.content for c in mine)
        assert not any(c in user.content for c in theirs)
        assert task.data["question"] in user.content and task.data["answer"] not in (mine + theirs)
    # Golden: the exact layout of Alice's first user message.
    d = task.data
    expected = (d["preamble"] + "\n\nYour clues (Bob has the others):\n"
                + "\n".join(f"{i}. {c}" for i, c in enumerate(d["role_clues"]["alice"], 1))
                + f"\n\nQuestion: {d['question']}")
    assert views["alice"][1].content == expected
    assert [s["function"]["name"] for s in env.tool_schemas("alice")] == ["answer"] == \
        [s["function"]["name"] for s in env.tool_schemas("bob")]


# --- the team episode loop ------------------------------------------------------------------------


def _expert_policies(env: TeamEnv) -> dict[str, Any]:
    return {r: message_policy((lambda r=r: env.expert_action(r))) for r in env.roles}


def test_expert_team_solves_through_play_team_episode() -> None:
    tasks = LogicGridEnv(houses=(3, 4)).tasks("test", 40, seed=0)

    async def play_all() -> list[list[Any]]:
        return [await play_team_episode(lambda: make("logic_grid", houses=(3, 4)), t, _expert_policies,
                                        sample_index=0, timeout_s=10) for t in tasks]

    episodes = asyncio.run(play_all())
    solved = 0
    for task, trajectories in zip(tasks, episodes):
        assert [t.policy for t in trajectories] == ["alice", "bob"]
        assert len({t.info["episode_id"] for t in trajectories}) == 1
        for t in trajectories:
            assert t.end_reason == "terminated" and t.error is None and t.task_id == task.id
            assert t.reward == 1.0 and t.success
            assert t.info["team_turns"] == 2 and t.info["role_turns"] == 1
        solved += all(t.success for t in trajectories)
        alice, bob = trajectories
        # Bob's conversation: his view, Alice's shared clues as a user message, then his answer.
        told = [m.content for m in bob.messages if m.role == "user"]
        assert told[-1].startswith("Alice says: Here are all my clues:")
        assert bob.messages[-2].tool_calls[0].name == "answer"
        assert bob.messages[-1].role == "tool" and bob.messages[-1].content.startswith("Correct")
        # Alice never saw Bob's clues before the end; she is told the outcome.
        assert not any(c in m.content for m in alice.messages[:2] for c in task.data["role_clues"]["bob"])
        assert alice.messages[-1].content.startswith("Bob answered")
    assert solved / len(tasks) >= 0.95


# --- step rules -----------------------------------------------------------------------------------


def _say(text: str) -> Message:
    return Message(role="assistant", content=text)


def _answer(value: Any, name: str = "answer", key: str = "value", content: str = "") -> Message:
    return Message(role="assistant", content=content, tool_calls=(ToolCall(name=name, arguments={key: value}, id="c1"),))


async def _fresh(**options: Any) -> tuple[LogicGridEnv, Any]:
    env = LogicGridEnv(**options)
    task = env.tasks("test", 3, seed=5)[1]
    await env.reset(task)
    return env, task


def test_text_goes_to_partner_and_turns_alternate() -> None:
    async def run() -> None:
        env, _ = await _fresh()
        assert env.next_role() == "alice"
        step = await env.step("alice", _say("  I have two clues. "))
        assert step.views == {"bob": (Message(role="user", content="Alice says: I have two clues."),)}
        assert step.reward == 0 and not step.terminated and not step.truncated and step.info["messages_exchanged"] == 1
        assert env.next_role() == "bob"
        step = await env.step("bob", _say(""))
        assert step.views == {"alice": (Message(role="user", content="Bob says: (said nothing)"),)}
        assert env.next_role() == "alice"
        with pytest.raises(ValueError):
            await env.step("bob", _say("out of turn"))

    asyncio.run(run())


@pytest.mark.parametrize("given, reward", [("{answer}", 1.0), (" The {ANSWER}! ", 1.0), ("nobody", 0.0)])
def test_answer_scoring_ends_the_episode(given: str, reward: float) -> None:
    async def run() -> None:
        env, task = await _fresh()
        await env.step("alice", _say("hi"))
        value = given.format(answer=task.data["answer"], ANSWER=task.data["answer"].upper())
        step = await env.step("bob", _answer(value))
        assert step.terminated and not step.truncated and step.reward == reward
        assert step.info["success"] == int(reward) and step.info["messages_exchanged"] == 2
        (result,) = step.views["bob"]
        assert result.role == "tool" and result.tool_call_id == "c1"
        assert result.content.startswith("Correct" if reward else "Wrong")
        assert step.views["alice"][0].content.startswith("Bob answered")
        assert env.next_role() is None
        with pytest.raises(RuntimeError):
            await env.step("alice", _say("more"))

    asyncio.run(run())


def test_wrong_answer_scores_zero_in_a_full_episode() -> None:
    env = LogicGridEnv()
    task = env.tasks("test", 1, seed=0)[0]
    wrong = next(v for v in task.data["values"][task.data["question_asked"]] if v != task.data["answer"])
    policies = lambda e: {"alice": message_policy(lambda: _answer(wrong)), "bob": message_policy(lambda: _say("?"))}
    trajectories = asyncio.run(play_team_episode(LogicGridEnv, task, policies))
    assert [t.policy for t in trajectories] == ["alice", "bob"]
    assert all(t.reward == 0.0 and not t.success and t.end_reason == "terminated" for t in trajectories)


def test_max_messages_truncates() -> None:
    async def run() -> None:
        env, _ = await _fresh(max_messages=3)
        for i, role in enumerate(["alice", "bob", "alice"], 1):
            step = await env.step(role, _say(f"message {i}"))
        assert step.truncated and not step.terminated and step.reward == 0 and step.info["success"] == 0
        assert env.next_role() is None

    asyncio.run(run())
    chatty = lambda e: {r: message_policy(lambda: _say("thinking...")) for r in e.roles}
    task = LogicGridEnv().tasks("train", 1, seed=0)[0]
    trajectories = asyncio.run(play_team_episode(LogicGridEnv, task, chatty))  # max_messages=6 by default
    assert all(t.end_reason == "truncated" and t.reward == 0 and t.info["team_turns"] == 6 for t in trajectories)


def test_bad_tool_calls_and_parse_errors_go_to_the_actor() -> None:
    async def run() -> None:
        env, task = await _fresh()
        step = await env.step("alice", _answer("x", name="shout", content="my clue is..."))
        assert not step.terminated and not step.truncated
        assert step.views["alice"][0].content == "Error: unknown tool 'shout'. Available tools: answer."
        assert step.views["bob"][0].content == "Alice says: my clue is..."  # her words still reach Bob
        step = await env.step("bob", _answer(3))
        assert step.views["alice"][0].content == "Bob says: (said nothing)"
        assert step.views["bob"][0].content.startswith("Error: invalid arguments for tool 'answer'")
        step = await env.step("alice", _answer("x", key="guess"))
        assert "unknown argument 'guess'" in step.views["alice"][0].content and not step.terminated
        # A malformed call: the error to the actor, the turn passes on.
        step = await env.step("bob", _say("hm"), parse_errors=("invalid JSON in tool call",))
        assert step.views["bob"] == (Message(role="tool", content="Error: invalid JSON in tool call"),)
        assert step.views["alice"][0].content == "Bob says: hm" and env.next_role() == "alice"
        assert step.info["parse_errors"] == 1 and not step.terminated
        # The episode still ends normally afterwards; a second call in the same message is not run.
        two = Message(role="assistant", tool_calls=(ToolCall(name="answer", arguments={"value": task.data["answer"]}, id="a"),
                                                    ToolCall(name="answer", arguments={"value": "other"}, id="b")))
        step = await env.step("alice", two)
        assert step.terminated and step.reward == 1.0
        assert step.views["alice"][1].content == "Error: not run, the episode ended at an earlier call."

    asyncio.run(run())


def test_expert_shares_then_answers() -> None:
    async def run() -> None:
        env, task = await _fresh()
        first = env.expert_action("alice")
        assert not first.tool_calls and all(c in first.content for c in task.data["role_clues"]["alice"])
        await env.step("alice", first)
        second = env.expert_action("bob")
        assert second.tool_calls[0].arguments == {"value": task.data["answer"]}

    asyncio.run(run())


# --- the single-agent baseline --------------------------------------------------------------------


def test_solo_env_sees_all_clues_and_expert_solves() -> None:
    env = LogicGridSoloEnv(houses=(3, 4))
    task = env.tasks("test", 1, seed=0)[0]
    system, user = asyncio.run(env.reset(task))
    assert all(c["text"] in user.content for c in task.data["clues"]) and task.data["question"] in user.content
    tasks = env.tasks("test", 40, seed=0)
    results = asyncio.run(run_episodes(lambda: LogicGridSoloEnv(houses=(3, 4)), tasks,
                                       lambda e: e.expert_action))
    assert sum(r.success for r in results) / len(results) >= 0.95
    assert all(r.reward == 1.0 and len(r.messages) == 4 for r in results)


def test_solo_wrong_answer_and_text_turns() -> None:
    async def run() -> None:
        env = LogicGridSoloEnv()
        task = env.tasks("test", 1, seed=0)[0]
        await env.reset(task)
        step = await env.step(_say("Let me think."))
        assert not step.terminated and not step.truncated and "`answer` tool" in step.messages[0].content
        step = await env.step(_answer("nobody"))
        assert step.terminated and step.reward == 0.0 and step.info["success"] == 0

    asyncio.run(run())


def test_solo_check_env() -> None:
    report = check_env(lambda: LogicGridSoloEnv(houses=(3, 4)), n_tasks=10)
    assert report.ok and report.expert_success_rate == 1.0


def test_registry_and_options() -> None:
    team = make("logic_grid")
    assert isinstance(team, LogicGridEnv) and team.roles == ("alice", "bob") and team.max_messages == 6
    solo = make("logic_grid_solo", houses=4)
    assert isinstance(solo, LogicGridSoloEnv) and solo.max_turns == 3
    assert all(t.data["houses"] == 4 for t in solo.tasks("train", 5))
    assert [t.id for t in make("logic_grid", houses="4").tasks("train", 5)] == [t.id for t in solo.tasks("train", 5)]
    for bad in ({"houses": 5}, {"houses": 2}, {"max_messages": 0}, {"test_fraction": 1.0}):
        with pytest.raises(ValueError):
            make("logic_grid", **bad)


def test_normalize_answer() -> None:
    assert normalize_answer("  The Fox!! ") == "fox" == normalize_answer("fox")
    assert normalize_answer("Corvin.") == "corvin" and normalize_answer("the") == "the"
