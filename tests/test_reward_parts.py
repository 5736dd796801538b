"""Named reward parts (``tracegym.envs.rewards``): the calculator's ``answer``/``calls`` and the grid
games' ``goal``/``distance`` (potential-based shaping), per turn by hand; the invariant
reward == sum of turn rewards == sum of weight * part; option errors; defaults unchanged; check_env;
and the episode loop's summing (a non-finite part, a branch replaying a recorded prefix)."""

from __future__ import annotations

import asyncio
import math
import random
import re
from typing import Any, Callable, Iterator, Sequence

import pytest

from tracegym.environments.calculator import CalculatorEnv
from tracegym.environments.gridworld import FrozenLakeEnv, SokobanEnv
from tracegym.envs import Task, make
from tracegym.envs.base import Env
from tracegym.envs.check import check_env
from tracegym.envs.episode import Action, Observation, TokenData, play_episode, run_episode
from tracegym.envs.rewards import RewardParts
from tracegym.render.call_errors import failure_metrics
from tracegym.rollout.branches import BranchEnv, recorded_action
from tracegym.types import Message, StepResult, ToolCall, Trajectory

ONE_TOKEN = TokenData(prompt_ids=(0,), completion_ids=(1,))  # token data makes the loop record Turns


def _calls(*expressions: str) -> Message:
    calls = tuple(ToolCall(name="calculate", arguments={"expression": e}, id=f"c{i}") for i, e in enumerate(expressions))
    return Message(role="assistant", tool_calls=calls)


def _moves(*directions: str) -> Message:
    calls = tuple(ToolCall(name="move", arguments={"direction": d}, id=f"m{i}") for i, d in enumerate(directions))
    return Message(role="assistant", tool_calls=calls)


def _scripted(messages: Sequence[Message]) -> Callable[[], Action]:
    it: Iterator[Message] = iter(messages)
    return lambda: Action(message=next(it), tokens=ONE_TOKEN)


def _expert(env: Env) -> Callable[[], Action]:
    return lambda: Action(message=env.expert_action(), tokens=ONE_TOKEN)


def _play(env: Env, task: Task, act: Callable[[], Action], max_turns: int = 50) -> Trajectory:
    return asyncio.run(run_episode(env, task, act, max_turns=max_turns, timeout_s=30.0))


def _assert_invariant(trajectory: Trajectory, weights: dict[str, float]) -> None:
    assert trajectory.error is None and trajectory.turns
    assert set(trajectory.reward_parts) == set(weights)
    weighted = sum(weights[part] * total for part, total in trajectory.reward_parts.items())
    assert abs(trajectory.reward - sum(turn.reward for turn in trajectory.turns)) < 1e-9
    assert abs(trajectory.reward - weighted) < 1e-9
    for part in weights:  # the episode's part is the sum of its turns' parts
        assert abs(trajectory.reward_parts[part] - sum(t.metrics[f"reward/{part}"] for t in trajectory.turns)) < 1e-9


# --- calculator -------------------------------------------------------------------------------------

CALC_PARTS = {"answer": 1.0, "calls": 0.3}


def _calc_task() -> Task:
    # The golden 3-call task of test_env_calculator: 15 * 51 = 765; 765 // 36 = 21; 21 * 46 = 966.
    task = CalculatorEnv(num_calls=3).tasks("test", 1, seed=0)[0]
    assert [c["arguments"]["expression"] for c in task.data["reference_calls"]] == ["15 * 51", "765 // 36", "21 * 46"]
    return task


def test_calculator_expert_earns_a_third_of_the_calls_part_per_call_then_the_answer() -> None:
    env = CalculatorEnv(num_calls=3, reward_parts=CALC_PARTS)
    t = _play(env, _calc_task(), _expert(env))
    # Each of the 3 calls earns calls = 1/3, weighted 0.3 * 1/3 = 0.1; the answer earns 1.0.
    assert [turn.reward for turn in t.turns] == pytest.approx([0.1, 0.1, 0.1, 1.0], abs=1e-12)
    assert [turn.metrics["reward/calls"] for turn in t.turns] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0], abs=1e-12)
    assert [turn.metrics["reward/answer"] for turn in t.turns] == [0.0, 0.0, 0.0, 1.0]
    assert t.success and t.reward == pytest.approx(1.3, abs=1e-12)
    assert t.reward_parts == pytest.approx({"answer": 1.0, "calls": 1.0}, abs=1e-12)
    _assert_invariant(t, CALC_PARTS)


def test_calculator_wrong_episode_repeats_and_misses_earn_nothing() -> None:
    env = CalculatorEnv(num_calls=3, reward_parts=CALC_PARTS)
    script = [
        _calls("15 * 51"),  # 765: reference 1 -> 1/3
        _calls("15 * 51"),  # 765 again: already reproduced -> 0
        _calls("765 / 36"),  # 21.25: no reference value -> 0
        _calls("765 // 36", "21 * 46"),  # 21 and 966: references 2 and 3 in one turn -> 2/3
        Message(role="assistant", content="<answer>965</answer>"),  # wrong -> 0
    ]
    t = _play(env, _calc_task(), _scripted(script))
    assert [turn.reward for turn in t.turns] == pytest.approx([0.1, 0.0, 0.0, 0.2, 0.0], abs=1e-12)
    # Every right call and no right answer: exactly the calls weight, no success.
    assert not t.success and t.reward == pytest.approx(0.3, abs=1e-12)
    assert t.reward_parts == pytest.approx({"answer": 0.0, "calls": 1.0}, abs=1e-12)
    _assert_invariant(t, CALC_PARTS)


def test_calculator_parts_off_by_default_and_answer_alone_matches_it() -> None:
    task = _calc_task()
    default = CalculatorEnv(num_calls=3)
    old = _play(default, task, _expert(default))
    # The numbers from before parts existed: the answer's 1.0 on the last turn, no reward/ keys.
    assert [turn.reward for turn in old.turns] == [0.0, 0.0, 0.0, 1.0] and old.reward == 1.0
    assert old.metrics == {"success": 1.0, "tool_calls": 3.0, "tool_errors": 0.0, "tool_timeouts": 0.0,
                           "parse_errors": 0.0, "tool_output_truncated": 0.0, "turns": 4.0, **failure_metrics({})}
    assert old.reward_parts == {} and default.reward_range == (0.0, 1.0)
    # Asking for the answer part alone changes no reward, only reports the part.
    answer_only = CalculatorEnv(num_calls=3, reward_parts={"answer": 1.0})
    t = _play(answer_only, task, _expert(answer_only))
    assert [turn.reward for turn in t.turns] == [0.0, 0.0, 0.0, 1.0]
    assert t.metrics == {**old.metrics, "reward/answer": 1.0}


def test_calls_part_alone_merges_with_the_default_answer_weight() -> None:
    # A dotted override (env.options.reward_parts.calls=0.3) gives {"calls": 0.3}: answer keeps 1.0.
    env = make("calculator", reward_parts={"calls": 0.3})
    assert env.reward_parts == RewardParts(parts=(("answer", 1.0), ("calls", 0.3)), outcome="answer")
    assert env.reward_range == (0.0, 1.3)


@pytest.mark.parametrize(
    "value, message",
    [
        ({"answer": 1.0, "cals": 0.3}, "reward_parts: unknown part 'cals'; this env's parts are answer, calls"),
        ({"calls": -0.1}, "reward_parts: the weight of 'calls' must be >= 0, got -0.1"),
        ({"answer": 0, "calls": 1.0}, "reward_parts: the outcome part 'answer' needs a positive weight"),
        ({"calls": float("nan")}, "reward_parts: the weight of 'calls' must be a finite number, got nan"),
        ({"calls": True}, "reward_parts: the weight of 'calls' must be a finite number, got True"),
        ("answer",
         'reward_parts must be a mapping of part -> weight such as {"answer": 1.0, "calls": 0.3}, got \'answer\''),
    ],
)
def test_calculator_bad_reward_parts_are_one_line_errors(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(f"env 'calculator': {message}")) as caught:
        make("calculator", reward_parts=value)
    assert "\n" not in str(caught.value)


def test_string_option_is_refused_before_the_env_is_built() -> None:
    from tracegym.envs.registry import EnvOptionError, check_env_options

    with pytest.raises(EnvOptionError, match="option 'reward_parts'"):
        check_env_options("calculator", {"reward_parts": '{"calls": 0.3}'})


def test_grid_bad_options() -> None:
    with pytest.raises(ValueError, match="unknown part 'answer'; this env's parts are goal, distance"):
        make("frozenlake", reward_parts={"answer": 1.0})
    with pytest.raises(ValueError, match=r"shaping_gamma must be in \(0, 1\], got 0"):
        make("sokoban", reward_parts={"distance": 0.3}, shaping_gamma=0)
    with pytest.raises(ValueError, match="env 'search' has no option 'reward_parts'"):
        make("search", reward_parts={"answer": 1.0})


# --- grid games -------------------------------------------------------------------------------------

GRID_PARTS = {"goal": 1.0, "distance": 0.5}
LAKE = ["S.H", ".H.", "..G"]  # start (0,0), goal (2,2), holes (0,2) and (1,1); shortest safe path 4


def _hand(grid: list[str]) -> Task:
    return Task(id="hand", data={"grid": grid, "solution": []})


def test_frozenlake_expert_earns_a_quarter_of_the_way_per_move() -> None:
    env = FrozenLakeEnv(size=3, reward_parts=GRID_PARTS)
    t = _play(env, _hand(LAKE), _expert(env))
    # d: 4 -> 3 -> 2 -> 1 -> 0, Phi = -d/4: each move earns 0.25, weighted 0.125; the goal 1.0.
    assert [turn.reward for turn in t.turns] == [0.125, 0.125, 0.125, 1.125]
    assert t.success and t.reward == 1.5 and t.reward_parts == {"goal": 1.0, "distance": 1.0}
    assert env.reward_range == (-0.5, 1.5)
    _assert_invariant(t, GRID_PARTS)


def test_frozenlake_moving_back_and_falling_pay_back_the_progress() -> None:
    env = FrozenLakeEnv(size=3, reward_parts=GRID_PARTS)
    script = [
        _moves("up"),  # the edge: still at d = 4 -> 0
        _moves("down"),  # d 3 -> +0.25
        _moves("up"),  # back at d 4 -> -0.25
        _moves("down"),  # d 3 -> +0.25
        _moves("right"),  # into the hole at (1,1): Phi = -1 as at the start -> -0.25
    ]
    t = _play(env, _hand(LAKE), _scripted(script))
    assert [turn.metrics["reward/distance"] for turn in t.turns] == [0.0, 0.25, -0.25, 0.25, -0.25]
    assert [turn.reward for turn in t.turns] == [0.0, 0.125, -0.125, 0.125, -0.125]
    assert not t.success and t.metrics["fell"] == 1.0 and t.reward == 0.0
    assert t.reward_parts == {"goal": 0.0, "distance": 0.0}
    _assert_invariant(t, GRID_PARTS)


def test_frozenlake_giving_up_halfway_keeps_half_the_distance_part() -> None:
    env = FrozenLakeEnv(size=3, reward_parts=GRID_PARTS)
    t = _play(env, _hand(LAKE), _scripted([_moves("down", "down"), Message(role="assistant", content="hmm")]))
    # Two moves in one turn: d 4 -> 2, Phi -1 -> -0.5; the text turn leaves Phi where it is.
    assert [turn.reward for turn in t.turns] == [0.25, 0.0] and t.reward_parts == {"goal": 0.0, "distance": 0.5}
    _assert_invariant(t, GRID_PARTS)


def test_shaping_gamma_discounts_the_next_potential() -> None:
    env = FrozenLakeEnv(size=3, reward_parts={"distance": 1.0}, shaping_gamma=0.5)
    t = _play(env, _hand(LAKE), _scripted([_moves("down"), _moves("up")]), max_turns=2)
    # gamma * Phi' - Phi: 0.5 * -0.75 + 1 = 0.625; then 0.5 * -1 + 0.75 = 0.25.
    assert [turn.metrics["reward/distance"] for turn in t.turns] == [0.625, 0.25]


SOKO_SOLVE = ["######", "#@_$.#", "#____#", "#____#", "#____#", "######"]  # box (1,3), target (1,4): d0 = 1
SOKO_AWAY = ["######", "#@$__#", "#___.#", "#____#", "#____#", "######"]  # box (1,2), target (2,4): d0 = 3


def test_sokoban_distance_counts_box_moves_only() -> None:
    parts = {"goal": 1.0, "distance": 0.3}
    env = SokobanEnv(reward_parts=parts)
    solved = _play(env, _hand(SOKO_SOLVE), _scripted([_moves("up"), _moves("right"), _moves("right")]))
    # A wall, a walk (no box moved: 0), then the push onto the target: d 1 -> 0 earns 1, plus the goal.
    assert [turn.reward for turn in solved.turns] == pytest.approx([0.0, 0.0, 1.3], abs=1e-12)
    _assert_invariant(solved, parts)
    env = SokobanEnv(reward_parts=parts)
    script = [_moves("right"), _moves("down", "right", "right", "up"), _moves("left")]
    away = _play(env, _hand(SOKO_AWAY), _scripted(script), max_turns=3)
    # Push right: d 3 -> 2 (+1/3); walk round the box (0); push it back left: d 2 -> 3 (-1/3).
    assert [turn.metrics["reward/distance"] for turn in away.turns] == pytest.approx([1 / 3, 0.0, -1 / 3], abs=1e-12)
    assert [turn.reward for turn in away.turns] == pytest.approx([0.1, 0.0, -0.1], abs=1e-12)
    assert away.end_reason == "max_turns" and away.reward == pytest.approx(0.0, abs=1e-12)


def test_grid_defaults_unchanged() -> None:
    env = FrozenLakeEnv(size=3)
    t = _play(env, _hand(LAKE), _expert(env))
    assert [turn.reward for turn in t.turns] == [0.0, 0.0, 0.0, 1.0] and t.reward_parts == {}
    assert "reward/goal" not in t.turns[-1].metrics and env.reward_range == (0.0, 1.0)


@pytest.mark.parametrize("name", ["frozenlake", "sokoban"])
def test_invariant_holds_for_random_walks(name: str) -> None:
    parts = {"goal": 1.0, "distance": 0.3}
    rng = random.Random(0)
    for task in make(name).tasks("train", 10, seed=0):
        env = make(name, reward_parts=parts)
        walk = [_moves(*rng.choices(["up", "down", "left", "right"], k=rng.randint(1, 3))) for _ in range(12)]
        t = _play(env, task, _scripted(walk), max_turns=12)
        _assert_invariant(t, parts)
        # With gamma = 1 the part telescopes to Phi(final) - Phi(start) = 1 + Phi(final), in [0, 1].
        assert -1e-9 <= t.reward_parts["distance"] <= 1 + 1e-9
        assert abs(t.reward_parts["distance"] - (1 + env.potential)) < 1e-9


# --- check_env ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, parts",
    [("calculator", CALC_PARTS), ("frozenlake", {"goal": 1.0, "distance": 0.3}),
     ("sokoban", {"goal": 1.0, "distance": 0.3})],
)
def test_check_env_passes_with_parts_on(name: str, parts: dict[str, float]) -> None:
    report = check_env(lambda: make(name, reward_parts=parts), n_tasks=10)
    assert report.ok and report.expert_success_rate == 1.0 and "branching" in report.passed


# --- the episode loop ----------------------------------------------------------------------------------


class _NaNPart(Env):
    name = "nan_part"

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return [Task(id="t0", split=split)]

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    async def reset(self, task: Task) -> list[Message]:
        return [Message(role="user", content="go")]

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        return StepResult(reward=0.0, terminated=True, info={"success": 0, "reward/shaping": math.nan})

    def expert_action(self) -> Message:
        return Message(role="assistant", content="x")


def test_non_finite_part_is_an_env_error() -> None:
    env = _NaNPart()
    t = _play(env, env.tasks()[0], lambda: Action(message=env.expert_action()))
    assert t.end_reason == "env_error"
    assert t.error == "task t0: step 1 returned a non-finite reward part {'shaping': nan}"


def test_branch_replaying_a_recorded_prefix_keeps_the_part_sums() -> None:
    # Tree and Monte-Carlo rollouts answer a branch's prefix turns from the recording (reward and
    # Turn.metrics): the parts must survive that, or a leaf's part sums would lose its prefix.
    task = _calc_task()
    env = CalculatorEnv(num_calls=3, reward_parts=CALC_PARTS)
    original = _play(env, task, _expert(env))
    prefix = 2

    def make_policy(branch: Env) -> Callable[[Observation], Any]:
        async def policy(obs: Observation) -> Action:
            if obs.turn < prefix:
                return recorded_action(original.turns[obs.turn])
            return Action(message=branch.expert_action(), tokens=ONE_TOKEN)

        return policy

    def make_branch() -> BranchEnv:  # no snapshot: the inner env replays the prefix at reset
        return BranchEnv(lambda: CalculatorEnv(num_calls=3, reward_parts=CALC_PARTS), original, prefix, None, [])

    leaf = asyncio.run(play_episode(make_branch, task, make_policy))
    assert leaf.error is None and [turn.reward for turn in leaf.turns] == [turn.reward for turn in original.turns]
    assert leaf.reward_parts == original.reward_parts == pytest.approx({"answer": 1.0, "calls": 1.0}, abs=1e-12)
    _assert_invariant(leaf, CALC_PARTS)
