"""Seeds as an axis: ``--seeds`` parsing and its errors, a 2-seed tiny RL run (and its resume),
pooling evaluations over seeds (``compare --pool-seeds``) against hand values, the seeds-and-tasks
bootstrap, and the mean-and-band curves ``tracegym report`` writes for a folder of seed runs."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tracegym.cli import main
from tracegym.commands._seeds import seed_list, summarize_seeds
from tracegym.eval.metrics import (
    bootstrap_ci,
    bootstrap_ci_seeds_tasks,
    paired_bootstrap_diff,
    paired_seeds_tasks_bootstrap_diff,
)
from tracegym.eval.seeds import (
    find_seed_runs,
    group_by_method,
    method_labels,
    pool_seeds,
    seed_band_figure,
    seed_curves,
    split_seed,
    write_seed_curves,
)
from tracegym.types import read_json_rows

# --- the seed list -------------------------------------------------------------------------------


def test_seed_list_parses_distinct_non_negative_integers():
    assert seed_list("1,2,3") == [1, 2, 3]
    assert seed_list(" 7 , 0") == [7, 0]  # order kept: it is the order the runs go in
    assert seed_list("5") == [5]


@pytest.mark.parametrize("text, says", [
    ("", "comma-separated integers"), ("1,x", "comma-separated integers"), ("1,,2", "comma-separated integers"),
    ("1.5", "comma-separated integers"), ("-1,2", "comma-separated integers"), ("1,2,1", "seed 1 is given twice"),
])
def test_seed_list_rejects_malformed_lists(text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        seed_list(text)


def test_malformed_seeds_is_a_one_line_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["rl", "--config", str(tmp_path / "rl.yaml"), "--seeds", "1,two"])
    assert exited.value.code == 2
    assert "argument --seeds: expected comma-separated integers >= 0 like 1,2,3, got '1,two'" in capsys.readouterr().err


def test_seed_override_and_seeds_together_are_refused(tmp_path, capsys):
    assert main(["rl", "--config", str(tmp_path / "rl.yaml"), "--seeds", "1,2", "seed=3"]) == 2
    assert "seed=... and --seeds both set the training seed" in capsys.readouterr().err


# --- RL over seeds on the tiny random model -------------------------------------------------------


def _rl_config(tmp_path: Path) -> Path:
    config = tmp_path / "rl.yaml"
    config.write_text(
        "model: {name: tiny-random}\nlora: {r: 4}\nenv: {name: calculator, options: {num_calls: 1}}\n"
        "tasks: {train: 4, test: 2, seed: 5}\ntasks_per_step: 2\ngroup_size: 2\nskip_uniform_groups: false\n"
        "rollout: {max_turns: 1, max_tokens_per_turn: 6, concurrency: 8}\nsteps: 1\n"
        f"output_dir: '{tmp_path / 'runs'}'\nlogging: {{progress: false, tensorboard: false}}\n"
    )
    return config


def test_print_config_shows_each_seeds_config_without_running(tmp_path, capsys):
    assert main(["rl", "--config", str(_rl_config(tmp_path)), "--seeds", "3,4", "--print-config"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [(d["seed"], d["tasks"]["seed"], d["output_dir"]) for d in docs] == [
        (3, 5, str(tmp_path / "runs" / "seed_3")), (4, 5, str(tmp_path / "runs" / "seed_4"))]
    assert not (tmp_path / "runs").exists()


def _sampled_tokens(run_dir: Path) -> list[tuple[int, ...]]:
    rows, _ = read_json_rows(run_dir / "rollouts" / "step_000001.jsonl")
    return [tuple(turn["completion_ids"]) for row in rows for turn in row["turns"]]


def test_two_seeds_train_into_their_own_folders_and_resume(tmp_path, capsys):
    config = _rl_config(tmp_path)
    runs = tmp_path / "runs"
    assert main(["rl", "--config", str(config), "--seeds", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "rl seed 1 (1 of 2)" in out and "rl seed 2 (2 of 2)" in out and "mean ± std" in out

    for seed in (1, 2):
        saved = yaml.safe_load((runs / f"seed_{seed}" / "config.yaml").read_text())
        # the training seed changes, the task draw does not: both seeds train and are judged on the same tasks
        assert (saved["seed"], saved["tasks"]["seed"], saved["output_dir"]) == (seed, 5, str(runs / f"seed_{seed}"))
        assert (runs / f"seed_{seed}" / "final" / "adapter_config.json").is_file()
    first, second = _sampled_tokens(runs / "seed_1"), _sampled_tokens(runs / "seed_2")
    assert len(first) == len(second) == 4  # 2 tasks x 2 samples x 1 turn
    assert first != second

    summary = json.loads((runs / "seeds.json").read_text())
    assert summary["seeds"] == [1, 2]
    rewards = [summary["per_seed"][s]["reward/mean"] for s in ("1", "2")]
    assert summary["mean"]["reward/mean"] == pytest.approx(np.mean(rewards))
    assert summary["std"]["reward/mean"] == pytest.approx(np.std(rewards, ddof=1))

    # without --resume the first seed's checkpoints stop the loop before anything trains
    assert main(["rl", "--config", str(config), "--seeds", "1,2"]) == 1
    err = capsys.readouterr().err
    assert "stopped at seed 1" in err and "--resume" in err

    # --resume continues each seed's run from its own checkpoint
    assert main(["rl", "--config", str(config), "--seeds", "1,2", "--resume", "steps=2"]) == 0
    for seed in (1, 2):
        steps = [row["step"] for row in read_json_rows(runs / f"seed_{seed}" / "metrics.jsonl")[0]]
        assert steps == [0, 1, 2]


def test_demo_seeds_pin_the_task_seed_and_vary_the_training_seed(tmp_path, capsys, monkeypatch):
    import tracegym.recipes.demo as demo_recipe

    calls = []

    def fake_demo(cfg):  # the demo's result: one eval.json dict per stage
        calls.append((cfg.seed, cfg.task_seed, cfg.output_dir))
        top = str(max(cfg.eval_turns))
        stages = (("base", 0.0), ("sft", 0.1), ("rl", 0.2))
        return {stage: {"pass_at": {top: {"1": value * cfg.seed}}} for stage, value in stages}

    monkeypatch.setattr(demo_recipe, "run_demo", fake_demo)
    out = tmp_path / "demo"
    assert main(["demo", f"output_dir={out}", "seed=4", "--seeds", "1,2"]) == 2  # two training seeds named
    assert main(["demo", f"output_dir={out}", "--seeds", "1,3"]) == 0
    # the config's seed (0) keeps drawing the tasks of every seed
    assert calls == [(1, 0, str(out / "seed_1")), (3, 0, str(out / "seed_3"))]
    summary = json.loads((out / "seeds.json").read_text())
    assert summary["per_seed"]["3"] == pytest.approx({"base pass@1": 0.0, "sft pass@1": 0.3, "rl pass@1": 0.6})
    assert summary["mean"]["rl pass@1"] == pytest.approx(0.4)
    assert f"tracegym compare --pool-seeds {out}/seed_*/{{base,sft,rl}}" in capsys.readouterr().out

    # inside a seed's demo the RL stage draws its train tasks with the pinned task seed, trains with its own
    rl = demo_recipe.rl_stage_config(demo_recipe.DemoConfig(seed=3, task_seed=0), "sft/final", "train_rl")
    assert (rl.seed, rl.tasks.seed) == (3, 0)


# --- the bootstrap over seeds and tasks ------------------------------------------------------------


def test_seed_resampling_widens_the_interval_when_seeds_disagree():
    # two seeds, two tasks: seed 1 solves both, seed 2 neither. Resampling tasks alone sees two
    # tasks at 0.5 each and no uncertainty; resampling seeds gives means 1, 0.5, 0 (p 1/4, 1/2, 1/4)
    table = [[1.0, 1.0], [0.0, 0.0]]
    assert bootstrap_ci(np.mean(table, axis=0)) == (0.5, 0.5)
    assert bootstrap_ci_seeds_tasks(table) == (0.0, 1.0)
    # and tasks are resampled too: seeds agree, tasks differ
    assert bootstrap_ci_seeds_tasks([[1.0, 0.0], [1.0, 0.0]]) == (0.0, 1.0)
    assert bootstrap_ci_seeds_tasks([[0.25, 0.25, 0.25]] * 3) == (0.25, 0.25)


def test_paired_difference_pairs_tasks_but_not_seeds():
    a = np.array([[0.2, 0.9, 0.5], [0.2, 0.9, 0.5]])
    diff, low, high = paired_seeds_tasks_bootstrap_diff(a, a + 0.1)
    # tasks of very different difficulty, each 0.1 better: pairing leaves no task variance
    assert (diff, low, high) == pytest.approx((0.1, 0.1, 0.1))
    # one task, two seeds each scoring 0 and 1 in both methods: were seeds paired by number the
    # difference would be exactly 0; they are unrelated runs, so it ranges from -1 to +1
    diff, low, high = paired_seeds_tasks_bootstrap_diff([[0.0], [1.0]], [[0.0], [1.0]])
    assert (diff, low, high) == (0.0, -1.0, 1.0)
    with pytest.raises(ValueError, match="same task columns"):
        paired_seeds_tasks_bootstrap_diff([[0.0, 1.0]], [[0.0]])


# --- pooling evaluations over seeds ----------------------------------------------------------------


def _eval(solved: dict[str, tuple[int, int]], turns: int = 2) -> dict[str, Any]:
    """A minimal eval.json: ``solved`` maps task -> (n, c) at the largest budget (and at T=1)."""
    rate = sum(c / n for n, c in solved.values()) / len(solved)
    return {
        "env": "calculator", "split": "test", "ks": [1], "turns": [1, turns], "success_rate": rate,
        "pass_at": {"1": {"1": rate}, str(turns): {"1": rate}},
        "pass_at_ci": {"1": {"1": [rate, rate]}, str(turns): {"1": [rate, rate]}},
        "per_task": {t: {"n": n, "solved": {"1": c, str(turns): c}} for t, (n, c) in solved.items()},
    }


def _write_eval(folder: Path, solved: dict[str, tuple[int, int]]) -> Path:
    folder.mkdir(parents=True)
    (folder / "eval.json").write_text(json.dumps(_eval(solved)))
    return folder


A = {1: {"t1": (4, 4), "t2": (4, 2), "t3": (4, 0), "t4": (4, 1)},   # pass@1 1, .5, 0, .25: 0.4375
     2: {"t1": (4, 3), "t2": (4, 2), "t3": (4, 1), "t4": (4, 0)}}   # .75, .5, .25, 0: 0.375
B = {1: {"t1": (4, 4), "t2": (4, 4), "t3": (4, 2), "t4": (4, 2), "t5": (4, 4)},  # t5: only this seed
     2: {"t1": (4, 4), "t2": (4, 3), "t3": (4, 1), "t4": (4, 2)},
     3: {"t1": (4, 4), "t2": (4, 2), "t3": (4, 0), "t4": (4, 2)}}


def test_split_seed_and_grouping_by_method(tmp_path):
    assert split_seed("runs/demo/seed_2/rl") == (Path("runs/demo/rl"), 2)
    assert split_seed("runs/a/seed_10") == (Path("runs/a"), 10)
    assert split_seed("runs/a/seeds") is None
    groups = group_by_method(["runs/b/seed_1/eval", "runs/a/seed_2/eval/eval.json", "runs/b/seed_3/eval"])
    assert groups == {Path("runs/b/eval"): {1: Path("runs/b/seed_1/eval"), 3: Path("runs/b/seed_3/eval")},
                      Path("runs/a/eval"): {2: Path("runs/a/seed_2/eval")}}
    assert method_labels([tmp_path / "x" / "sft", tmp_path / "x" / "rl"]) == ["sft", "rl"]
    assert method_labels([tmp_path / "a" / "eval", tmp_path / "b" / "eval"]) == ["a", "b"]
    assert method_labels([tmp_path / "a" / "x" / "eval", tmp_path / "a" / "y"]) == ["x/eval", "y"]
    with pytest.raises(ValueError, match="no seed_<N> folder"):
        group_by_method(["runs/a/seed_1", "runs/b"])
    with pytest.raises(ValueError, match="seed 1 given twice"):
        group_by_method(["runs/a/seed_1", "runs/a/seed_1/eval.json"])


def test_pooled_pass_at_1_per_seed_and_paired_difference_match_hand_values():
    pooled = pool_seeds({"a": {s: _eval(v) for s, v in A.items()}, "b": {s: _eval(v) for s, v in B.items()}}, 2)
    a, b = pooled["methods"]
    assert (a["seeds"], a["tasks"], b["seeds"], b["tasks"]) == ([1, 2], 4, [1, 2, 3], 4)
    assert a["per_seed"] == {"1": 0.4375, "2": 0.375}
    assert a["pass@1"] == pytest.approx(0.40625)
    assert a["seed_std"] == pytest.approx(0.0625 / math.sqrt(2))
    # b on t1..t4 (t5 left out): seed 1 (1 + 1 + .5 + .5) / 4, seed 2 (1 + .75 + .25 + .5) / 4,
    # seed 3 (1 + .5 + 0 + .5) / 4
    assert b["per_seed"] == {"1": 0.75, "2": 0.625, "3": 0.5}
    assert b["pass@1"] == pytest.approx(0.625) and b["seed_std"] == pytest.approx(0.125)
    assert pooled["notes"] == ["b: 1 task left out (not evaluated by every seed)"]
    assert a["diff"] is None
    assert b["diff"]["diff"] == pytest.approx(0.625 - 0.40625) and b["diff"]["tasks"] == 4
    low, high = b["diff"]["ci"]
    assert low < 0.625 - 0.40625 < high
    # the same gain with the seeds pooled into one count per task (a task-only paired bootstrap):
    # per-task gains t1 .125, t2 .25, t3 .125, t4 .375. The seed spread widens the interval.
    pooled_a = {t: (8, A[1][t][1] + A[2][t][1]) for t in A[1]}
    pooled_b = {t: (12, sum(B[s][t][1] for s in B)) for t in A[1]}
    diff, task_low, task_high, _ = paired_bootstrap_diff(pooled_a, pooled_b, 1)
    assert diff == pytest.approx(0.21875)
    assert high - low > 1.5 * (task_high - task_low)
    lo_a, hi_a = a["ci"]
    assert 0.0 <= lo_a < 0.40625 < hi_a <= 1.0


def test_compare_pool_seeds_groups_folders_and_writes_its_table(tmp_path, capsys):
    dirs = [str(_write_eval(tmp_path / "runs" / "a" / f"seed_{s}" / "eval", v)) for s, v in A.items()]
    dirs += [str(_write_eval(tmp_path / "runs" / "b" / f"seed_{s}" / "eval", v)) for s, v in B.items()]
    out = tmp_path / "cmp"
    assert main(["compare", "--pool-seeds", *dirs, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "resampling seeds and tasks" in printed and "seed 3: 0.500" in printed
    result = json.loads((out / "compare_seeds.json").read_text())
    assert [m["label"] for m in result["methods"]] == ["a", "b"]
    assert result["turns"] == 2 and result["methods"][1]["per_seed"] == {"1": 0.75, "2": 0.625, "3": 0.5}
    assert result["methods"][0]["dirs"] == {"1": dirs[0], "2": dirs[1]}
    assert (out / "compare_seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["compare", "--pool-seeds", dirs[0], str(tmp_path / "runs" / "a")]) == 2
    assert "no seed_<N> folder" in capsys.readouterr().err


def test_summarize_seeds_gives_mean_and_sample_std():
    summary = summarize_seeds({1: {"x": 1.0, "y": 2.0}, 2: {"x": 3.0}, 3: {"x": 8.0}})
    assert summary["mean"] == {"x": 4.0, "y": 2.0}
    assert summary["std"]["x"] == pytest.approx(math.sqrt(13.0)) and summary["std"]["y"] is None


# --- curves over seeds ----------------------------------------------------------------------------


def _write_metrics(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _seed_runs(root: Path, below: str = "") -> None:
    for seed, rewards, health in ((1, [0.0, 0.5, 1.0], 0.2), (2, [0.2, 0.3, 0.4], 0.4), (3, [0.1, 0.1, 0.7], 0.0)):
        rows = [{"step": 0, "eval/pass@1": 0.1 * seed}]
        rows += [{"step": step, "reward/mean": r, "health/reward_std": health, "rss_mb": 100.0}
                 for step, r in enumerate(rewards, 1)]
        rows.append({"step": 3, "eval/pass@1": 0.2 * seed})
        _write_metrics(root / f"seed_{seed}" / below, rows)


def test_seed_curves_align_steps_and_the_figure_draws_mean_and_band(tmp_path):
    _seed_runs(tmp_path)
    runs = find_seed_runs(tmp_path)
    assert list(runs) == ["."] and list(runs["."]) == [1, 2, 3]
    curves = seed_curves(runs["."])
    assert list(curves) == ["reward/mean", "eval/pass@1", "health/reward_std"]  # rss_mb is no default curve
    steps, values = curves["reward/mean"]
    assert steps.tolist() == [1, 2, 3] and values.shape == (3, 3)
    steps, values = curves["eval/pass@1"]
    assert steps.tolist() == [0, 3]
    np.testing.assert_allclose(values, [[0.1, 0.2], [0.2, 0.4], [0.3, 0.6]])

    fig = seed_band_figure(curves, [1, 2, 3])
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["reward/mean", "eval/pass@1", "health/reward_std"]
    mean_line = panels[0].lines[-1]
    assert mean_line.get_ydata().tolist() == pytest.approx([0.1, 0.3, 0.7])
    band = panels[0].collections[0].get_paths()[0].vertices[:, 1]
    assert band.min() == pytest.approx(0.0) and band.max() == pytest.approx(1.0)  # min-max over seeds


def test_report_on_a_folder_of_seed_runs_writes_the_band_plots(tmp_path, capsys):
    _seed_runs(tmp_path / "rl")
    assert main(["report", str(tmp_path / "rl"), "--tokenizer", "none"]) == 0
    png = tmp_path / "rl" / "seed_curves.png"
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the demo's layout: a training run below each seed folder
    _seed_runs(tmp_path / "demo", below="train_rl")
    assert write_seed_curves(tmp_path / "demo") == [tmp_path / "demo" / "seed_curves_train_rl.png"]
