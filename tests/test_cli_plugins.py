"""Envs from outside tracegym, end to end through the command line (a subprocess, as a user runs it):

- an installed-looking distribution (``mypkg-0.1.dist-info`` with an ``entry_points.txt`` declaring
  ``[tracegym.envs]``) on PYTHONPATH: ``envs``, ``envs expert``, ``rollout``, ``eval``, ``sft`` (on
  the trajectories recorded in it) and ``rl`` with the tiny-random model;
- a plain module named with ``--plugin path.py`` (the docs' example env): ``envs`` and ``rollout``;
- a bad env name or option stops ``rl``/``eval``/``rollout``/``demo`` with one line, before any model loads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tracegym.cli import main

REPO = Path(__file__).resolve().parents[1]

PACKAGE = '''
from tracegym.environments.calculator import CalculatorEnv


class PlugCalcEnv(CalculatorEnv):
    """One-call arithmetic from an installed plugin package."""

    description = "Plugin arithmetic from the mypkg entry point."

    def __init__(self, num_calls=1, max_turns=None, test_fraction=0.2):
        super().__init__(num_calls=num_calls, max_turns=max_turns, test_fraction=test_fraction)
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that looks like site-packages with one installed distribution, ``mypkg``."""
    root = tmp_path_factory.mktemp("site")
    (root / "tgplug_envs").mkdir()
    (root / "tgplug_envs" / "__init__.py").write_text(PACKAGE)
    info = root / "mypkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tracegym.envs]\nplugcalc = tgplug_envs:PlugCalcEnv\n")
    return root


def tracegym(cwd: Path, *args: str, site: Path | None = None) -> subprocess.CompletedProcess:
    paths = ([str(site)] if site else []) + [str(REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "tracegym", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- an entry-point env -------------------------------------------------------------------------


def test_entry_point_env_is_listed_and_its_expert_runs(site: Path, tmp_path: Path) -> None:
    listed = _ok(tracegym(tmp_path, "envs", site=site))
    assert re.search(r"^plugcalc\s+Plugin arithmetic from the mypkg entry point\.$", listed, re.M), listed
    assert "plugcalc" not in _ok(tracegym(tmp_path, "envs"))  # not installed: not listed
    expert = _ok(tracegym(tmp_path, "envs", "expert", "plugcalc", "--tasks", "5", site=site))
    assert re.search(r"^plugcalc\s+5/5\s+100.0%", expert, re.M), expert


def test_entry_point_env_through_rollout_sft_eval_and_rl(site: Path, tmp_path: Path) -> None:
    # rollout: the scripted expert records trajectories of the plugin env
    _ok(tracegym(tmp_path, "rollout", "--env", "plugcalc", "--policy", "expert", "--model", "tiny-random",
                 "--tasks", "4", "--no-progress", "--out", "expert", site=site))
    recorded = _lines(tmp_path / "expert" / "trajectories.jsonl")
    assert len(recorded) == 4 and {t["env"] for t in recorded} == {"plugcalc"} and all(t["success"] for t in recorded)

    # sft has no env: it trains on those recorded trajectories
    (tmp_path / "sft.yaml").write_text(
        "model: {name: tiny-random}\nlora: {r: 4}\ndata: {train_files: [expert/trajectories.jsonl]}\n"
        "batch_size: 2\nmicro_batch_size: 2\nmax_steps: 1\noutput_dir: sft\nlogging: {progress: false, tensorboard: false}\n"
    )
    assert "sft done: 1 steps" in _ok(tracegym(tmp_path, "sft", "-c", "sft.yaml", site=site))

    # eval with the tiny-random model
    _ok(tracegym(tmp_path, "eval", "--env", "plugcalc", "--model", "tiny-random", "--tasks", "2", "--samples", "1",
                 "--k", "1", "--turns", "1,2", "--max-tokens-per-turn", "8", "--no-progress", "--out", "eval", site=site))
    summary = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert summary["env"] == "plugcalc" and summary["n_tasks"] == 2

    # rl: one step on the plugin env
    (tmp_path / "rl.yaml").write_text(
        "model: {name: tiny-random}\nlora: {r: 4}\nenv: {name: plugcalc, options: {num_calls: 1}}\n"
        "tasks: {train: 2, test: 1}\ntasks_per_step: 1\ngroup_size: 2\n"
        "rollout: {max_turns: 2, max_tokens_per_turn: 6, concurrency: 4}\nsteps: 1\nskip_uniform_groups: false\n"
        "eval: {every: 0, at_start: false}\noutput_dir: rl\nlogging: {progress: false, tensorboard: false}\n"
    )
    assert "rl done: 1 steps" in _ok(tracegym(tmp_path, "rl", "-c", "rl.yaml", site=site))
    rollouts = sorted((tmp_path / "rl" / "rollouts").glob("*.jsonl"))
    assert rollouts and {t["env"] for t in _lines(rollouts[0])} == {"plugcalc"}


# --- a plain module with --plugin ------------------------------------------------------------------


def _docs_example() -> str:
    """The "Write your own environment" example of docs/environments.md, which the "--plugin"
    section of the same page tells the user to save as letter_count.py."""
    text = (REPO / "docs" / "environments.md").read_text(encoding="utf-8")
    section = text[text.index("## Write your own environment"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_plugin_file_env_works_with_envs_and_rollout(tmp_path: Path) -> None:
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "letter_count.py").write_text(_docs_example())
    assert "letter_count" not in _ok(tracegym(tmp_path, "envs"))
    listed = _ok(tracegym(tmp_path, "envs", "--plugin", "plug/letter_count.py"))
    assert re.search(r"^letter_count\s+Count a letter", listed, re.M), listed
    _ok(tracegym(tmp_path, "rollout", "--plugin", "plug/letter_count.py", "--env", "letter_count", "--policy", "expert",
                 "--model", "tiny-random", "--tasks", "3", "--no-progress", "--out", "letters"))
    recorded = _lines(tmp_path / "letters" / "trajectories.jsonl")
    assert len(recorded) == 3 and all(t["env"] == "letter_count" and t["success"] for t in recorded)
    # without the flag the name is unknown: one line, exit 2
    result = tracegym(tmp_path, "rollout", "--env", "letter_count", "--policy", "expert", "--out", "x")
    assert result.returncode == 2 and result.stderr.startswith("error: cannot make env 'letter_count': unknown env")
    assert len(result.stderr.strip().splitlines()) == 1
    # a plugin that fails to import: one line naming it and the cause
    (tmp_path / "broken.py").write_text("import no_such_dependency_xyz\n")
    result = tracegym(tmp_path, "envs", "--plugin", "broken.py")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: plugin 'broken.py': importing " + str(tmp_path / "broken.py") + " failed: ModuleNotFoundError: "
        "No module named 'no_such_dependency_xyz' (at " + str(tmp_path / "broken.py") + ":1)"
    ]


# --- env name and options are checked before any model loads (in process) --------------------------


@pytest.fixture()
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import tracegym.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the env was checked")

    monkeypatch.setattr(tracegym.models, "load", refuse)
    monkeypatch.setattr(tracegym.models, "load_tokenizer", refuse)


@pytest.mark.parametrize(
    "env_section, expected",
    [
        ("{name: calculater}", "bad value for 'env.name': unknown env 'calculater'; did you mean 'calculator'?"),
        ("{name: calculator, options: {num_call: 2}}",
         "bad value for 'env.options': env 'calculator' has no option 'num_call' (did you mean 'num_calls'?); "
         "allowed options: num_calls, max_turns, test_fraction"),
        ("{name: sokoban, options: {size: big}}",
         "bad value for 'env.options': env 'sokoban': bad value for option 'size'='big'"),
    ],
)
def test_rl_rejects_a_bad_env_at_config_check(tmp_path: Path, capsys, no_model, env_section: str, expected: str) -> None:
    config = tmp_path / "rl.yaml"
    config.write_text(f"model: {{name: tiny-random}}\nenv: {env_section}\noutput_dir: '{tmp_path / 'run'}'\n")
    assert main(["rl", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert not (tmp_path / "run").exists()


def test_rl_lists_env_and_policy_loss_problems_together(tmp_path: Path, capsys, no_model) -> None:
    config = tmp_path / "rl.yaml"
    config.write_text("model: {name: tiny-random}\nenv: {name: calculater}\npolicy_loss: {loss: ppo}\n")
    assert main(["rl", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "'env.name'" in err and "'policy_loss.loss'" in err, err


@pytest.mark.parametrize("command", ["eval", "rollout"])
@pytest.mark.parametrize(
    "args, expected",
    [
        (["--env", "sokobn"], "error: cannot make env 'sokobn': unknown env 'sokobn'; did you mean 'sokoban'?"),
        (["--env", "calculator", "--env-option", "num_call=2"],
         "error: cannot make env 'calculator': env 'calculator' has no option 'num_call' (did you mean 'num_calls'?); allowed options: num_calls, "
         "max_turns, test_fraction"),
    ],
)
def test_eval_and_rollout_reject_a_bad_env_in_one_line(tmp_path: Path, capsys, no_model, command: str,
                                                       args: list[str], expected: str) -> None:
    assert main([command, *args, "--model", "tiny-random", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(expected) and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_demo_checks_its_env_options(tmp_path: Path, capsys, no_model) -> None:
    assert main(["demo", "sft_env_options={levels: 2}", "--print-config"]) == 2
    assert "bad value for 'sft_env_options': env 'calculator' has no option 'levels'" in capsys.readouterr().err


def test_a_missing_plugin_stops_every_command_with_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for argv in (["envs"], ["rl", "--config", "x.yaml"], ["eval", "--env", "calculator", "--out", "o"]):
        assert main([*argv, "--plugin", "tgp_nowhere_mod"]) == 2
        assert capsys.readouterr().err.startswith("error: plugin 'tgp_nowhere_mod': no module named 'tgp_nowhere_mod'")
