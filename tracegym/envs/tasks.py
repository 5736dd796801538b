"""Seeded generation of distinct tasks, split into train and test by a hash of their content.

The split is a function of the task itself, so train and test never share a task whatever the
seeds; the task id is made from the same hash, so equal tasks are drawn once.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any, Callable, Sequence

from tracegym.envs.base import Task

__all__ = ["content_split", "distinct_tasks", "parse_int_range"]


def content_split(content: str, test_fraction: float) -> tuple[str, str]:
    """(split, 12-hex-digit sha256 prefix) of a task's ``content``: "test" for a ``test_fraction`` of contents."""
    digest = hashlib.sha256(content.encode()).digest()
    split = "test" if int.from_bytes(digest[:8], "big") / 2**64 < test_fraction else "train"
    return split, digest.hex()[:12]


def distinct_tasks(
    split: str, n: int, rng: random.Random, generate: Callable[[random.Random], dict[str, Any]],
    content: Callable[[dict[str, Any]], str], id_prefix: str, test_fraction: float, what: str = "tasks",
) -> list[Task]:
    """The first ``n`` distinct tasks of ``split`` among the data ``generate(rng)`` draws, each split
    and named (``{id_prefix}-{hash}``) by ``content(data)``; RuntimeError naming ``what`` when
    ``50 * n + 1000`` draws do not give them."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    found: dict[str, Task] = {}
    attempts = 0
    while len(found) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise RuntimeError(f"could not generate {n} distinct {split} {what}")
        data = generate(rng)
        data_split, digest = content_split(content(data), test_fraction)
        if data_split != split:
            continue
        task_id = f"{id_prefix}-{digest}"
        found.setdefault(task_id, Task(id=task_id, split=split, data=data))
    return list(found.values())


def parse_int_range(value: int | Sequence[int] | str, what: str, low: int, high: int) -> tuple[int, int]:
    """A difficulty option as (min, max) within ``low..high``: ``3``, ``[1, 2]``, ``"1..2"``
    (also ``"1-2"``, ``"1:2"``). ValueError naming ``what`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int or a range, got {value!r}")
    if isinstance(value, int):
        first = last = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*(?:(?:\.\.|-|:)\s*(\d+))?\s*", value)
        if not m:
            raise ValueError(f"{what} must look like '{low}' or '{low}..{high}', got {value!r}")
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
    else:
        values = list(value)
        if len(values) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{what} range must be two ints (min, max), got {value!r}")
        first, last = values
    if not low <= first <= last <= high:
        raise ValueError(f"{what} must satisfy {low} <= min <= max <= {high}, got {first}..{last}")
    return first, last
