"""bench/calc_confusion.py: the per-template operator table an RL analysis reads (no model)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from tracegym.environments.calculator import generate_problem

_SPEC = importlib.util.spec_from_file_location("calc_confusion", Path(__file__).resolve().parents[1] / "bench" / "calc_confusion.py")
calc_confusion = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(calc_confusion)


def _episode(problem: dict, used: list[str]) -> dict:
    turns = [{"message": {"role": "assistant", "content": "", "tool_calls": [
        {"name": "calculate", "arguments": {"expression": expression}}]}} for expression in used]
    return {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": problem["question"]}],
            "turns": turns, "info": {"reference_calls": problem["reference_calls"]}}


def _problem_with(needed_at_1: str) -> dict:
    rng = random.Random(0)
    while True:
        problem = generate_problem(rng, 3)
        if calc_confusion.operator(problem["reference_calls"][1]["arguments"]["expression"]) == needed_at_1:
            return problem


def test_operator_and_template():
    assert calc_confusion.operator("765 // 36") == "//"
    assert calc_confusion.operator("(12) - 5") == "-"
    assert calc_confusion.operator("hello") == "?"
    assert calc_confusion.template("It spends 40 dollars of that money.") == "X spends N dollars of that money."
    assert calc_confusion.template("A farm collects 12 baskets of 40 eggs each.") == "X collects N OBJ of N OBJ each."


def test_walks_to_the_first_wrong_operator_and_tabulates(tmp_path):
    problem = _problem_with("-")
    reference = [call["arguments"]["expression"] for call in problem["reference_calls"]]
    wrong = reference[1].replace(" - ", " + ")
    right_run, wrong_run = tmp_path / "sft", tmp_path / "rl"
    for run, used in ((right_run, reference), (wrong_run, [reference[0], wrong, reference[2]])):
        run.mkdir()
        (run / "trajectories.jsonl").write_text(json.dumps(_episode(problem, used)) + "\n", encoding="utf-8")
    assert [d[1:] for d in calc_confusion.episode_decisions(_episode(problem, reference))] == [
        ("-", "-"), (calc_confusion.operator(reference[2]),) * 2]
    # the wrong run stops at its wrong call: the third call is not counted
    [(template, needed, used)] = list(calc_confusion.episode_decisions(_episode(problem, [reference[0], wrong])))
    assert (needed, used) == ("-", "+") and "N" in template
    table = calc_confusion.confusion(wrong_run)
    assert table[(template, "-")] == {"+": 1} and sum(sum(c.values()) for c in table.values()) == 1


def test_a_file_that_is_not_a_calculator_eval_names_its_line(tmp_path):
    (tmp_path / "trajectories.jsonl").write_text('{"messages": []}\n', encoding="utf-8")
    with pytest.raises(SystemExit, match=r"trajectories.jsonl:1: not a calculator eval episode"):
        calc_confusion.confusion(tmp_path)
