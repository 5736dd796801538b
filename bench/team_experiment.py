"""Teams on one base model: two LoRA adapters vs one shared adapter vs one agent, at equal compute.

    .venv/bin/python bench/team_experiment.py                     # the whole experiment (~1 h on 2 cores)
    .venv/bin/python bench/team_experiment.py --rl-steps 2 --test-tasks 8 --out /tmp/team_quick   # a smoke run

The task: the calculator's one-call word problems (``num_calls: 1``), played three ways on the same
train and test tasks (``calc_relay`` and ``calculator`` draw identical tasks for the same options):

- ``team_two``: ``calc_relay``, a planner (sees the problem, no tools) tells a solver (has the
  calculator, never sees the problem) what to compute; two adapters ``planner`` and ``solver``,
  each trained on its own turns with its own optimizer (MAGRPO: joint reward, group baseline per
  role);
- ``team_shared``: the same team, both roles played by one adapter (one set of weights and one
  optimizer over both roles' turns);
- ``single``: one agent on ``calculator`` with the problem and the tool.

Every arm starts from an SFT adapter trained for the same steps on its env's scripted expert (the
team arms share one: SFT on both roles' expert turns), then runs the same RL budget: steps x tasks
x group size, learning rate, temperature, turn budget. Evaluation: the same held-out tasks, samples
and seed for the SFT start and the RL end of every arm; pass@1 with a bootstrap CI over tasks, and
the paired RL - SFT difference. Every stage is its own subprocess (one torch job at a time).
Printed: the table (with generated tokens per episode and wall time as the compute each arm
spent), the per-role curves (``curves.png``) and peak RSS of each stage; ``results.json`` holds it all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from stages import ROOT, dump_yaml, run

PY = sys.executable

EVAL_SNIPPET = r'''
import json, sys, resource
import torch
from tracegym.config import LoraConfig
from tracegym.engines.hf import HFEngine
from tracegym.envs import make
from tracegym.models import load
from tracegym.render import get_renderer
from tracegym.rollout import RolloutConfig, run_rollouts_sync
from tracegym.rollout.team import run_team_rollouts_sync, with_adapter
from tracegym.recipes.team import episode_heads
from tracegym.train.adapter_pool import AdapterPool

spec = json.loads(sys.argv[1])
torch.manual_seed(0)
base, tokenizer = load("smollm2-135m")
pool = AdapterPool(base, {name: LoraConfig(r=spec["lora_r"]) for name in spec["adapters"]}, init=spec["adapters"])
renderer = get_renderer("smollm2-135m", tokenizer)
engine = HFEngine(pool.model, tokenizer, stop_token_ids=renderer.stop_token_ids, max_batch_size=64)
options = {"num_calls": 1}
tasks = make(spec["env"], **options).tasks("test", spec["test_tasks"], 0)
config = RolloutConfig(max_turns=spec["max_turns"], max_tokens_per_turn=spec["max_tokens_per_turn"],
                       temperature=spec["temperature"], samples_per_task=spec["samples"], seed=12345, concurrency=64)
if spec["roles"]:
    result = run_team_rollouts_sync(spec["env"], tasks, engine, renderer, config, adapters=spec["roles"], env_options=options)
    episodes = episode_heads(result.trajectories) + episode_heads(result.failed)
    tokens = result.stats.generated_tokens / max(len(episodes), 1)
else:
    (name,) = spec["adapters"]
    result = run_rollouts_sync(spec["env"], tasks, with_adapter(engine, name), renderer, config, env_options=options,
                               progress=False)
    episodes = result.trajectories + result.failed
    tokens = result.stats.generated_tokens / max(len(episodes), 1)
per_task = {}
for t in episodes:
    per_task.setdefault(t.task_id, []).append(float(t.success))
print("RESULT " + json.dumps({"per_task": per_task, "tokens_per_episode": tokens,
                              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def evaluate(spec: dict, log: Path) -> dict:
    with open(log, "w") as f:
        proc = subprocess.run([PY, "-c", EVAL_SNIPPET, json.dumps(spec)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=f, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"evaluation failed: see {log}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def pass_at_1(per_task: dict) -> tuple[float, float, float]:
    from tracegym.eval.metrics import bootstrap_ci

    values = [sum(v) / len(v) for v in per_task.values()]
    low, high = bootstrap_ci(values, n_resamples=2000)
    return sum(values) / len(values), low, high


def paired(a: dict, b: dict) -> tuple[float, float, float]:
    from tracegym.eval.metrics import bootstrap_ci

    shared = sorted(set(a) & set(b))
    diffs = [sum(b[t]) / len(b[t]) - sum(a[t]) / len(a[t]) for t in shared]
    low, high = bootstrap_ci(diffs, n_resamples=2000)
    return sum(diffs) / len(diffs), low, high


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/team_experiment")
    p.add_argument("--expert-tasks", type=int, default=160)
    p.add_argument("--sft-steps", type=int, default=24)
    p.add_argument("--rl-steps", type=int, default=12)
    p.add_argument("--tasks-per-step", type=int, default=6)
    p.add_argument("--group-size", type=int, default=6)
    p.add_argument("--test-tasks", type=int, default=64)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--arms", default="team_two,team_shared,single")
    args = p.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cli = [PY, "-m", "tracegym"]
    temperature, max_tokens, lora_r = 0.7, 64, 16
    peaks: dict[str, float] = {}
    started = time.perf_counter()

    # 1. scripted expert data, 2. SFT starts (one for the team arms, one for the single agent)
    sft = {}
    for env, max_turns in (("calc_relay", 6), ("calculator", 4)):
        data = out / f"expert_{env}"
        if not (data / "trajectories.jsonl").is_file():
            print(f"expert data: {env}", flush=True)
            run(cli + ["rollout", "--env", env, "--env-option", "num_calls=1", "--policy", "expert", "--tasks",
                       str(args.expert_tasks), "--max-turns", str(max_turns), "--out", str(data), "--no-progress"],
                out / f"expert_{env}.log")
        sft[env] = out / f"sft_{env}" / "final"
        if not sft[env].is_dir():
            print(f"SFT: {env}, {args.sft_steps} steps x 8", flush=True)
            config = dump_yaml({
                "model": {"name": "smollm2-135m"}, "lora": {"enabled": True, "r": lora_r, "alpha": 2 * lora_r},
                "optim": {"lr": 3e-4, "warmup_steps": 1, "schedule": "cosine"},
                "data": {"train_files": [str(data / "trajectories.jsonl")], "only_successful": True},
                "max_steps": args.sft_steps, "batch_size": 8, "micro_batch_size": 2, "max_length": 1024,
                "output_dir": str(out / f"sft_{env}"), "checkpoint": {"every": 0, "keep_last": 1},
                "logging": {"progress": False, "tensorboard": False}}, out / f"sft_{env}.yaml")
            peaks[f"sft_{env}"] = run(cli + ["sft", "--config", str(config)], out / f"sft_{env}.log")

    arms = {
        "team_two": {"env": "calc_relay", "roles": {"planner": {}, "solver": {}}, "max_turns": 6},
        "team_shared": {"env": "calc_relay", "roles": {"planner": {"adapter": "team"}, "solver": {"adapter": "team"}},
                        "max_turns": 6},
        "single": {"env": "calculator", "roles": None, "max_turns": 4},
    }
    results: dict[str, dict] = {}
    for arm in args.arms.split(","):
        spec = arms[arm]
        run_dir = out / f"rl_{arm}"
        init = str(sft[spec["env"]])
        if not (run_dir / "final").is_dir():
            print(f"RL: {arm}, {args.rl_steps} steps x {args.tasks_per_step} tasks x {args.group_size}", flush=True)
            config = {
                "model": {"name": "smollm2-135m", "adapter": init},
                "lora": {"enabled": True, "r": lora_r, "alpha": 2 * lora_r},
                "optim": {"lr": 2e-4, "warmup_steps": 0, "schedule": "constant"},
                "env": {"name": spec["env"], "options": {"num_calls": 1}},
                "tasks": {"train": args.rl_steps * args.tasks_per_step, "test": 0, "seed": 0},
                "tasks_per_step": args.tasks_per_step, "group_size": args.group_size,
                "rollout": {"engine": "hf", "max_turns": spec["max_turns"], "max_tokens_per_turn": max_tokens,
                            "temperature": temperature, "concurrency": 64},
                "advantage": {"estimator": "magrpo" if spec["roles"] else "dr_grpo"},
                "policy_loss": {"loss": "ppo_clip", "aggregation": "token_mean"},
                "steps": args.rl_steps, "micro_batch_size": 4, "max_length": 1024,
                "eval": {"every": 0, "at_start": False}, "checkpoint": {"every": 0, "keep_last": 1},
                "save_rollouts": False, "logging": {"progress": False, "tensorboard": False},
                "output_dir": str(run_dir),
            }
            if spec["roles"]:
                config["roles"] = spec["roles"]
            peaks[f"rl_{arm}"] = run(cli + ["rl", "--config", str(dump_yaml(config, out / f"rl_{arm}.yaml"))],
                                     out / f"rl_{arm}.log")
        # evaluation of the SFT start and of the RL end, same tasks, samples and seed
        adapters_end = ({a: str(run_dir / "final" / a) for a in dict.fromkeys(
            (r.get("adapter") or role) for role, r in spec["roles"].items())} if spec["roles"]
            else {"policy": str(run_dir / "final")})
        roles = {role: (r.get("adapter") or role) for role, r in spec["roles"].items()} if spec["roles"] else None
        adapters_start = {a: init for a in adapters_end}
        common = {"env": spec["env"], "roles": roles, "test_tasks": args.test_tasks, "samples": args.samples,
                  "temperature": temperature, "max_turns": spec["max_turns"], "max_tokens_per_turn": max_tokens,
                  "lora_r": lora_r}
        print(f"eval: {arm}", flush=True)
        start = evaluate({**common, "adapters": adapters_start}, out / f"eval_{arm}_sft.log")
        end = evaluate({**common, "adapters": adapters_end}, out / f"eval_{arm}_rl.log")
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rows = [r for r in rows if r.get("step", 0) > 0]
        results[arm] = {
            "sft": pass_at_1(start["per_task"]), "rl": pass_at_1(end["per_task"]),
            "delta": paired(start["per_task"], end["per_task"]),
            "tokens_per_episode": end["tokens_per_episode"],
            "train_generated_tokens": sum(r.get("rollout/generated_tokens", 0) for r in rows),
            "rl_wall_s": sum(r.get("time/step_s", 0) for r in rows),
            "curves": rows, "peak_rss_mb": {"eval": max(start["peak_rss_mb"], end["peak_rss_mb"]),
                                            "rl": peaks.get(f"rl_{arm}")},
        }

    # table
    print(f"\nteam experiment: {args.rl_steps} RL steps x {args.tasks_per_step} tasks x {args.group_size} samples per arm; "
          f"eval {args.test_tasks} test tasks x {args.samples} samples, T={temperature}\n")
    print("| arm | SFT pass@1 [95% CI] | RL pass@1 [95% CI] | RL - SFT (paired) [95% CI] | train tokens | RL wall s | tokens/episode |")
    print("|---|---|---|---|---|---|---|")
    for arm, r in results.items():
        s, e, d = r["sft"], r["rl"], r["delta"]
        print(f"| {arm} | {s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}] | {e[0]:.3f} [{e[1]:.3f}, {e[2]:.3f}] | "
              f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}] | {r['train_generated_tokens']:.0f} | {r['rl_wall_s']:.0f} | "
              f"{r['tokens_per_episode']:.1f} |")
    if "team_two" in results and "team_shared" in results:
        a, b = results["team_shared"], results["team_two"]
        print(f"\nteam_two - team_shared at the RL end: {b['rl'][0] - a['rl'][0]:+.3f} (independent runs; same tasks)")
    print("\npeak RSS (MB): " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items() if v) + "; eval " +
          ", ".join(f"{arm} {r['peak_rss_mb']['eval']:.0f}" for arm, r in results.items()))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "curves.png")
    print(f"total {time.perf_counter() - started:.0f}s; wrote {out / 'results.json'} and {out / 'curves.png'}")


def plot(results: dict, path: Path) -> None:
    """Per-step training reward of every arm, and per-role generated tokens and update loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for arm, r in results.items():
        rows = r["curves"]
        steps = [x["step"] for x in rows]
        axes[0].plot(steps, [x.get("reward/mean", 0) for x in rows], marker="o", label=arm)
        for key in sorted({k for x in rows for k in x if k.startswith("role/") and k.endswith("/generated_tokens")}):
            role = key.split("/")[1]
            axes[1].plot(steps, [x.get(key, 0) for x in rows], marker=".", label=f"{arm}: {role}")
        for key in sorted({k for x in rows for k in x if k.endswith("/train/loss") or k == "train/loss"}):
            axes[2].plot(steps, [x.get(key, 0) for x in rows], marker=".", label=f"{arm}: {key.split('/train')[0]}")
    axes[0].set(title="training reward (team success)", xlabel="RL step")
    axes[1].set(title="generated tokens per episode, by role", xlabel="RL step")
    axes[2].set(title="policy loss, by adapter", xlabel="RL step")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
