"""Per-turn state keys: ``Env.state_key()`` before each action (the gridworlds: the board), else a
hash of the observations so far (the calculator), recorded on each ``Turn``."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest

from tracegym.envs import Env, Task, make
from tracegym.envs.episode import Action, Observation, TokenData, play_episode
from tracegym.rollout import RolloutConfig, run_rollouts_sync
from tracegym.types import Message, ToolCall, Trajectory

OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}


def move(direction: str) -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name="move", arguments={"direction": direction}, id="m"),))


class Scripted:
    """Plays ``moves`` first, then the env's expert; every action carries (dummy) token data so the
    loop records turns."""

    def __init__(self, env: Env, moves: list[str]):
        self.env, self.moves = env, list(moves)

    async def __call__(self, obs: Observation) -> Action:
        message = move(self.moves.pop(0)) if self.moves else self.env.expert_action()
        return Action(message=message, tokens=TokenData(prompt_ids=(obs.turn,), completion_ids=(1,)))


def play(name: str, task: Task, moves: list[str]) -> Trajectory:
    return asyncio.run(play_episode(lambda: make(name), task, lambda env: Scripted(env, moves), max_turns=60))


@pytest.mark.parametrize("name", ["frozenlake", "sokoban"])
def test_gridworld_keys_are_the_board_and_match_where_boards_match(name: str) -> None:
    env = make(name)
    assert env.state_key() is None  # before reset
    task = next(t for t in env.tasks("test", 20, seed=0) if len(t.data["solution"]) >= 3)
    asyncio.run(env.reset(task))
    assert env.state_key() == f"{name}:{env.render()}"

    first = task.data["solution"][0]
    straight = play(name, task, [])
    detour = play(name, task, [first, OPPOSITE[first]])  # out and back: the start board again
    assert straight.success and detour.success
    keys, detour_keys = [t.state_key for t in straight.turns], [t.state_key for t in detour.turns]
    assert all(k and k.startswith(f"{name}:") for k in keys + detour_keys)
    # turn 0 and turn 2 of the detour faced the start board; turn 1 the board after the first move
    assert detour_keys[0] == detour_keys[2] == keys[0]
    assert detour_keys[1] == keys[1] != keys[0]
    # from there on the detour replays the straight path, board for board
    assert detour_keys[2:] == keys
    assert len(set(keys)) == len(keys)  # a shortest path never revisits a board


def test_observation_hash_when_the_env_has_no_key() -> None:
    """The fallback key: sha1 of role and content of every non-assistant message, 16 hex digits."""
    env = make("calculator")
    assert env.state_key() is None
    task = env.tasks("train", 1, seed=0)[0]
    t = asyncio.run(play_episode(lambda: make("calculator"), task, lambda e: Scripted(e, []), max_turns=5))
    assert t.success and len(t.turns) >= 2
    h = hashlib.sha1()
    for m in t.messages[:2]:
        h.update(m.role.encode() + b"\x00" + m.content.encode() + b"\x1e")
    assert t.turns[0].state_key == h.hexdigest()[:16]
    for m in t.turns[0].env_messages:
        h.update(m.role.encode() + b"\x00" + m.content.encode() + b"\x1e")
    assert t.turns[1].state_key == h.hexdigest()[:16]


class JsonRenderer:
    """Just enough of a renderer for the runner's message-level path: one id per character."""

    stop_token_ids = [0]

    def _ids(self, messages: Any) -> list[int]:
        return [1 + ord(c) % 250 for m in messages for c in m.model_dump_json()]

    def render_prompt(self, messages: Any, tools: Any = None) -> list[int]:
        return self._ids(messages)

    def continue_prompt(self, prompt: Any, completion: Any, new_messages: Any) -> list[int]:
        return list(prompt) + list(completion) + self._ids(new_messages)

    def encode_completion(self, message: Message) -> list[int]:
        return self._ids([message]) + [0]


class CalcEngine:
    """A message-level engine: calls calculate with ``1 + <call number>`` first, then answers."""

    name = "calc-chat"
    returns_logprobs = False

    def __init__(self) -> None:
        self.calls = 0

    def chat(self, messages: list[Message], tools: Any, params: Any) -> Message:
        if messages[-1].role == "tool":
            return Message(role="assistant", content=f"<answer>{messages[-1].content}</answer>")
        self.calls += 1
        call = ToolCall(name="calculate", arguments={"expression": f"1 + {self.calls}"}, id="c")
        return Message(role="assistant", tool_calls=(call,))


def test_calculator_keys_through_the_runner() -> None:
    tasks = make("calculator").tasks("train", 2, seed=0)
    res = run_rollouts_sync("calculator", tasks, CalcEngine(), JsonRenderer(),
                            RolloutConfig(max_turns=3, samples_per_task=3, max_context=None), progress=False)
    assert res.stats.end_reasons == {"terminated": 6}
    by_task: dict[str, list[Trajectory]] = {}
    for t in res.trajectories:
        by_task.setdefault(t.task_id, []).append(t)
        assert len(t.turns) == 2 and all(turn.state_key for turn in t.turns)
    first, second = by_task[tasks[0].id], by_task[tasks[1].id]
    # the samples of one task start in the same state; tasks differ
    assert len({t.turns[0].state_key for t in first}) == 1
    assert first[0].turns[0].state_key != second[0].turns[0].state_key
    # every sample computed something else, so after the tool result the states differ
    assert len({t.turns[1].state_key for t in first + second}) == 6
