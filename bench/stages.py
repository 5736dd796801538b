"""What the experiment scripts in bench/ share: run a CLI stage as a subprocess (its output to a
log, its own peak RSS from GNU time) and write a stage's YAML config."""

from __future__ import annotations

import subprocess
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
