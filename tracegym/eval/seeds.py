"""Results over several training seeds: runs laid out as ``<dir>/seed_<N>/``, pooled and plotted.

``tracegym rl --seeds 1,2,3`` and ``tracegym demo --seeds 1,2,3`` write one run per seed into
``<output_dir>/seed_<N>/``. This module reads such folders back:

- :func:`group_by_method` groups evaluation folders (``runs/a/seed_1/eval``, ``runs/b/seed_2``, ...)
  by their path without the ``seed_<N>`` part, the *method*;
- :func:`pool_seeds` gives per method pass@1 pooled over seeds and tasks with a bootstrap interval
  that resamples both, the per-seed values, and the paired difference to the first method
  (``tracegym compare --pool-seeds``);
- :func:`seed_curves` and :func:`seed_band_figure` plot training curves of the seed runs as their
  mean with a min-max band (``tracegym report`` on a folder of ``seed_*`` runs).

Every seed of a method is expected to be evaluated on the same held-out tasks (the ``--seeds``
commands vary the training seed only); tasks missing from some seed are left out and counted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from tracegym.eval.metrics import bootstrap_ci_seeds_tasks, paired_seeds_tasks_bootstrap_diff, pass_at_k

__all__ = [
    "DEFAULT_CURVE_KEYS",
    "SeedTable",
    "find_seed_runs",
    "group_by_method",
    "method_labels",
    "pass_at_1_table",
    "pool_seeds",
    "seed_band_figure",
    "seed_compare_figure",
    "seed_curves",
    "seed_dir_name",
    "split_seed",
    "write_seed_curves",
]

SEED_DIR = re.compile(r"seed_(\d+)")

DEFAULT_CURVE_KEYS = ("reward/mean", "eval/pass@1", "train/loss")
"""Curves drawn when no keys are named (those every seed logged), followed by every ``health/*`` key."""


def seed_dir_name(seed: int) -> str:
    """The folder of one seed's run inside the output folder."""
    return f"seed_{seed}"


def split_seed(path: str | Path) -> tuple[Path, int] | None:
    """``(path without its seed folder, seed)``, or None when no folder of ``path`` is ``seed_<N>``.
    The innermost seed folder counts: ``runs/demo/seed_2/rl`` -> ``(runs/demo/rl, 2)``."""
    parts = Path(path).parts
    for i in range(len(parts) - 1, -1, -1):
        match = SEED_DIR.fullmatch(parts[i])
        if match:
            return Path(*parts[:i], *parts[i + 1:]), int(match.group(1))
    return None


def group_by_method(dirs: Iterable[str | Path]) -> dict[Path, dict[int, Path]]:
    """``{method: {seed: folder}}`` in the order the methods first appear; ``eval.json`` files
    stand for their folder. ValueError for a path without a ``seed_<N>`` folder or a seed given
    twice for one method."""
    groups: dict[Path, dict[int, Path]] = {}
    for item in dirs:
        folder = Path(item) if Path(item).suffix != ".json" else Path(item).parent
        found = split_seed(folder)
        if found is None:
            raise ValueError(f"{item}: no seed_<N> folder in the path (expected e.g. runs/a/seed_1)")
        method, seed = found
        if seed in groups.setdefault(method, {}):
            raise ValueError(f"{method}: seed {seed} given twice ({groups[method][seed]} and {folder})")
        groups[method][seed] = folder
    return groups


def method_labels(methods: Sequence[Path]) -> list[str]:
    """Short names of methods: the parts of their paths that differ, without the leading and
    trailing folders they all share (``runs/a/eval``, ``runs/b/eval`` -> ``a``, ``b``;
    ``runs/demo/sft``, ``runs/demo/rl`` -> ``sft``, ``rl``)."""
    resolved = [m.resolve() for m in methods]
    if len(resolved) == 1:
        return [resolved[0].name or str(methods[0])]
    common = Path(os.path.commonpath(resolved))
    parts = [r.relative_to(common).parts for r in resolved]
    while all(len(p) > 1 for p in parts) and len({p[-1] for p in parts}) == 1:
        parts = [p[:-1] for p in parts]
    return ["/".join(p) for p in parts]


# --- pooling evaluations over seeds ------------------------------------------------------------


@dataclass(frozen=True)
class SeedTable:
    """pass@1 of one method: a row per seed, a column per task every one of its seeds evaluated."""

    seeds: list[int]
    tasks: list[str]
    values: np.ndarray  # (seeds, tasks)
    dropped_tasks: int  # tasks some seed evaluated but not every one

    def columns(self, tasks: Sequence[str]) -> np.ndarray:
        """The table restricted to ``tasks`` (in that order)."""
        index = {t: i for i, t in enumerate(self.tasks)}
        return self.values[:, [index[t] for t in tasks]]


def pass_at_1_table(summaries: Mapping[int, Mapping[str, Any]], turns: int) -> SeedTable:
    """Per-task pass@1 at budget ``turns`` of each seed's eval.json dict, on the tasks all seeds share."""
    if not summaries:
        raise ValueError("no evaluations to pool")
    key = str(turns)
    per_seed: dict[int, dict[str, float]] = {}
    for seed, summary in sorted(summaries.items()):
        if "per_task" not in summary:
            raise ValueError(f"the evaluation of seed {seed} has no per_task counts (written by an old tracegym?)")
        per_seed[seed] = {task: pass_at_k(int(v["n"]), int(v["solved"][key]), 1)
                          for task, v in summary["per_task"].items()}
    task_sets = [set(values) for values in per_seed.values()]
    shared = sorted(set.intersection(*task_sets))
    if not shared:
        raise ValueError(f"the seeds {sorted(per_seed)} share no evaluated task: evaluate every seed on the same tasks")
    values = np.array([[per_seed[s][t] for t in shared] for s in per_seed], dtype=np.float64)
    return SeedTable(list(per_seed), shared, values, len(set.union(*task_sets)) - len(shared))


def pool_seeds(
    groups: Mapping[str, Mapping[int, Mapping[str, Any]]], turns: int, n_resamples: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """pass@1 per method pooled over its seeds and tasks, compared with the first method.

    ``groups`` maps a method's label to ``{seed: eval.json dict}``. Per method: ``pass@1`` (the mean
    over seeds and tasks) with ``ci``, a 95% bootstrap interval that resamples seeds and tasks
    (``metrics.bootstrap_ci_seeds_tasks``); ``per_seed`` pass@1; ``seed_std``, the sample standard
    deviation (ddof 1) across seeds (None with one seed); and ``diff``: pass@1 minus the first
    method's on the tasks both evaluated, paired over tasks, seeds resampled per method
    (``metrics.paired_seeds_tasks_bootstrap_diff``); None for the first method.
    """
    if not groups:
        raise ValueError("no methods to pool")
    tables = {label: pass_at_1_table(summaries, turns) for label, summaries in groups.items()}
    labels = list(tables)
    base = tables[labels[0]]
    methods, notes = [], []
    for label, table in tables.items():
        low, high = bootstrap_ci_seeds_tasks(table.values, n_resamples=n_resamples, seed=seed)
        per_seed = table.values.mean(axis=1)
        row: dict[str, Any] = {
            "label": label,
            "seeds": table.seeds,
            "tasks": len(table.tasks),
            "pass@1": float(table.values.mean()),
            "ci": [low, high],
            "per_seed": {str(s): float(v) for s, v in zip(table.seeds, per_seed)},
            "seed_std": float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else None,
            "diff": None,
        }
        if table.dropped_tasks:
            notes.append(f"{label}: {table.dropped_tasks} task{'s' if table.dropped_tasks > 1 else ''} left out "
                         "(not evaluated by every seed)")
        if table is not base:
            shared = sorted(set(base.tasks) & set(table.tasks))
            if shared:
                diff, d_low, d_high = paired_seeds_tasks_bootstrap_diff(
                    base.columns(shared), table.columns(shared), n_resamples=n_resamples, seed=seed)
                row["diff"] = {"diff": diff, "ci": [d_low, d_high], "tasks": len(shared)}
            else:
                notes.append(f"{label}: shares no task with {labels[0]}, no paired difference")
        methods.append(row)
    return {
        "turns": turns,
        "baseline": labels[0],
        "methods": methods,
        "notes": notes,
        "interval": "95% percentile bootstrap resampling seeds and tasks (crossed); Δ paired over tasks, "
                    "seeds resampled per method",
    }


# --- training curves over seeds ----------------------------------------------------------------


def find_seed_runs(root: str | Path) -> dict[str, dict[int, Path]]:
    """Training runs (folders with metrics.jsonl) of the ``seed_<N>`` folders directly under
    ``root``, by their place inside the seed folder: ``{".": {1: root/seed_1, ...}}`` for
    ``tracegym rl --seeds``, ``{"train_sft": ..., "train_rl": ...}`` for ``tracegym demo --seeds``."""
    from tracegym.train.logging import METRICS_FILE

    root = Path(root)
    found: dict[str, dict[int, Path]] = {}
    for seed_dir in sorted(root.iterdir()) if root.is_dir() else []:
        match = SEED_DIR.fullmatch(seed_dir.name)
        if not match or not seed_dir.is_dir():
            continue
        for metrics in sorted([seed_dir / METRICS_FILE, *seed_dir.glob(f"*/{METRICS_FILE}")]):
            if metrics.is_file():
                place = metrics.parent.relative_to(seed_dir).as_posix()
                found.setdefault(place, {})[int(match.group(1))] = metrics.parent
    return {place: dict(sorted(runs.items())) for place, runs in sorted(found.items())}


def _numeric_by_step(rows: Sequence[Mapping[str, Any]], key: str) -> dict[int, float]:
    """``{step: value}`` of ``key`` in metric rows, finite numbers only."""
    out = {}
    for row in rows:
        value, step = row.get(key), row.get("step")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value) \
                and isinstance(step, int):
            out[step] = float(value)
    return out


def _default_keys(rows_by_seed: Mapping[int, Sequence[Mapping[str, Any]]]) -> list[str]:
    logged = [{k for row in rows for k in row} for rows in rows_by_seed.values()]
    everywhere = set.intersection(*logged) if logged else set()
    health = sorted(k for k in everywhere if k.startswith("health/"))
    return [k for k in DEFAULT_CURVE_KEYS if k in everywhere] + health


def seed_curves(
    run_dirs: Mapping[int, str | Path], keys: Sequence[str] | None = None
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{key: (steps, values)}`` from the metrics.jsonl of each seed's run, ``values`` of shape
    (seeds, steps) on the steps every seed logged the key. Keys: ``keys``, or those of
    ``DEFAULT_CURVE_KEYS`` and ``health/*`` that every seed logged; a key without a shared step is
    left out."""
    from tracegym.train.logging import read_metrics

    rows_by_seed = {seed: read_metrics(path) for seed, path in sorted(run_dirs.items())}
    curves = {}
    for key in keys if keys is not None else _default_keys(rows_by_seed):
        by_seed = [_numeric_by_step(rows, key) for rows in rows_by_seed.values()]
        steps = sorted(set.intersection(*(set(v) for v in by_seed))) if by_seed else []
        if steps:
            curves[key] = (np.array(steps), np.array([[v[s] for s in steps] for v in by_seed]))
    return curves


def seed_band_figure(curves: Mapping[str, tuple[np.ndarray, np.ndarray]], seeds: Sequence[int], title: str = "") -> Any:
    """One panel per metric: each seed faint, their mean bold, the min-max range over seeds as a
    band (with a handful of seeds, a standard deviation would be a guess; the range shows them all)."""
    import math

    from matplotlib.ticker import MaxNLocator

    from tracegym.eval.plots import _new_figure

    if not curves:
        raise ValueError("seed_band_figure needs at least one curve")
    cols = min(3, len(curves))
    nrows = math.ceil(len(curves) / cols)
    fig = _new_figure(3.6 * cols, 2.6 * nrows + 0.3)
    axes = fig.subplots(nrows, cols, squeeze=False)
    for idx, (key, (steps, values)) in enumerate(curves.items()):
        ax = axes[idx // cols][idx % cols]
        for i, row in enumerate(values):
            ax.plot(steps, row, color="#8d99ae", linewidth=0.8, alpha=0.6, label="each seed" if i == 0 else None)
        ax.fill_between(steps, values.min(axis=0), values.max(axis=0), color="#e76f51", alpha=0.2, linewidth=0,
                        label="min–max")
        ax.plot(steps, values.mean(axis=0), color="#e76f51", linewidth=1.8, marker="o" if len(steps) <= 30 else None,
                markersize=3, label=f"mean of {len(values)}")
        ax.set_title(key, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        if idx == 0:
            ax.legend(fontsize=7, loc="best")
        if idx // cols == nrows - 1:
            ax.set_xlabel("step", fontsize=8)
    for idx in range(len(curves), nrows * cols):
        axes[idx // cols][idx % cols].set_visible(False)
    fig.suptitle(f"{title + ': ' if title else ''}seeds {', '.join(map(str, seeds))}; mean and min–max over seeds",
                 fontsize=10)
    return fig


def write_seed_curves(root: str | Path) -> list[Path]:
    """``seed_curves.png`` (``seed_curves_<place>.png`` for runs below the seed folders, e.g. the
    demo's ``train_rl``) in ``root`` for each set of seed runs :func:`find_seed_runs` finds that
    logged a default curve; the paths written."""
    from tracegym.eval.plots import save_figure

    root = Path(root)
    written = []
    for place, runs in find_seed_runs(root).items():
        curves = seed_curves(runs)
        if not curves:
            continue
        name = "seed_curves.png" if place == "." else f"seed_curves_{place.replace('/', '_')}.png"
        title = root.name if place == "." else f"{root.name}/{place}"
        written.append(save_figure(seed_band_figure(curves, list(runs), title), root / name))
    return written


def seed_compare_figure(pooled: Mapping[str, Any]) -> Any:
    """pass@1 per method: each seed a dot, the pooled value with its seeds-and-tasks interval."""
    from tracegym.eval.plots import _new_figure

    methods = pooled["methods"]
    fig = _new_figure(max(4.0, 1.3 * len(methods) + 2.0), 3.8)
    ax = fig.add_subplot()
    for x, method in enumerate(methods):
        per_seed = list(method["per_seed"].values())
        ax.scatter(np.full(len(per_seed), x - 0.12), per_seed, color="#8d99ae", s=18, zorder=3,
                   label="each seed" if x == 0 else None)
        low, high = method["ci"]
        ax.errorbar([x + 0.12], [method["pass@1"]], yerr=[[method["pass@1"] - low], [high - method["pass@1"]]],
                    fmt="o", color="#e76f51", capsize=4, zorder=4,
                    label="pooled, 95% CI over seeds and tasks" if x == 0 else None)
    ax.set_xticks(range(len(methods)), [m["label"] for m in methods])
    ax.set_xlim(-0.6, len(methods) - 0.4)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel(f"pass@1 at T={pooled['turns']}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax.set_title("pass@1 over seeds", fontsize=10)
    return fig
