"""``--seeds 1,2,3`` of the training commands (``rl``, ``demo``): the same config once per seed.

The runs go one after another (parallel runs would fight over the same CPU cores), each into
``<output_dir>/seed_<s>/`` with the config's ``seed`` set to s. Only the training seed changes:
task draws keep their own seed (``tasks.seed`` of ``rl``, ``task_seed`` of ``demo``), so every
seed trains on the same task pool and is judged on the same held-out tasks, and the seeds differ
by initialisation, task order and sampling alone. At the end a table gives each seed's final
metrics and their mean ± sample standard deviation across seeds, also written to
``<output_dir>/seeds.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

SEEDS_FILE = "seeds.json"


def seed_list(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``: distinct integers >= 0 (``argparse`` type)."""
    items = [item.strip() for item in text.split(",")]
    try:
        seeds = [int(item) for item in items]
    except ValueError:
        seeds = []
    if not seeds or any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0 like 1,2,3, got {text!r}")
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"seed {repeated[0]} is given twice in {text!r}")
    return seeds


def add_seeds_argument(parser: argparse.ArgumentParser, task_seed_field: str) -> None:
    parser.add_argument(
        "--seeds", type=seed_list, default=None, metavar="S1,S2,...",
        help=f"run the config once per seed, one after another, into OUTPUT_DIR/seed_<S>/ with seed=S "
             f"({task_seed_field} kept: every seed sees the same tasks); a summary table at the end",
    )


def seed_override_given(overrides: Sequence[str]) -> bool:
    """Whether a ``seed=...`` override is on the command line (it would be overwritten by ``--seeds``)."""
    return any(item.partition("=")[0].strip() == "seed" for item in overrides)


def seeded_config(cfg: Any, seed: int) -> Any:
    """``cfg`` with ``seed`` and ``output_dir`` = ``<output_dir>/seed_<seed>``."""
    from tracegym.eval.seeds import seed_dir_name

    return cfg.model_copy(update={"seed": seed, "output_dir": str(Path(cfg.output_dir) / seed_dir_name(seed))})


def run_over_seeds(
    cfg: Any, seeds: Sequence[int], run_one: Callable[[Any], Mapping[str, float]], command: str,
    print_config: bool = False,
) -> int:
    """Run ``run_one`` on :func:`seeded_config` of each seed in turn; it returns the run's final
    metrics. Prints their table and writes ``seeds.json`` in ``cfg.output_dir``. ``print_config``:
    print each seed's config as one YAML document and run nothing. An error stops the loop (the
    seeds after it do not run) and is raised after a line naming the seed."""
    import yaml

    configs = [(seed, seeded_config(cfg, seed)) for seed in seeds]
    if print_config:
        print("\n---\n".join(f"# seed {seed}\n" + yaml.safe_dump(c.model_dump(mode="json"), sort_keys=False)
                              for seed, c in configs), end="")
        return 0
    per_seed: dict[int, dict[str, float]] = {}
    for i, (seed, seed_cfg) in enumerate(configs, 1):
        print(f"\n=== {command} seed {seed} ({i} of {len(configs)}): {seed_cfg.output_dir}", flush=True)
        try:
            per_seed[seed] = dict(run_one(seed_cfg))
        except BaseException:
            done = ", ".join(map(str, per_seed)) or "none"
            print(f"{command} --seeds: stopped at seed {seed} ({seed_cfg.output_dir}); seeds finished: {done}",
                  file=sys.stderr)
            raise
    summary = summarize_seeds(per_seed)
    out = Path(cfg.output_dir) / SEEDS_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print_seed_table(summary, f"{command}: final metrics over {len(per_seed)} seeds")
    print(f"per seed in {Path(cfg.output_dir)}/seed_<S>/; this table in {out}")
    return 0


def summarize_seeds(per_seed: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    """``{"seeds", "per_seed", "mean", "std"}`` of each metric over the seeds that have it; ``std``
    is the sample standard deviation (ddof 1), None with fewer than two values."""
    import numpy as np

    keys = list(dict.fromkeys(k for metrics in per_seed.values() for k in metrics))
    mean: dict[str, float] = {}
    std: dict[str, float | None] = {}
    for key in keys:
        values = np.array([m[key] for m in per_seed.values() if key in m], dtype=np.float64)
        mean[key] = float(values.mean())
        std[key] = float(values.std(ddof=1)) if len(values) > 1 else None
    return {"seeds": list(per_seed), "per_seed": {str(s): dict(m) for s, m in per_seed.items()},
            "mean": mean, "std": std}


def print_seed_table(summary: Mapping[str, Any], title: str, digits: int = 3) -> None:
    from rich.console import Console
    from rich.table import Table

    keys = list(summary["mean"])
    table = Table(title=title, caption="mean ± sample std (ddof 1) across seeds")
    table.add_column("seed")
    for key in keys:
        table.add_column(key, justify="right")
    for seed, metrics in summary["per_seed"].items():
        table.add_row(seed, *(f"{metrics[k]:.{digits}f}" if k in metrics else "–" for k in keys))
    cells = []
    for key in keys:
        std = summary["std"][key]
        cells.append(f"{summary['mean'][key]:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else ""))
    table.add_row("mean ± std", *cells, style="bold")
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def last_logged(run_dir: str | Path, keys: Sequence[str]) -> dict[str, float]:
    """The last value each of ``keys`` has in the run's metrics.jsonl (keys never logged are left
    out). Read from the file rather than the result's history, so a seed that ``--resume`` found
    finished still reports its numbers."""
    from tracegym.train.logging import read_metrics

    found: dict[str, float] = {}
    for row in read_metrics(run_dir):
        for key in keys:
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found[key] = float(value)
    return {k: found[k] for k in keys if k in found}
