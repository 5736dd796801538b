"""The demo's RL stage again, from the SFT adapter of a finished demo run, with other RL settings.

Why: on a 2-core CPU the SFT stage of a 3-call demo takes 35 minutes; RL settings can be compared
from one SFT start without re-running it. The RL run and its evaluation use the demo run's own
``demo_config.json`` (env, options, test tasks, samples, temperature, turn budgets, seeds), so its
pass@1 is paired task by task with that run's ``sft/eval.json``, as ``tracegym demo`` pairs them.

    .venv/bin/python bench/rl_from_sft.py runs/demo3b --out runs/rl_from_sft/lr5e-5 --lr 5e-5 \
        --tasks-per-step 8 --group-size 4 --steps 12

prints each step's train reward, then the table row and the paired difference RL - SFT, and writes
``<out>/train_rl`` (the run), ``<out>/rl/eval.json`` and ``<out>/compare.json``. ``--eval-adapter DIR``
evaluates an adapter (a checkpoint's ``model/``) instead of training; ``--test-tasks N`` evaluates on N
held-out tasks and evaluates the SFT adapter on the same ones. Torch-heavy: run it alone (never
beside another training or benchmark process on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("demo_dir", type=Path, help="a finished `tracegym demo` output_dir (train_sft/final, sft/eval.json)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--train-tasks", type=int, default=None, help="default: steps x tasks-per-step (each task once)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warmup (optimizer steps)")
    parser.add_argument("--estimator", default="grpo")
    parser.add_argument("--estimator-options", default="{}", help='JSON, e.g. \'{"baseline": false}\'')
    parser.add_argument("--loss", default="ppo_clip")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="also keep the adapter every N steps (train_rl/checkpoints/step_*/model), for --eval-adapter")
    parser.add_argument("--eval-adapter", type=Path, default=None,
                        help="train nothing: evaluate this adapter (e.g. a checkpoint's model/) against the SFT, into --out")
    parser.add_argument("--test-tasks", type=int, default=None,
                        help="held-out tasks of the evaluation (default: the demo's); other than the demo's, the SFT "
                             "adapter is evaluated on them too (kept in DEMO_DIR/sft_test<N>/) so the pairing holds")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="KL to the SFT model (the policy at step 0)")
    args = parser.parse_args()

    from tracegym.config import RLConfig
    from tracegym.envs import make
    from tracegym.models import load_tokenizer
    from tracegym.recipes.demo import DemoConfig, compare_summaries, evaluate_stage, rl_stage_config
    from tracegym.recipes.rl import train_rl
    from tracegym.render import get_renderer

    demo = DemoConfig(**json.loads((args.demo_dir / "demo_config.json").read_text(encoding="utf-8")))
    sft_adapter, sft_eval = args.demo_dir / "train_sft" / "final", args.demo_dir / "sft" / "eval.json"
    for needed in (sft_adapter / "adapter_config.json", sft_eval):
        if not needed.is_file():
            raise SystemExit(f"{needed} is missing: {args.demo_dir} is not a finished demo run")
    loss = {"loss": args.loss, "kl_coef": args.kl_coef}
    if args.loss == "ppo_clip":
        loss.update(clip_eps_low=0.2, clip_eps_high=0.28)
    # the demo's stage 5 (recipes/demo.py) with the settings given here
    stage = demo.model_copy(update={"rl_steps": args.steps, "rl_tasks_per_step": args.tasks_per_step,
                                    "rl_group_size": args.group_size, "rl_lr": args.lr,
                                    "rl_warmup_steps": args.warmup_steps})
    base = rl_stage_config(stage, sft_adapter, args.out / "train_rl").model_dump()
    cfg = RLConfig(**{
        **base, "policy_loss": loss, "logging": {**base["logging"], "tensorboard": False},
        "advantage": {**base["advantage"], "estimator": args.estimator, "options": json.loads(args.estimator_options)},
        "tasks": {**base["tasks"], "train": args.train_tasks or base["tasks"]["train"]},
        "checkpoint": {"every": args.checkpoint_every, "keep_last": max(1, args.steps)},
    })
    if args.eval_adapter is not None:
        if not (args.eval_adapter / "adapter_config.json").is_file():
            raise SystemExit(f"--eval-adapter {args.eval_adapter}: no adapter_config.json there (a LoRA adapter folder)")
        adapter, rl_seconds = args.eval_adapter, 0.0
    else:
        shutil.rmtree(args.out / "train_rl", ignore_errors=True)
        started = time.perf_counter()
        rl = train_rl(cfg)
        rl_seconds = time.perf_counter() - started
        adapter = rl.final_dir
        for row in rl.history[1:]:
            print(f"step {row['step']:3d}  train reward {row['reward/mean']:.3f}  groups without signal "
                  f"{row['groups/no_signal']:.0f}/{args.tasks_per_step}", flush=True)

    renderer = get_renderer(demo.model, load_tokenizer(demo.model))
    n_test = args.test_tasks or demo.test_tasks
    test_tasks = make(demo.env, **demo.env_options).tasks("test", n_test, demo.seed)

    if n_test != demo.test_tasks:  # the demo's SFT evaluation covers other tasks: evaluate the SFT on these
        sft_eval = args.demo_dir / f"sft_test{n_test}" / "eval.json"
        if not sft_eval.is_file():
            evaluate_stage(stage, test_tasks, renderer, sft_adapter, sft_eval.parent, "sft")
    summary = evaluate_stage(stage, test_tasks, renderer, adapter, args.out / "rl", "rl")
    comparison = compare_summaries({"sft": json.loads(sft_eval.read_text(encoding="utf-8")), "rl": summary},
                                   str(max(demo.eval_turns)))
    comparison["settings"] = {**vars(args), "demo_dir": str(args.demo_dir), "out": str(args.out), "rl_seconds": rl_seconds}
    (args.out / "compare.json").write_text(json.dumps(comparison, indent=2, default=str), encoding="utf-8")
    for label, row in comparison["stages"].items():
        low, high = row["pass@1_ci"]
        print(f"{label}: pass@1 {row['pass@1']:.3f} [{low:.3f}, {high:.3f}]")
    diff = comparison["paired_diff_pass@1"]["rl-sft"]
    print(f"rl-sft: {diff['diff']:+.3f} [{diff['ci'][0]:+.3f}, {diff['ci'][1]:+.3f}] paired over {diff['tasks']} tasks; "
          f"RL {rl_seconds / 60:.1f} min; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
