"""What this CPU's matmuls sustain, float32 against bfloat16, at the shapes SmolLM2-135M trains and
samples with: the ceiling every other timing in bench/ runs under.

Shapes (M x K @ K x N, SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49152):

- ``mlp, 2048 tokens``: a training micro-batch's MLP up-projection (4 rows x ~500 tokens);
- ``attention out, 2048 tokens``: the same tokens through the 576 x 576 output projection;
- ``output layer, 256 positions``: the vocabulary projection of the trained positions;
- ``mlp, 64 rows decoding``: one decoding step of 64 episodes (the evaluation's concurrency).

Each is timed ``--repeats`` times after a warm-up; the table gives the median GFLOP/s (2 M K N
floating-point operations per matmul) per dtype and the bfloat16 / float32 ratio. bfloat16 runs
under ``torch.autocast`` as the trainer does (``model.autocast``). Run alone on the machine::

    .venv/bin/python bench/matmul_rate.py [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # name: (M, K, N)
    "mlp, 2048 tokens": (2048, 576, 1536),
    "attention out, 2048 tokens": (2048, 576, 576),
    "output layer, 256 positions": (256, 576, 49152),
    "mlp, 64 rows decoding": (64, 576, 1536),
}


def rate(m: int, k: int, n: int, dtype: str, repeats: int) -> float:
    """Median GFLOP/s of ``[m, k] @ [k, n]`` (float32 tensors; ``bfloat16`` under CPU autocast)."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else torch.autocast("cpu", enabled=False)
    inner = max(1, int(2e9 // (2 * m * k * n)))  # about 2 GFLOP per timed sample
    with torch.no_grad(), context:
        for _ in range(3):
            a @ b
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                a @ b
            samples.append(2 * m * k * n * inner / (time.perf_counter() - start) / 1e9)
    return statistics.median(samples)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown CPU" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    import torch

    from stages import machine_line
    from tracegym.train.precision import native_bfloat16

    torch.set_num_threads(args.threads)
    print(f"{machine_line(args.threads)} | {cpu_model()} | native bfloat16: {native_bfloat16(torch.device('cpu'))} | "
          f"median of {args.repeats} samples of ~2 GFLOP each")
    print("| shape (M x K x N) | float32 GFLOP/s | bfloat16 GFLOP/s | bfloat16 / float32 |")
    print("|---|---|---|---|")
    for name, (m, k, n) in SHAPES.items():
        f32, bf16 = rate(m, k, n, "float32", args.repeats), rate(m, k, n, "bfloat16", args.repeats)
        print(f"| {name} ({m} x {k} x {n}) | {f32:.0f} | {bf16:.0f} | {bf16 / f32:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
