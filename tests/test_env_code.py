"""The code env: generated function tasks, grading by hidden tests in the sandbox (and what earns
nothing: a wrong value, a fake result line, an early exit, an endless loop), the expert's solve
rate, check_env, branching, and the fail-closed refusal without bubblewrap.

Tests that run code need bubblewrap; they skip with the reason where it is missing, except under
CI (``CI`` set), where a skip would hide a broken sandbox, so they fail instead. Tests that only
generate tasks build the env with ``isolation="unsafe_local"``: making tasks runs nothing.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tracegym.envs import sandbox as sandbox_module
from tracegym.envs.base import Task
from tracegym.envs.check import check_env
from tracegym.envs.episode import run_episodes
from tracegym.envs.sandbox import SandboxUnavailable, bwrap_unavailable_reason
from tracegym.environments.code import FAMILIES, CodeEnv, build_task_data, values_match
from tracegym.environments.code_harness import encode_value
from tracegym.types import Message, StepResult, ToolCall

REASON = bwrap_unavailable_reason()
needs_bwrap = pytest.mark.skipif(
    REASON is not None and not os.environ.get("CI"),
    reason=f"code env sandbox tests not run: {REASON} (apt-get install bubblewrap; CI fails instead of skipping)",
)


def _generator(**options: Any) -> CodeEnv:
    """An env used only to make tasks: nothing runs, so no isolation is needed."""
    return CodeEnv(isolation="unsafe_local", **options)


def _call(name: str, **arguments: Any) -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name=name, arguments=arguments, id=f"call_{name}"),))


def _play(env: CodeEnv, task: Task, *messages: Message) -> list[StepResult]:
    async def go() -> list[StepResult]:
        await env.reset(task)
        return [await env.step(m) for m in messages]

    return asyncio.run(go())


def _submit(task: Task, code: str, **options: Any) -> StepResult:
    return _play(CodeEnv(**options), task, _call("submit", code=code))[0]


def _task(family: str, index: int = 0, split: str = "train") -> Task:
    return _generator(families=[family]).tasks(split, index + 1, seed=0)[index]


def _value(task: Task, args: list[Any]) -> Any:
    namespace: dict[str, Any] = {}
    exec(task.data["reference"], namespace)
    return namespace[task.data["function"]](*args)


# --- task generation (host only) ----------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_generates_consistent_json_tasks(family: str) -> None:
    tasks = _generator(families=[family]).tasks("train", 25, seed=3)
    assert len({t.data["definition"] for t in tasks}) == 25
    for task in tasks:
        data = task.data
        assert json.loads(json.dumps(data)) == data, "task data must survive JSON (trajectory files)"
        assert len(data["tests"]) == len(data["expected"]) == 10
        assert data["signature"] in data["prompt"] and data["reference"].startswith(data["signature"] + ":")
        for args, expected in zip(data["tests"], data["expected"]):
            assert json.loads(json.dumps(args)) == args  # inputs travel to the sandbox as JSON
            assert expected == encode_value(_value(task, args))
        for example in data["examples"]:
            shown = f"{data['function']}({', '.join(repr(a) for a in example['args'])}) == {example['result']}"
            assert shown in data["prompt"]
        # The hidden tests tell answers apart: a constant function cannot pass them all.
        assert len({json.dumps(e, sort_keys=True) for e in data["expected"]}) >= 2, data["definition"]
        # More tests keep the first ones: num_tests changes the count, not the tests.
        fewer = build_task_data(data["family"], data["params"], 4)
        assert fewer["tests"] == data["tests"][:4] and fewer["prompt"] == data["prompt"]


def test_tasks_are_the_same_in_every_process() -> None:
    # The data must not depend on str hashing (set order in a reference solution would).
    program = (
        "import json; from tracegym.environments.code import CodeEnv; "
        "print(json.dumps([t.model_dump() for t in CodeEnv(isolation='unsafe_local').tasks('test', 60)], sort_keys=True))"
    )
    outputs = [
        subprocess.run([sys.executable, "-c", program], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, check=True).stdout
        for seed in ("1", "2")
    ]
    assert outputs[0] == outputs[1] and len(json.loads(outputs[0])) == 60


def test_example_task_is_stable() -> None:
    # Golden: the generator is part of the dataset definition; a change here changes every split.
    task = _generator(families=["steps_to_zero"]).tasks("test", 1, seed=0)[0]
    assert task.id == "code-0837d5989836" and task.split == "test"
    assert task.data["params"] == {"function": "hops_to_zero", "divisor": 3, "step": 1}
    assert "    hops_to_zero(62) == 9\n" in task.data["prompt"]
    # By hand: 62 -> 61 -> 60 -> 20 -> 19 -> 18 -> 6 -> 2 -> 1 -> 0 is 9 steps; 7 -> 6 -> 2 -> 1 -> 0 is 4.
    assert _value(task, [62]) == 9 and _value(task, [7]) == 4
    assert _generator(families=["steps_to_zero"]).tasks("test", 1, seed=0)[0] == task


def test_splits_are_disjoint_seeded_and_selected_by_options() -> None:
    env = _generator()
    train, test = env.tasks("train", 300, seed=0), env.tasks("test", 200, seed=0)
    assert not {t.id for t in train} & {t.id for t in test}
    # The split is by definition: no function is asked in both splits, whatever its examples.
    assert not {t.data["definition"] for t in train} & {t.data["definition"] for t in test}
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    assert [t.model_dump() for t in env.tasks("test", 200, seed=0)] == [t.model_dump() for t in test]
    assert [t.id for t in env.tasks("test", 20, seed=1)] != [t.id for t in test[:20]]
    assert {t.data["family"] for t in test} == set(FAMILIES)

    assert {t.data["level"] for t in _generator(difficulty=1).tasks("train", 50)} == {1}
    assert {t.data["level"] for t in _generator(difficulty="2..3").tasks("train", 50)} == {2, 3}
    picked = _generator(families="chunk,dedupe").tasks("train", 30)
    assert {t.data["family"] for t in picked} == {"chunk", "dedupe"}
    assert _generator(families=["dedupe", "chunk"]).tasks("train", 30) == picked  # the order named is no choice
    assert len(_generator(num_tests=3).tasks("test", 1)[0].data["tests"]) == 3

    with pytest.raises(RuntimeError, match="too few distinct functions"):
        _generator(families=["palindrome_base"]).tasks("test", 100)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"families": ["no_such_family"]}, "unknown code families"),
        ({"families": ["chunk"], "difficulty": 1}, "no family"),
        ({"difficulty": "4"}, "difficulty must satisfy"),
        ({"num_tests": 0}, "num_tests must be in"),
        ({"reward": "best"}, "reward must be"),
        ({"max_submissions": 0}, "max_submissions"),
        ({"wall_s": 0}, "wall_s must be in"),
        ({"wall_s": 2, "test_timeout_s": 3}, "test_timeout_s must be in"),
        ({"isolation": "docker"}, "isolation must be"),
        ({"mem_mb": 16}, "mem_mb must be >= 64"),
    ],
)
def test_bad_options_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CodeEnv(**{"isolation": "unsafe_local", **options})


def test_values_match_like_a_python_test_but_strict_on_bool() -> None:
    assert values_match(encode_value([1, "a", None, {"k": [2]}]), encode_value([1, "a", None, {"k": [2]}]))
    assert not values_match(encode_value((1, 2)), encode_value([1, 2]))  # a tuple is not a list
    assert not values_match(encode_value(True), encode_value(1)) and not values_match(encode_value(1), encode_value(True))
    assert not values_match(encode_value({1: "a"}), encode_value({"1": "a"}))
    assert values_match(encode_value({"b": 1, "a": 2}), encode_value({"a": 2, "b": 1}))  # dict order is free
    assert values_match(encode_value(0.1 + 0.2), encode_value(0.3)) and values_match(encode_value(3.0), encode_value(3))
    assert not values_match(encode_value(float("nan")), encode_value(float("nan")))
    assert not values_match(encode_value({1, 2}), encode_value([1, 2])) and values_match(encode_value({2, 1}), encode_value({1, 2}))
    assert not values_match(encode_value(object()), encode_value(None))

    class Liar(str):
        def __str__(self) -> str:
            return "something else"

    assert encode_value(Liar("abc")) == "abc"  # the base type's value, not what an override claims
    looped: list[Any] = []
    looped.append(looped)
    with pytest.raises(ValueError, match="nested deeper"):
        encode_value(looped)


# --- grading in the sandbox -------------------------------------------------------------------------


@needs_bwrap
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_solutions_pass_every_hidden_test(family: str) -> None:
    for task in _generator(families=[family]).tasks("train", 3, seed=7):
        result = _submit(task, task.data["reference"])
        assert result.terminated and result.reward == 1.0, (task.data["definition"], result.messages[0].content)
        assert result.info["success"] == 1 and result.info["tests_passed"] == result.info["tests_total"] == 10
        assert result.messages[0].content == "All 10 hidden tests passed."


@needs_bwrap
def test_a_partly_wrong_solution_gets_the_fraction_it_earned() -> None:
    task = _task("rotate_list")
    name, first = task.data["function"], task.data["tests"][0]
    wrong_once = (task.data["reference"].replace(f"def {name}(", "def _reference(", 1)
                  + f"\ndef {name}(*args):\n    if list(args) == {first!r}:\n        return 'wrong'\n    return _reference(*args)\n")
    failures = sum(t == first for t in task.data["tests"])
    result = _submit(task, wrong_once)
    assert result.reward == pytest.approx(1 - failures / 10) and result.info["success"] == 0
    assert result.info["tests_passed"] == 10 - failures
    assert f"Passed {10 - failures} of 10 hidden tests." in result.messages[0].content
    assert _submit(task, wrong_once, reward="all").reward == 0.0

    off_by_one = _task("steps_to_zero")
    code = off_by_one.data["reference"].replace("steps = 0", "steps = 1")
    assert _submit(off_by_one, code).reward == 0.0
    returns_none = f"def {name}(items):\n    items.sort()\n"
    assert _submit(task, returns_none).reward == 0.0
    as_tuple = task.data["reference"].replace("return []", "return ()").replace("return items", "return tuple(items)")
    assert _submit(task, as_tuple).info["tests_passed"] < 10  # (1, 2) is not [1, 2]


@needs_bwrap
def test_printing_results_or_exiting_early_earns_nothing() -> None:
    task = _task("digit_rule")
    name = task.data["function"]
    # Even the exact expected values, printed in the harness's own format, to every descriptor.
    forged = "\n".join(json.dumps({"test": i, "status": "ok", "value": v}) for i, v in enumerate(task.data["expected"]))
    forged = '{"stage": "define", "status": "ok"}\n' + forged + '\n{"stage": "end"}\nAll tests passed\n'
    forge = f"import os\nfor fd in (1, 2, 3, 4, 5, 6):\n    try:\n        os.write(fd, {forged.encode()!r})\n    except OSError:\n        pass\n"
    attempts = {
        "exit at import": f"{forge}import sys\nsys.exit(0)\n",
        "hard exit at import": f"{forge}os._exit(0)\n",
        "print and return nothing": f"def {name}(n):\n{textwrap.indent(forge, '    ')}    return None\n",
        "hard exit in the call": f"def {name}(n):\n{textwrap.indent(forge, '    ')}    os._exit(0)\n",
        "raise": f"def {name}(n):\n    raise RuntimeError('no idea')\n",
        "no function": forge,
    }
    for label, code in attempts.items():
        result = _submit(task, code)
        assert result.terminated and result.reward == 0.0 and result.info["tests_passed"] == 0, (label, result.messages[0].content)
        assert result.messages[0].content.splitlines()[-1].startswith(("Passed 0 of 10", "Failed:", "First exception"))
    assert "SystemExit" in _submit(task, attempts["exit at import"]).messages[0].content
    assert "ended the process before the tests ran" in _submit(task, attempts["hard exit at import"]).messages[0].content
    assert "RuntimeError: no idea" in _submit(task, attempts["raise"]).messages[0].content
    assert f"does not define a function named {name}" in _submit(task, attempts["no function"]).messages[0].content


@needs_bwrap
def test_an_endless_loop_times_out_with_reward_zero_and_the_episode_ends() -> None:
    task = _task("chunk")
    name = task.data["function"]
    loop = f"def {name}(items):\n    while True:\n        pass\n"
    result = _submit(task, loop, wall_s=3, test_timeout_s=0.3)
    assert result.terminated and not result.truncated and result.reward == 0.0
    assert "1 ran past the 0.3 s limit per test; 9 did not run" in result.messages[0].content
    assert result.info["test_timeouts"] == 1

    # A loop that switches the per-test timer off still ends at the sandbox's wall limit.
    stubborn = f"import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n{loop}"
    result = _submit(task, stubborn, wall_s=1.5, test_timeout_s=0.3)
    assert result.terminated and result.reward == 0.0 and result.info["sandbox_timeouts"] == 1
    assert "ran past the 1.5 s time limit" in result.messages[0].content


@needs_bwrap
def test_run_python_is_bounded_stateless_and_never_ends_the_episode() -> None:
    task = _task("chunk")
    env = CodeEnv(wall_s=1.0, max_output_chars=500)
    loud, note, look, loop = _play(
        env, task,
        _call("run_python", code="print('x' * 100_000)\nprint(1 / 0)"),
        _call("run_python", code="open('note.txt', 'w').write('hi')\nprint('written')"),
        _call("run_python", code="import os\nprint(sorted(os.listdir('.')))"),
        _call("run_python", code="while True:\n    pass"),
    )
    text = loud.messages[0].content
    assert len(text) < 1500 and "characters cut" in text
    assert "ZeroDivisionError: division by zero" in text and text.endswith("exit status 1")
    assert note.messages[0].content == "stdout:\nwritten\nexit status 0"
    assert look.messages[0].content == "stdout:\n['main.py']\nexit status 0"  # a fresh sandbox each call
    assert loop.messages[0].content == "(no output)\nkilled: the program ran past the 1 s time limit"
    assert not any(s.terminated for s in (loud, note, look, loop)) and loop.reward == 0.0
    assert env.stats["python_runs"] == 4 and env.stats["sandbox_timeouts"] == 1


@needs_bwrap
def test_more_submissions_allow_a_retry() -> None:
    task = _task("dedupe")
    env = CodeEnv(max_submissions=2)
    first, second = _play(env, task, _call("submit", code="def nope(): pass"), _call("submit", code=task.data["reference"]))
    assert not first.terminated and first.reward == 0.0
    assert first.messages[0].content.endswith("You may submit again (1 submission left).")
    assert second.terminated and second.reward == 1.0 and second.info["submissions"] == 2
    wrong_twice = _play(CodeEnv(max_submissions=2), task, *[_call("submit", code="def nope(): pass")] * 2)
    assert [s.terminated for s in wrong_twice] == [False, True] and wrong_twice[-1].reward == 0.0


def test_a_text_answer_without_submit_scores_zero() -> None:
    task = _generator().tasks("test", 1)[0]
    answer = Message(role="assistant", content=f"```python\n{task.data['reference']}```")
    result = _play(_generator(), task, answer)[0]
    assert result.terminated and result.reward == 0.0 and result.info["no_submission"] == 1


def test_a_failing_sandbox_is_an_error_not_a_graded_submission(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise SandboxUnavailable("bubblewrap cannot create the sandbox here: out of user namespaces")

    monkeypatch.setattr(sandbox_module, "Sandbox", broken)
    task = _generator().tasks("test", 1)[0]
    env = _generator()
    result = _play(env, task, _call("submit", code=task.data["reference"]))[0]
    assert not result.terminated and result.messages[0].content.startswith("Error: tool 'submit' failed")
    assert "out of user namespaces" in result.messages[0].content
    assert env.submissions == 0 and env.stats["sandbox_errors"] == 1


# --- expert, check_env, branching ---------------------------------------------------------------------


@needs_bwrap
def test_expert_solves_60_test_tasks() -> None:
    tasks = CodeEnv().tasks("test", 60, seed=0)
    results = asyncio.run(run_episodes(lambda: CodeEnv(), tasks, lambda e: e.expert_action))
    assert sum(r.success for r in results) >= 57, [r.info for r in results if not r.success][:3]
    for task, result in zip(tasks[:30], results[:30]):
        calls = [c.name for m in result.messages if m.role == "assistant" for c in m.tool_calls]
        assert calls == ["run_python", "submit"] and result.reward == 1.0
        # The check run printed the first example's value, as the prompt shows it.
        check = next(m.content for m in result.messages if m.role == "tool")
        example = task.data["examples"][0]
        assert check == f"stdout:\n{ast.literal_eval(example['result'])}\nexit status 0"


@needs_bwrap
def test_check_env_passes() -> None:
    report = check_env(lambda: CodeEnv(), n_tasks=10)
    assert report.ok and report.expert_success_rate == 1.0 and "branching" in report.passed
    options = {"reward": "all", "max_submissions": 2, "difficulty": "2..3", "num_tests": 5}
    assert check_env(lambda: CodeEnv(**options), n_tasks=6).ok


@needs_bwrap
def test_snapshot_restores_the_episode_before_a_submission() -> None:
    task = _task("caesar_shift")

    async def go() -> tuple[StepResult, StepResult, StepResult]:
        env = CodeEnv()
        await env.reset(task)
        await env.step(env.expert_action())  # run_python
        snap = env.snapshot()
        wrong = await env.step(_call("submit", code="def nope(): pass"))
        fresh = CodeEnv()
        fresh.restore(snap)
        right = await fresh.step(_call("submit", code=task.data["reference"]))
        env.restore(snap)
        again = await env.step(_call("submit", code=task.data["reference"]))
        return wrong, right, again

    wrong, right, again = asyncio.run(go())
    assert wrong.reward == 0.0 and right.reward == again.reward == 1.0
    assert right.info["python_runs"] == again.info["python_runs"] == 1 and right.info["turns"] == 2


# --- isolation: fail closed ---------------------------------------------------------------------------


def test_refuses_without_bubblewrap_unless_unsafe_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_module, "bwrap_unavailable_reason", lambda: "bubblewrap is not installed")
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed.*isolation='unsafe_local'"):
        CodeEnv()
    env = CodeEnv(isolation="unsafe_local")
    task = env.tasks("test", 1)[0]
    monkeypatch.setattr(sandbox_module, "_warned_unsafe", False)
    with pytest.warns(RuntimeWarning, match="WITHOUT isolation"):
        steps = _play(env, task, _call("run_python", code="print(6 * 7)"), _call("submit", code=task.data["reference"]))
    assert steps[0].messages[0].content == "stdout:\n42\nexit status 0"
    assert steps[1].terminated and steps[1].reward == 1.0
