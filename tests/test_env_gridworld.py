"""FrozenLake and Sokoban as text: hand-made levels with known answers, generated levels replayed
through the env's own move logic (a second implementation of the BFS model), check_env, experts."""

from __future__ import annotations

import asyncio
import random

import pytest

from tracegym.envs import Task, make
from tracegym.envs.check import check_env
from tracegym.envs.episode import run_episodes
from tracegym.environments.gridworld import (
    FrozenLakeEnv,
    SokobanEnv,
    _lake_successors,
    bfs_path,
    generate_frozenlake,
    generate_sokoban,
    parse_sokoban,
    solve_sokoban,
)
from tracegym.types import Message, StepResult, ToolCall


def _moves(*directions: str) -> Message:
    calls = tuple(ToolCall(name="move", arguments={"direction": d}, id=f"m{i}") for i, d in enumerate(directions))
    return Message(role="assistant", tool_calls=calls)


async def _play(env, grid: list[str], *messages: Message) -> list[StepResult]:
    await env.reset(Task(id="hand", data={"grid": grid, "solution": []}))
    return [await env.step(m) for m in messages]


def test_bfs_path_shortest_and_unreachable() -> None:
    # A line 0..5 with moves +1 / +2: shortest to 5 is three moves.
    path = bfs_path(0, lambda s: s == 5, lambda s: [("one", s + 1), ("two", s + 2)] if s < 5 else [])
    # Three moves; among equal-length paths the successor order breaks ties (deterministic).
    assert path == ["one", "two", "two"]
    assert bfs_path(0, lambda s: s == 7, lambda s: [("one", s + 1)] if s < 5 else []) is None
    assert bfs_path(3, lambda s: s == 3, lambda s: []) == []


LAKE = ["S.H", ".H.", "..G"]  # shortest path: down, down, right, right


def test_frozenlake_hand_level() -> None:
    env = FrozenLakeEnv(size=3)
    r = asyncio.run(_play(env, LAKE, _moves("up"), _moves("down"), _moves("down", "right", "right")))
    assert r[0].messages[0].content == "P.H\n.H.\n..G\nYou cannot move up: that is the edge of the lake."
    assert r[1].messages[0].content == "..H\nPH.\n..G" and not r[1].terminated
    assert r[2].terminated and r[2].reward == 1.0 and r[2].info["success"] == 1
    assert r[2].messages[-1].content.endswith("You reached the goal!")
    assert bfs_path((0, 0), lambda c: c == (2, 2), _lake_successors(LAKE)) == ["down", "down", "right", "right"]


def test_frozenlake_hole_ends_with_zero_and_skips_later_moves() -> None:
    env = FrozenLakeEnv(size=3)
    (result,) = asyncio.run(_play(env, LAKE, _moves("right", "right", "down")))
    assert result.terminated and result.reward == 0.0 and result.info["success"] == 0 and result.info["fell"] == 1
    assert result.messages[1].content.endswith("You fell into a hole. Game over.")
    assert result.messages[2].content == "Error: not run, the episode ended at an earlier call."


def test_text_without_a_move_gives_up() -> None:
    (result,) = asyncio.run(_play(FrozenLakeEnv(size=3), LAKE, Message(role="assistant", content="hmm")))
    assert result.terminated and result.reward == 0.0 and result.info["gave_up"] == 1


def test_bad_direction_is_a_tool_error() -> None:
    (result,) = asyncio.run(_play(FrozenLakeEnv(size=3), LAKE, _moves("north")))
    assert result.messages[0].content.startswith("Error: invalid arguments for tool 'move': argument 'direction': Input should be")
    assert not result.terminated


SOKO = [
    "######",
    "#@_$.#",
    "#____#",
    "#____#",
    "#____#",
    "######",
]


def test_sokoban_hand_level_push_wall_and_solve() -> None:
    walls, targets, player, boxes = parse_sokoban(SOKO)
    assert solve_sokoban(walls, targets, player, boxes) == ["right", "right"]
    env = SokobanEnv()
    r = asyncio.run(_play(env, SOKO, _moves("up"), _moves("right"), _moves("right")))
    assert r[0].messages[0].content.endswith("You cannot move up: there is a wall. Boxes on targets: 0/1.")
    assert r[1].messages[0].content.split("\n")[1] == "#_@$.#"
    assert r[2].terminated and r[2].reward == 1.0
    assert r[2].messages[0].content == "######\n#__@*#\n#____#\n#____#\n#____#\n######\nEvery box is on a target. You solved it!"


def test_sokoban_blocked_push_and_deadlock() -> None:
    level = ["######", "#@$$.#", "#___.#", "#____#", "#____#", "######"]
    env = SokobanEnv()
    (blocked,) = asyncio.run(_play(env, level, _moves("right")))
    assert "The box cannot be pushed right: it is blocked." in blocked.messages[0].content
    # A box pushed into a corner that is not a target can never be solved; the expert then stops.
    corner = ["######", "#_$_.#", "#@___#", "#____#", "#____#", "######"]
    walls, targets, _, _ = parse_sokoban(corner)
    assert solve_sokoban(walls, targets, (2, 1), [(1, 2)]) is not None
    assert solve_sokoban(walls, targets, (1, 2), [(1, 1)]) is None
    env = SokobanEnv()
    asyncio.run(_play(env, corner, _moves("right"), _moves("right"), _moves("up"), _moves("left")))
    assert env.boxes == {(1, 1)}
    assert env.expert_action() == Message(role="assistant", content="I cannot make progress.")


@pytest.mark.parametrize("seed", range(5))
def test_generated_sokoban_solutions_replay_through_the_env(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(20):
        level = generate_sokoban(rng, size=6, num_boxes=rng.randint(1, 2), min_moves=6, max_moves=30)
        assert 6 <= len(level["solution"]) <= 30
        env = SokobanEnv()
        # Independent check: the env's move logic (not the solver's successor function) solves it,
        # and only on the last move.
        results = asyncio.run(_play(env, level["grid"], *[_moves(d) for d in level["solution"]]))
        assert [r.terminated for r in results] == [False] * (len(results) - 1) + [True]
        assert results[-1].reward == 1.0


def test_generated_frozenlake_solutions_replay_through_the_env() -> None:
    rng = random.Random(0)
    for _ in range(100):
        level = generate_frozenlake(rng, size=5)
        start = next((r, c) for r, row in enumerate(level["grid"]) for c, ch in enumerate(row) if ch == "S")
        goal = next((r, c) for r, row in enumerate(level["grid"]) for c, ch in enumerate(row) if ch == "G")
        assert len(level["solution"]) >= abs(start[0] - goal[0]) + abs(start[1] - goal[1]) >= 4
        results = asyncio.run(_play(FrozenLakeEnv(), level["grid"], *[_moves(d) for d in level["solution"]]))
        assert results[-1].reward == 1.0 and sum(r.terminated for r in results) == 1


def test_options_are_validated() -> None:
    for bad in ({"size": 2}, {"hole_fraction": 0.9}, {"test_fraction": 1.0}):
        with pytest.raises(ValueError):
            FrozenLakeEnv(**bad)
    for bad in ({"num_boxes": 0}, {"num_boxes": (2, 1)}, {"size": 4}, {"min_moves": 9, "max_moves": 8}):
        with pytest.raises(ValueError):
            SokobanEnv(**bad)
    one_box = SokobanEnv(num_boxes=1).tasks("train", 20)
    assert all(sum(row.count("$") + row.count("*") for row in t.data["grid"]) == 1 for t in one_box)


@pytest.mark.parametrize("name", ["frozenlake", "sokoban"])
def test_check_env_passes(name: str) -> None:
    report = check_env(name, n_tasks=30)
    assert report.ok and report.expert_success_rate == 1.0


@pytest.mark.parametrize("name", ["frozenlake", "sokoban"])
def test_expert_solves_200_test_tasks_with_reference_length(name: str) -> None:
    tasks = make(name).tasks("test", 200, seed=0)
    results = asyncio.run(run_episodes(lambda: make(name), tasks, lambda e: e.expert_action))
    assert sum(r.success for r in results) >= 190
    for task, result in zip(tasks, results):
        # The expert replans with BFS each step, so its path is a shortest one.
        assert sum(m.role == "assistant" for m in result.messages) == len(task.data["reference_calls"])
