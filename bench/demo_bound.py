"""The fastest this CPU could run the demo: its matmul arithmetic, counted, over the CPU's best matmul rate.

Runs a sample of every model stage of ``make demo`` under torch's FLOP counter (``FlopCounterMode``:
2 x the multiply-adds of every ``mm`` / ``addmm`` / ``bmm`` any thread runs, forward and backward),
from a finished demo folder (its expert data and SFT adapter), and scales each to the whole job:

- SFT: one optimizer step of the demo's SFT stage (8 expert traces, 4 rows a pass, step prefix),
  times ``sft_steps``;
- the evaluations: ``--tasks`` held-out tasks x 2 samples of the base model and of the SFT adapter,
  times ``test_tasks / --tasks`` (the RL evaluation counted as the SFT one: same turns and tokens);
- RL: one step of the demo's RL stage (8 tasks x 6 samples, the update with expert replay, drift,
  probe and MI passes), times ``rl_steps``.

Attention's own products (``scaled_dot_product_attention`` on the CPU) are not counted, nor any
elementwise work, so the sum is a lower bound on the job's arithmetic, and the time it gives at the
CPU's best float32 matmul rate at the model's shapes (``bench/matmul_rate.py``'s, measured here) is
a lower bound on the demo's time on this machine. Run alone on the machine (about 6 minutes)::

    .venv/bin/python bench/demo_bound.py --run runs/demo [--tasks 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))


def counted_flops(work: Callable[[], object]) -> tuple[float, float]:
    """(FLOPs, 2 per multiply-add, of every matmul ``work`` runs, forward and backward, in any thread; its seconds).

    torch's counter (``FlopCounterMode``, a dispatch mode) and its profiler see the thread that
    enters them only, and the demo samples in worker threads (the runner's ``asyncio.to_thread``, the
    continuous decoder's stepper): every thread started meanwhile runs under a counter of its own."""
    from torch.utils.flop_counter import FlopCounterMode

    counters: list[FlopCounterMode] = []
    lock = threading.Lock()

    def counter() -> FlopCounterMode:
        mode = FlopCounterMode(display=False)
        with lock:
            counters.append(mode)
        return mode

    thread_run = threading.Thread.run

    def counted_run(thread: threading.Thread) -> None:
        with counter():
            thread_run(thread)

    start = time.perf_counter()
    threading.Thread.run = counted_run  # type: ignore[method-assign]
    try:
        with counter():
            work()
    finally:
        threading.Thread.run = thread_run  # type: ignore[method-assign]
    seconds = time.perf_counter() - start
    return float(sum(mode.get_total_flops() for mode in counters)), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=Path("runs/demo"), help="a finished demo folder")
    parser.add_argument("--tasks", type=int, default=16, help="held-out tasks of each sampled evaluation")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2))
    args = parser.parse_args(argv)

    import torch
    import yaml

    torch.set_num_threads(args.threads)
    from matmul_rate import SHAPES, rate
    from stages import machine_line
    from tracegym.config import SFTConfig
    from tracegym.envs import make
    from tracegym.models import load_tokenizer
    from tracegym.recipes.demo import DemoConfig, evaluate_stage, rl_stage_config
    from tracegym.recipes.rl import train_rl
    from tracegym.recipes.sft import train_sft
    from tracegym.render import get_renderer

    cfg = DemoConfig.model_validate_json((args.run / "demo_config.json").read_text(encoding="utf-8"))
    cfg = cfg.model_copy(update={"progress": False})
    sft_adapter = args.run / "train_sft" / "final"
    renderer = get_renderer(cfg.model, load_tokenizer(cfg.model))
    test_tasks = make(cfg.env, **cfg.env_options).tasks("test", args.tasks, cfg.task_draw_seed)
    eval_scale = cfg.test_tasks / args.tasks
    rows: list[tuple[str, float, float, float]] = []  # stage, counted FLOPs, times in the job, sampled seconds
    with tempfile.TemporaryDirectory(prefix="demo-bound-") as scratch:
        out = Path(scratch)
        sft_data = yaml.safe_load((args.run / "train_sft" / "config.yaml").read_text(encoding="utf-8"))
        sft_data.update(max_steps=1, output_dir=str(out / "sft"), logging={"tensorboard": False, "progress": False})
        sft_data["data"]["train_files"] = [str(args.run / "expert" / "trajectories.jsonl")]
        sft_data["optim"]["warmup_steps"] = 0
        flops, seconds = counted_flops(lambda: train_sft(SFTConfig.model_validate(sft_data)))
        rows.append(("SFT (one step)", flops, cfg.sft_steps, seconds))
        for label, model in (("base evaluation", cfg.model), ("SFT evaluation", str(sft_adapter))):
            flops, seconds = counted_flops(lambda: evaluate_stage(cfg, test_tasks, renderer, model, out / label, label))
            rows.append((f"{label} ({args.tasks} tasks x {cfg.eval_samples})", flops, eval_scale, seconds))
        rows.append(("RL evaluation (as the SFT one)", rows[-1][1], eval_scale, 0.0))
        rl_cfg = rl_stage_config(cfg, sft_adapter, out / "rl")
        rl_cfg = rl_cfg.model_copy(update={"steps": 1, "logging": rl_cfg.logging.model_copy(
            update={"tensorboard": False, "progress": False})})
        flops, seconds = counted_flops(lambda: train_rl(rl_cfg))
        rows.append(("RL (one step)", flops, cfg.rl_steps, seconds))

    rates = {name: rate(*shape, "float32", 10) for name, shape in SHAPES.items()}
    best_name, best = max(rates.items(), key=lambda item: item[1])
    total = sum(flops * times for _, flops, times, _ in rows)
    print(f"{machine_line(args.threads)} | demo config of {args.run}: SFT {cfg.sft_steps} steps, RL {cfg.rl_steps} steps, "
          f"{cfg.test_tasks} test tasks x {cfg.eval_samples} samples x 3 evaluations")
    print("| stage | counted TFLOP (sample) | x in the job | job TFLOP | minutes at the ceiling | sample s (counted) |")
    print("|---|---|---|---|---|---|")
    for name, flops, times, seconds in rows:
        print(f"| {name} | {flops / 1e12:.2f} | {times:g} | {flops * times / 1e12:.1f} | "
              f"{flops * times / best / 1e9 / 60:.1f} | {seconds:.0f} |")
    print(f"| **the job** | | | **{total / 1e12:.0f}** | **{total / best / 1e9 / 60:.1f}** | |")
    print("float32 matmul rate at the model's shapes (GFLOP/s): "
          + ", ".join(f"{name} {value:.0f}" for name, value in rates.items())
          + f"; the ceiling used: {best:.0f} ({best_name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
