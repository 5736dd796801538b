"""One cgroup per sandbox, where this machine lets the host process create them.

A sandbox's processes share limits only when the kernel counts them together: a cgroup. This
module finds what the host process may use, per feature, and builds one cgroup per sandbox out of
it; :mod:`tracegym.envs.sandbox` falls back to rlimits, capped tmpfs sizes and a watchdog for
whatever is missing.

Features and where they come from (the first that works wins):

=============  ===============================================  ==================================
feature        cgroup v2 (unified)                              cgroup v1
=============  ===============================================  ==================================
``memory``     ``memory.max`` (+ ``memory.swap.max=0``)         ``memory.limit_in_bytes`` (+memsw)
``pids``       ``pids.max``                                     ``pids.max``
``cpu_quota``  ``cpu.max``                                      ``cpu.cfs_quota_us``
``cpu_usage``  ``cpu.stat`` ``usage_usec`` (any v2 cgroup)      ``cpuacct.usage``
``kill``       ``cgroup.kill`` (any v2 cgroup, Linux >= 5.14)   (none: SIGKILL to each member)
=============  ===============================================  ==================================

On a hybrid machine (v1 controllers, and a v2 hierarchy mounted at ``/sys/fs/cgroup/unified`` with
no controllers), memory, pids and the CPU quota come from v1 and the CPU usage and the kill from
v2: a v2 cgroup counts CPU time and can kill its members without any controller. Memory counts
every page the sandbox's processes charge: their own, the tmpfs and shm pages they write, and the
kernel memory of the inodes they create.

Where cgroups live: under this process's own cgroup in each hierarchy (v1: it may have children
next to its processes), in ``tracegym-<pid>/sb-<n>``. In a pure v2 hierarchy a cgroup holding
processes cannot hand controllers to children, so when this process's cgroup is not the root the
sandboxes go under its parent instead where the parent already enables more of the controllers
(they then sit next to this process's cgroup rather than inside its limits). Nothing here enables a
controller in a cgroup this module did not create.

A sandbox's processes join its cgroup before they run anything: the sandbox starts them blocked on
a pipe, the host writes their pid into each ``cgroup.procs`` and only then unblocks them (see
:meth:`SandboxCgroup.attach`), so no child is ever forked outside it.
"""

from __future__ import annotations

import atexit
import errno
import functools
import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CgroupSupport", "SandboxCgroup", "cgroup_support"]

log = logging.getLogger(__name__)

FEATURES = ("memory", "pids", "cpu_quota", "cpu_usage", "kill")
_V1_CONTROLLER = {"memory": "memory", "pids": "pids", "cpu_quota": "cpu", "cpu_usage": "cpuacct"}
_V2_CONTROLLER = {"memory": "memory", "pids": "pids", "cpu_quota": "cpu"}
_CFS_PERIOD_US = 100_000

#: Where /proc/self/cgroup and /proc/self/mountinfo are read (tests point these at a fake tree).
_PROC_SELF = Path("/proc/self")


@dataclass
class _Hierarchy:
    """One mounted cgroup hierarchy this process can create cgroups in."""

    version: int  # 1 or 2
    mount: Path
    controllers: frozenset[str]  # v1: bound to the mount; v2: enabled for our sandboxes
    base: Path  # tracegym-<pid>: the parent of every sandbox cgroup of this process


@dataclass
class CgroupSupport:
    """What the host process may use, per feature (None when nothing provides it)."""

    providers: dict[str, _Hierarchy] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)  # why features are missing, for the docs/logs
    pid: int = field(default_factory=os.getpid)  # the process that created the bases

    def has(self, feature: str) -> bool:
        return feature in self.providers

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(f for f in FEATURES if f in self.providers)

    def describe(self) -> str:
        """One line: which features come from where, e.g. ``memory v1, pids v1, cpu_usage v2``."""
        if not self.providers:
            return "no cgroups (" + ("; ".join(self.reasons) or "none usable") + ")"
        return ", ".join(f"{f} v{self.providers[f].version}" for f in self.features)


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _mounts() -> list[tuple[str, Path, str, set[str]]]:
    """(fs type, mount point, mount root, super options) of every cgroup mount."""
    found = []
    for line in _read(_PROC_SELF / "mountinfo").splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        mount_point = fields[4].replace("\\040", " ")
        found.append((tail[0], Path(mount_point), fields[3], set(tail[2].split(","))))
    return found


def _own_paths() -> tuple[dict[str, str], str | None]:
    """({v1 controller: this process's path}, its v2 path or None) from /proc/self/cgroup."""
    v1: dict[str, str] = {}
    v2: str | None = None
    for line in _read(_PROC_SELF / "cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        else:
            for name in controllers.split(","):
                v1[name] = path
    return v1, v2


def _inside(mount: Path, mount_root: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` under a hierarchy mounted at ``mount`` (whose root is
    ``mount_root``), or None when that cgroup is not visible through this mount."""
    if mount_root in ("/", ""):
        rel = path
    elif path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
        rel = path[len(mount_root):]
    else:
        return None
    if rel.endswith(" (deleted)"):
        return None
    return mount / rel.lstrip("/")


def _make_base(parent: Path) -> Path:
    base = parent / f"tracegym-{os.getpid()}"
    try:
        base.mkdir()
    except FileExistsError:
        pass
    _sweep_dead(parent)
    return base


def _sweep_dead(parent: Path) -> None:
    """Remove the cgroups of host processes that died without removing theirs."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not name.startswith("tracegym-") or not name[9:].isdigit():
            continue
        pid = int(name[9:])
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        _remove_base(Path(entry.path))


def _remove_base(base: Path) -> None:
    try:
        children = [Path(e.path) for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for child in children:
        _kill_members(child)
        _rmdir_when_empty(child, 1.0)
    try:
        base.rmdir()
    except OSError:
        pass


def _kill_members(directory: Path, rounds: int = 20) -> None:
    """SIGKILL every process of a cgroup: ``cgroup.kill`` where the kernel has it, else each pid
    listed, repeated until the list is empty (a member forking meanwhile is caught next round)."""
    kill_file = directory / "cgroup.kill"
    if kill_file.exists():
        try:
            _write(kill_file, "1")
            return
        except OSError:
            pass
    for _ in range(rounds):
        pids = _members(directory)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)


def _members(directory: Path) -> list[int]:
    try:
        return [int(x) for x in _read(directory / "cgroup.procs").split()]
    except (OSError, ValueError):
        return []


def _rmdir_when_empty(directory: Path, timeout_s: float) -> bool:
    """rmdir a cgroup once its killed members are gone (they exit asynchronously)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while True:
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _probe_v1(mounts, v1_paths, support: CgroupSupport) -> None:
    for fstype, mount, root, options in mounts:
        if fstype != "cgroup":
            continue
        for feature, controller in _V1_CONTROLLER.items():
            if feature in support.providers or controller not in options:
                continue
            path = v1_paths.get(controller)
            folder = _inside(mount, root, path) if path is not None else None
            if folder is None or not folder.is_dir():
                support.reasons.append(f"{controller} (v1): this process's cgroup is not visible")
                continue
            try:
                base = _make_base(folder)
            except OSError as exc:
                support.reasons.append(f"{controller} (v1): cannot create cgroups ({exc.strerror})")
                continue
            support.providers[feature] = _Hierarchy(1, mount, frozenset(options & set(_V1_CONTROLLER.values())), base)


def _probe_v2(mounts, v2_path: str | None, support: CgroupSupport) -> None:
    if v2_path is None:
        return
    for fstype, mount, root, _ in mounts:
        if fstype != "cgroup2":
            continue
        own = _inside(mount, root, v2_path)
        if own is None or not own.is_dir():
            continue
        wanted = set(_V2_CONTROLLER.values())

        def enabled(folder: Path) -> set[str]:
            try:
                return set(_read(folder / "cgroup.subtree_control").split()) & wanted
            except OSError:
                return set()

        # A cgroup holding processes cannot pass controllers down (the root excepted), so this
        # process's own cgroup passes none unless it is the root; its parent may pass some.
        candidates = [own]
        if own != mount:
            candidates.append(own.parent)
        best = max(candidates, key=lambda c: (len(enabled(c)), c == own))
        try:
            base = _make_base(best)
        except OSError as exc:
            support.reasons.append(f"v2: cannot create cgroups ({exc.strerror})")
            return
        usable = set()
        try:
            available = set(_read(base / "cgroup.controllers").split()) & wanted
        except OSError:
            available = set()
        for controller in sorted(available):
            try:
                _write(base / "cgroup.subtree_control", f"+{controller}")
                usable.add(controller)
            except OSError:
                pass
        hierarchy = _Hierarchy(2, mount, frozenset(usable), base)
        for feature, controller in _V2_CONTROLLER.items():
            if controller in usable:
                support.providers[feature] = hierarchy
        if (base / "cgroup.procs").exists():
            support.providers["cpu_usage"] = hierarchy  # cpu.stat is kept by every v2 cgroup
            if (base / "cgroup.kill").exists():
                support.providers["kill"] = hierarchy
        return


@functools.lru_cache(maxsize=1)
def cgroup_support() -> CgroupSupport:
    """What this process may use (probed once: creates ``tracegym-<pid>`` where it can)."""
    support = CgroupSupport()
    if os.environ.get("TRACEGYM_SANDBOX_CGROUPS", "").strip().lower() in ("0", "off", "no", "false"):
        support.reasons.append("turned off by TRACEGYM_SANDBOX_CGROUPS")
        return support
    try:
        mounts = _mounts()
        v1_paths, v2_path = _own_paths()
    except OSError as exc:
        support.reasons.append(f"cannot read /proc/self ({exc.strerror})")
        return support
    if not mounts:
        support.reasons.append("no cgroup file system is mounted")
        return support
    # v2 first: where a controller is in both, the unified hierarchy is the one to use.
    _probe_v2(mounts, v2_path, support)
    _probe_v1(mounts, v1_paths, support)
    if support.providers:
        atexit.register(_remove_own_bases, support)
        log.debug("sandbox cgroups: %s", support.describe())
    return support


def _remove_own_bases(support: CgroupSupport) -> None:
    if support.pid != os.getpid():  # a forked child inherited the handler: the bases are its parent's
        return
    seen = set()
    for hierarchy in support.providers.values():
        if hierarchy.base in seen:
            continue
        seen.add(hierarchy.base)
        _remove_base(hierarchy.base)


_names = itertools.count()
_names_lock = threading.Lock()

# A forked child probes (and names its cgroups) afresh, under its own pid.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=cgroup_support.cache_clear)


class SandboxCgroup:
    """The cgroup (one directory per hierarchy used) of one sandbox, with its limits set.

    ``memory_bytes``, ``pids`` and ``cpu_cores`` are applied where the feature exists; read
    :attr:`features` for what holds. Raises OSError when a directory or limit cannot be written
    (the sandbox then refuses to start: a limit it was told holds must hold)."""

    def __init__(self, support: CgroupSupport, memory_bytes: int, pids: int, cpu_cores: float) -> None:
        with _names_lock:
            name = f"sb-{next(_names)}"
        self.support = support
        self.dirs: dict[int, Path] = {}  # id(hierarchy) -> directory
        self._by_feature: dict[str, Path] = {}
        self.closed = False
        try:
            for feature, hierarchy in support.providers.items():
                key = id(hierarchy)
                if key not in self.dirs:
                    folder = hierarchy.base / name
                    folder.mkdir()
                    self.dirs[key] = folder
                self._by_feature[feature] = self.dirs[key]
            self._set_limits(memory_bytes, pids, cpu_cores)
        except OSError:
            self.remove()
            raise

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(f for f in FEATURES if f in self._by_feature)

    def has(self, feature: str) -> bool:
        return feature in self._by_feature

    def _version(self, feature: str) -> int:
        return self.support.providers[feature].version

    def _set_limits(self, memory_bytes: int, pids: int, cpu_cores: float) -> None:
        if "memory" in self._by_feature:
            folder = self._by_feature["memory"]
            if self._version("memory") == 2:
                _write(folder / "memory.max", str(memory_bytes))
                if (folder / "memory.swap.max").exists():
                    _write(folder / "memory.swap.max", "0")
            else:
                _write(folder / "memory.limit_in_bytes", str(memory_bytes))
                if (folder / "memory.memsw.limit_in_bytes").exists():
                    try:  # memory + swap: the same, so nothing of the sandbox goes to swap
                        _write(folder / "memory.memsw.limit_in_bytes", str(memory_bytes))
                    except OSError:
                        pass
        if "pids" in self._by_feature:
            _write(self._by_feature["pids"] / "pids.max", str(pids))
        if "cpu_quota" in self._by_feature:
            folder = self._by_feature["cpu_quota"]
            quota = max(1000, int(cpu_cores * _CFS_PERIOD_US))
            if self._version("cpu_quota") == 2:
                _write(folder / "cpu.max", f"{quota} {_CFS_PERIOD_US}")
            else:
                _write(folder / "cpu.cfs_period_us", str(_CFS_PERIOD_US))
                _write(folder / "cpu.cfs_quota_us", str(quota))

    def attach(self, pid: int) -> None:
        """Move ``pid`` (a process that has not forked yet) into every directory of this cgroup."""
        for folder in self.dirs.values():
            _write(folder / "cgroup.procs", str(pid))

    def cpu_seconds(self) -> float | None:
        """CPU time all members ever used, seconds (members that exited included)."""
        folder = self._by_feature.get("cpu_usage")
        if folder is None:
            return None
        try:
            if self._version("cpu_usage") == 2:
                for line in _read(folder / "cpu.stat").splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
                return None
            return int(_read(folder / "cpuacct.usage").strip()) / 1e9
        except (OSError, ValueError):
            return None

    def memory_bytes(self) -> int | None:
        """Memory charged now (processes, tmpfs pages, kernel memory)."""
        return self._memory_file("memory.current", "memory.usage_in_bytes")

    def memory_peak(self) -> int | None:
        """The most memory charged at once (v2 kernels without ``memory.peak``: None)."""
        return self._memory_file("memory.peak", "memory.max_usage_in_bytes")

    def _memory_file(self, v2_name: str, v1_name: str) -> int | None:
        folder = self._by_feature.get("memory")
        if folder is None:
            return None
        try:
            return int(_read(folder / (v2_name if self._version("memory") == 2 else v1_name)).strip())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes the kernel killed for the memory limit so far."""
        folder = self._by_feature.get("memory")
        if folder is None:
            return 0
        name = "memory.events" if self._version("memory") == 2 else "memory.oom_control"
        try:
            for line in _read(folder / name).splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def pids(self) -> list[int]:
        """Every member process (host pids)."""
        found: set[int] = set()
        for folder in self.dirs.values():
            found.update(_members(folder))
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every member (every directory holds the same processes, so one suffices)."""
        if "kill" in self._by_feature:
            try:
                _write(self._by_feature["kill"] / "cgroup.kill", "1")
                return
            except OSError:
                pass
        for folder in self.dirs.values():
            _kill_members(folder)
            return

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Kill the members and remove the directories (idempotent). False when one could not be
        removed in time (its members still exiting); the host process's exit sweeps it."""
        if self.closed:
            return True
        self.kill()
        ok = True
        for folder in self.dirs.values():
            ok = _rmdir_when_empty(folder, timeout_s) and ok
        self.closed = ok
        return ok
