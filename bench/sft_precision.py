"""SFT step time by micro-batch, forward mode and precision: the demo's SFT before and after, side by side.

The same optimizer steps as ``bench/sft_vs_plain.py`` (its ``build_job``: scripted expert calculator
traces through ``load_sft_examples``, ``train_sft``'s batch order, LoRA r=16 on SmolLM2-135M, AdamW,
clip 1.0), run in the settings below, each in its own subprocess (so each peak RSS is its own):

- ``float32, 1 row a pass, train mode``: the demo's SFT until 2026-12-06 (every row's forward whole);
- ``float32, 8 rows a pass, eval mode`` (full logits, then with the fused output layer of
  ``train/logprobs.py``, and at 4 rows): the rows' common prefix (system prompt and tool schemas,
  about half of a calculator trace) runs once (``forward_logits``' shared prefix, which train mode
  turns off; fixed-dataset recipes now train in eval mode unless dropout or checkpointing needs it);
- ``bfloat16 autocast, 8 rows a pass, eval mode``: ``model.autocast: bfloat16`` on top (matmuls in
  bfloat16 on AMX / AVX512-BF16; weights, gradients and AdamW in float32);
- the same at 4 rows a pass (a lower peak);
- at 4 and 2 rows a pass, with and without the step prefix (``tracegym/train/step_prefix.py``: the
  system prompt every row starts with runs once per optimizer step, forward and backward, instead of
  once per micro-batch; "prefix per micro-batch" is the code before 2026-12-07).

Run from the repository root, nothing else on the CPU::

    .venv/bin/python bench/sft_precision.py [--num-calls 3] [--steps 4] [--warmup 1]

The first-step loss of each setting is printed: the float32 ones agree to float rounding, the
bfloat16 ones to bfloat16 rounding. Each worker caps glibc's malloc arenas at 2, as the CLI does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = {  # name: (autocast, micro-batch rows, train mode, fused output layer, step prefix)
    "float32, 1 row a pass, train mode, full logits": ("none", 1, True, False, False),
    "float32, 8 rows a pass, eval mode, full logits": ("none", 8, False, False, False),
    "float32, 8 rows a pass, eval mode": ("none", 8, False, True, True),
    "float32, 4 rows a pass, eval mode, prefix per micro-batch": ("none", 4, False, True, False),
    "float32, 4 rows a pass, eval mode": ("none", 4, False, True, True),
    "float32, 2 rows a pass, eval mode, prefix per micro-batch": ("none", 2, False, True, False),
    "float32, 2 rows a pass, eval mode": ("none", 2, False, True, True),
    "bfloat16 autocast, 8 rows a pass, eval mode": ("bfloat16", 8, False, True, True),
    "bfloat16 autocast, 4 rows a pass, eval mode, prefix per micro-batch": ("bfloat16", 4, False, True, False),
    "bfloat16 autocast, 4 rows a pass, eval mode": ("bfloat16", 4, False, True, True),
}


def run_setting(job: dict[str, Any], name: str) -> dict[str, Any]:
    from sft_vs_plain import run_tracegym

    autocast, micro_batch_size, train_mode, fused, step_prefix = SETTINGS[name]
    if not fused:  # the output layer as the model applies it: full [B, L, V] logits, then the log-probs
        import tracegym.train.logprobs as logprobs

        logprobs.FUSED_HEAD_MODEL_TYPES = frozenset()
    if not step_prefix:  # each micro-batch runs the system prompt itself (the code before 2026-12-07)
        import tracegym.recipes.sft as sft

        sft.step_prefix = lambda *args, **kwargs: None
    return run_tracegym(job, autocast=autocast, micro_batch_size=micro_batch_size, train_mode=train_mode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-calls", type=int, default=3, help="calculator calls per expert trace")
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per setting")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2))
    parser.add_argument("--only", default="", help="run the settings whose name holds this text, or one of "
                        "several separated by '|' (e.g. float32: bfloat16 autocast is slow where the CPU has no "
                        "native bfloat16)")
    parser.add_argument("--worker", nargs=2, metavar=("SETTING", "JOB"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import sft_vs_plain

    if args.worker:
        import torch

        index, job_file = args.worker
        job = json.loads(Path(job_file).read_text(encoding="utf-8"))
        torch.set_num_threads(job["threads"])
        print("RESULT " + json.dumps(run_setting(job, list(SETTINGS)[int(index)])), flush=True)
        return 0

    from stages import machine_line, print_settings_table, run_settings

    sft_vs_plain.ENV_OPTIONS = {"num_calls": args.num_calls}
    job_args = argparse.Namespace(model=args.model, episodes=args.episodes, steps=args.steps, warmup=args.warmup,
                                  batch_size=8, micro_batch_size=8, threads=args.threads, lr=1e-4)
    with tempfile.TemporaryDirectory(prefix="sft-precision-") as tmp:
        job = sft_vs_plain.build_job(job_args, Path(tmp))
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job), encoding="utf-8")
        results = run_settings(__file__, {name: [str(i), str(job_file)] for i, name in enumerate(SETTINGS)
                                               if any(part in name for part in args.only.split("|"))})
    lengths = [len(e["input_ids"]) for e in job["examples"]]
    print(f"{machine_line(args.threads)} | {args.model}, "
          f"{len(job['examples'])} expert calculator traces (num_calls={args.num_calls}, {min(lengths)}-{max(lengths)} "
          f"tokens, mean {statistics.fmean(lengths):.0f}), batch 8, {args.warmup} warmup + {args.steps} timed steps, LoRA r=16")
    print_settings_table(results, "step_s", "step", "first_loss", 2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
