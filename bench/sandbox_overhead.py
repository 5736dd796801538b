"""Per-call overhead of the code sandbox: the same benign commands run N times each way.

    .venv/bin/python bench/sandbox_overhead.py            # default --calls 200

Modes, side by side in one run:
- ``subprocess``: a plain ``subprocess.run`` (no isolation, no limits): the floor.
- ``unsafe_local``: :class:`~tracegym.envs.sandbox.Sandbox` with rlimits, a cleared environment
  and a private work dir, no namespaces.
- ``bwrap``: the default isolation (namespaces, read-only system, seccomp when available, and the
  per-sandbox cgroup where the host allows one: each command joins it before it runs).
- ``bwrap, no cgroup``: the same with ``cgroup=False``: the per-sandbox limits held by the
  watchdog (what a host without cgroup delegation gets).
- ``bwrap, no seccomp``: what the seccomp filter costs.
- ``shell session``: one command in a persistent bash session (no process start per call), with
  and without the cgroup.

Commands: ``true`` (process start only) and ``python3 -c "print(sum(range(1000)))"`` (an
interpreter start, what the code env pays per ``run_python``). Prints median and p90 ms per call,
the ratio to the plain subprocess, and the process's peak RSS. Also timed on their own: a
sandbox's set-up and close (uid from the pool, work dir and its tmpfs, the cgroup), one whole
``run_python`` cycle (set-up, one python3 run, close), and the watchdog: the CPU its thread uses
per second with ``--idle`` sandboxes alive (each with an idle shell), with and without cgroups.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tracegym.envs.cgroups import cgroup_support  # noqa: E402
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


def thread_cpu_s(name: str) -> float:
    """CPU seconds used so far by this process's thread called ``name`` (0 when there is none)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            try:
                fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return 0.0
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def watchdog_load(idle: int, seconds: float, cgroup: bool, limits: SandboxLimits) -> float:
    """Per cent of one core the watchdog thread uses with ``idle`` sandboxes alive."""
    boxes = [Sandbox(limits, cgroup=cgroup) for _ in range(idle)]
    try:
        for box in boxes:
            box.shell().run("true")  # an idle shell: a process tree to watch
        before = thread_cpu_s("tracegym-sandbox-watchdog")
        time.sleep(seconds)
        return (thread_cpu_s("tracegym-sandbox-watchdog") - before) / seconds * 100
    finally:
        for box in boxes:
            box.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--idle", type=int, default=16, help="sandboxes alive while the watchdog is measured")
    parser.add_argument("--watch-seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # the unsafe_local row is measured on purpose
    reason = bwrap_unavailable_reason()
    if reason is not None:
        sys.exit(f"bubblewrap unavailable: {reason}")
    rows: list[dict] = []
    limits = SandboxLimits(wall_s=20)
    cgroups_here = cgroup_support().describe()

    def add(mode: str, command: str, samples: list[float]) -> None:
        rows.append({"mode": mode, "command": command, "median_ms": statistics.median(samples),
                     "p90_ms": statistics.quantiles(samples, n=10)[-1], "calls": len(samples)})

    for name, argv in COMMANDS.items():
        add("subprocess", name, timed(args.calls, lambda: subprocess.run(argv, capture_output=True, check=True, env=CLEAN_ENV)))
        with Sandbox(limits, isolation="unsafe_local") as box:
            add("unsafe_local", name, timed(args.calls, lambda: box.run(argv)))
        with Sandbox(limits) as box:
            add("bwrap", name, timed(args.calls, lambda: box.run(argv)))
        with Sandbox(limits, cgroup=False) as box:
            add("bwrap, no cgroup", name, timed(args.calls, lambda: box.run(argv)))
        with Sandbox(limits, seccomp=False) as box:
            add("bwrap, no seccomp", name, timed(args.calls, lambda: box.run(argv)))
        for cgroup in (True, False):
            with Sandbox(limits, cgroup=cgroup) as box:
                shell = box.shell()
                add("shell session" + ("" if cgroup else ", no cgroup"), name,
                    timed(args.calls, lambda: shell.run(SHELL_COMMANDS[name])))

    def cycle(cgroup: bool) -> None:
        with Sandbox(limits, cgroup=cgroup, files={"main.py": "print(sum(range(1000)))"}) as box:
            box.run(["/usr/bin/python3", "main.py"])

    few = max(20, args.calls // 10)
    setup = {cg: timed(few, lambda cg=cg: Sandbox(limits, cgroup=cg).close()) for cg in (True, False)}
    cycles = {cg: timed(few, lambda cg=cg: cycle(cg)) for cg in (True, False)}
    with Sandbox(limits) as box:
        quota = "tmpfs quota" if box._mounted else "disk watchdog"
        accounting = box.accounting
    watch = {cg: watchdog_load(args.idle, args.watch_seconds, cg, limits) for cg in (True, False)}

    floor = {row["command"]: row["median_ms"] for row in rows if row["mode"] == "subprocess"}
    print(f"\nsandbox per-call overhead, {args.calls} calls per row (seccomp available: {seccomp_available()}; "
          f"per-sandbox accounting: {accounting})\n")
    print("| mode | command | median ms | p90 ms | x subprocess |\n|---|---|---|---|---|")
    for row in rows:
        row["ratio"] = row["median_ms"] / floor[row["command"]]
        print(f"| {row['mode']} | {row['command']} | {row['median_ms']:.1f} | {row['p90_ms']:.1f} | {row['ratio']:.2f} |")
    print(f"\ncgroups here: {cgroups_here}")
    for cg in (True, False):
        label = "cgroup" if cg else "no cgroup"
        print(f"sandbox set-up + close ({label}; work dir, {quota}): median {statistics.median(setup[cg]):.1f} ms over {few}")
        print(f"one run_python cycle ({label}; set-up, python3, close): median {statistics.median(cycles[cg]):.1f} ms "
              f"over {few}")
        print(f"watchdog thread ({label}) with {args.idle} idle sandboxes: {watch[cg]:.2f}% of one core")
    print(f"peak RSS {peak_rss_mb():.0f} MB")
    if args.json:
        args.json.write_text(json.dumps({
            "rows": rows, "seccomp": seccomp_available(), "cgroups": cgroups_here, "peak_rss_mb": peak_rss_mb(),
            "setup_median_ms": {str(k): statistics.median(v) for k, v in setup.items()},
            "cycle_median_ms": {str(k): statistics.median(v) for k, v in cycles.items()},
            "watchdog_percent_core": {str(k): v for k, v in watch.items()},
        }, indent=2))


if __name__ == "__main__":
    main()
