"""Scoring passes as plugins (``tracegym.rl.scoring.SCORING_PASSES``): the registry and its errors,
the example plugin (``examples/plugins/overlong_penalty.py``, DAPO's soft overlong punishment)
against hand values, its effect on the estimator, and a run of ``tracegym rl`` that uses it by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracegym.algos import PolicyLossConfig, estimate
from tracegym.cli import main
from tracegym.config import RLConfig
from tracegym.plugins import load_plugins
from tracegym.rl.scoring import SCORING_PASSES, ScoringJob, score_and_estimate, scoring_problems
from tracegym.types import Message, Trajectory, TrajectoryGroup, Turn

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plugins" / "overlong_penalty.py"


def _episode(task: str, index: int, reward: float, sampled: int) -> Trajectory:
    turn = Turn(prompt_ids=(1, 2), completion_ids=tuple(range(3, 3 + sampled)),
                message=Message(role="assistant", content="x"), reward=reward)
    return Trajectory(env="t", task_id=task, sample_index=index, messages=(), turns=(turn,), reward=reward,
                      success=reward > 0)


@pytest.fixture(scope="module")
def overlong():
    load_plugins([str(EXAMPLE)])
    return SCORING_PASSES.entry("overlong_penalty")


def test_builtins_are_registered_and_problems_are_one_line_each(overlong):
    assert {"info_gain", "mc_continuation", "overlong_penalty"} <= set(SCORING_PASSES.names())
    assert scoring_problems("none", {}) == [] and scoring_problems("info_gain", {}) == []
    assert "Did you mean 'info_gain'" in scoring_problems("info_gian", {})[0]
    problem = scoring_problems("overlong_penalty", {"max_tokens": 10})[0]
    assert problem.startswith("advantage.intrinsic_options of 'overlong_penalty'") and "cache_tokens" in problem
    assert "no scoring pass is set" in scoring_problems("none", {"weight": 1.0})[0]
    assert "mc_k" in scoring_problems("mc_continuation", {"mc_k": 3})[0]  # built-ins read advantage.mc_*


def test_the_overlong_penalty_matches_dapo_by_hand(overlong):
    # max 10, cache 4: free up to 6 tokens, then (6 - n) / 4, then -1 beyond 10
    groups = [TrajectoryGroup(env="t", task_id="a", trajectories=tuple(
        _episode("a", i, 1.0, n) for i, n in enumerate((6, 8, 10, 11))))]
    job = ScoringJob(groups, [], None, None, None, None, 0, 1.0, 0)  # type: ignore[arg-type]
    scored, metrics = overlong(job, {"max_tokens": 10, "cache_tokens": 4})
    rewards = [t.reward for t in scored[0].trajectories]
    assert rewards == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert [t.turns[-1].reward for t in scored[0].trajectories] == pytest.approx(rewards)  # turn sum = episode reward
    assert metrics == {"overlong/penalty_mean": pytest.approx(-2.5 / 4), "overlong/penalised": 3.0}
    with pytest.raises(ValueError, match="cache_tokens <= max_tokens"):
        overlong(job, {"max_tokens": 4, "cache_tokens": 5})


def test_the_pass_runs_before_the_estimator(overlong):
    # two equally right answers: without the pass GRPO sees no signal, with it the shorter one wins
    groups = [TrajectoryGroup(env="t", task_id="a", trajectories=(_episode("a", 0, 1.0, 6), _episode("a", 1, 1.0, 9)))]
    cfg = RLConfig.model_validate({"model": {"name": "tiny-random"}, "env": {"name": "calculator"}, "advantage": {
        "intrinsic": "overlong_penalty", "intrinsic_options": {"max_tokens": 10, "cache_tokens": 4}}})
    assert estimate("grpo", groups).advantages[0] == [[0.0], [0.0]]
    scored, result, kl = score_and_estimate(groups, [], cfg, PolicyLossConfig(**cfg.policy_loss), sampler=None, model=None, reference=None,
                                            renderer=None, pad_token_id=0, temperature=1.0, seed=0)
    (short,), (long,) = result.advantages[0]
    assert short > 0 > long and short == pytest.approx(-long) and kl == 0.0
    assert result.metrics["overlong/penalised"] == 1.0 and scored[0].trajectories[1].reward == pytest.approx(0.25)


def test_rl_runs_a_plugin_pass_by_name_and_refuses_a_misspelt_one(tmp_path, capsys):
    def config(name: str, intrinsic: str) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            f"plugins: ['{EXAMPLE}']\nmodel: {{name: tiny-random}}\nlora: {{r: 4}}\n"
            "env: {name: calculator, options: {num_calls: 1}}\ntasks: {train: 4, test: 0}\ntasks_per_step: 2\n"
            "group_size: 2\nrollout: {max_turns: 2, max_tokens_per_turn: 6, concurrency: 8}\nsteps: 1\n"
            f"advantage: {{intrinsic: {intrinsic}, intrinsic_options: {{max_tokens: 8, cache_tokens: 4}}}}\n"
            f"skip_uniform_groups: false\nhealth: {{probe_tasks: 0}}\noutput_dir: '{tmp_path / name}'\n"
            "logging: {progress: false, tensorboard: false}\n", encoding="utf-8")
        return path

    assert main(["rl", "--config", str(config("run", "overlong_penalty"))]) == 0
    row = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert "advantage/overlong/penalty_mean" in row and row["advantage/overlong/penalty_mean"] <= 0.0
    assert main(["rl", "--config", str(config("bad", "overlong_penalti"))]) == 2
    assert "Did you mean 'overlong_penalty'" in capsys.readouterr().err
