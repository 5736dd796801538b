"""The command line's contract: ``--version``; ``rollout``/``eval`` default their turn limit to the
env's own; every command's errors are one line on stderr (exit 2 for usage errors, 1 otherwise),
real bugs named with a ``--debug`` hint, and ``--debug`` shows the traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tracegym
import tracegym.cli as cli
from tracegym.cli import build_parser, main
from tracegym.commands.eval import default_turns


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tracegym {tracegym.__version__}"


def test_version_and_usage_error_in_a_real_process():
    done = subprocess.run([sys.executable, "-m", "tracegym", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"tracegym {tracegym.__version__}"
    bad = subprocess.run([sys.executable, "-m", "tracegym", "rollout", "--env", "calculatr", "--out", "x"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: ") and "calculator" in bad.stderr


def test_every_command_rejects_an_unknown_option_with_exit_code_2(capsys):
    commands = sorted(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001
    assert {"rollout", "eval", "sft", "rl", "serve", "inspect"} <= set(commands)
    for command in commands:
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--no-such-option"])
        assert exit_info.value.code == 2, command
        assert "Traceback" not in capsys.readouterr().err


def test_usage_error_is_one_line_exit_2(capsys, tmp_path):
    assert main(["rollout", "--env", "calculator", "--env-option", "nope=1", "--policy", "expert", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_expected_failure_is_one_line_exit_1(capsys, tmp_path):
    code = main(["inspect", str(tmp_path / "missing.jsonl")])
    err = capsys.readouterr().err
    assert code in (1, 2) and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_a_bug_is_one_line_with_a_debug_hint_and_debug_shows_it(capsys, monkeypatch, tmp_path):
    from tracegym.commands import inspect as inspect_command

    def broken(args):
        raise TypeError("unsupported operand\nsecond line")

    monkeypatch.setattr(inspect_command, "run", broken)
    assert main(["inspect", str(tmp_path / "x.jsonl")]) == 1
    err = capsys.readouterr().err
    assert err == "error: unexpected TypeError: unsupported operand second line (a bug in tracegym or a plugin; rerun with --debug for the traceback)\n"
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["inspect", str(tmp_path / "x.jsonl"), "--debug"])
    with pytest.raises(TypeError):
        main(["--debug", "inspect", str(tmp_path / "x.jsonl")])
    monkeypatch.setenv("TRACEGYM_DEBUG", "1")
    with pytest.raises(TypeError):
        main(["inspect", str(tmp_path / "x.jsonl")])


def test_error_classification():
    from tracegym.commands._policy import UsageError
    from tracegym.config import ConfigError

    assert cli.error_exit_code(UsageError("x"))[0] == 2
    assert cli.error_exit_code(ConfigError("x"))[0] == 2
    assert cli.error_exit_code(FileNotFoundError("f"))[0] == 1
    assert "--debug" not in cli.error_exit_code(FileNotFoundError("f"))[1]
    assert "--debug" in cli.error_exit_code(KeyError("k"))[1]


def test_default_turns():
    assert default_turns(8) == [1, 2, 4, 8]
    assert default_turns(20) == [1, 2, 4, 8, 16, 20]
    assert default_turns(1) == [1]


def _summary(tmp_path, *extra):
    out = tmp_path / "r"
    code = main(["rollout", "--env", "calculator", "--env-option", "num_calls=4", "--policy", "expert",
                 "--tasks", "3", "--no-logprob-gap", "--out", str(out), *extra])
    assert code == 0
    return json.loads((out / "summary.json").read_text())


def test_rollout_max_turns_defaults_to_the_env_limit(tmp_path, capsys):
    from tracegym.envs import make

    limit = make("calculator", num_calls=4).max_turns
    assert limit > 4  # the old default (4) was below it: 4-call problems need 5 turns
    summary = _summary(tmp_path)
    assert summary["config"]["max_turns"] == limit
    assert summary["success_rate"] == 1.0 and "max_turns" not in summary["end_reasons"]
    # an explicit flag wins; an env option changes the env's own limit
    assert _summary(tmp_path / "a", "--max-turns", "2")["config"]["max_turns"] == 2
    assert _summary(tmp_path / "b", "--env-option", "max_turns=6")["config"]["max_turns"] == 6
