"""What the experiment scripts in bench/ share: run a CLI stage as a subprocess (its output to a
log, its own peak RSS from GNU time), run one side of a side-by-side benchmark in its own process
and read its result line, and write a stage's YAML config."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], log: Path) -> float:
    """Run a stage as a subprocess (its output to ``log``); returns its peak RSS in MB."""
    t0 = time.perf_counter()
    rss_file = log.with_suffix(".rss")
    with open(log, "w") as f:  # GNU time writes the stage's own peak RSS (KiB) to rss_file
        proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd], cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"stage failed ({proc.returncode}): {' '.join(cmd)}\n  see {log}")
    peak = float(rss_file.read_text().split()[-1]) / 1024
    print(f"  done in {time.perf_counter() - t0:.0f}s, peak RSS {peak:.0f} MB  ({log.name})", flush=True)
    return peak


def dump_yaml(data: dict, path: Path) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_side(command: list[str], side: str) -> dict:
    """Run one side of a side-by-side benchmark (its own process, so its peak RSS is its own) and
    return the JSON of its last ``RESULT `` line; exit with its output tail when it fails."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    marker = "RESULT "
    lines = [line for line in done.stdout.splitlines() if line.startswith(marker)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"the {side} side failed (exit {done.returncode})")
    return json.loads(lines[-1][len(marker):])


def print_settings_table(results: dict[str, dict], times: str, unit: str, loss: str, digits: int) -> None:
    """A settings benchmark's table: per setting (``results[name]`` from ``run_side``), the median of
    its ``times`` list, the timed values, the speed ratio to the first setting, its ``loss`` and peak RSS."""
    base = statistics.median(next(iter(results.values()))[times])
    print(f"| setting | median s/{unit} | timed {unit}s (s) | vs the first | {loss.replace('_', ' ')} | peak RSS (MB) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        median = statistics.median(r[times])
        print(f"| {name} | {median:.{digits}f} | {' '.join(f'{s:.{digits}f}' for s in r[times])} | {base / median:.2f}x | "
              f"{r[loss]:.5f} | {r['peak_rss_mb']:.0f} |")


def run_settings(script: str, worker_args: dict[str, list[str]]) -> dict[str, dict]:
    """Each setting of a side-by-side benchmark in its own process (``script --worker ...`` with its
    arguments), with glibc's malloc arenas capped at 2 as the CLI does (tracegym/cli.py)."""
    if not worker_args:
        raise SystemExit("no setting selected")
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")  # inherited by the workers
    return {name: run_side([sys.executable, str(Path(script).resolve()), "--worker", *extra], name)
            for name, extra in worker_args.items()}


def machine_line(threads: int) -> str:
    """When and on what a benchmark ran: the start of its header line."""
    return f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, {threads} torch threads"
