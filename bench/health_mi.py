"""The RL stage's mutual-information health measure, with and without the step prefix, side by side.

``mutual_information_proxy`` (``tracegym/train/health.py``) scores the first assistant turn of one
trajectory per group under every group's prompt: B^2 teacher-forced rows for B prompts (B = 8 in the
demo, 9-16 s of each RL step on 2 cores). Every prompt starts with the same system prompt and tool
schemas (288 tokens of calculator's ~340). Settings, each in its own process:

- ``prompt per micro-batch``: each prompt's 8 rows share that whole prompt, run once per prompt
  (the code before 2026-12-07: the system prompt 8 times);
- ``system prompt once``: what all prompts share runs once (``step_prefix``), then each prompt's own
  remainder once, then the responses (two levels).

The rows are the env's expert first turns of ``--prompts`` three-call calculator tasks (the demo's
RL stage: SmolLM2-135M, float32, LoRA r=16 fresh); the MI values of both settings are printed (they
agree to float rounding). Run from the repository root, nothing else on the CPU::

    .venv/bin/python bench/health_mi.py [--prompts 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = {"prompt per micro-batch": False, "system prompt once": True}  # name: step prefix


def run_setting(name: str, prompts: int, repeats: int) -> dict:
    import torch

    import tracegym.train.step_prefix as step_prefix_module
    from tracegym.algos.config import PolicyLossConfig
    from tracegym.envs import make
    from tracegym.recipes._run import split_tasks
    from tracegym.recipes.demo import DemoConfig, rl_stage_config
    from tracegym.rl.collect import expert_episodes
    from tracegym.rl.policy import load_policy, make_renderer
    from tracegym.train.health import mutual_information_proxy
    from tracegym.types import TrajectoryGroup

    if not SETTINGS[name]:  # no step prefix: each prompt's micro-batch runs that whole prompt itself
        step_prefix_module.step_prefix = lambda *args, **kwargs: None  # health.py imports it when it runs
    cfg = rl_stage_config(DemoConfig(autocast="none"), "unused", "/tmp/bench-health-mi")
    cfg.model.adapter = None
    model, tokenizer, _ = load_policy(cfg, PolicyLossConfig(**cfg.policy_loss), torch.device("cpu"))
    renderer = make_renderer(cfg, tokenizer)
    train_tasks, _ = split_tasks(cfg, make(cfg.env.name, **cfg.env.options))
    episodes = list(expert_episodes(cfg, train_tasks[: 2 * prompts], renderer, seed=1).values())[:prompts]
    groups = [TrajectoryGroup(task_id=e.task_id, env=cfg.env.name, trajectories=(e,)) for e in episodes]
    seconds, values = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = mutual_information_proxy(model, groups, pad_token_id=tokenizer.pad_token_id, max_pairs=prompts,
                                       micro_batch_size=prompts, temperature=0.7)
        seconds.append(time.perf_counter() - start)
        values.append(out["health/mi"])
    first_turn = episodes[0].turns[0]
    return {"mi_s": seconds, "mi": values[0], "prompt_tokens": len(first_turn.prompt_ids),
            "response_tokens": len(first_turn.completion_ids),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="B: distinct prompts (the demo's mi_max_pairs)")
    parser.add_argument("--repeats", type=int, default=3, help="timed measures per setting")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(run_setting(args.worker, args.prompts, args.repeats)), flush=True)
        return 0

    from stages import machine_line, print_settings_table, run_settings

    results = run_settings(__file__, {name: [name, "--prompts", str(args.prompts), "--repeats", str(args.repeats),
                                             "--threads", str(args.threads)] for name in SETTINGS})
    first = next(iter(results.values()))
    print(f"{machine_line(args.threads)} | smollm2-135m, float32, {args.prompts} prompts of about "
          f"{first['prompt_tokens']} tokens x {args.prompts} first-turn responses of about {first['response_tokens']}, "
          f"{args.repeats} timed measures per setting")
    print_settings_table(results, "mi_s", "measure", "mi", 2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
