"""Steps per hour and time to reward: ``executor.kind`` local vs threads vs ray, side by side.

    .venv/bin/python bench/async_vs_sync.py                  # tiny-random easy task + SmolLM2 calculator
    .venv/bin/python bench/async_vs_sync.py --only tiny      # the quick half

Each (model, executor) run is its own subprocess, one after the other (never two torch jobs at
once on a small machine). Rows:

- ``tiny``: the tiny random model, full fine-tuning at a high learning rate on a one-token task
  (reply containing "e": about half of a random model's replies), 12 steps of 2 tasks x 16 samples.
  Time to reward: wall seconds until the mean reward of two consecutive steps reaches 0.85.
- ``smollm2``: SmolLM2-135M from the demo's SFT adapter (``runs/demo/train_sft/final``; skipped
  when absent) on one-call calculator problems, 4 steps of 4 tasks x 6 samples (the demo's RL
  settings). Time to reward: until the step reward reaches 0.6.

``threads`` and ``ray`` run with ``max_staleness: 1`` and the ``decoupled_ppo`` loss; ``ray`` with
2 rollout actors of 1 CPU each. Printed: median and total wall time per step, steps/hour, the
speedup over local, mean version lag, trainer wait per step, time to reward, peak RSS of each run
(the trainer's process; Ray actors are separate processes and not included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ENVS = textwrap.dedent('''
    from tracegym.envs import register
    from tracegym.envs.base import Env, Task
    from tracegym.types import Message, StepResult


    class LetterEnv(Env):
        name = "bench-letter"

        def __init__(self, letter: str = "e"):
            self.letter = letter

        def tasks(self, split="train", n=100, seed=0):
            offset = 0 if split == "train" else 10_000
            return [Task(id=f"{split}-{seed}-{i}", split=split, data={"word": f"w{offset + i}"}) for i in range(n)]

        def tool_schemas(self):
            return []

        async def reset(self, task):
            return [Message(role="system", content="Reply with one word."),
                    Message(role="user", content=f"Word {task.data['word']}")]

        async def step(self, message, parse_errors=()):
            ok = self.letter in message.content
            return StepResult(reward=float(ok), terminated=True, info={"success": ok})

        def expert_action(self):
            return Message(role="assistant", content=self.letter)


    register("bench-letter", LetterEnv, overwrite=True)
''')

RUNNER = textwrap.dedent('''
    import json, resource, sys, time
    from tracegym.config import RLConfig, load_config
    from tracegym.recipes.rl import train_rl
    from tracegym.train.logging import read_metrics
    from tracegym.plugins import load_plugins
    data = json.loads(sys.argv[1])
    load_plugins(data.get("plugins", []))
    cfg = load_config(RLConfig, data=data)
    started = time.perf_counter()
    result = train_rl(cfg)
    wall = time.perf_counter() - started
    rows = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    print("RESULT " + json.dumps({"wall_s": wall, "rows": rows,
                                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
''')


def base_config(model: str, plugin: Path, out: Path) -> dict:
    if model == "tiny":
        return {
            "plugins": [str(plugin)], "model": {"name": "tiny-random"}, "lora": {"enabled": False},
            "optim": {"lr": 0.1}, "env": {"name": "bench-letter", "options": {"letter": "e"}},
            "tasks": {"train": 32, "test": 0}, "tasks_per_step": 2, "group_size": 16,
            "rollout": {"max_turns": 1, "max_tokens_per_turn": 1, "concurrency": 32},
            "micro_batch_size": 16, "steps": 12, "eval": {"every": 0, "at_start": False},
            "output_dir": str(out), "save_rollouts": False, "logging": {"progress": False, "tensorboard": False},
        }
    return {
        "model": {"name": "smollm2-135m", "adapter": str(ROOT / "runs/demo/train_sft/final")},
        "lora": {"enabled": True, "r": 16, "alpha": 32}, "optim": {"lr": 2e-4},
        "env": {"name": "calculator", "options": {"num_calls": 1}}, "tasks": {"train": 32, "test": 0},
        "tasks_per_step": 4, "group_size": 6,
        "rollout": {"max_turns": 4, "max_tokens_per_turn": 48, "temperature": 0.7, "concurrency": 64},
        "micro_batch_size": 2, "steps": 4, "eval": {"every": 0, "at_start": False},
        "policy_loss": {"loss": "ppo_clip", "clip_eps_low": 0.2, "clip_eps_high": 0.28},
        "output_dir": str(out), "save_rollouts": False, "logging": {"progress": False, "tensorboard": False},
    }


def time_to_reward(rows: list[dict], threshold: float, window: int) -> float | None:
    elapsed = 0.0
    rewards: list[float] = []
    for row in rows:
        elapsed += row["time/step_s"]
        rewards.append(row["reward/mean"])
        if len(rewards) >= window and sum(rewards[-window:]) / window >= threshold:
            return elapsed
    return None


def run_one(model: str, executor: str, plugin: Path, work: Path) -> dict:
    data = base_config(model, plugin, work / f"{model}-{executor}")
    if executor != "local":
        data["executor"] = {"kind": executor, "max_staleness": 1, "rollout_workers": 2, "worker_cpus": 1}
        data.setdefault("policy_loss", {})["loss"] = "decoupled_ppo"
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 2))
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(data)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=3600)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{model}/{executor} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["tiny", "smollm2"], default=None)
    parser.add_argument("--executors", default="local,threads,ray")
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/async_vs_sync.json")
    args = parser.parse_args()
    models = [args.only] if args.only else ["tiny", "smollm2"]
    if "smollm2" in models and not (ROOT / "runs/demo/train_sft/final").exists():
        print("skipping smollm2: run `make demo` first (it writes runs/demo/train_sft/final)")
        models.remove("smollm2")
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        plugin = Path(tmp) / "bench_envs.py"
        plugin.write_text(ENVS)
        for model in models:
            threshold, window = (0.85, 2) if model == "tiny" else (0.6, 1)
            for executor in args.executors.split(","):
                out = run_one(model, executor, plugin, Path(tmp))
                rows = out["rows"]
                steps = [r["time/step_s"] for r in rows]
                lags = [r["async/lag_mean"] for r in rows if "async/lag_mean" in r]
                waits = [r["async/wait_s"] for r in rows if "async/wait_s" in r]
                table.append({
                    "model": model, "executor": executor, "steps": len(rows), "wall_s": out["wall_s"],
                    "median_step_s": statistics.median(steps[1:] or steps), "total_step_s": sum(steps),
                    "steps_per_hour": 3600 * len(rows) / sum(steps),
                    "lag_mean": statistics.mean(lags) if lags else 0.0,
                    "wait_per_step_s": statistics.mean(waits) if waits else 0.0,
                    "time_to_reward_s": time_to_reward(rows, threshold, window),
                    "final_reward": rows[-1]["reward/mean"], "peak_rss_mb": out["peak_rss_mb"],
                })
                print(f"done {model}/{executor}: {sum(steps):.0f} s for {len(rows)} steps", flush=True)
    print("\n| model | executor | steps | median s/step | steps/hour | x local | lag mean | wait s/step | "
          "time to reward (s) | final reward | peak RSS MB |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        local = next(r for r in table if r["model"] == row["model"] and r["executor"] == "local")
        ttr = f"{row['time_to_reward_s']:.0f}" if row["time_to_reward_s"] is not None else "not reached"
        print(f"| {row['model']} | {row['executor']} | {row['steps']} | {row['median_step_s']:.2f} | "
              f"{row['steps_per_hour']:.0f} | {row['steps_per_hour'] / local['steps_per_hour']:.2f} | "
              f"{row['lag_mean']:.2f} | {row['wait_per_step_s']:.2f} | {ttr} | {row['final_reward']:.3f} | "
              f"{row['peak_rss_mb']:.0f} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
