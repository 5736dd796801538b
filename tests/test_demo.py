"""Smoke run of the main job (``tracegym demo``) end to end on tiny-random with tiny stage sizes:
every stage runs and writes what the README promises. The real run is ``make demo``."""

import json

from tracegym.cli import main

TINY = [
    "model=tiny-random", "expert_tasks=8", "test_tasks=3", "eval_samples=2", "eval_ks=[1,2]", "eval_turns=[1,2]",
    "sft_steps=2", "sft_batch_size=4", "sft_micro_batch_size=2", "rl_steps=2", "rl_tasks_per_step=2", "rl_group_size=2",
    "max_tokens_per_turn=8", "progress=false", "env_options={num_calls: 1}", "sft_env_options={num_calls: 1}",
]


def test_demo_runs_every_stage_and_writes_the_outputs(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", *TINY, f"output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    for stage in ("1/6", "2/6", "3/6", "4/6", "5/6", "6/6"):
        assert stage in printed
    for label in ("base", "sft", "rl"):
        summary = json.loads((out / label / "eval.json").read_text())
        assert summary["n_tasks"] == 3 and summary["samples_per_task"] == 2
        assert set(summary["pass_at"]) == {"1", "2"} and set(summary["pass_at"]["2"]) == {"1", "2"}
        assert summary["checkpoint"] == ("tiny-random" if label == "base" else str(out / f"train_{label}" / "final"))
    # the three evaluations ran on the same held-out tasks
    tasks = [sorted(json.loads((out / label / "eval.json").read_text())["per_task"]) for label in ("base", "sft", "rl")]
    assert tasks[0] == tasks[1] == tasks[2]
    compare = json.loads((out / "compare.json").read_text())
    assert set(compare["stages"]) == {"base", "sft", "rl"}
    assert set(compare["paired_diff_pass@1"]) == {"sft-base", "rl-sft", "rl-base"}
    assert (out / "train_sft" / "final" / "adapter_config.json").is_file()
    assert (out / "train_rl" / "final" / "adapter_config.json").is_file()
    assert (out / "train_rl" / "metrics.jsonl").is_file()
    html = (out / "report.html").read_text()
    assert "<html" in html.lower() and "rl" in html
    assert "Δpass@1" in printed


def test_demo_rejects_a_bad_key(capsys):
    assert main(["demo", "rl_step=3"]) == 2
    assert "rl_steps" in capsys.readouterr().err
    assert main(["demo", "sft_batch_size=6"]) == 2  # the default 8 rows a pass do not divide it
    assert "sft_micro_batch_size" in capsys.readouterr().err


def test_the_rl_stage_takes_the_demo_settings():
    from tracegym.recipes.demo import DemoConfig, rl_stage_config

    demo = DemoConfig(rl_steps=5, rl_tasks_per_step=3, rl_group_size=4, rl_lr=1e-4, rl_warmup_steps=2,
                      env_options={"num_calls": 3}, eval_turns=[1, 2, 3, 4, 5])
    rl = rl_stage_config(demo, "runs/x/train_sft/final", "runs/x/train_rl")
    assert (rl.optim.lr, rl.optim.warmup_steps, rl.optim.schedule) == (1e-4, 2, "constant")
    assert (rl.steps, rl.tasks_per_step, rl.group_size, rl.tasks.train) == (5, 3, 4, 15)
    assert rl.model.adapter == "runs/x/train_sft/final" and rl.env.options["num_calls"] == 3
    assert rl.rollout.max_turns == 5 and rl.output_dir == "runs/x/train_rl"
    # the strong-start settings (bench/strong_start.py): the RL rate derived from the SFT rate and
    # the batch, guidance, the calculator's calls part, a trust region, one temperature pair
    holds = rl_stage_config(DemoConfig(rl_tasks_per_step=8, rl_group_size=8, rl_lr=None, rl_warmup_steps=2,
                                       rl_guidance=True, rl_reward_parts={"answer": 1.0, "calls": 0.3},
                                       rl_max_policy_drift=0.02), "a", "b")
    assert holds.optim.lr == 3e-4 / 8 and holds.optim.warmup_steps == 2
    assert holds.guidance is not None and holds.guidance.groups == "all_failed" and holds.max_policy_drift == 0.02
    every = rl_stage_config(DemoConfig(rl_guidance=True, rl_guidance_groups="every"), "a", "b")
    assert every.guidance is not None and every.guidance.groups == "every"
    anchored = rl_stage_config(DemoConfig(rl_kl_coef=0.3, rl_expert_replay=0.5, rl_steps=10, rl_tasks_per_step=8), "a", "b")
    assert anchored.policy_loss["kl_coef"] == 0.3
    assert anchored.expert_replay is not None and anchored.expert_replay.model_dump() == {"coef": 0.5, "tasks": 80, "per_step": 8,
                                                                            "policy_gradient": True}
    assert holds.env.options["reward_parts"] == {"answer": 1.0, "calls": 0.3}
    assert holds.rollout.temperature == holds.eval.temperature == DemoConfig().temperature
    # the main job is the many-step one, with the strong start's RL settings (bench/strong_start.py)
    main_job = rl_stage_config(DemoConfig(), "a", "b")
    assert main_job.env.options == {"num_calls": 3, "reward_parts": {"answer": 1.0, "calls": 0.3}}
    assert (main_job.optim.lr, main_job.optim.warmup_steps, main_job.max_policy_drift) == (3e-4 / 8 * (48 / 64) ** 0.5, 2, 0.02)
    assert main_job.guidance is not None and main_job.expert_replay is not None and main_job.expert_replay.coef == 1.0
    assert (main_job.tasks_per_step, main_job.group_size, main_job.steps, main_job.model.autocast) == (8, 6, 10, "auto")
    assert main_job.policy_loss["kl_coef"] == 0.0


def test_the_one_call_config_keeps_the_settings_its_block_was_measured_with():
    from pathlib import Path

    from tracegym.config import load_config
    from tracegym.recipes.demo import DemoConfig, rl_stage_config

    one_call = load_config(DemoConfig, path=Path(__file__).parent.parent / "examples" / "demo_one_call.yaml")
    rl = rl_stage_config(one_call, "a", "b")
    assert (rl.optim.lr, rl.guidance, rl.max_policy_drift, rl.expert_replay, rl.model.autocast) == (2e-4, None, None, None, "none")
    assert rl.env.options == {"num_calls": 1} and (one_call.sft_steps, one_call.test_tasks, one_call.eval_samples) == (16, 40, 4)
    assert one_call.micro_batch_size == one_call.sft_micro_batch_size == 1 and one_call.eval_concurrency == 64


def test_the_evaluations_decode_eval_concurrency_episodes_together(monkeypatch, tmp_path):
    """``eval_concurrency`` reaches both the runner (episodes in flight) and the engine (rows a step)."""
    import tracegym.engines
    from tracegym.envs import make
    from tracegym.models import load_tokenizer
    from tracegym.recipes.demo import DemoConfig, eval_rollout_config, evaluate_stage
    from tracegym.render import get_renderer

    cfg = DemoConfig(model="tiny-random", eval_concurrency=3, eval_samples=2, eval_ks=[1], eval_turns=[1],
                     max_tokens_per_turn=4, progress=False, env_options={"num_calls": 1})
    assert eval_rollout_config(cfg).concurrency == 3 and DemoConfig().eval_concurrency == 128
    engines = []
    make_engine = tracegym.engines.make_engine

    def spy(*args, **kwargs):
        engines.append(make_engine(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(tracegym.engines, "make_engine", spy)
    renderer = get_renderer("tiny-random", load_tokenizer("tiny-random"))
    tasks = make("calculator", num_calls=1).tasks("test", 2, 0)
    summary = evaluate_stage(cfg, tasks, renderer, "tiny-random", tmp_path, "base")
    assert summary["n_tasks"] == 2 and engines[0].max_batch_size == 3
