"""Per-call overhead of the code sandbox: the same benign commands run N times each way.

    .venv/bin/python bench/sandbox_overhead.py            # default --calls 200

Modes, side by side in one run:
- ``subprocess``: a plain ``subprocess.run`` (no isolation, no limits): the floor.
- ``unsafe_local``: :class:`~tracegym.envs.sandbox.Sandbox` with rlimits, a cleared environment
  and a private work dir, no namespaces.
- ``bwrap``: the default isolation (namespaces, read-only system, seccomp when available).
- ``bwrap, no seccomp``: what the seccomp filter costs.
- ``shell session``: one command in a persistent bash session (no process start per call).

Commands: ``true`` (process start only) and ``python3 -c "print(sum(range(1000)))"`` (an
interpreter start, what the code env pays per ``run_python``). Prints median and p90 ms per call,
the ratio to the plain subprocess, and the process's peak RSS. The sandbox set-up (work dir,
tmpfs mount as root) is timed separately.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tracegym.envs.sandbox import Sandbox, SandboxLimits, bwrap_unavailable_reason, seccomp_available  # noqa: E402

# Absolute paths and a cleared environment everywhere, so the floor starts the same programs (a
# PATH with pyenv shims would put a bash script in front of python3 and flatter the sandbox).
COMMANDS = {"true": ["/usr/bin/true"], "python3": ["/usr/bin/python3", "-c", "print(sum(range(1000)))"]}
SHELL_COMMANDS = {"true": "/usr/bin/true", "python3": "/usr/bin/python3 -c 'print(sum(range(1000)))'"}
CLEAN_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(calls: int, fn: Callable[[], object]) -> list[float]:
    fn()  # warm the page cache and the probes
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # the unsafe_local row is measured on purpose
    reason = bwrap_unavailable_reason()
    if reason is not None:
        sys.exit(f"bubblewrap unavailable: {reason}")
    rows: list[dict] = []
    limits = SandboxLimits(wall_s=20)

    def add(mode: str, command: str, samples: list[float]) -> None:
        rows.append({"mode": mode, "command": command, "median_ms": statistics.median(samples),
                     "p90_ms": statistics.quantiles(samples, n=10)[-1], "calls": len(samples)})

    for name, argv in COMMANDS.items():
        add("subprocess", name, timed(args.calls, lambda: subprocess.run(argv, capture_output=True, check=True, env=CLEAN_ENV)))
        with Sandbox(limits, isolation="unsafe_local") as box:
            add("unsafe_local", name, timed(args.calls, lambda: box.run(argv)))
        with Sandbox(limits) as box:
            add("bwrap", name, timed(args.calls, lambda: box.run(argv)))
        with Sandbox(limits, seccomp=False) as box:
            add("bwrap, no seccomp", name, timed(args.calls, lambda: box.run(argv)))
        with Sandbox(limits) as box:
            shell = box.shell()
            add("shell session", name, timed(args.calls, lambda: shell.run(SHELL_COMMANDS[name])))
    setup = timed(max(20, args.calls // 10), lambda: Sandbox(limits).close())
    with Sandbox(limits) as box:
        quota = "tmpfs quota" if box._mounted else "disk watchdog"

    floor = {row["command"]: row["median_ms"] for row in rows if row["mode"] == "subprocess"}
    print(f"\nsandbox per-call overhead, {args.calls} calls per row (seccomp available: {seccomp_available()})\n")
    print(f"| mode | command | median ms | p90 ms | x subprocess |\n|---|---|---|---|---|")
    for row in rows:
        row["ratio"] = row["median_ms"] / floor[row["command"]]
        print(f"| {row['mode']} | {row['command']} | {row['median_ms']:.1f} | {row['p90_ms']:.1f} | {row['ratio']:.2f} |")
    print(f"\nsandbox set-up + close (work dir, {quota}): "
          f"median {statistics.median(setup):.1f} ms over {len(setup)}")
    print(f"peak RSS {peak_rss_mb():.0f} MB")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "setup_median_ms": statistics.median(setup),
                                         "seccomp": seccomp_available(), "peak_rss_mb": peak_rss_mb()}, indent=2))


if __name__ == "__main__":
    main()
