"""Rollout strategies as plugins (``tracegym.rollout.strategies``): the registry and its errors, the
built-ins against the code they wrap, and the example plugin (``examples/plugins/retry_errors_rollout.py``)
run by name through ``tracegym rollout``, ``eval`` and ``rl`` on an env whose first attempt at each
task fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracegym.cli import main
from tracegym.rollout import RolloutConfig, run_rollouts_sync
from tracegym.rollout.strategies import ROLLOUT_STRATEGIES, RolloutJob, run_strategy_sync, strategy_problems

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plugins" / "retry_errors_rollout.py"

# An env whose first episode of each task raises in its first step (a flaky tool server): with
# ``on_env_error: exclude`` that episode is left out, unless the strategy plays it again.
FLAKY_ENV = '''
from tracegym.environments.calculator import CalculatorEnv
from tracegym.envs.registry import register

FAILED_ONCE = set()


class FlakyCalculator(CalculatorEnv):
    async def step(self, message, parse_errors=()):
        if self.task.id not in FAILED_ONCE:
            FAILED_ONCE.add(self.task.id)
            raise ConnectionError("tool server went away")
        return await super().step(message, parse_errors)


register("flaky_calculator", FlakyCalculator, overwrite=True)
'''


def flaky_plugin(folder: Path, name: str) -> Path:
    """A fresh copy of the flaky env (its own module, so its memory of failed tasks starts empty)."""
    path = folder / f"flaky_{name}.py"
    path.write_text(FLAKY_ENV, encoding="utf-8")
    return path


def test_builtins_are_registered_and_unknown_names_say_the_nearest():
    assert {"chains", "tree"} <= set(ROLLOUT_STRATEGIES.names())
    assert strategy_problems("chains", {}) == []
    assert "Did you mean 'chains'" in strategy_problems("chain", {})[0]
    problem = strategy_problems("tree", {"branch": "sideways"})[0]
    assert problem.startswith("rollout.strategy_options of 'tree'") and "branch" in problem
    assert "retries" in strategy_problems("chains", {"retries": 2})[0]  # chains takes no options


def test_chains_and_tree_are_the_code_they_name(tiny_model):
    from tracegym.config import TreeConfig
    from tracegym.engines.hf import HFEngine
    from tracegym.envs import make
    from tracegym.render import get_renderer
    from tracegym.rollout.tree import run_tree_rollouts_sync

    model, tokenizer = tiny_model
    renderer = get_renderer("smollm2-135m", tokenizer)
    engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids, max_batch_size=8)
    tasks = make("calculator", num_calls=1).tasks("test", 2, 0)
    config = RolloutConfig(max_turns=2, max_tokens_per_turn=6, samples_per_task=2, seed=5)
    job = RolloutJob("calculator", tasks, engine, renderer, config, env_options={"num_calls": 1})
    direct = run_rollouts_sync("calculator", tasks, engine, renderer, config, progress=False, env_options={"num_calls": 1})
    named = run_strategy_sync("chains", job)
    assert [t.turns for t in named.trajectories] == [t.turns for t in direct.trajectories]
    tree, stats = run_tree_rollouts_sync("calculator", tasks, engine, renderer, config, TreeConfig(), 2,
                                         env_options={"num_calls": 1})
    named = run_strategy_sync("tree", job, {})
    assert [t.turns for t in named.trajectories] == [t.turns for t in tree.trajectories]
    timing = "tree/wall_time_s"
    assert {k: v for k, v in named.stats.extra.items() if k != timing} == {
        k: v for k, v in stats.metrics().items() if k != timing} and timing in named.stats.extra


def test_the_retry_plugin_fills_every_group_through_rollout_eval_and_rl(tmp_path):
    def plugins(name: str) -> list[str]:
        return ["--plugin", str(flaky_plugin(tmp_path, name)), "--plugin", str(EXAMPLE)]

    common = ["--env", "flaky_calculator", "--env-option", "num_calls=1", "--model", "tiny-random", "--tasks", "3",
              "--samples", "2", "--max-tokens-per-turn", "6", "--no-progress"]

    # rollout: chains loses each task's first episode, the plugin plays it again
    assert main(["rollout", *plugins("plain"), *common, "--max-turns", "2", "--out", str(tmp_path / "plain")]) == 0
    plain = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert plain["strategy"] == "chains" and plain["kept"] == 3 and plain["failed"] == 3
    assert main(["rollout", *plugins("retried"), *common, "--max-turns", "2", "--strategy", "retry_errors",
                 "--strategy-option", "retries=1", "--out", str(tmp_path / "retried")]) == 0
    retried = json.loads((tmp_path / "retried" / "summary.json").read_text())
    assert retried["strategy"] == "retry_errors" and retried["extra"]["retry/replayed"] == 3.0
    kept = [json.loads(line) for line in (tmp_path / "retried" / "trajectories.jsonl").read_text().splitlines()]
    assert len(kept) == 6 and len({(t["task_id"], t["sample_index"]) for t in kept}) == 6  # each slot once

    # eval: every task has both samples, so pass@2 is defined over 3 tasks x 2
    assert main(["eval", *plugins("eval"), *common, "--turns", "2", "--k", "1,2", "--strategy", "retry_errors",
                 "--out", str(tmp_path / "eval")]) == 0
    summary = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert summary["rollout"]["strategy"] == "retry_errors" and summary["rollout"]["failed"] == 0

    # rl: the groups are whole again (group_size 2 per task, nothing excluded)
    config = tmp_path / "rl.yaml"
    config.write_text(
        f"plugins: ['{flaky_plugin(tmp_path, 'rl')}', '{EXAMPLE}']\nmodel: {{name: tiny-random}}\nlora: {{r: 4}}\n"
        "env: {name: flaky_calculator, options: {num_calls: 1}}\ntasks: {train: 4, test: 0}\ntasks_per_step: 2\n"
        "group_size: 2\nrollout: {max_turns: 2, max_tokens_per_turn: 6, concurrency: 8, strategy: retry_errors,"
        " strategy_options: {retries: 2}}\nsteps: 1\nskip_uniform_groups: false\nhealth: {probe_tasks: 0}\n"
        f"output_dir: '{tmp_path / 'run'}'\nlogging: {{progress: false, tensorboard: false}}\n", encoding="utf-8")
    assert main(["rl", "--config", str(config)]) == 0
    row = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["retry/replayed"] == 2.0 and row["examples/count"] == 4.0


def test_a_bad_strategy_stops_each_command_with_one_line(tmp_path, capsys):
    args = ["--env", "calculator", "--model", "tiny-random", "--tasks", "1", "--out", str(tmp_path / "o")]
    assert main(["rollout", *args, "--strategy", "chians"]) == 2
    assert "Did you mean 'chains'" in capsys.readouterr().err
    assert main(["eval", *args, "--strategy", "tree", "--strategy-option", "how=sideways"]) == 2
    assert "--strategy-option of 'tree'" in capsys.readouterr().err
    config = tmp_path / "rl.yaml"
    config.write_text("model: {name: tiny-random}\nenv: {name: calculator}\nrollout: {strategy: chians}\n"
                      f"output_dir: '{tmp_path / 'run'}'\n", encoding="utf-8")
    assert main(["rl", "--config", str(config)]) == 2
    assert "rollout.strategy" in capsys.readouterr().err
