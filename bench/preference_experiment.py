"""DPO vs DMPO vs KTO vs on-policy distillation vs GRPO, from one SFT start on 2-call problems.

    .venv/bin/python bench/preference_experiment.py                   # the whole experiment (~1.5 h on 2 cores)
    .venv/bin/python bench/preference_experiment.py --steps 1 --tasks-per-step 2 --group 2 \\
        --test-tasks 4 --sft-steps 4 --student-step 2 --out /tmp/pref_quick   # a smoke run

The task: the calculator's word problems that need two dependent calls (``num_calls: 2``): call,
read the result, call again with it, answer. Every arm uses the same train tasks and the same
held-out test tasks.

1. SFT on the scripted expert's episodes (LoRA r=16). One run: its checkpoint at
   ``--student-step`` is the **student** every arm starts from, its final adapter (``--sft-steps``,
   several times longer) is the **teacher** of on-policy distillation, "a longer-SFT'd SmolLM2".
2. The same sampling budget for every arm: ``steps x tasks_per_step x group`` episodes sampled from
   the policy at temperature 1.0, on the same train tasks.

   - ``grpo``: ``tracegym rl``, group-normalised episode advantages (PPO-clip, token mean);
   - ``distill``: ``tracegym distill``, per-token advantage ``-(log pi_student - log pi_teacher)``
     on the student's own samples (reverse KL, importance-weighted to the sampler);
   - ``dpo``, ``dmpo``, ``kto``: the budget's episodes are sampled once from the student
     (``tracegym rollout``, off-policy), pairs are built per task (chosen = success, rejected =
     failure, truncated at the first divergent turn; KTO: each episode labelled), and
     ``tracegym dpo`` trains ``--pref-epochs`` epochs on them with the student as the reference.
3. Held-out pass@1, pass@2 and pass@4 (``tracegym eval``, ``--test-tasks`` x 4 samples, T=0.7, the
   same seed) of the student, the teacher and every arm's final adapter; 95% bootstrap CIs over
   tasks, and each arm's paired difference to the student start (same tasks).

Printed: the table (with training wall time and the tokens each arm trained on) and peak RSS of
every stage; ``<out>/results.json`` holds it all and ``<out>/curves.png`` the training curves. Every
stage is a subprocess of the CLI a user runs, one after another (never two torch jobs at once).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

from stages import ROOT, dump_yaml, run

PY = sys.executable
CLI = [PY, "-m", "tracegym"]
ENV_OPTIONS = {"num_calls": 2}
LORA = {"enabled": True, "r": 16, "alpha": 32}
MAX_TURNS, MAX_TOKENS = 4, 64
TRAIN_T, EVAL_T, EVAL_SAMPLES, KS = 1.0, 0.7, 4, (1, 2, 4)


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def per_task_rates(eval_dir: Path) -> dict[str, float]:
    """Success rate per test task at the largest turn budget (eval.json's ``per_task``)."""
    data = json.loads((eval_dir / "eval.json").read_text())
    out = {}
    for task, row in data["per_task"].items():
        solved = row["solved"][max(row["solved"], key=int)]
        out[task] = solved / row["n"]
    return out


def paired(a: dict[str, float], b: dict[str, float]) -> tuple[float, float, float]:
    """Mean of ``b - a`` over the shared tasks, with a 95% paired-bootstrap CI."""
    from tracegym.eval.metrics import bootstrap_ci

    diffs = [b[t] - a[t] for t in sorted(set(a) & set(b))]
    low, high = bootstrap_ci(diffs, n_resamples=2000)
    return sum(diffs) / len(diffs), low, high


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/pref_experiment")
    p.add_argument("--expert-tasks", type=int, default=256)
    p.add_argument("--sft-steps", type=int, default=64, help="the teacher's SFT steps (batch 8)")
    p.add_argument("--student-step", type=int, default=16, help="the SFT checkpoint every arm starts from")
    p.add_argument("--steps", type=int, default=6, help="grpo/distill steps; the preference arms get the same episodes")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="samples per task")
    p.add_argument("--pref-epochs", type=int, default=2)
    p.add_argument("--test-tasks", type=int, default=40)
    p.add_argument("--arms", default="grpo,distill,dpo,dmpo,kto")
    args = p.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    peaks: dict[str, float] = {}
    walls: dict[str, float] = {}
    started = time.perf_counter()

    def stage(name: str, cmd: list[str]) -> None:
        t0 = time.perf_counter()
        peaks[name] = run(cmd, out / f"{name}.log")
        walls[name] = time.perf_counter() - t0

    # 1. expert data, then one SFT run: the student is a checkpoint of it, the teacher its end
    expert = out / "expert" / "trajectories.jsonl"
    if not expert.is_file():
        print(f"expert data: {args.expert_tasks} tasks", flush=True)
        stage("expert", CLI + ["rollout", "--env", "calculator", "--env-option", "num_calls=2", "--policy", "expert",
                               "--tasks", str(args.expert_tasks), "--max-turns", "6", "--out", str(expert.parent),
                               "--no-progress"])
    sft_dir = out / "sft"
    teacher = sft_dir / "final"
    student = sft_dir / "checkpoints" / f"step_{args.student_step:06d}" / "model"
    if not teacher.is_dir():
        print(f"SFT: {args.sft_steps} steps x 8 (student at step {args.student_step})", flush=True)
        config = dump_yaml({
            "model": {"name": "smollm2-135m"}, "lora": LORA,
            "optim": {"lr": 3e-4, "warmup_steps": 2, "schedule": "cosine"},
            "data": {"train_files": [str(expert)], "only_successful": True},
            "max_steps": args.sft_steps, "batch_size": 8, "micro_batch_size": 2, "max_length": 1024, "seed": 0,
            "output_dir": str(sft_dir), "checkpoint": {"every": args.student_step, "keep_last": 8},
            "logging": {"progress": True, "tensorboard": False}}, out / "sft.yaml")
        stage("sft", CLI + ["sft", "--config", str(config)])
    if not (student / "adapter_config.json").is_file():
        raise SystemExit(f"no student adapter at {student}: --student-step must be a checkpoint of the SFT run")

    budget = args.steps * args.tasks_per_step * args.group
    train_tasks = args.steps * args.tasks_per_step
    rollout_common = {"engine": "hf", "max_turns": MAX_TURNS, "max_tokens_per_turn": MAX_TOKENS,
                      "temperature": TRAIN_T, "concurrency": 32}
    common = {
        "model": {"name": "smollm2-135m", "adapter": str(student)}, "lora": LORA,
        "env": {"name": "calculator", "options": ENV_OPTIONS},
        "tasks": {"train": train_tasks, "test": 0, "seed": 0},
        "tasks_per_step": args.tasks_per_step, "group_size": args.group, "rollout": rollout_common,
        "steps": args.steps, "micro_batch_size": 4, "max_length": 1024, "seed": 0,
        "eval": {"every": 0, "at_start": False}, "checkpoint": {"every": 0, "keep_last": 1},
        "logging": {"progress": True, "tensorboard": False},
    }
    arms: dict[str, dict] = {}
    for arm in args.arms.split(","):
        run_dir = out / arm
        if (run_dir / "final").is_dir():
            arms[arm] = {"final": run_dir / "final"}
            continue
        print(f"{arm}: budget {budget} sampled episodes", flush=True)
        if arm == "grpo":
            config = {**common, "optim": {"lr": 2e-4, "warmup_steps": 0, "schedule": "constant"},
                      "advantage": {"estimator": "grpo"},
                      "policy_loss": {"loss": "ppo_clip", "aggregation": "token_mean"},
                      "save_rollouts": False, "output_dir": str(run_dir)}
            stage(arm, CLI + ["rl", "--config", str(dump_yaml(config, out / f"{arm}.yaml"))])
        elif arm == "distill":
            config = {**common, "optim": {"lr": 2e-4, "warmup_steps": 0, "schedule": "constant"},
                      "teacher": {"model": str(teacher)}, "loss": "policy_gradient", "tis_cap": 2.0,
                      "output_dir": str(run_dir)}
            stage(arm, CLI + ["distill", "--config", str(dump_yaml(config, out / f"{arm}.yaml"))])
        else:  # dpo, dmpo, kto: the budget sampled once from the student, then offline epochs
            samples = out / "student_rollouts"
            if not (samples / "trajectories.jsonl").is_file():
                print(f"  student samples: {train_tasks} tasks x {args.group}", flush=True)
                stage("student_rollouts", CLI + [
                    "rollout", "--env", "calculator", "--env-option", "num_calls=2", "--adapter", str(student),
                    "--tasks", str(train_tasks), "--samples", str(args.group), "--temperature", str(TRAIN_T),
                    "--max-turns", str(MAX_TURNS), "--max-tokens-per-turn", str(MAX_TOKENS), "--concurrency", "32",
                    "--seed", "0", "--no-progress", "--out", str(samples)])
            config = {
                "model": {"name": "smollm2-135m", "adapter": str(student)}, "lora": LORA,
                "optim": {"lr": 5e-5, "warmup_steps": 1, "schedule": "cosine"},
                "data": {"rollouts_files": [str(samples / "trajectories.jsonl")], "min_gap": 0.5,
                         "truncate_at_divergence": True, "max_pairs_per_task": 4},
                "loss": {"name": arm, "beta": 0.1, "gamma": 0.7},
                "epochs": args.pref_epochs, "batch_size": 8, "micro_batch_size": 2, "max_length": 1024, "seed": 0,
                "output_dir": str(run_dir), "checkpoint": {"every": 0, "keep_last": 1},
                "logging": {"progress": True, "tensorboard": False},
            }
            stage(arm, CLI + ["dpo", "--config", str(dump_yaml(config, out / f"{arm}.yaml"))])
        arms[arm] = {"final": run_dir / "final"}

    # 3. held-out evaluation: the student, the teacher, every arm; same tasks, samples and seed
    evaluated = {"student (SFT start)": student, "teacher (longer SFT)": teacher,
                 **{arm: info["final"] for arm, info in arms.items()}}
    results: dict[str, dict] = {}
    for label, adapter in evaluated.items():
        key = label.split(" ")[0]
        eval_dir = out / f"eval_{key}"
        if not (eval_dir / "eval.json").is_file():
            print(f"eval: {label}", flush=True)
            stage(f"eval_{key}", CLI + [
                "eval", "--env", "calculator", "--env-option", "num_calls=2", "--adapter", str(adapter),
                "--tasks", str(args.test_tasks), "--samples", str(EVAL_SAMPLES), "--k", ",".join(map(str, KS)),
                "--temperature", str(EVAL_T), "--turns", str(MAX_TURNS), "--max-tokens-per-turn", str(MAX_TOKENS),
                "--concurrency", "32", "--seed", "1234", "--no-progress", "--out", str(eval_dir)])
        data = json.loads((eval_dir / "eval.json").read_text())
        turns = str(max(int(t) for t in data["pass_at"]))
        results[label] = {
            "pass_at": {k: data["pass_at"][turns][str(k)] for k in KS},
            "ci": {k: data["pass_at_ci"][turns][str(k)] for k in KS},
            "per_task": per_task_rates(eval_dir),
            "tokens_per_episode": data["cost"]["generated_tokens"],
        }
    start = results["student (SFT start)"]["per_task"]
    for label, r in results.items():
        if label != "student (SFT start)":
            r["vs_student"] = paired(start, r["per_task"])
        key = label.split(" ")[0]
        rows = [x for x in read_rows(out / key) if x.get("step", 0) > 0]
        r["train_wall_s"] = walls.get(key, sum(x.get("time/step_s", x.get("step_time_s", 0)) for x in rows) or None)
        r["train_tokens"] = sum(x.get("tokens", x.get("train/tokens", 0)) or 0 for x in rows) or None
        r["curves"] = rows

    print(f"\npreference experiment, calculator num_calls=2: student = SFT step {args.student_step}, teacher = SFT step "
          f"{args.sft_steps}; budget {budget} sampled episodes per arm (T={TRAIN_T}); eval {args.test_tasks} test tasks "
          f"x {EVAL_SAMPLES} samples, T={EVAL_T}\n")
    print("| policy | pass@1 [95% CI] | pass@2 | pass@4 [95% CI] | pass@1 - student, paired [95% CI] | tokens/episode |")
    print("|---|---|---|---|---|---|")
    for label, r in results.items():
        pa, ci = r["pass_at"], r["ci"]
        delta = r.get("vs_student")
        d = f"{delta[0]:+.3f} [{delta[1]:+.3f}, {delta[2]:+.3f}]" if delta else "-"
        print(f"| {label} | {pa[1]:.3f} [{ci[1][0]:.3f}, {ci[1][1]:.3f}] | {pa[2]:.3f} | "
              f"{pa[4]:.3f} [{ci[4][0]:.3f}, {ci[4][1]:.3f}] | {d} | {r['tokens_per_episode']:.1f} |")
    print("\nwall time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in walls.items()))
    print("peak RSS (MB): " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()))
    summary = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {platform.processor() or ''}".strip(", "),
               "args": vars(args), "budget_episodes": budget, "results": results, "wall_s": walls,
               "peak_rss_mb": peaks, "total_s": time.perf_counter() - started}
    (out / "results.json").write_text(json.dumps(summary, indent=2, default=str))
    plot(results, out / "curves.png")
    print(f"total {time.perf_counter() - started:.0f}s; wrote {out / 'results.json'} and {out / 'curves.png'}")


def plot(results: dict, path: Path) -> None:
    """Held-out pass@k of every policy, and each arm's training loss per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for label, r in results.items():
        ks = sorted(r["pass_at"])
        axes[0].plot(ks, [r["pass_at"][k] for k in ks], marker="o", label=label)
        rows = r.get("curves") or []
        losses = [(x["step"], x["loss"]) for x in rows if isinstance(x.get("loss"), (int, float))]
        losses = losses or [(x["step"], x["train/loss"]) for x in rows if isinstance(x.get("train/loss"), (int, float))]
        if losses:
            axes[1].plot(*zip(*losses), marker=".", label=label)
    axes[0].set(title="held-out pass@k (calculator, 2 calls)", xlabel="k", ylabel="pass@k", xticks=[1, 2, 4])
    axes[1].set(title="training loss", xlabel="optimizer step")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
