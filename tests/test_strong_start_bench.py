"""bench/strong_start.py's comparisons (no model is loaded): the per-operator split and ``--against``,
the paired difference of a run's RL evaluation against another run's on the same test tasks (the
replay-only control against the demo's GRPO + replay)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "strong_start", Path(__file__).resolve().parents[1] / "bench" / "strong_start.py")
strong_start = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(strong_start)


def _task(task_id: str, *templates: str) -> SimpleNamespace:
    return SimpleNamespace(id=task_id, data={"templates": list(templates)})


def _summary(solved: dict[str, int], n: int = 2) -> dict:
    """An eval.json as far as the comparison reads it: per task (n, solved within 4 turns), pass@1."""
    return {"per_task": {t: {"n": n, "solved": {"4": c}} for t, c in solved.items()},
            "pass_at": {"4": {"1": sum(solved.values()) / (n * len(solved))}}}


TASKS = [_task("a", "{x} * 3", "{x} - 129"), _task("b", "{x} * 2", "{x} + 7"), _task("c", "{x} * 5", "{x} - 1"),
         _task("d", "{x} * 4", "{x} % 9")]


def test_against_row_is_the_paired_difference_and_splits_it_by_operator():
    other = _summary({"a": 2, "b": 0, "c": 1, "d": 1})
    rl = _summary({"a": 2, "b": 2, "c": 0, "d": 1})
    row = strong_start.against_row(TASKS, other, rl, "4")
    # per task pass@1 differences: 0, +1, -0.5, 0 -> mean +0.125
    assert row["pass@1"] == pytest.approx(0.5) and row["diff"] == pytest.approx(0.125) and row["tasks"] == 4
    assert row["ci"][0] <= row["diff"] <= row["ci"][1]
    ops = row["operators"]
    assert set(ops) == {"*", "-", "+", "%"}  # "//" is in no task's chain
    assert (ops["-"]["tasks"], ops["-"]["sft"], ops["-"]["rl"], ops["-"]["diff"]) == (2, 0.75, 0.5, pytest.approx(-0.25))
    assert (ops["+"]["tasks"], ops["+"]["sft"], ops["+"]["rl"], ops["+"]["diff"]) == (1, 0.0, 1.0, pytest.approx(1.0))
    assert ops["*"]["tasks"] == 4 and ops["*"]["diff"] == pytest.approx(0.125)


def test_against_refuses_an_evaluation_of_other_tasks():
    other = _summary({"a": 2, "b": 0, "x": 1, "y": 1})  # two of the four test tasks
    rl = _summary({"a": 2, "b": 2, "c": 0, "d": 1})
    with pytest.raises(SystemExit, match="shares 2 of the 4 test tasks"):
        strong_start.against_row(TASKS, other, rl, "4")
