"""pass@k, pass@(k,T), bootstrap intervals and eval.json: closed-form cases and properties."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pytest

from tracegym.eval import metrics as M
from tracegym.eval.evaluate import load_eval, summarize, write_eval
from tracegym.types import Message, ToolCall, Trajectory, Turn


def make_traj(task: str, index: int, success: bool, n_turns: int, *, env: str = "toy", tokens: int = 3,
              end_reason: str = "terminated", error: str | None = None, reward: float | None = None) -> Trajectory:
    """An episode with ``n_turns`` assistant turns, each a calculator call of ``tokens`` tokens."""
    turns, messages = [], [Message(role="user", content=f"task {task}")]
    for i in range(n_turns):
        msg = Message(role="assistant", tool_calls=(ToolCall(name="calc", arguments={"x": i}, id=f"c{i}"),))
        result = Message(role="tool", content="42", tool_call_id=f"c{i}", name="calc")
        turns.append(Turn(prompt_ids=tuple(range(10 + i)), completion_ids=tuple(range(tokens)), message=msg,
                          env_messages=(result,)))
        messages += [msg, result]
    return Trajectory(env=env, task_id=task, split="test", sample_index=index, messages=tuple(messages),
                      turns=tuple(turns), success=success, reward=float(success) if reward is None else reward,
                      end_reason=end_reason, error=error, policy="m",
                      tools=({"type": "function", "function": {"name": "calc", "parameters": {}}},))


# --- pass@k ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (5, 2, 1, 0.4),
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
        (4, 1, 4, 1.0),  # every 4-subset of 4 samples holds the correct one
        (10, 3, 5, 1 - 21 / 252),  # C(7,5)=21, C(10,5)=252
    ],
)
def test_pass_at_k_closed_form(n: int, c: int, k: int, expected: float) -> None:
    assert M.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_subset_enumeration() -> None:
    # The definition: the fraction of k-subsets of the n samples that contain a correct one.
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert M.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_stable_for_large_n() -> None:
    # The binomials here have ~60 digits; the product form must agree with exact rationals.
    n, c, k = 200, 50, 100
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert M.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert M.pass_at_k(10_000, 1, 1) == pytest.approx(1e-4, rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (3, 4, 1), (3, 1, 4), (3, 1, 0), (3, -1, 1)])
def test_pass_at_k_rejects_bad_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        M.pass_at_k(n, c, k)


# --- pass@(k,T) -------------------------------------------------------------------------------

# task A: (success, turns) = (Y,1) (Y,3) (N,2) (N,1); task B: (Y,2) (N,5) (N,5) (N,5)
HAND = [("A", [(True, 1), (True, 3), (False, 2), (False, 1)]), ("B", [(True, 2), (False, 5), (False, 5), (False, 5)])]
# solved within T: T=1 -> A 1, B 0; T=2 -> A 1, B 1; T=3 -> A 2, B 1
HAND_EXPECTED = {
    1: {1: (0.25 + 0) / 2, 2: (0.5 + 0) / 2},
    2: {1: (0.25 + 0.25) / 2, 2: (0.5 + 0.5) / 2},
    3: {1: (0.5 + 0.25) / 2, 2: (5 / 6 + 0.5) / 2},  # A at k=2: 1 - C(2,2)/C(4,2) = 5/6
}


def hand_trajectories() -> list[Trajectory]:
    return [make_traj(task, i, ok, t) for task, samples in HAND for i, (ok, t) in enumerate(samples)]


def test_pass_at_k_t_hand_case() -> None:
    tasks = M.group_by_task(hand_trajectories())
    assert [t.task_id for t in tasks] == ["A", "B"]
    assert [tasks[0].solved_within(t) for t in (1, 2, 3, None)] == [1, 1, 2, 2]
    got = M.pass_at_k_t(tasks, [1, 2], [1, 2, 3])
    for budget, row in HAND_EXPECTED.items():
        for k, value in row.items():
            assert got[budget][k] == pytest.approx(value, abs=1e-12), (budget, k)


def test_assistant_turns_falls_back_to_messages() -> None:
    traj = make_traj("A", 0, True, 3)
    assert M.assistant_turns(traj) == 3
    without_turns = traj.model_copy(update={"turns": ()})
    assert M.assistant_turns(without_turns) == 3


def test_duplicate_samples_are_rejected() -> None:
    trajs = [make_traj("A", 0, True, 1), make_traj("A", 0, False, 1)]
    with pytest.raises(ValueError, match="duplicate sample_index"):
        M.group_by_task(trajs)


def test_valid_ks_skips_k_above_fewest_samples() -> None:
    trajs = [make_traj("A", i, True, 1) for i in range(4)] + [make_traj("B", i, False, 1) for i in range(2)]
    kept, skipped = M.valid_ks([4, 1, 2, 8, 2], M.group_by_task(trajs))
    assert kept == [1, 2] and skipped == [4, 8]


def random_tasks(rng: np.random.Generator, n_tasks: int, n: int, max_t: int) -> list[M.TaskOutcomes]:
    return [
        M.TaskOutcomes(
            task_id=str(j),
            success=tuple(bool(x) for x in rng.random(n) < rng.random()),
            turns=tuple(int(x) for x in rng.integers(1, max_t + 1, n)),
        )
        for j in range(n_tasks)
    ]


@pytest.mark.parametrize("seed", range(20))
def test_pass_at_k_t_monotone_in_k_and_t(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 17))
    tasks = random_tasks(rng, int(rng.integers(1, 12)), n, 6)
    ks, budgets = list(range(1, n + 1)), [1, 2, 3, 4, 5, 6]
    values = M.pass_at_k_t_per_task(tasks, ks, budgets)  # (T, k, task)
    assert np.all(np.diff(values, axis=1) >= -1e-12), "pass@k must not decrease in k"
    assert np.all(np.diff(values, axis=0) >= -1e-12), "pass@(k,T) must not decrease in T"
    # at the largest T every success counts: pass@1 is the plain per-task success fraction
    np.testing.assert_allclose(values[-1, 0], [sum(t.success) / t.n for t in tasks])
    low, high = M.bootstrap_ci_matrix(values, n_resamples=200, seed=seed)
    # shared resamples keep the interval ends ordered in k and T as well
    assert np.all(np.diff(low, axis=1) >= -1e-12) and np.all(np.diff(high, axis=1) >= -1e-12)
    assert np.all(np.diff(low, axis=0) >= -1e-12) and np.all(np.diff(high, axis=0) >= -1e-12)
    assert np.all(low <= high + 1e-12)


# --- bootstrap ------------------------------------------------------------------------------


def test_bootstrap_matches_loop_implementation() -> None:
    values = np.array([0.0, 1.0, 0.5, 0.25, 1.0, 0.0, 0.75])
    low, high = M.bootstrap_ci(values, n_resamples=500, confidence=0.9, seed=3)
    # the same draws, resampled means computed one by one
    rng = np.random.default_rng(3)
    idx = rng.integers(0, len(values), size=(500, len(values)))
    means = np.array([values[row].mean() for row in idx])
    assert low == pytest.approx(np.quantile(means, 0.05), abs=1e-12)
    assert high == pytest.approx(np.quantile(means, 0.95), abs=1e-12)
    assert low < values.mean() < high


def test_bootstrap_degenerate_and_seeded() -> None:
    assert M.bootstrap_ci([0.3] * 5) == pytest.approx((0.3, 0.3))
    values = list(np.random.default_rng(0).random(30))
    assert M.bootstrap_ci(values, seed=7) == M.bootstrap_ci(values, seed=7)
    assert M.bootstrap_ci(values, seed=7) != M.bootstrap_ci(values, seed=8)
    with pytest.raises(ValueError):
        M.bootstrap_ci([])


def test_paired_difference() -> None:
    a = {"x": (4, 0), "y": (4, 4), "z": (4, 2)}
    b = {"x": (4, 4), "y": (4, 4), "z": (4, 2), "only_b": (4, 4)}
    diff, low, high, shared = M.paired_bootstrap_diff(a, b, k=1, n_resamples=300)
    assert shared == 3 and diff == pytest.approx(1 / 3)
    assert 0.0 <= low <= diff <= high <= 1.0


# --- summarize / eval.json ----------------------------------------------------------------------


def test_summarize_hand_case(tmp_path) -> None:
    trajs = hand_trajectories()
    trajs[-1] = make_traj("B", 3, False, 5, end_reason="env_error", error="ConnectionError: search server down\ntrace")
    s = summarize(trajs, ks=[1, 2, 8], turns=[3, 1, 2], env="toy", model="m", split="test", n_bootstrap=200)
    assert (s["env"], s["model"], s["split"]) == ("toy", "m", "test")
    assert s["n_tasks"] == 2 and s["samples_per_task"] == 4 and s["n_trajectories"] == 8
    assert s["ks"] == [1, 2] and s["skipped_ks"] == [8] and s["turns"] == [1, 2, 3]
    for budget, row in HAND_EXPECTED.items():
        for k, value in row.items():
            assert s["pass_at"][str(budget)][str(k)] == pytest.approx(value, abs=1e-6)
            low, high = s["pass_at_ci"][str(budget)][str(k)]
            assert 0.0 <= low <= high <= 1.0
    assert s["success_rate"] == pytest.approx(3 / 8)
    # 1+3+2+1 + 2+5+5+5 = 24 turns of 3 tokens each, one call per turn
    assert s["cost"]["turns"] == pytest.approx(24 / 8)
    assert s["cost"]["generated_tokens"] == pytest.approx(24 * 3 / 8)
    assert s["cost"]["tool_calls"] == pytest.approx(24 / 8)
    assert s["end_reasons"] == {"env_error": 1, "terminated": 7}
    assert s["errors"]["env_error"] == 1
    assert s["errors"]["top"] == [{"error": "ConnectionError: search server down", "count": 1}]
    assert s["per_task"]["A"] == {"n": 4, "solved": {"1": 1, "2": 1, "3": 2}}
    assert s["tool_calls"] is None  # no references in these episodes
    assert s["invalid_calls"]["invalid_call_rate"] == 0.0
    json.dumps(s)  # JSON-ready

    written = write_eval(tmp_path / "ev", s, trajs)
    assert load_eval(tmp_path / "ev") == s
    for name in ("pass_at_k", "pass_at_kt", "turns"):
        assert written[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "ev" / "trajectories.jsonl").read_text().splitlines()) == 8
    assert not list((tmp_path / "ev").glob(".*tmp"))


def test_summarize_defaults_and_errors() -> None:
    trajs = hand_trajectories()
    s = summarize(trajs, ks=[1, 4], n_bootstrap=50)
    assert s["turns"] == [5] and s["env"] == "toy" and s["split"] == "test" and s["model"] == "m"
    assert s["pass_at"]["5"]["4"] == pytest.approx(1.0)  # A and B each have a success among 4
    with pytest.raises(ValueError, match="at least one trajectory"):
        summarize([], ks=[1])
    with pytest.raises(ValueError, match="samples per task"):
        summarize(trajs, ks=[16])


def test_load_eval_rejects_other_json(tmp_path) -> None:
    (tmp_path / "eval.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a tracegym eval.json"):
        load_eval(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_eval(tmp_path / "nowhere")


def test_solved_per_task_reads_an_eval_summary_at_a_turn_budget():
    summary = {"per_task": {"a": {"n": 2, "solved": {"1": 0, "4": 2}}, "b": {"n": 2, "solved": {"1": 1, "4": 1}}}}
    assert M.solved_per_task(summary, 4) == M.solved_per_task(summary, "4") == {"a": (2, 2), "b": (2, 1)}
    assert M.solved_per_task(summary, 1) == {"a": (2, 0), "b": (2, 1)}
