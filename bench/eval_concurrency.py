"""The demo's evaluation at several concurrencies (episodes decoding together), side by side.

Each setting evaluates the same adapter on the same held-out tasks and sampling seeds with the
demo's own stage (``tracegym.recipes.demo.evaluate_stage``: calculator with 3 dependent calls, 4
turns, 48 tokens a turn, temperature 0.7), ``DemoConfig.eval_concurrency`` set to the setting's
value, each in its own process, so its peak RSS is its own. A decoding step's matmuls are
``[rows, 576] @ [576, N]``: more rows a step run closer to the CPU's matmul rate (the 49152-wide
output layer most of all: ``bench/matmul_rate.py``), until the batch outgrows the episodes
still running. pass@1 differs only by float rounding (each row samples
with its own seeded generator); its paired difference to the first setting is printed.

    .venv/bin/python bench/eval_concurrency.py --model runs/demo/train_sft/final [--tasks 128] [--concurrency 64,128]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_setting(model: str, tasks: int, samples: int, concurrency: int, scratch: str) -> dict:
    from tracegym.envs import make
    from tracegym.eval.metrics import solved_per_task
    from tracegym.models import load_tokenizer
    from tracegym.recipes.demo import DemoConfig, evaluate_stage
    from tracegym.render import get_renderer

    cfg = DemoConfig(progress=False, eval_samples=samples, eval_concurrency=concurrency)
    renderer = get_renderer(cfg.model, load_tokenizer(cfg.model))
    test_tasks = make(cfg.env, **cfg.env_options).tasks("test", tasks, cfg.seed)
    start = time.perf_counter()
    summary = evaluate_stage(cfg, test_tasks, renderer, model, Path(scratch) / str(concurrency), "sft")
    seconds = time.perf_counter() - start
    return {"eval_s": seconds, "pass@1": summary["pass_at"]["4"]["1"], "tokens": summary["rollout"]["generated_tokens"],
            "solved": solved_per_task(summary, 4), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an adapter folder (e.g. runs/demo/train_sft/final) or a model")
    parser.add_argument("--tasks", type=int, default=128, help="held-out calculator tasks")
    parser.add_argument("--samples", type=int, default=2, help="samples per task")
    parser.add_argument("--concurrency", default="64,128", help="comma-separated settings; the first is the baseline")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2))
    parser.add_argument("--worker", nargs=2, metavar=("CONCURRENCY", "SCRATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        result = run_setting(args.model, args.tasks, args.samples, int(args.worker[0]), args.worker[1])
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    from stages import machine_line, run_settings
    from tracegym.eval.metrics import paired_bootstrap_diff

    settings = [int(c) for c in args.concurrency.split(",")]
    common = ["--model", args.model, "--tasks", str(args.tasks), "--samples", str(args.samples),
              "--threads", str(args.threads)]
    with tempfile.TemporaryDirectory(prefix="eval-concurrency-") as scratch:
        results = run_settings(__file__, {str(c): [str(c), scratch, *common] for c in settings})
    print(f"{machine_line(args.threads)} | {args.model}: {args.tasks} held-out tasks x {args.samples} samples, "
          f"the demo's evaluation stage")
    base = next(iter(results.values()))
    print("| episodes decoding together | eval s | tokens/s | vs the first | pass@1 | pass@1 - first [95% CI] | peak RSS (MB) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        diff, low, high, _ = paired_bootstrap_diff(base["solved"], r["solved"], 1)
        print(f"| {name} | {r['eval_s']:.1f} | {r['tokens'] / r['eval_s']:.1f} | {base['eval_s'] / r['eval_s']:.2f}x | "
              f"{r['pass@1']:.3f} | {diff:+.3f} [{low:+.3f}, {high:+.3f}] | {r['peak_rss_mb']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
