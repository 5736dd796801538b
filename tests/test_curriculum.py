"""Pass-rate curriculum (``tasks.curriculum``): the draw against hand-computed values, its
determinism and checkpoint round trip, the config section, and RL runs on the tiny random model
whose task choice follows the estimates (and comes back on resume).

The RL runs use ``FixedRateEnv``: the outcome ignores the reply, so the pass rate of every task is
known exactly: ``always`` 1, ``never`` 0, ``half`` 1/2 (every other episode of the task succeeds;
a group of 4 is exactly 2 of 4).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Sequence

import pytest
import torch

from tracegym.config import ConfigError, RLConfig, load_config
from tracegym.envs import register, unregister
from tracegym.envs.base import Env, Task
from tracegym.rl.executors.curriculum import CurriculumStats, PassRateCurriculum, curriculum_rng
from tracegym.rl.executors.factory import make_executor
from tracegym.recipes.rl import train_rl
from tracegym.rl.tasks import task_order
from tracegym.train.checkpoint import list_checkpoints
from tracegym.train.logging import read_metrics
from tracegym.types import Message, StepResult


def _with(num_tasks: int, outcomes: dict[int, tuple[int, int]], step: int = 0, **options: Any) -> PassRateCurriculum:
    curriculum = PassRateCurriculum(num_tasks, **options)
    for index, (successes, attempts) in outcomes.items():
        curriculum.record(index, successes, attempts, step=step)
    return curriculum


# --- the draw --------------------------------------------------------------------------------------


def test_tasks_solved_every_time_or_never_are_not_drawn_while_enough_informative_ones_exist():
    # 0-2 always solved, 3-5 never, 6-9 disagree
    outcomes = {0: (4, 4), 1: (4, 4), 2: (4, 4), 3: (0, 4), 4: (0, 4), 5: (0, 4),
                6: (1, 4), 7: (2, 4), 8: (3, 4), 9: (2, 4)}
    curriculum = _with(10, outcomes, explore=0.0)
    for step in range(20):
        assert sorted(curriculum.pick(4, curriculum_rng(0, step))) == [6, 7, 8, 9]
        three = curriculum.pick(3, curriculum_rng(0, step))
        assert len(set(three)) == 3 and set(three) <= {6, 7, 8, 9}
    # explore 0.5 of 4: two informative tasks, then the two stalest uninformative ones (all tried at
    # step 0, so the seeded order decides: 0, 1)
    explorer = _with(10, outcomes, explore=0.5)
    picked = explorer.pick(4, curriculum_rng(0, 0))
    assert set(picked[:2]) <= {6, 7, 8, 9} and len(set(picked[:2])) == 2 and picked[2:] == [0, 1]


def test_unseen_tasks_get_the_exploration_share_in_the_seeded_order():
    order = [7, 6, 5, 4, 3, 2, 1, 0]  # tasks 4-7 are unseen; the seeded order meets 7 first
    seen = {0: (2, 4), 1: (1, 4), 2: (3, 4), 3: (2, 4)}
    quarter = _with(8, seen, explore=0.25, order=order).pick(4, curriculum_rng(1, 3))
    assert set(quarter[:3]) <= {0, 1, 2, 3} and len(set(quarter[:3])) == 3 and quarter[3] == 7
    half = _with(8, seen, explore=0.5, order=order).pick(4, curriculum_rng(1, 3))
    assert half[2:] == [7, 6]
    # nothing informative yet (a run's first step): the whole draw is the seeded order
    assert PassRateCurriculum(8, explore=0.25, order=order).pick(3, curriculum_rng(1, 0)) == [7, 6, 5]
    # the share rounds half up: 0.25 of 2 is one task
    assert _with(8, seen, explore=0.25, order=order).pick(2, curriculum_rng(1, 3))[1] == 7


def test_saturated_tasks_are_rechecked_least_recently_tried_first():
    curriculum = PassRateCurriculum(4, explore=0.5)
    curriculum.record(0, 4, 4, step=3)
    curriculum.record(1, 0, 4, step=1)  # failed every time, longest ago
    curriculum.record(2, 4, 4, step=2)
    curriculum.record(3, 2, 4, step=3)
    assert curriculum.pick(2, curriculum_rng(0, 4)) == [3, 1]
    stats = CurriculumStats()
    stats.add(curriculum, [3, 1])
    assert stats.revisited == 1 and stats.explored == 0
    curriculum.record(1, 1, 4, step=4)  # the re-check finds it solvable now: informative again
    assert curriculum.is_informative(1) and curriculum.pass_rate(1) == 0.125  # (0 + 1) / (4 + 4)
    # 0.5 of 3 rounds up to two re-checks, stalest first: 2 (step 2), then 0 (step 3)
    picked = curriculum.pick(3, curriculum_rng(0, 5))
    assert picked[0] in (1, 3) and picked[1:] == [2, 0]


def test_draw_weights_are_the_bernoulli_variance_p_times_1_minus_p():
    curriculum = _with(2, {0: (2, 4), 1: (1, 8)}, explore=0.0)  # p(1-p): 0.25 and 7/64
    draws = [curriculum.pick(1, curriculum_rng(0, step))[0] for step in range(2000)]
    expected = 0.25 / (0.25 + 7 / 64)  # 0.696
    assert abs(draws.count(0) / len(draws) - expected) < 0.035, draws.count(0)


def test_estimate_counts_the_last_window_groups_only():
    curriculum = PassRateCurriculum(1, window=2)
    curriculum.record(0, 4, 4, step=0)
    assert curriculum.pass_rate(0) == 1.0 and not curriculum.is_informative(0)
    curriculum.record(0, 0, 4, step=1)
    assert curriculum.pass_rate(0) == 0.5 and curriculum.is_informative(0)
    curriculum.record(0, 0, 4, step=2)  # the solved group has left the window
    assert curriculum.counts(0) == (0, 8) and not curriculum.is_informative(0)
    curriculum.record(0, 0, 0, step=3)  # every episode failed in the env: tried, estimate unchanged
    assert curriculum.counts(0) == (0, 8) and curriculum.last_tried[0] == 3
    assert PassRateCurriculum(1).pass_rate(0) is None
    with pytest.raises(ValueError, match="within 0..attempts"):
        curriculum.record(0, 5, 4, step=4)


def test_draw_is_determined_by_seed_step_and_round():
    outcomes = {i: (1 + i % 3, 4) for i in range(10)}  # every task informative, p in {1/4, 1/2, 3/4}
    a, b = _with(10, outcomes), _with(10, outcomes)
    draws = {}
    for step in range(8):
        for round_index in range(2):
            draws[step, round_index] = a.pick(3, curriculum_rng(5, step, round_index))
            assert draws[step, round_index] == b.pick(3, curriculum_rng(5, step, round_index))
    assert len({tuple(d) for d in draws.values()}) > 4  # steps and rounds differ
    assert a.pick(3, curriculum_rng(5, 2)) != a.pick(3, curriculum_rng(6, 2)) or \
        a.pick(3, curriculum_rng(5, 3)) != a.pick(3, curriculum_rng(6, 3))


def test_excluded_tasks_are_skipped_and_tasks_repeat_only_when_too_few_remain():
    curriculum = _with(3, {0: (2, 4), 1: (4, 4)}, explore=0.0)
    assert curriculum.pick(2, curriculum_rng(0, 0), exclude=[0]) == [2, 1]  # unseen 2 before tried 1
    assert curriculum.pick(1, curriculum_rng(0, 0), exclude=[0, 1, 2]) == [2]  # all drawn: the stalest again
    five = curriculum.pick(5, curriculum_rng(0, 0))
    assert five == [0, 2, 1, 2, 0]  # all three once, then again stalest first (never, step 0 rank 0, ...)


def test_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    curriculum = PassRateCurriculum(5, explore=0.4, window=3, order=[4, 3, 2, 1, 0])
    for step, (index, successes) in enumerate([(0, 1), (1, 4), (0, 3), (2, 0), (0, 2), (3, 2)]):
        curriculum.record(index, successes, 4, step=step)
    torch.save({"executor": {"curriculum": curriculum.state_dict()}}, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)["executor"]["curriculum"]
    restored = PassRateCurriculum(5, explore=0.4, window=3, order=[4, 3, 2, 1, 0])
    restored.load_state_dict(state)
    assert restored.recent == curriculum.recent and restored.last_tried == curriculum.last_tried
    assert restored.counts(0) == (6, 12) and restored.last_tried == [4, 1, 3, 5, -1]
    for step in range(6, 10):
        assert restored.pick(3, curriculum_rng(0, step)) == curriculum.pick(3, curriculum_rng(0, step))
    with pytest.raises(ValueError, match="covers 5 train tasks"):
        PassRateCurriculum(6).load_state_dict(state)


def test_stats_report_the_estimates_at_draw_time():
    curriculum = _with(4, {0: (2, 4), 1: (4, 4)})
    stats = CurriculumStats()
    stats.add(curriculum, [0, 1, 2])
    assert stats.metrics(curriculum) == {
        "curriculum/explored": 1.0, "curriculum/revisited": 1.0, "curriculum/informative_share": pytest.approx(1 / 3),
        "curriculum/informative_tasks": 1.0, "curriculum/unseen_tasks": 2.0, "curriculum/mean_pass_rate": 0.75}
    assert "curriculum/mean_pass_rate" not in CurriculumStats().metrics(curriculum)


# --- config ----------------------------------------------------------------------------------------


def test_curriculum_is_off_by_default_and_named_in_config_errors():
    assert RLConfig().tasks.curriculum is None
    cfg = load_config(RLConfig, data={}, overrides=["tasks.curriculum.explore=0.5"])
    assert cfg.tasks.curriculum.enabled and cfg.tasks.curriculum.explore == 0.5 and cfg.tasks.curriculum.window == 2
    with pytest.raises(ConfigError, match="tasks.curriculum.explore"):
        load_config(RLConfig, data={}, overrides=["tasks.curriculum.explore=1.5"])


def test_asynchronous_executors_refuse_the_curriculum():
    # refused when the config loads, before any model
    with pytest.raises(ConfigError, match="tasks.curriculum needs executor.kind: local"):
        load_config(RLConfig, data={}, overrides=["executor.kind=threads", "tasks.curriculum.enabled=true"])
    # and by the executor factory for a config built around the validator
    cfg = load_config(RLConfig, data={}, overrides=["executor.kind=threads"])
    cfg.tasks.curriculum = load_config(RLConfig, data={}, overrides=["tasks.curriculum.enabled=true"]).tasks.curriculum
    with pytest.raises(ValueError, match="tasks.curriculum needs executor.kind: local"):
        make_executor(cfg, None, None, None, None, [], version=0)


# --- RL runs ---------------------------------------------------------------------------------------


class FixedRateEnv(Env):
    """The outcome ignores the reply: task ``i`` is of kind ``kinds[i % len(kinds)]``; ``always``
    succeeds, ``never`` fails, ``half`` succeeds on every other episode of the task."""

    name = "test-fixed-rate"
    episodes: ClassVar[dict[str, int]] = {}  # episodes started per task id, across env instances

    def __init__(self, kinds: Sequence[str] = ("always", "never", "half")):
        self.kinds, self.succeeds = list(kinds), False

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return [Task(id=f"{split}-{i}", split=split, data={"kind": self.kinds[i % len(self.kinds)]}) for i in range(n)]

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    async def reset(self, task: Task) -> list[Message]:
        started = FixedRateEnv.episodes[task.id] = FixedRateEnv.episodes.get(task.id, 0) + 1
        kind = task.data["kind"]
        self.succeeds = kind == "always" or (kind == "half" and started % 2 == 0)
        return [Message(role="system", content="Reply with one word."), Message(role="user", content=task.id)]

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        return StepResult(reward=float(self.succeeds), terminated=True, info={"success": self.succeeds})

    def expert_action(self) -> Message:
        return Message(role="assistant", content="done")


@pytest.fixture(autouse=True)
def fixed_rate_env():
    register("test-fixed-rate", FixedRateEnv, overwrite=True)
    FixedRateEnv.episodes.clear()
    yield
    unregister("test-fixed-rate")


# task i's kind
KINDS = ["always", "half", "never", "half", "always", "half"]


def _config(out: Path, *overrides: str) -> RLConfig:
    data = {
        "model": {"name": "tiny-random"},
        "lora": {"enabled": True, "r": 4},
        "optim": {"lr": 1e-3},
        "env": {"name": "test-fixed-rate", "options": {"kinds": KINDS}},
        "tasks": {"train": 6, "test": 0, "seed": 0, "curriculum": {"explore": 0.5}},
        "tasks_per_step": 2,
        "group_size": 4,
        "rollout": {"max_turns": 1, "max_tokens_per_turn": 2, "concurrency": 8},
        "micro_batch_size": 4,
        "steps": 3,
        "output_dir": str(out),
        "logging": {"progress": False, "tensorboard": False},
        # this env's "half" outcome alternates on an episode counter kept across runs: the probe
        # set's expert episodes (played again on resume) would shift it
        "health": {"probe_tasks": 0},
    }
    return load_config(RLConfig, data=data, overrides=list(overrides))


def _drawn(run_dir: Path, step: int) -> list[str]:
    lines = (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text(encoding="utf-8").splitlines()
    return list(dict.fromkeys(json.loads(line)["task_id"] for line in lines))


def test_rl_run_draws_by_pass_rate_and_logs_the_curriculum(tmp_path):
    # step 1: nothing tried, the seeded order: 1 (half), 4 (always). From then on one exploit slot
    # (task 1, the only task with 0 < p < 1) and one explore slot (the next unseen: 0, then 2).
    assert list(task_order(6, 0, 0)) == [1, 4, 0, 2, 3, 5]  # the plain order: step 1 draws as it would
    result = train_rl(_config(tmp_path / "run"))
    assert [_drawn(result.run_dir, s) for s in (1, 2, 3)] == [["train-1", "train-4"], ["train-1", "train-0"],
                                                              ["train-1", "train-2"]]
    rows = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    curriculum = [{k.removeprefix("curriculum/"): v for k, v in r.items() if k.startswith("curriculum/")} for r in rows]
    base = {"revisited": 0.0, "informative_tasks": 1.0}
    assert curriculum == [
        {**base, "explored": 2.0, "informative_share": 0.0, "unseen_tasks": 4.0},
        {**base, "explored": 1.0, "informative_share": 0.5, "unseen_tasks": 3.0, "mean_pass_rate": 0.5},
        {**base, "explored": 1.0, "informative_share": 0.5, "unseen_tasks": 2.0, "mean_pass_rate": 0.5},
    ]
    assert [r["success_rate"] for r in rows] == [0.75, 0.75, 0.25]  # (2+4)/8, (2+4)/8, (2+0)/8


def test_rl_resume_continues_the_curriculum_exactly(tmp_path):
    # A dynamic-sampling round per step draws further tasks, never those of the step's first round.
    common = ("steps=4", "resample_rounds=1")
    straight = train_rl(_config(tmp_path / "a", *common))
    cfg = _config(tmp_path / "b", *common, "checkpoint.every=2")
    assert train_rl(cfg, stop_at_step=3).final_dir is None and [s for s, _ in list_checkpoints(cfg.output_dir)] == [2]
    resumed = train_rl(cfg, resume=True)
    assert resumed.step == 4

    def reproducible(run_dir: Path) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k.startswith(("curriculum/", "reward/", "train/loss", "success_rate"))}
                for r in read_metrics(run_dir) if r["step"] > 0]

    a, b = reproducible(straight.run_dir), reproducible(resumed.run_dir)
    assert len(a) == 4 and a == b
    for step in (1, 2, 3, 4):
        assert _drawn(straight.run_dir, step) == _drawn(resumed.run_dir, step)
    # step 1's second round: task 1 (half) was the only one with signal; the round skips 1 and 4
    assert _drawn(straight.run_dir, 1) == ["train-1", "train-4", "train-0", "train-2"]
    # step 3 depends on the estimates of steps 1-2, which the resumed run read from the checkpoint
    # (a fresh curriculum would take 1 and 4 again, both unseen): 1 or 3 (both p = 1/2), then unseen 5
    assert a[2]["curriculum/explored"] == 1.0 and _drawn(straight.run_dir, 3)[1] == "train-5"
