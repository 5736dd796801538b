"""bench/demo_bound.py's counter: the demo's sampling runs the model in worker threads (the runner's
``asyncio.to_thread``, the continuous decoder's stepper), so the count must see every thread's
matmuls, forward and backward, and nothing else (no model is loaded)."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import torch

_SPEC = importlib.util.spec_from_file_location(
    "demo_bound", Path(__file__).resolve().parents[1] / "bench" / "demo_bound.py")
demo_bound = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(demo_bound)


def test_the_count_is_every_threads_matmuls_forward_and_backward():
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4)

    def work():
        torch.nn.functional.gelu(x).sum()  # elementwise work: not counted
        worker = threading.Thread(target=lambda: (x @ w).sum().backward())
        worker.start()
        worker.join()

    flops, seconds = demo_bound.counted_flops(work)
    # forward [8,16]@[16,4], backward dX = dY [8,4] @ W^T [4,16]: 8*16*4 multiply-adds, 2 FLOPs each
    assert flops == 2 * (2 * 8 * 16 * 4) and seconds >= 0
    assert demo_bound.counted_flops(lambda: torch.ones(3).exp())[0] == 0
