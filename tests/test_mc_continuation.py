"""Monte-Carlo continuation advantages: the branching step (``tracegym.rollout.branches``) on a toy env
with scripted engines whose samples the test controls, and the ``mc_continuation`` estimator.

Toy env ``TwoStep`` (2 turns): turn 0's action "good" puts the episode in the good state, anything
else in the bad one (reward 0.125 either way); turn 1 ends it with reward 1 in the good state, 0 in
the bad one, plus 0.5 for the action "bonus". So from the start: Q(good) = 0.125 + 1 + 0.5 p(bonus),
Q(other) = 0.125 + 0.5 p(bonus); from turn 1 on the 0.125 is not counted.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Sequence

import pytest

from test_rollout import EOT, ByteRenderer
from tracegym.algos import estimate
from tracegym.envs.base import Env, Task
from tracegym.rollout import RolloutConfig, run_rollouts_sync
from tracegym.rollout.branches import (
    BranchingUnsupported,
    ReplayMismatch,
    decision_turn_indices,
    score_mc_continuation,
)
from tracegym.types import Generation, Message, ParsedCompletion, StepResult, Trajectory, TrajectoryGroup, Turn, group_trajectories

RENDERER = ByteRenderer()


def text_of(ids: Sequence[int]) -> str:
    return "".join(chr(i - 10) if 10 <= i < 210 else "|" for i in ids)


def encode(text: str) -> tuple[int, ...]:
    return tuple(RENDERER.encode_completion(Message(role="assistant", content=text)))


class TwoStep(Env):
    name = "twostep"
    branchable = True
    steps_taken = 0  # class-wide count of real env steps

    def __init__(self):
        self.task: Task | None = None
        self.turn = 0
        self.good = False

    def tasks(self, split="train", n=100, seed=0):
        return [Task(id=f"t{i}", split=split) for i in range(n)]

    def tool_schemas(self):
        return []

    async def reset(self, task):
        self.task, self.turn, self.good = task, 0, False
        return [Message(role="system", content="sys"), Message(role="user", content=f"task {task.id}")]

    async def step(self, message, parse_errors=()):
        type(self).steps_taken += 1
        self.turn += 1
        if self.turn == 1:
            self.good = message.content == "good"
            return StepResult(messages=(Message(role="user", content="next"),), reward=0.125)
        reward = (1.0 if self.good else 0.0) + (0.5 if message.content == "bonus" else 0.0)
        return StepResult(reward=reward, terminated=True, info={"success": reward >= 1.0})

    def expert_action(self):
        return Message(role="assistant", content="good")


class ScriptEngine:
    """``generate``: the completion for a prompt is the next item of ``script(prompt text)``, cycled per
    distinct prompt (so equal prompts get the script's items in turn). Records every prompt."""

    name = "script"
    returns_logprobs = True

    def __init__(self, script):
        self.script = script
        self.cursors: dict[tuple[int, ...], itertools.cycle] = {}
        self.prompts: list[tuple[int, ...]] = []
        self.params = []

    def generate(self, prompts, params):
        self.params.append(params)
        out = []
        for prompt in prompts:
            key = tuple(prompt)
            self.prompts.append(key)
            if key not in self.cursors:
                self.cursors[key] = itertools.cycle(self.script(text_of(prompt)))
            ids = encode(next(self.cursors[key]))[: params.max_tokens]
            out.append([Generation(token_ids=ids, logprobs=tuple(-0.25 for _ in ids), finish_reason="stop")])
        return out


def is_turn0(prompt_text: str) -> bool:
    """A turn-0 prompt holds one "assistant:" (the generation prompt); later ones hold earlier turns too."""
    return prompt_text.count("assistant:") == 1


def record(actions: dict[str, str], n_tasks: int = 2) -> tuple[list[TrajectoryGroup], list[Task]]:
    """One recorded trajectory per task: turn 0 plays ``actions[task id]``, turn 1 plays "x"."""

    def script(text: str) -> list[str]:
        if is_turn0(text):
            return [next(a for tid, a in actions.items() if f"task {tid}" in text)]
        return ["x"]

    tasks = TwoStep().tasks(n=n_tasks)
    result = run_rollouts_sync(TwoStep, tasks, ScriptEngine(script), RENDERER, RolloutConfig(max_turns=4), progress=False)
    assert result.stats.failed == 0
    return group_trajectories(result.trajectories), tasks


def mc(groups, tasks, engine, **kw):
    kw.setdefault("config", RolloutConfig(max_turns=4, temperature=1.0))
    return score_mc_continuation(groups, engine, RENDERER, TwoStep, None, tasks, **kw)


def advantages_of(groups) -> list[list[float | None]]:
    return [[turn.metrics.get("mc_advantage") for turn in g.trajectories[0].turns] for g in groups]


# --- (a) the SPECS test: deterministic env + greedy policy => every alternative equal, A = 0 ----------


def test_greedy_policy_on_a_deterministic_env_gives_zero_advantage():
    # greedy: the completion is a function of the prompt only (t0 plays "good", t1 "bad", then "bonus")
    def greedy(text: str) -> list[str]:
        if is_turn0(text):
            return ["good" if "task t0" in text else "bad"]
        return ["bonus"]

    tasks = TwoStep().tasks(n=2)
    recorded = run_rollouts_sync(TwoStep, tasks, ScriptEngine(greedy), RENDERER, RolloutConfig(max_turns=4, temperature=0.0),
                                 progress=False)
    groups = group_trajectories(recorded.trajectories)
    assert [g.rewards for g in groups] == [[1.625], [0.625]]  # rewards differ across tasks: not trivially zero
    engine = ScriptEngine(greedy)
    scored, stats = mc(groups, tasks, engine, k=4, m=2, temperature=0.0)
    assert all(p.temperature == 0.0 for p in engine.params)
    assert stats.alternatives == 2 * 2 * 3 and stats.identical_alternatives == stats.alternatives
    values = [a for row in advantages_of(scored) for a in row]
    assert values == [0.0, 0.0, 0.0, 0.0]  # every turn scored, Var(A) = 0
    # Q of the actual action = the recorded return from that turn on (turn 0's 0.125 only from turn 0)
    q = [[turn.metrics["mc_q"] for turn in g.trajectories[0].turns] for g in scored]
    assert q == [[1.625, 1.5], [0.625, 0.5]]


# --- (b) scripted samples: hand-computed Q and A, the better action gets A > 0 ----------------------


def branch_script(text: str) -> list[str]:
    if is_turn0(text):  # the alternatives at turn 0
        return ["good", "meh"] if "task t0" in text else ["bad", "meh"]
    return ["bonus", "x"]  # every turn-1 prompt: one "bonus" and one "x" in turn


@pytest.mark.parametrize("reach", ["auto", "replay"])
def test_hand_computed_q_and_advantages(reach: str):
    groups, tasks = record({"t0": "bad", "t1": "good"})
    assert [g.rewards for g in groups] == [[0.125], [1.125]]
    engine = ScriptEngine(branch_script)
    TwoStep.steps_taken = 0
    scored, stats = mc(groups, tasks, engine, k=3, m=2, reach=reach)
    # turn 0, t0 (took "bad"):  Q(bad) = 0.125 + (0.5 + 0)/2 = 0.375, Q(good) = 0.125 + (1.5 + 1)/2 = 1.375,
    #                            Q(meh) = 0.375 -> A = 0.375 - (1.375 + 0.375)/2 = -0.5
    # turn 0, t1 (took "good"): Q(good) = 1.375, Q(bad) = Q(meh) = 0.375 -> A = 1.375 - 0.375 = +1.0
    # turn 1, t0 (bad state, took "x"): Q = 0; alternatives "bonus" 0.5, "x" 0 -> A = 0 - 0.25 = -0.25
    # turn 1, t1 (good state, took "x"): Q = 1; alternatives 1.5 and 1.0 -> A = 1 - 1.25 = -0.25
    assert advantages_of(scored) == [[-0.5, -0.25], [1.0, -0.25]]
    t0, t1 = (g.trajectories[0].turns for g in scored)
    assert (t0[0].metrics["mc_q"], t0[0].metrics["mc_baseline"]) == (0.375, 0.875)
    assert (t1[0].metrics["mc_q"], t1[0].metrics["mc_baseline"]) == (1.375, 0.375)
    assert (t0[1].metrics["mc_q"], t0[1].metrics["mc_baseline"]) == (0.0, 0.25)
    assert (t1[1].metrics["mc_q"], t1[1].metrics["mc_baseline"]) == (1.0, 1.25)
    assert stats.reach == ("snapshot" if reach == "auto" else "replay")
    assert (stats.decision_points, stats.scored, stats.alternatives, stats.continuations) == (4, 4, 8, 24)
    assert stats.failed_continuations == 0
    # the recorded prefix is replayed, never re-sampled: each turn-0 prompt went to the engine only for
    # its k-1 alternatives; the recorded turn-1 prompt of t0 is what the actual branch continued from
    recorded0 = groups[0].trajectories[0].turns
    counts = Counter(engine.prompts)
    assert counts[recorded0[0].prompt_ids] == 2
    assert counts[recorded0[1].prompt_ids] == 2 + 2  # turn 1's alternatives + turn 0's actual branch (m=2)
    # snapshot: the prefix is stepped once per trajectory (1 step to reach turn 1), then every
    # continuation steps from the branch point: 3 actions x 2 continuations x 2 steps at turn 0
    # and 3 x 2 x 1 at turn 1 per trajectory; replay re-steps the prefix in each turn-1 continuation
    per_trajectory = 12 + 6 + (1 if reach == "auto" else 6)
    assert TwoStep.steps_taken == 2 * per_trajectory
    # the rest of the trajectory is unchanged
    for before, after in zip(groups, scored):
        b, a = before.trajectories[0], after.trajectories[0]
        assert [t.completion_ids for t in a.turns] == [t.completion_ids for t in b.turns] and a.reward == b.reward
        assert a.info["mc_continuation"]["scored_turns"] == [0, 1]

    # the estimator puts each score on its turn
    est = estimate("mc_continuation", scored)
    assert est.advantages == [[[-0.5, -0.25]], [[1.0, -0.25]]]
    assert est.metrics == {"mc_scored_frac": 1.0, "mc_advantage_abs_mean": 0.5}


def test_first_decision_turn_only_and_unscored_turns():
    groups, tasks = record({"t0": "bad", "t1": "good"})
    scored, stats = mc(groups, tasks, ScriptEngine(branch_script), k=3, m=2, decision_turns="first")
    assert advantages_of(scored) == [[-0.5, None], [1.0, None]]
    assert (stats.decision_points, stats.continuations) == (2, 12)
    assert estimate("mc_continuation", scored).advantages == [[[-0.5, 0.0]], [[1.0, 0.0]]]
    assert estimate("mc_continuation", scored, {"fill": "previous"}).advantages == [[[-0.5, -0.5]], [[1.0, 1.0]]]


class CrashAfterMeh(TwoStep):
    """TwoStep whose turn-1 step raises after the turn-0 action "meh" (an env error in that branch)."""

    name = "crash_after_meh"

    async def step(self, message, parse_errors=()):
        if self.turn == 0:
            self.meh = message.content == "meh"
        elif self.meh:
            raise RuntimeError("tool server died")
        return await super().step(message, parse_errors)


@pytest.mark.parametrize("on_env_error", ["exclude", "zero_reward"])
def test_failed_continuations_are_left_out_or_count_zero(on_env_error: str):
    groups, tasks = record({"t0": "bad", "t1": "good"})
    config = RolloutConfig(max_turns=4, on_env_error=on_env_error)
    scored, stats = score_mc_continuation(groups, ScriptEngine(branch_script), RENDERER, CrashAfterMeh, None, tasks,
                                          k=3, m=2, decision_turns="first", config=config)
    assert stats.failed_continuations == 4  # the "meh" branch of both tasks, m=2 each
    # exclude: the baseline is the other alternative alone; zero_reward: Q(meh) = 0
    #   t0: Q(bad) = 0.375, Q(good) = 1.375 -> -1.0 | (0.375 - (1.375 + 0)/2) = -0.3125
    #   t1: Q(good) = 1.375, Q(bad) = 0.375 -> +1.0 | (1.375 - (0.375 + 0)/2) = +1.1875
    expected = [[-1.0, None], [1.0, None]] if on_env_error == "exclude" else [[-0.3125, None], [1.1875, None]]
    assert advantages_of(scored) == expected


def test_decision_turn_choices():
    assert decision_turn_indices(3, "all") == [0, 1, 2]
    assert decision_turn_indices(3, "first") == [0]
    assert decision_turn_indices(3, [2, 0, 5]) == [0, 2]
    assert decision_turn_indices(0, "first") == []
    with pytest.raises(ValueError, match="decision_turns"):
        decision_turn_indices(3, "last")


def test_k_must_leave_a_baseline():
    groups, tasks = record({"t0": "bad", "t1": "good"})
    with pytest.raises(ValueError, match="k >= 2"):
        mc(groups, tasks, ScriptEngine(branch_script), k=1)


# --- (c) replay mismatch and refusal -----------------------------------------------------------------


class Drifting(TwoStep):
    """Claims to be deterministic, but its observation after turn 0 changes from instance to instance."""

    name = "drifting"
    branchable = False
    deterministic_replay = True
    made = 0

    def __init__(self):
        super().__init__()
        type(self).made += 1
        self.serial = type(self).made

    async def step(self, message, parse_errors=()):
        result = await super().step(message, parse_errors)
        if self.turn == 1:
            return result.model_copy(update={"messages": (Message(role="user", content=f"next {self.serial}"),)})
        return result


def test_replay_mismatch_raises_clearly():
    tasks = TwoStep().tasks(n=1)
    recorded = run_rollouts_sync(Drifting, tasks, ScriptEngine(lambda text: ["bad"]), RENDERER, RolloutConfig(max_turns=4),
                                 progress=False)
    groups = group_trajectories(recorded.trajectories)
    with pytest.raises(ReplayMismatch, match=r"env 'drifting' task t0 sample 0 turn 0: observation .*next"):
        score_mc_continuation(groups, ScriptEngine(lambda text: ["x"]), RENDERER, Drifting, None, tasks,
                              decision_turns=[1], k=2, m=1)

    class DriftingBranchable(Drifting):  # the snapshot path checks its one replay too
        name = "drifting_branchable"
        branchable = True

    recorded = run_rollouts_sync(DriftingBranchable, tasks, ScriptEngine(lambda text: ["bad"]), RENDERER,
                                 RolloutConfig(max_turns=4), progress=False)
    with pytest.raises(ReplayMismatch, match="drifting_branchable"):
        score_mc_continuation(group_trajectories(recorded.trajectories), ScriptEngine(lambda text: ["x"]), RENDERER,
                              DriftingBranchable, None, tasks, decision_turns=[1], k=2, m=1)


def test_env_that_can_neither_branch_nor_replay_is_refused():
    class Opaque(TwoStep):
        name = "opaque"
        branchable = False

    groups, tasks = record({"t0": "bad", "t1": "good"})
    with pytest.raises(BranchingUnsupported, match=r"env 'opaque' .*cannot branch .*deterministic_replay"):
        score_mc_continuation(groups, ScriptEngine(branch_script), RENDERER, Opaque, None, tasks)
    with pytest.raises(BranchingUnsupported, match="env 'opaque' cannot branch"):
        score_mc_continuation(groups, ScriptEngine(branch_script), RENDERER, Opaque, None, tasks, reach="snapshot")


# --- (d) the estimator -------------------------------------------------------------------------------


def _turn(reward: float = 0.0, score: float | None = None) -> Turn:
    metrics = {} if score is None else {"mc_advantage": score}
    return Turn(prompt_ids=(1,), completion_ids=(2,), message=Message(role="assistant", content="a"), reward=reward,
                metrics=metrics)


def _traj(turns: list[Turn], info: dict | None = None) -> Trajectory:
    return Trajectory(env="e", task_id="t", messages=(), turns=tuple(turns), reward=sum(t.reward for t in turns),
                      info=info or {})


def test_estimator_fill_modes_and_rloo():
    group = TrajectoryGroup(env="e", task_id="t", trajectories=(
        _traj([_turn(), _turn(score=0.5), _turn(reward=1.0)]),  # R = 1
        _traj([_turn(score=-0.25), _turn()]),  # R = 0
    ))
    assert estimate("mc_continuation", [group]).advantages == [[[0.0, 0.5, 0.0], [-0.25, 0.0]]]
    assert estimate("mc_continuation", [group], {"fill": "previous"}).advantages == [[[0.0, 0.5, 0.5], [-0.25, -0.25]]]
    # RLOO of R = (1, 0): +1 and -1, added to the unscored turns only
    assert estimate("mc_continuation", [group], {"add_rloo": True}).advantages == [[[1.0, 0.5, 1.0], [-0.25, -1.0]]]
    result = estimate("mc_continuation", [group])
    assert result.metrics == {"mc_scored_frac": 2 / 5, "mc_advantage_abs_mean": 0.375}
    with pytest.raises(ValueError, match="fill"):
        estimate("mc_continuation", [group], {"fill": "nearest"})


def test_estimator_refuses_unscored_groups():
    unscored = TrajectoryGroup(env="e", task_id="t9", trajectories=(_traj([_turn(), _turn(reward=1.0)]),))
    with pytest.raises(ValueError, match=r"task t9 .*run with advantage.intrinsic: mc_continuation"):
        estimate("mc_continuation", [unscored])
    # went through the step but nothing could be scored (its continuations failed): zeros, not an error
    marked = TrajectoryGroup(env="e", task_id="t9", trajectories=(
        _traj([_turn(), _turn(reward=1.0)], info={"mc_continuation": {"scored_turns": []}}),))
    assert estimate("mc_continuation", [marked]).advantages == [[[0.0, 0.0]]]
    # a group without turns has nothing to score
    empty = TrajectoryGroup(env="e", task_id="t8", trajectories=(_traj([]),))
    assert estimate("mc_continuation", [empty]).advantages == [[[]]]


# --- the real engine: tiny-random through the hf engine and the batcher -----------------------------


class LengthReward(TwoStep):
    """TwoStep whose turn-1 reward is a function of the task and the action's text:
    (task number + sum of the text's code points) % 3 / 2."""

    name = "length_reward"

    async def step(self, message, parse_errors=()):
        result = await super().step(message, parse_errors)
        if self.turn == 2:
            number = int(self.task.id[1:])
            return result.model_copy(update={"reward": ((number + sum(map(ord, message.content))) % 3) / 2})
        return result


class LetterRenderer(ByteRenderer):
    """ByteRenderer whose parse reads any token id as a letter (tiny-random samples ids far past 210)."""

    def parse_completion(self, completion_ids):
        ids = list(completion_ids)
        ended = bool(ids) and ids[-1] == EOT
        text = "".join(chr(97 + i % 26) for i in (ids[:-1] if ended else ids))
        return ParsedCompletion(message=Message(role="assistant", content=text), ended_with_eot=ended)


LETTERS = LetterRenderer()


@pytest.fixture(scope="module")
def hf_engine(tiny_model):
    from tracegym.engines import make_engine

    model, tokenizer = tiny_model
    return make_engine("hf", model=model, tokenizer=tokenizer, renderer=LETTERS, pad_token_id=0)


def test_tiny_random_greedy_gives_zero_advantage(hf_engine):
    config = RolloutConfig(max_turns=4, max_tokens_per_turn=5, temperature=0.0)
    tasks = LengthReward().tasks(n=3)
    recorded = run_rollouts_sync(LengthReward, tasks, hf_engine, LETTERS, config, progress=False)
    groups = group_trajectories(recorded.trajectories)
    assert all(len(t.turns) == 2 for g in groups for t in g.trajectories)
    assert len({g.rewards[0] for g in groups}) > 1  # the tasks' returns differ: A = 0 is not for free
    scored, stats = score_mc_continuation(groups, hf_engine, LETTERS, LengthReward, None, tasks, k=3, m=2,
                                          config=config)
    assert stats.reach == "snapshot" and (stats.decision_points, stats.scored, stats.continuations) == (6, 6, 36)
    # greedy: every alternative is the recorded action, token for token, so every A is exactly 0 ...
    assert stats.identical_alternatives == stats.alternatives == 12
    assert [turn.metrics["mc_advantage"] for g in scored for turn in g.trajectories[0].turns] == [0.0] * 6
    # ... and Q of the actual action is the recorded return from that turn on
    for g in scored:
        turns = g.trajectories[0].turns
        assert [turn.metrics["mc_q"] for turn in turns] == [turns[0].reward + turns[1].reward, turns[1].reward]
    # the continuations sampled through the batcher: several episodes per generate call
    assert stats.mean_batch_size > 1


def test_tiny_random_on_the_calculator_snapshots(tiny_model):
    from tracegym.engines import make_engine
    from tracegym.envs import make
    from tracegym.render import get_renderer

    model, tokenizer = tiny_model
    renderer = get_renderer("tiny-random", tokenizer)
    engine = make_engine("hf", model=model, tokenizer=tokenizer, renderer=renderer, pad_token_id=tokenizer.eos_token_id)
    config = RolloutConfig(max_turns=2, max_tokens_per_turn=6, temperature=0.0)
    tasks = make("calculator").tasks("train", n=2, seed=0)
    groups = group_trajectories(run_rollouts_sync("calculator", tasks, engine, renderer, config, progress=False).trajectories)
    scored, stats = score_mc_continuation(groups, engine, renderer, "calculator", None, tasks, k=2, m=1, config=config)
    turns = [turn for g in scored for t in g.trajectories for turn in t.turns]
    assert stats.reach == "snapshot" and stats.scored == stats.decision_points == len(turns) > 0
    assert stats.identical_alternatives == stats.alternatives
    assert [turn.metrics["mc_advantage"] for turn in turns] == [0.0] * len(turns)
