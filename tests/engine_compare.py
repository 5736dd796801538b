"""Helpers shared by the engine tests that compare two generation paths (plain vs cached, shared
prefix, preallocated buffers): seeded random token ids, and a same-tokens / log-prob-gap check."""

from __future__ import annotations

import torch


def random_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids in [3, 5000), the same for the same seed."""
    return torch.randint(3, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def compare_generations(out_a, out_b) -> float:
    """Assert the same tokens and finish reasons; return the largest log-prob difference."""
    worst = 0.0
    for gens_a, gens_b in zip(out_a, out_b, strict=True):
        for a, b in zip(gens_a, gens_b, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            worst = max(worst, max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0))
    return worst
