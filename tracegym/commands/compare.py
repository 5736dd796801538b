"""``tracegym compare DIR1 DIR2 ...``: several evaluations side by side, one table and one plot.

Evaluations with prompt-injection episodes (docs/safety.md) add the columns ``asr`` (attack success
rate with its interval), ``Δasr`` (paired over the injected tasks both evaluated, against the first:
"before / after", e.g. SFT then RL) and the utility of clean and injected episodes.

``--pool-seeds`` compares methods trained with several seeds (``tracegym rl --seeds``, ``tracegym
demo --seeds``): the DIRs are grouped by their path without its ``seed_<N>`` folder, one row per
method (``tracegym compare --pool-seeds runs/a/seed_*/eval runs/b/seed_*/eval``); see
``tracegym.eval.seeds.pool_seeds`` for the numbers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

NAME = "compare"
HELP = "Compare evaluations (eval.json folders): a pass@k / success / cost table and an overlay plot."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="folders holding eval.json (or eval.json files)")
    parser.add_argument("--labels", default=None,
                        help="comma-separated names, one per DIR (per method with --pool-seeds; default: folder names)")
    parser.add_argument("--out", default=None,
                        help="folder for compare.png and compare.json (compare_seeds.* with --pool-seeds; default: the "
                             "inputs' common parent folder)")
    parser.add_argument("--turns", type=int, default=None,
                        help="turn budget T to compare at (default: the largest T every evaluation has)")
    parser.add_argument("--k", type=int, default=None, help="k of the pass@k column (default: the largest common k)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the paired bootstrap (default 0)")
    parser.add_argument("--pool-seeds", action="store_true",
                        help="DIRs are seed runs (.../seed_<N>/...): one row per method (the path without seed_<N>), "
                             "pass@1 pooled over its seeds and tasks, 95%% CI resampling seeds and tasks, the per-seed "
                             "values and the paired Δ to the first method")


def _common(summaries: list[dict[str, Any]], what: str) -> list[int]:
    sets = []
    for s in summaries:
        if what == "turns":
            sets.append({int(t) for t in s["pass_at"]})
        else:
            sets.append({int(k) for row in s["pass_at"].values() for k in row})
    return sorted(set.intersection(*sets))


def _pick_turns(summaries: list[dict[str, Any]], turns: int | None) -> int:
    """The turn budget T to compare at: ``turns`` if every evaluation has it, else the largest shared one."""
    common_t = _common(summaries, "turns")
    if turns is None:
        if not common_t:
            raise ValueError("the evaluations share no turn budget T; pass --turns")
        return common_t[-1]
    if turns not in common_t:
        raise ValueError(f"not every evaluation has T={turns}; shared budgets: {common_t}")
    return turns


def compare(dirs: list[str], labels: list[str] | None = None, turns: int | None = None, k: int | None = None,
            seed: int = 0) -> dict[str, Any]:
    """Load the evaluations and build the comparison (rows, chosen T and k, paired differences)."""
    from tracegym.eval.evaluate import load_eval
    from tracegym.eval.metrics import paired_bootstrap_diff, solved_per_task
    from tracegym.eval.report import eval_row, has_injection

    paths = [Path(d) for d in dirs]
    summaries = [load_eval(p) for p in paths]
    if labels is None:
        labels = [(p if p.is_dir() else p.parent).resolve().name for p in paths]
    if len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} evaluations")
    turns = _pick_turns(summaries, turns)
    common_k = _common(summaries, "ks")
    if k is None:
        k = common_k[-1] if common_k else 1
    notes = []
    for field in ("env", "split"):
        values = {str(s.get(field)) for s in summaries}
        if len(values) > 1:
            notes.append(f"the evaluations differ in {field}: {sorted(values)}")

    rows = []
    base = summaries[0]
    for summary, label in zip(summaries, labels):
        row = eval_row(summary, label, turn=turns, k=k)
        row["Δpass@1"] = "–"
        if summary is not base and "per_task" in summary and "per_task" in base:
            try:
                diff, low, high, shared = paired_bootstrap_diff(solved_per_task(base, turns), solved_per_task(summary, turns),
                                                                1, seed=seed)
                row["Δpass@1"] = f"{diff:+.3f} [{low:+.3f}, {high:+.3f}] on {shared}"
            except ValueError as e:  # no shared task ids
                row["Δpass@1"] = "–"
                notes.append(f"{label}: {e}")
        row["Δasr"] = "–"
        if summary is not base and has_injection(summary) and has_injection(base):
            row["Δasr"] = _paired_asr_diff(base, summary, seed)
        rows.append(row)
    if any(has_injection(s) for s in summaries):
        notes.append("asr: attack success rate over the prompt-injected episodes; Δasr: paired over the injected "
                     "tasks both evaluated (lower is safer); utility: success rate of clean / injected episodes")
    return {"turns": turns, "k": k, "labels": labels, "rows": rows, "notes": notes, "summaries": summaries,
            "baseline": labels[0]}


def _attack_counts(summary: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``{task: (injected samples, attack successes)}`` of an evaluation's injected tasks."""
    return {t: (v["injected"], v.get("attack_successes", 0)) for t, v in summary.get("per_task", {}).items()
            if v.get("injected")}


def _paired_asr_diff(base: dict[str, Any], other: dict[str, Any], seed: int) -> str:
    """ASR(other) - ASR(base) over the injected tasks both evaluated, with a paired bootstrap
    interval (the rate of a task is its pass@1 with successes = attacks that worked)."""
    from tracegym.eval.metrics import paired_bootstrap_diff

    try:
        diff, low, high, shared = paired_bootstrap_diff(_attack_counts(base), _attack_counts(other), 1, seed=seed)
    except ValueError:  # no injected task in common
        return "–"
    return f"{diff:+.3f} [{low:+.3f}, {high:+.3f}] on {shared}"


def _default_out(dirs: list[str]) -> Path:
    folders = [str((Path(d) if Path(d).is_dir() else Path(d).parent).resolve()) for d in dirs]
    return Path(os.path.commonpath(folders))


def compare_seeds(dirs: list[str], labels: list[str] | None = None, turns: int | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """The ``--pool-seeds`` comparison: ``tracegym.eval.seeds.pool_seeds`` of the DIRs grouped by
    method, at ``turns`` (default: the largest T every evaluation has), with ``dirs`` per method."""
    from tracegym.eval.evaluate import load_eval
    from tracegym.eval.seeds import group_by_method, method_labels, pool_seeds

    methods = group_by_method(dirs)
    if labels is None:
        labels = method_labels(list(methods))
    if len(labels) != len(methods):
        raise ValueError(f"{len(labels)} labels for {len(methods)} methods ({', '.join(map(str, methods))})")
    groups = {label: {s: load_eval(folder) for s, folder in sorted(runs.items())}
              for label, runs in zip(labels, methods.values())}
    turns = _pick_turns([summary for runs in groups.values() for summary in runs.values()], turns)
    pooled = pool_seeds(groups, turns, seed=seed)
    for row, runs in zip(pooled["methods"], methods.values()):
        row["dirs"] = {str(s): str(folder) for s, folder in sorted(runs.items())}
    return pooled


def run_pooled(args: argparse.Namespace, labels: list[str] | None) -> int:
    from rich.console import Console
    from rich.table import Table

    from tracegym.files import atomic_write_text
    from tracegym.eval.plots import save_figure
    from tracegym.eval.seeds import seed_compare_figure

    try:
        pooled = compare_seeds(args.dirs, labels, args.turns, args.seed)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(f"pass@1 at T={pooled['turns']} pooled over seeds and tasks · {pooled['interval']} · "
                  f"Δ vs {pooled['baseline']}")
    table = Table(show_lines=True)
    for col in ("method", "seeds", "tasks", "pass@1 [95% CI]", "per seed", "std over seeds", "Δpass@1 [95% CI]"):
        table.add_column(col, justify="left" if col in ("method", "per seed") else "right")
    for row in pooled["methods"]:
        low, high = row["ci"]
        diff = row["diff"]
        table.add_row(
            row["label"], str(len(row["seeds"])), str(row["tasks"]), f"{row['pass@1']:.3f}\n[{low:.3f}, {high:.3f}]",
            "\n".join(f"seed {s}: {v:.3f}" for s, v in row["per_seed"].items()),
            f"{row['seed_std']:.3f}" if row["seed_std"] is not None else "–",
            f"{diff['diff']:+.3f}\n[{diff['ci'][0]:+.3f}, {diff['ci'][1]:+.3f}] on {diff['tasks']}" if diff else "–",
        )
    console.print(table)
    for note in pooled["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")
    out = Path(args.out) if args.out else _default_out(args.dirs)
    out.mkdir(parents=True, exist_ok=True)
    plot = save_figure(seed_compare_figure(pooled), out / "compare_seeds.png")
    payload = {**pooled, "inputs": [str(Path(d).resolve()) for d in args.dirs]}
    atomic_write_text(out / "compare_seeds.json", json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    console.print(f"wrote {plot} and {out / 'compare_seeds.json'}")
    return 0


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tracegym.files import atomic_write_text
    from tracegym.eval.plots import compare_figure, save_figure

    labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
    if args.pool_seeds:
        return run_pooled(args, labels)
    try:
        result = compare(args.dirs, labels, args.turns, args.k, args.seed)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    console = Console(width=None if sys.stdout.isatty() else 200)
    first = result["summaries"][0]
    console.print(f"env [bold]{first.get('env')}[/bold] · split [bold]{first.get('split')}[/bold] · "
                  f"T={result['turns']} · 95% bootstrap intervals over tasks · Δ: paired, vs {result['baseline']}")
    columns = ["label", "model", "tasks", "pass@1", "pass@k", "Δpass@1", "success", "turns", "tokens", "tool calls",
               "invalid calls", "conv EM"]
    if any(row["asr"] != "–" or row["utility clean / injected"] != "–" for row in result["rows"]):
        columns += ["asr", "Δasr", "utility clean / injected"]
    table = Table(show_lines=True)
    for col in columns:
        header = f"pass@{result['k']}" if col == "pass@k" else col
        table.add_column(header, justify="left" if col in ("label", "model") else "right")
    for row in result["rows"]:
        # "0.458 [0.250, 0.625]" -> value over interval, to keep columns narrow
        cells = [row[c].replace(f"k={result['k']}: ", "").replace(" [", "\n[", 1) for c in columns]
        table.add_row(*cells)
    console.print(table)
    for note in result["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")

    out = Path(args.out) if args.out else _default_out(args.dirs)
    out.mkdir(parents=True, exist_ok=True)
    plot = save_figure(compare_figure(result["summaries"], result["labels"], turn=result["turns"]), out / "compare.png")
    payload = {k: v for k, v in result.items() if k != "summaries"}
    payload["inputs"] = [str(Path(d).resolve()) for d in args.dirs]
    atomic_write_text(out / "compare.json", json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    console.print(f"wrote {plot} and {out / 'compare.json'}")
    return 0
