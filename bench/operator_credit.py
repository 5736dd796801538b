"""Where an RL run's credit lands, per calculator operator: for every call of every trained episode,
the operator the task's reference chain needed at that position and the one the policy used, with
the summed GRPO advantage of those episodes (episode reward normalised in its group with the sample
std, as ``grpo``; uniform groups left out). Reads only the run's saved rollouts (no model).

    .venv/bin/python bench/operator_credit.py runs/strong_start/seed_0/train_rl --num-calls 3 --train-tasks 80

Used for bench/results/strong_start_2026-12-04.md, "Where the direction comes from".
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np


def operator_of(expression: str) -> str | None:
    """The first binary operator of an expression (``//`` before ``/``)."""
    found = re.findall(r"//|%|\*|-|\+", expression)
    return found[0] if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="an RL run with rollouts/step_*.jsonl")
    parser.add_argument("--num-calls", type=int, default=3)
    parser.add_argument("--train-tasks", type=int, required=True, help="the run's tasks.train")
    parser.add_argument("--task-seed", type=int, default=0)
    args = parser.parse_args()

    from tracegym.envs import make

    tasks = {t.id: t for t in make("calculator", num_calls=args.num_calls).tasks("train", args.train_tasks, args.task_seed)}
    mass: dict[tuple, float] = defaultdict(float)
    calls: dict[tuple, int] = defaultdict(int)
    for path in sorted((args.run_dir / "rollouts").glob("step_*.jsonl")):
        groups: dict[str, list[dict]] = defaultdict(list)
        for line in path.read_text(encoding="utf-8").splitlines():
            episode = json.loads(line)
            groups[episode["task_id"]].append(episode)
        for task_id, episodes in groups.items():
            rewards = np.array([e["reward"] for e in episodes])
            if len(rewards) < 2 or rewards.std() < 1e-9:
                continue
            advantages = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
            needed = [operator_of(t) for t in tasks[task_id].data["templates"]]
            for episode, advantage in zip(episodes, advantages):
                made = [c for turn in episode["turns"] for c in turn["message"].get("tool_calls", [])]
                for k, call in enumerate(made[: len(needed)]):
                    key = (needed[k], operator_of(str(call["arguments"].get("expression", ""))))
                    mass[key] += float(advantage)
                    calls[key] += 1
    print("| needed -> used | calls | summed advantage |\n|---|---|---|")
    for key in sorted(mass, key=lambda k: (str(k[0]), str(k[1]))):
        print(f"| `{key[0]}` -> `{key[1]}` | {calls[key]} | {mass[key]:+.1f} |")
    for op in ("+", "-", "*", "//", "%"):
        net = sum(v for (want, used), v in mass.items() if used == op)
        print(f"net advantage on calls using {op}: {net:+.1f}")


if __name__ == "__main__":
    main()
