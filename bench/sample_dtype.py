"""How the hf engine samples: the peft model itself, its merged float32 copy, its merged bfloat16
copy (``HFEngine(sample_dtype=...)``), and the merged float32 copy with the strided output-layer
input of before 2026-12-06 (``contiguous_head_input`` off): time, tokens/s and pass@1 of one
evaluation each, side by side in one process.

    python bench/sample_dtype.py --model runs/demo/train_sft/final [--tasks 48] [--samples 2] [--repeats 1]

The demo's evaluation: calculator with 3 dependent calls, 4 turns, 48 tokens a turn, temperature
0.7, 64 episodes decoding together, the same tasks and sampling seeds for every row. ``--model`` is
an adapter folder (the RL rollouts sample the peft model; the evaluations load the merge) or a
plain model (no peft row). Rows run in turn, ``--repeats`` times (median). pass@1 checks what each
numerics costs the policy: its paired difference over tasks against the first row, with a 95%
bootstrap CI. Peak RSS is the process's (every copy loads in it).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an adapter folder (e.g. runs/demo/train_sft/final) or a model")
    parser.add_argument("--tasks", type=int, default=48, help="held-out calculator tasks")
    parser.add_argument("--samples", type=int, default=2, help="samples per task")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row (median)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from contextlib import nullcontext
    from unittest.mock import patch

    import torch

    torch.set_num_threads(args.threads)
    from tracegym.engines import hf, make_engine
    from tracegym.envs import make
    from tracegym.eval.metrics import paired_bootstrap_diff, solved_per_task
    from tracegym.models import adapter_base_model, load, load_tokenizer
    from tracegym.recipes.evaluate import evaluate_to_dir
    from tracegym.render import get_renderer
    from tracegym.rollout import RolloutConfig

    renderer = get_renderer("smollm2-135m", load_tokenizer("smollm2-135m"))
    env_options = {"num_calls": 3}
    tasks = make("calculator", **env_options).tasks("test", args.tasks, 0)
    rollout = RolloutConfig(max_turns=4, max_tokens_per_turn=48, temperature=0.7, samples_per_task=args.samples,
                            seed=12345, concurrency=64)
    folder = Path(args.model)
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        base, tokenizer = load(adapter_base_model(folder))
        policy = PeftModel.from_pretrained(base, str(folder)).eval()
    else:
        policy, tokenizer = load(args.model)
    rows = {"float32, merged": dict(sample_dtype="float32"), "bfloat16, merged": dict(sample_dtype="bfloat16"),
            "float32, merged, strided head": dict(sample_dtype="float32")}
    if hasattr(policy, "peft_config"):
        rows = {"float32, peft (no copy)": {}, **rows}
    engines = {name: make_engine("hf", model=policy, tokenizer=tokenizer, renderer=renderer, max_batch_size=64, **opts)
               for name, opts in rows.items()}
    runs: dict[str, list[dict]] = {name: [] for name in rows}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for name in rows:
                strided = "strided" in name  # the output layer's input as transformers hands it
                with patch.object(hf, "contiguous_head_input", lambda _m: nullcontext()) if strided else nullcontext():
                    t0 = time.perf_counter()
                    summary, _, _ = evaluate_to_dir("calculator", tasks, engines[name], renderer, rollout, [1], [4],
                                                    Path(scratch) / f"{list(rows).index(name)}_{repeat}", env_options=env_options,
                                                    progress=False)
                    seconds = time.perf_counter() - t0
                tokens = summary["rollout"]["generated_tokens"]
                runs[name].append({"s": seconds, "tokens": tokens, "summary": summary})
                print(f"  {name:30s} run {repeat + 1}: {seconds:6.1f} s, {tokens / seconds:6.1f} tokens/s, "
                      f"pass@1 {summary['pass_at']['4']['1']:.3f}", flush=True)
    dtypes = list(rows)

    base = statistics.median(r["s"] for r in runs[dtypes[0]])
    print(f"\n{args.tasks} tasks x {args.samples} samples, model {args.model}, {args.threads} threads, "
          f"torch {torch.__version__}")
    print("| sampling | median s | tokens/s | speedup | pass@1 | turns | tokens/episode |")
    print("|---|---|---|---|---|---|---|")
    for d in dtypes:
        seconds = statistics.median(r["s"] for r in runs[d])
        first = runs[d][0]["summary"]
        print(f"| {d} | {seconds:.1f} | {statistics.median(r['tokens'] / r['s'] for r in runs[d]):.1f} | "
              f"{base / seconds:.2f}x | {first['pass_at']['4']['1']:.3f} | {first['cost']['turns']:.2f} | "
              f"{first['cost']['generated_tokens']:.1f} |")

    for d in dtypes[1:]:
        diff, low, high, shared = paired_bootstrap_diff(solved_per_task(runs[dtypes[0]][0]["summary"], 4),
                                                        solved_per_task(runs[d][0]["summary"], 4), 1)
        print(f"pass@1 {d} - {dtypes[0]}: {diff:+.3f} [{low:+.3f}, {high:+.3f}] over {shared} tasks (paired bootstrap)")
    print(f"peak RSS {peak_rss_mb():.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
