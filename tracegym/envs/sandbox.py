"""Run model-written code and shell commands in an isolated sandbox that fails closed.

    with Sandbox(SandboxLimits(wall_s=10), files={"main.py": code}) as sb:
        result = sb.run(["python3", "main.py"], stdin=b"")   # -> SandboxResult
        shell = sb.shell()                                    # a persistent bash session
        out = shell.run("cd data && ls")                      # files and processes survive calls

Isolation (``isolation="bwrap"``, the default) uses bubblewrap (Debian package ``bubblewrap``):
new user, pid, network, ipc, uts and cgroup namespaces, so the command sees no host process, no
network (not even the host's loopback) and cannot create namespaces of its own
(``--disable-userns``); a private file system view (``/usr`` read-only, ``/bin``, ``/lib`` links,
a fresh ``/proc``, a read-only minimal ``/dev`` with a small size-capped ``/dev/shm``, a
size-capped ``/tmp``, and the per-sandbox work dir at ``/work``; no ``/etc``, no home, no
repository); a cleared environment (no secrets); all capabilities dropped; and, when libseccomp is
installed (``pyseccomp``), a seccomp filter that answers ``ptrace``, ``mount``, ``unshare``,
``bpf``, ``keyctl``, module loading, ``io_uring`` and the like with EPERM, and lets ``socket()``
create only AF_UNIX, AF_INET and AF_INET6 sockets (vsock, netlink, packet and every other family:
EPERM). bubblewrap reads its options from a pipe, so the sandbox's view of its own command line
(``/proc/1/cmdline``) holds nothing of the host.

Limits, from :class:`SandboxLimits`. Per process (rlimits set by util-linux ``prlimit`` before
``bwrap`` starts): CPU seconds, address space, file size, open files. Per command: wall time (the
whole sandbox is killed: every process in its pid namespace dies with it, orphans included), bytes
of output kept (and a hard cap past which the run is killed). Per sandbox, i.e. per episode (see
:mod:`tracegym.envs.cgroups`): where the host process may create cgroups, one cgroup per sandbox
holds every process of it: a memory limit that counts their pages and the tmpfs, shm and inode
pages they write, a process count, a CPU rate (cores) and a CPU-seconds budget read from the
cgroup's own accounting; past the budget every process is killed, the running command ends with
``killed="cpu_budget"`` and no later command runs. Without cgroups a watchdog sums the CPU time and
memory of the sandbox's process tree instead (an approximation, see docs/sandbox.md), and every
tmpfs keeps its size cap. The work dir's disk use: a tmpfs of ``disk_mb`` with ``max_files`` inodes
as root, a watchdog otherwise.

When the host process runs as root, each sandbox also runs as its own unprivileged uid, taken from
a pool shared by every host process on the machine (a lock per uid) and never handed out while a
process of that uid lives; so the process limit counts only that sandbox's processes, and a
``kill -9 -1`` as that uid removes any leftover and nothing of another sandbox. As a normal user
the process limit is added to the user's current count.

The host never trusts the work dir's shape: listing, measuring, emptying and removing it go
through :mod:`tracegym.envs.hostfs` (iterative, depth-, entry-, byte- and time-bounded).

Where bubblewrap is missing or cannot create namespaces, :class:`Sandbox` raises
:class:`SandboxUnavailable` (fail closed) unless the caller opts into ``isolation="unsafe_local"``:
the same rlimits, cgroup, cleared environment, private work dir and process-group kill, but no
namespaces: the code can read the host's files and reach its network. It is for a developer's own
laptop and trusted code only, and says so in a warning.

Why not a library: the PyPI packages named after bubblewrap are unrelated, container runtimes
(docker, podman) need a daemon or privileges these machines do not give, and hosted sandboxes need
a network. bubblewrap + rlimits + seccomp is what Flatpak builds on and is available everywhere
Debian is.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import functools
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Mapping, Sequence

from tracegym.envs import cgroups, hostfs
from tracegym.envs.hostfs import TreeLimitError, TreeLimits

__all__ = [
    "FileEntry",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "ShellSession",
    "TreeLimitError",
    "TreeLimits",
    "bwrap_unavailable_reason",
    "seccomp_available",
]

log = logging.getLogger(__name__)

Isolation = Literal["bwrap", "unsafe_local"]

#: Where the work dir appears inside a bwrap sandbox (also the command's cwd and ``$HOME``).
SANDBOX_WORKDIR = "/work"

#: The environment a sandboxed command sees: nothing of the host's (no tokens, no keys).
_CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "TERM": "dumb",
}

#: Syscalls a sandboxed program never needs and that are the usual first step of an escape.
SECCOMP_DENY = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "bpf", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "perf_event_open", "userfaultfd", "swapon",
    "swapoff", "reboot", "acct", "quotactl", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "name_to_handle_at", "fsopen", "fsmount", "fsconfig", "move_mount",
    "open_tree", "syslog", "settimeofday", "clock_settime", "adjtimex",
)

#: Socket families ``socket()`` may create (AF_UNIX, AF_INET, AF_INET6; the network namespace is
#: empty, so the inet ones reach nothing but the sandbox's own loopback). Every other family, among
#: them AF_VSOCK (not namespaced: the host's and the hypervisor's port space), AF_NETLINK and
#: AF_PACKET, gets EPERM, and ``socketpair()`` gets EPERM for all but AF_UNIX.
SOCKET_FAMILIES = (1, 2, 10)
#: One past the largest family number the filter enumerates; everything from here up is denied.
_SOCKET_FAMILY_CEILING = 11

#: uids handed to sandboxes when the host runs as root: far above any real user's uid.
_SANDBOX_UID_BASE = 1_600_000_000
#: How many uids the pool holds (shared by every host process on the machine).
_UID_POOL_SIZE = 100_000
#: The pool's lock file (one byte-range lock per uid, held while a sandbox has the uid).
_UID_LOCK_PATH = "/run/tracegym-sandbox-uids.lock"

#: How often the watchdog reads each sandbox's CPU time (and, without a memory cgroup, memory).
_WATCH_INTERVAL_S = 0.2


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be provided on this machine (fail closed)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one :class:`Sandbox`: per process, per command, and per sandbox (every
    process it ever runs together, over its whole life: an episode)."""

    wall_s: float = 15.0
    """Wall-clock seconds per command (per :meth:`ShellSession.run` call); then the sandbox is killed."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU)."""
    mem_mb: int = 512
    """Address space per process, MB (RLIMIT_AS)."""
    nproc: int = 64
    """Processes and threads at once (RLIMIT_NPROC per sandbox uid, and the cgroup's pids.max)."""
    fsize_mb: int = 16
    """Largest file a process may write, MB (RLIMIT_FSIZE)."""
    nofile: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    disk_mb: int = 64
    """Bytes the work dir may hold, MB (a tmpfs as root; a watchdog otherwise)."""
    max_files: int = 20_000
    """Entries the work dir may hold (the tmpfs's inode count as root; the watchdog otherwise)."""
    tmp_mb: int = 16
    """Size of the sandbox's private ``/tmp`` (a tmpfs), MB."""
    shm_mb: int = 8
    """Size of ``/dev/shm`` (a tmpfs; the rest of ``/dev`` is read-only), MB."""
    sandbox_mem_mb: int | None = None
    """Memory of the whole sandbox, MB: every process's pages plus what they keep in its tmpfs
    (``/tmp``, ``/dev/shm``, the work dir) and the kernel memory of their files (cgroup memory
    limit; without one a watchdog over the processes' resident memory). None: ``mem_mb + disk_mb +
    tmp_mb + shm_mb``, so one process may use its whole ``mem_mb`` beside full tmpfs."""
    cpu_budget_s: float = 60.0
    """CPU seconds all the sandbox's processes may use together over its life (an episode); past
    it every process is killed and no further command runs."""
    cpu_cores: float = 1.0
    """CPU rate of the whole sandbox, in cores (cgroup ``cpu.max``; not enforced without one)."""
    max_output: int = 64_000
    """Bytes of stdout (and of stderr) kept; the rest is dropped and the result marked truncated."""
    kill_output: int = 8_000_000
    """Bytes of output past which the command is killed (a 100 MB print loop ends here)."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "mem_mb", "nproc", "fsize_mb", "nofile", "disk_mb", "max_files", "tmp_mb",
                     "shm_mb", "cpu_budget_s", "cpu_cores", "max_output", "kill_output"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")
        if self.sandbox_mem_mb is not None and self.sandbox_mem_mb <= 0:
            raise ValueError(f"sandbox limit sandbox_mem_mb must be > 0, got {self.sandbox_mem_mb}")

    @property
    def total_mem_mb(self) -> int:
        """The sandbox's memory limit, MB (``sandbox_mem_mb`` or its default)."""
        if self.sandbox_mem_mb is not None:
            return self.sandbox_mem_mb
        return self.mem_mb + self.disk_mb + self.tmp_mb + self.shm_mb


@dataclass
class SandboxResult:
    """What a sandboxed command did. ``returncode`` is negative for a signal (``-9``: killed)."""

    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    # "wall_time" | "output_limit" | "disk_limit" | "memory_limit" | "cpu_budget" | "shell_exited"
    killed: str | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float | None = None
    """CPU seconds the sandbox's processes used during the command, from its cgroup (None without
    one: the watchdog still holds the budget, but a reading per command would cost a scan of /proc)."""
    memory_kills: int = 0
    """Processes the kernel killed during the command for the sandbox's memory limit."""

    @property
    def ok(self) -> bool:
        """Exited by itself with status 0. Never a reward on its own: graders check outputs."""
        return self.returncode == 0 and self.killed is None

    def describe(self) -> str:
        """One line for a tool message: how the command ended."""
        if self.killed == "wall_time":
            return f"killed: the command ran past the {self.wall_s:.0f} s time limit"
        if self.killed == "output_limit":
            return "killed: the command printed too much output"
        if self.killed == "disk_limit":
            return "killed: the work dir exceeded its disk quota"
        if self.killed == "memory_limit":
            return "killed: the sandbox's processes used more memory than it allows"
        if self.killed == "cpu_budget":
            return "killed: the sandbox used up its CPU time budget; no further commands run"
        if self.killed == "shell_exited":
            return f"the shell exited (status {self.returncode}); a new shell starts at the next command"
        if self.returncode is not None and self.returncode < 0:
            name = _signal_name(-self.returncode)
            hint = " (CPU time limit)" if name == "SIGXCPU" else " (file size limit)" if name == "SIGXFSZ" else ""
            if name == "SIGKILL" and self.memory_kills:
                hint = " (memory limit)"
            return f"killed by {name}{hint}"
        if self.memory_kills:
            return f"exit status {self.returncode} (a process was killed for the memory limit)"
        return f"exit status {self.returncode}"


@dataclass(frozen=True)
class FileEntry:
    """One entry of the work dir as the host sees it (never following links)."""

    path: str  # relative to the work dir, "/"-separated
    kind: Literal["file", "dir", "symlink", "other"]
    mode: int  # permission bits, e.g. 0o755
    size: int
    content: bytes | None = field(default=None, repr=False)  # files up to the read limit
    target: str | None = None  # symlinks: where they point (not followed)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# --- probes -----------------------------------------------------------------------------------------


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _system_links() -> list[str]:
    """``/bin``, ``/lib``... as links into the read-only ``/usr`` (merged-/usr systems) or as
    read-only binds where they are real directories."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{name}"]
    return args


@functools.lru_cache(maxsize=1)
def bwrap_unavailable_reason() -> str | None:
    """None when bubblewrap can build the sandbox on this machine, else why not (one line). The
    probe runs the real flag set once per process (``true`` inside a sandbox), as the uid the
    sandboxes will use."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    if shutil.which("prlimit") is None:
        return "util-linux prlimit is not installed"
    try:
        with tempfile.TemporaryDirectory(prefix="tracegym-probe-") as work:
            uid = _SANDBOX_UID_BASE - 1 if _is_root() else None
            if uid is not None:
                os.chown(work, uid, uid)
            args_fd = _pipe_holding(_args_blob(_bwrap_flags(work, SandboxLimits(), seccomp_fd=None)))
            try:
                done = subprocess.run(
                    ["bwrap", "--args", str(args_fd), "--", "true"], capture_output=True, timeout=20,
                    env=dict(_CLEAN_ENV), pass_fds=(args_fd,),
                    **({"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}),
                )
            finally:
                os.close(args_fd)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap failed to start: {type(exc).__name__}: {exc}"
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip().splitlines()
        return f"bubblewrap cannot create the sandbox here: {detail[-1] if detail else f'exit {done.returncode}'}"
    return None


@functools.lru_cache(maxsize=1)
def _seccomp_program() -> bytes | None:
    """The compiled BPF program (:data:`SECCOMP_DENY` and the socket families, EPERM), or None
    without libseccomp."""
    try:
        import pyseccomp
    except (ImportError, OSError) as exc:
        log.warning(
            "seccomp filter unavailable (%s: %s; Debian/Ubuntu: apt-get install libseccomp2): sandboxes run without "
            "it, so ptrace, io_uring, bpf... are left to the namespaces and capabilities, and socket() is not "
            "limited to AF_UNIX/AF_INET/AF_INET6 (vsock, which no namespace isolates, stays open)",
            type(exc).__name__, exc)
        return None
    try:
        program = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
        eperm = pyseccomp.ERRNO(errno.EPERM)
        for name in SECCOMP_DENY:
            try:
                program.add_rule(eperm, name)
            except (ValueError, RuntimeError, OSError):
                pass  # a syscall this architecture does not have
        # libseccomp takes one comparison per argument and rule, so "not one of these" is a rule
        # for each family below the ceiling that is not allowed, and one for the ceiling and up.
        # The comparison is on all 64 bits: a family with high bits set is >= the ceiling.
        for syscall, allowed in (("socket", SOCKET_FAMILIES), ("socketpair", (1,))):
            for family in range(_SOCKET_FAMILY_CEILING):
                if family not in allowed:
                    program.add_rule(eperm, syscall, pyseccomp.Arg(0, pyseccomp.EQ, family))
            program.add_rule(eperm, syscall, pyseccomp.Arg(0, pyseccomp.GE, _SOCKET_FAMILY_CEILING))
        with tempfile.TemporaryFile() as out:
            program.export_bpf(out)
            out.seek(0)
            return out.read()
    except Exception as exc:  # libseccomp present but unusable: the namespaces still hold
        log.warning("seccomp filter unavailable (%s: %s); sandboxes run without it", type(exc).__name__, exc)
        return None


def seccomp_available() -> bool:
    """Whether sandboxes add the seccomp filter (``pyseccomp`` and libseccomp installed)."""
    return _seccomp_program() is not None


def _bwrap_flags(workdir: str, limits: SandboxLimits, seccomp_fd: int | None) -> list[str]:
    flags = [
        "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--clearenv", "--cap-drop", "ALL", "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr", *_system_links(),
        # Debian's /usr/bin/awk, nawk, lzma... are links through /etc/alternatives; the rest of /etc
        # (passwd, hosts, ssl keys) stays out.
        "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
        "--proc", "/proc",
        # A minimal /dev (null, zero, random, urandom, tty, pts) made read-only, so nothing can be
        # stored in it, with a small tmpfs for POSIX shared memory on top.
        "--dev", "/dev", "--remount-ro", "/dev",
        "--perms", "1777", "--size", str(limits.shm_mb * 2**20), "--tmpfs", "/dev/shm",
        "--perms", "1777", "--size", str(limits.tmp_mb * 2**20), "--tmpfs", "/tmp",
        "--bind", workdir, SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR,
        "--setenv", "HOME", SANDBOX_WORKDIR,
        "--remount-ro", "/",  # the sandbox's own root (a tmpfs bwrap made) takes no stray files
    ]
    for key, value in _CLEAN_ENV.items():
        flags += ["--setenv", key, value]
    if seccomp_fd is not None:
        flags += ["--seccomp", str(seccomp_fd)]
    return flags


def _args_blob(args: Sequence[str]) -> bytes:
    """bwrap's ``--args`` format: NUL-terminated arguments."""
    return b"".join(arg.encode() + b"\0" for arg in args)


def _pipe_holding(data: bytes) -> int:
    """The read end of a pipe that holds ``data`` and is closed for writing (``data`` must fit the
    pipe's buffer, 64 KiB: bwrap's options and a seccomp program are a few KiB)."""
    read_end, write_end = os.pipe()
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(write_end, view):]
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    return read_end


def _rlimit_prefix(limits: SandboxLimits, nproc: int) -> list[str]:
    mb = 2**20
    return [
        "prlimit",
        f"--as={limits.mem_mb * mb}",
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",  # SIGXCPU first (a readable end), SIGKILL a second later
        f"--fsize={limits.fsize_mb * mb}",
        f"--nofile={limits.nofile}",
        f"--nproc={nproc}",
        "--core=0",
        "--",
    ]


def _uids_of(pid: str) -> tuple[int, ...]:
    """The real, effective, saved and file-system uids of a live process (its /proc dir is owned
    by root when it made itself non-dumpable, so the owner alone would miss it); () for a zombie,
    which runs nothing and takes no signal (a sandbox's init, reparented to the host's init, stays
    one until that reaps it)."""
    with open(f"/proc/{pid}/status", "rb") as handle:
        for line in handle:
            if line.startswith(b"State:") and line.split()[1:2] in ([b"Z"], [b"X"]):
                return ()
            if line.startswith(b"Uid:"):
                return tuple(int(x) for x in line.split()[1:])
    return ()


def _processes_of(uid: int) -> list[int]:
    """Live processes of ``uid`` (zombies left out)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if uid in _uids_of(entry.name):
                    found.append(int(entry.name))
            except (OSError, ValueError):
                continue
    return found


def _count_processes_of(uid: int) -> int:
    return len(_processes_of(uid))


def _wait_until_gone(uid: int, timeout_s: float) -> bool:
    """Wait until no process of ``uid`` is left (killed ones exit, and are reaped, asynchronously)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while _processes_of(uid):
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True


# --- the uid pool -------------------------------------------------------------------------------------


class _UidPool:
    """Sandbox uids for a root host, never handed out while in use.

    A uid is in use while a sandbox of *any* host process on the machine holds it: each holds a
    POSIX byte-range lock on byte ``uid - base`` of one lock file (released by the kernel when the
    holder dies), and this process also keeps its own set (its locks do not conflict with
    themselves). The byte itself says whether the last holder gave the uid back clean (0: every
    process of it confirmed gone) or not (1: in use, or its holder died); a uid whose lock is free
    but whose byte is 1 is checked against /proc and skipped while a process of it lives (the
    leftover of a host killed at a bad moment), and that leftover is killed. The pool is walked
    from a random start, so host processes seldom contend."""

    def __init__(
        self, base: int = _SANDBOX_UID_BASE, size: int = _UID_POOL_SIZE, lock_path: str = _UID_LOCK_PATH
    ) -> None:
        self.base, self.size, self.lock_path = base, size, lock_path
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._fd: int | None = None
        self._next = random.randrange(size)
        self._pid = os.getpid()

    def _lock_fd(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            # A forked child holds none of its parent's locks: it starts its own bookkeeping.
            self._held, self._pid = set(), os.getpid()
            path = self.lock_path
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError:
                path = os.path.join(tempfile.gettempdir(), "tracegym-sandbox-uids.lock")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                os.close(fd)
                raise SandboxUnavailable(
                    f"the sandbox uid lock file {path} is not owned by this user or is writable by others")
            self._fd = fd
        return self._fd

    def acquire(self) -> int:
        with self._lock:
            fd = self._lock_fd()
            for _ in range(self.size):
                index = self._next
                self._next = (self._next + 1) % self.size
                uid = self.base + index
                if uid in self._held:
                    continue
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, index)
                except OSError:
                    continue  # another host process's sandbox has it
                if os.pread(fd, 1, index) not in (b"", b"\0"):  # not given back clean: look
                    leftovers = _processes_of(uid)
                    if leftovers:
                        for pid in leftovers:
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except OSError:
                                pass
                        fcntl.lockf(fd, fcntl.LOCK_UN, 1, index)
                        continue
                os.pwrite(fd, b"\1", index)
                self._held.add(uid)
                return uid
        raise SandboxUnavailable(f"no free sandbox uid: all {self.size} are in use")

    def release(self, uid: int) -> None:
        """Give ``uid`` back: only once no process of it is left (the caller checked)."""
        with self._lock:
            if uid not in self._held or self._fd is None or self._pid != os.getpid():
                return
            self._held.discard(uid)
            try:
                os.pwrite(self._fd, b"\0", uid - self.base)
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, uid - self.base)
            except OSError:
                pass


_uid_pool = _UidPool()


# --- watching CPU and memory without cgroups -----------------------------------------------------


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass
class _Proc:
    ppid: int
    cpu: float  # seconds: own user + system time and that of the children it waited for
    rss: int  # bytes of anonymous resident memory (file-backed pages are shared libraries, mostly)


def _proc_table() -> dict[int, _Proc]:
    """Every process of the machine (one pass over /proc)."""
    table: dict[int, _Proc] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                raw = handle.read()
            with open(f"/proc/{entry.name}/statm", "rb") as handle:
                statm = handle.read().split()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after its last ")".
        fields = raw[raw.rfind(b")") + 2:].split()
        try:
            ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
            table[int(entry.name)] = _Proc(int(fields[1]), ticks / _CLK_TCK, (int(statm[1]) - int(statm[2])) * _PAGE)
        except (IndexError, ValueError):
            continue
    return table


def _sigchld_ignored(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            for line in handle:
                if line.startswith(b"SigIgn:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGCHLD - 1)))
    except (OSError, ValueError):
        pass
    return False


class _TreeMeter:
    """CPU time of a sandbox's process tree, for hosts without a CPU-accounting cgroup.

    Each sample sums, over the live processes under the sandbox's roots, their own CPU time and
    their waited-for children's (``cutime``/``cstime``), so a burner that ran and was reaped still
    counts through its parent. A process that vanished counts its last-seen total when nothing
    alive will account for it: it was a root (reaped by the host), or its parent ignores SIGCHLD
    (children reaped automatically). What it cannot see: CPU a process used after the last sample
    before it vanished, and short-lived children of a parent that reaps automatically through
    SA_NOCLDWAIT. The reading never goes down."""

    def __init__(self) -> None:
        self.done = 0.0  # seconds of processes gone and not accounted for by a live one
        self.last: dict[int, tuple[int, float]] = {}  # pid -> (ppid, cpu) at the last sample
        self.reading = 0.0
        self.rss = 0
        self._lock = threading.Lock()

    def sample(self, table: dict[int, _Proc], roots: Sequence[int]) -> float:
        with self._lock:
            return self._sample(table, roots)

    def _sample(self, table: dict[int, _Proc], roots: Sequence[int]) -> float:
        children: dict[int, list[int]] = {}
        for pid, proc in table.items():
            children.setdefault(proc.ppid, []).append(pid)
        tree: dict[int, tuple[int, float]] = {}
        rss = 0
        stack = [pid for pid in roots if pid in table]
        while stack:
            pid = stack.pop()
            if pid in tree:
                continue
            proc = table[pid]
            tree[pid] = (proc.ppid, proc.cpu)
            rss += proc.rss
            stack.extend(children.get(pid, ()))
        for pid, (ppid, cpu) in self.last.items():
            if pid in tree:
                continue
            if ppid not in self.last:  # a root: the host reaped it, its time is nowhere in the tree
                self.done += cpu
            elif ppid in tree and _sigchld_ignored(ppid):
                self.done += cpu
        self.last = tree
        self.rss = rss
        self.reading = max(self.reading, self.done + sum(cpu for _, cpu in tree.values()))
        return self.reading


class _DaemonLoop:
    """A daemon thread running ``_loop``, (re)started under ``_lock`` when work arrives."""

    thread_name = "tracegym-sandbox"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _ensure_running(self) -> None:
        """Start the thread if none runs (the caller holds ``_lock``)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        raise NotImplementedError


class _Watchdog(_DaemonLoop):
    """One thread for the whole process: every ``_WATCH_INTERVAL_S`` it reads each live sandbox's
    CPU time (and memory where no cgroup limits it) and stops a sandbox past its budget, whether a
    command is running or not (a background job between tool calls included)."""

    thread_name = "tracegym-sandbox-watchdog"

    def __init__(self) -> None:
        super().__init__()
        self._boxes: weakref.WeakSet[Sandbox] = weakref.WeakSet()

    def add(self, box: Sandbox) -> None:
        with self._lock:
            self._boxes.add(box)
            self._ensure_running()

    def discard(self, box: Sandbox) -> None:
        with self._lock:
            self._boxes.discard(box)

    def _loop(self) -> None:
        while True:
            time.sleep(_WATCH_INTERVAL_S)
            with self._lock:
                boxes = list(self._boxes)
            if not boxes:
                continue
            table = _proc_table() if any(box._needs_proc_table for box in boxes) else None
            for box in boxes:
                try:
                    box._watch(table)
                except Exception:  # never let one sandbox stop the watch of the others
                    log.exception("sandbox watchdog failed on one sandbox")


_watchdog = _Watchdog()


# --- reading output with limits -----------------------------------------------------------------


class _Collector:
    """Reads a pipe in a thread, keeping the first ``keep`` bytes and counting the rest."""

    def __init__(self, stream, keep: int, on_total) -> None:
        self.kept = bytearray()
        self.total = 0
        self._keep = keep
        self._on_total = on_total
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        try:
            while chunk := stream.read1(65536):
                room = self._keep - len(self.kept)
                if room > 0:
                    self.kept += chunk[:room]
                self.total += len(chunk)
                self._on_total()
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def text(self) -> tuple[str, bool]:
        return self.kept.decode(errors="replace"), self.total > len(self.kept)


def _over_disk_quota(root: str, limits: SandboxLimits) -> bool:
    """Whether the work dir holds more than ``disk_mb`` (allocated blocks) or ``max_files``
    entries, or is too deep or slow to measure (the watchdog where no tmpfs holds the quota)."""
    quota = limits.disk_mb * 2**20
    bounds = TreeLimits(max_depth=256, max_entries=limits.max_files, timeout_s=2.0)
    try:
        return hostfs.disk_usage(root, quota, bounds) > quota
    except TreeLimitError:
        return True
    except OSError:
        return False


# --- background removal ----------------------------------------------------------------------------


class _Janitor(_DaemonLoop):
    """Removes what a sandbox left that did not go in the time :meth:`Sandbox.close` gives it, on
    one daemon thread, bounded (:func:`hostfs.remove_tree`)."""

    thread_name = "tracegym-sandbox-janitor"

    def __init__(self) -> None:
        super().__init__()
        self._queue: list[str] = []

    def remove(self, path: str) -> None:
        with self._lock:
            self._queue.append(path)
            self._ensure_running()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                path = self._queue.pop(0)
            report = hostfs.remove_tree(path, deadline_s=120.0)
            if not report.complete:
                log.warning("could not remove sandbox leftovers %s: %s", path, "; ".join(report.errors[:3]))


_janitor = _Janitor()


# --- the sandbox ----------------------------------------------------------------------------------


class Sandbox:
    """One private work dir and the commands run in it (an episode's sandbox).

    ``files`` are written into the work dir first (``{"main.py": "print(1)"}``, paths relative,
    str or bytes). The work dir lives until :meth:`close` (or the ``with`` block ends), so files
    persist between :meth:`run` calls; :meth:`reset_files` starts it over. Thread-safe for one
    command at a time."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolation: Isolation = "bwrap",
        files: Mapping[str, str | bytes] | None = None,
        seccomp: bool = True,
        base_dir: str | os.PathLike[str] | None = None,
        cgroup: bool = True,
    ) -> None:
        if isolation not in ("bwrap", "unsafe_local"):
            raise ValueError(f"sandbox isolation must be 'bwrap' or 'unsafe_local', got {isolation!r}")
        self.limits = limits or SandboxLimits()
        self.isolation: Isolation = isolation
        if isolation == "bwrap":
            reason = bwrap_unavailable_reason()
            if reason is not None:
                raise SandboxUnavailable(
                    f"cannot isolate model-written code: {reason}. Install bubblewrap, or set isolation "
                    "'unsafe_local' to run it unisolated on a machine you own (never for untrusted models)"
                )
        else:
            _warn_unsafe_once()
        self._closed = False
        self._lock = threading.Lock()
        self._sessions: list[ShellSession] = []
        self._procs: set[subprocess.Popen] = set()
        self._procs_lock = threading.Lock()
        self._mounted = False
        self._uid: int | None = None
        self._cgroup: cgroups.SandboxCgroup | None = None
        self._meter = _TreeMeter()
        self._spent: str | None = None  # "cpu_budget" once the budget is used up
        self._memory_kills = 0  # watchdog kills for memory (no memory cgroup)
        self._seccomp = _seccomp_program() if (seccomp and isolation == "bwrap") else None
        base = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir()) / "tracegym-sandbox"
        self.workdir = base / f"{os.getpid()}-not-created"
        self._workdir_created = False
        try:
            self._uid = _uid_pool.acquire() if _is_root() else None
            base.mkdir(parents=True, exist_ok=True)
            if self._uid is not None:
                _check_reachable(base)
            _sweep_stale(base)
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base))
            self._workdir_created = True
            if self._uid is not None:
                os.chown(self.workdir, self._uid, self._uid)
                self._mounted = _mount_tmpfs(self.workdir, self.limits, self._uid)
            self.workdir.chmod(0o700)
            support = cgroups.cgroup_support() if cgroup else cgroups.CgroupSupport()
            if support.providers:
                pids = self.limits.nproc + 16  # bwrap's own two processes per command, and room for the shell's
                self._cgroup = cgroups.SandboxCgroup(
                    support, self.limits.total_mem_mb * 2**20, pids, self.limits.cpu_cores)
            if files:
                self.write_files(files)
        except BaseException:
            self.close()
            raise
        _watchdog.add(self)

    # -- limits per sandbox --

    @property
    def accounting(self) -> str:
        """How this sandbox's per-sandbox limits hold: ``cgroup: memory v1, pids v1, ...`` or
        ``watchdog`` (no cgroup)."""
        if self._cgroup is None:
            return "watchdog"
        return "cgroup: " + ", ".join(f"{f} v{self._cgroup.support.providers[f].version}" for f in self._cgroup.features)

    def _command_cpu(self) -> float | None:
        """The cgroup's CPU reading, for a command's ``cpu_s`` (None without one)."""
        if self._cgroup is not None and self._cgroup.has("cpu_usage"):
            return self._cgroup.cpu_seconds()
        return None

    def cpu_seconds(self) -> float:
        """CPU seconds every process of the sandbox used so far (the budget's reading)."""
        if self._cgroup is not None and self._cgroup.has("cpu_usage"):
            used = self._cgroup.cpu_seconds()
            if used is not None:
                return used
        with self._procs_lock:
            roots = [p.pid for p in self._procs]
        if not roots and not self._meter.last:
            return self._meter.reading
        return self._meter.sample(_proc_table(), roots)  # also when the last root just went: it counts

    @property
    def _needs_proc_table(self) -> bool:
        if self._closed:
            return False
        cg = self._cgroup
        return cg is None or not cg.has("cpu_usage") or not cg.has("memory")

    def _watch(self, table: dict[int, _Proc] | None) -> None:
        """One watchdog round (on the watchdog's thread)."""
        if self._closed or self._spent is not None:
            return
        with self._procs_lock:
            roots = [p.pid for p in self._procs]
        cg = self._cgroup
        if cg is not None and cg.has("cpu_usage"):
            used = cg.cpu_seconds() or 0.0
        elif table is not None:
            # Sampled even with no root left: a root that exited since the last round still counts.
            used = self._meter.sample(table, roots) if roots or self._meter.last else self._meter.reading
        else:
            used = 0.0
        if table is not None and (cg is None or not cg.has("memory")) and roots:
            if cg is not None and cg.has("cpu_usage"):
                self._meter.sample(table, roots)  # for its memory reading
            if self._meter.rss > self.limits.total_mem_mb * 2**20:
                log.info("sandbox %s: processes hold %d MB, over its %d MB; killing them",
                         self.workdir.name, self._meter.rss >> 20, self.limits.total_mem_mb)
                self._memory_kills += 1
                self._kill_everything()
        if used > self.limits.cpu_budget_s:
            log.info("sandbox %s used %.1f CPU s, past its budget of %g s; killing it",
                     self.workdir.name, used, self.limits.cpu_budget_s)
            self._spent = "cpu_budget"
            self._kill_everything()

    def _kill_everything(self) -> None:
        """Kill every process of the sandbox now (any thread; does not wait for the command lock)."""
        with self._procs_lock:
            procs = list(self._procs)
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.kill_all()

    def _budget_result(self, started: float) -> SandboxResult:
        return SandboxResult(returncode=None, killed="cpu_budget", wall_s=time.monotonic() - started)

    # -- the work dir --

    def _host_path(self, relative: str) -> Path:
        rel = Path(relative)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(f"sandbox file path must be relative and inside the work dir, got {relative!r}")
        return self.workdir / rel

    def write_files(self, files: Mapping[str, str | bytes], mode: int = 0o644) -> None:
        """Write files into the work dir (parents created), owned by the sandbox's uid."""
        for relative, content in files.items():
            path = self._host_path(relative)
            for parent in reversed(path.relative_to(self.workdir).parents[:-1]):
                folder = self.workdir / parent
                if folder.is_symlink():
                    raise ValueError(f"sandbox path {relative!r} goes through a symlink")
                folder.mkdir(exist_ok=True)
                self._own(folder)
            data = content.encode() if isinstance(content, str) else bytes(content)
            # O_NOFOLLOW: a link the sandboxed code left behind must not redirect a host write.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.chmod(path, mode)
            self._own(path)

    def _own(self, path: Path) -> None:
        if self._uid is not None:
            os.lchown(path, self._uid, self._uid)

    def reset_files(self, files: Mapping[str, str | bytes] | None = None) -> None:
        """Empty the work dir (killing every process of the sandbox first) and write ``files``.
        Whatever the sandbox left (a chain thousands deep, millions of files) this neither recurses
        nor fails: as root the work dir's tmpfs is replaced by a fresh one; otherwise the old dir is
        moved aside (one rename) and removed in the background, and a fresh one takes its place."""
        self.kill_all()
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.workdir)], check=False, stderr=subprocess.DEVNULL)
            assert self._uid is not None
            self._mounted = _mount_tmpfs(self.workdir, self.limits, self._uid)
            if not self._mounted:  # the mount went away and a new one is refused: the watchdog holds
                self._fresh_workdir()
        else:
            self._fresh_workdir()
        if files:
            self.write_files(files)

    def _fresh_workdir(self) -> None:
        """Swap the work dir for an empty one at the same path; the old one goes to the janitor."""
        trash = self.workdir.with_name(f"{os.getpid()}-trash-{os.urandom(6).hex()}")
        try:
            os.rename(self.workdir, trash)
        except FileNotFoundError:
            trash = None  # type: ignore[assignment]
        self.workdir.mkdir(mode=0o700)
        if self._uid is not None:
            os.chown(self.workdir, self._uid, self._uid)
        self.workdir.chmod(0o700)
        if trash is not None:
            report = hostfs.remove_tree(trash, deadline_s=0.5)
            if not report.complete:
                _janitor.remove(str(trash))

    def list_files(
        self,
        read_limit: int = 65_536,
        *,
        read: Callable[[str], bool] | None = None,
        limits: TreeLimits | None = None,
    ) -> list[FileEntry]:
        """Every entry under the work dir, never following a link (a link to ``/etc/shadow`` is
        reported as a link, not read). Contents of regular files up to ``read_limit`` bytes are
        included, for the paths ``read`` accepts (default: all). The walk is bounded (``limits``:
        depth, entries, bytes read in total, each inode read once, time):
        :class:`TreeLimitError`, with a reason to show, past a bound."""
        bounds = limits or TreeLimits()
        if bounds.read_limit != read_limit:
            bounds = TreeLimits(bounds.max_depth, bounds.max_entries, bounds.max_read_bytes, read_limit, bounds.timeout_s)
        return [
            FileEntry(e.path, e.kind, e.mode, e.size, content=e.content, target=e.target)
            for e in hostfs.list_tree(self.workdir, bounds, read=read)
        ]

    # -- running --

    def _command(self, argv: Sequence[str], args_fd: int | None) -> list[str]:
        nproc = self.limits.nproc
        if self._uid is None:  # RLIMIT_NPROC counts all of this user's processes
            nproc += _count_processes_of(os.getuid())
        prefix = _rlimit_prefix(self.limits, nproc)
        if self.isolation == "bwrap":
            # The options (the host's work dir path among them) come through a pipe, so the
            # sandbox's own /proc/1/cmdline shows "bwrap --args N -- <command>" and nothing else.
            return [*prefix, "bwrap", "--args", str(args_fd), "--", *argv]
        return [*prefix, *argv]

    def _popen(self, argv: Sequence[str], merge_stderr: bool, extra_fds: Sequence[int] = ()) -> subprocess.Popen:
        if self._closed:
            raise RuntimeError("sandbox is closed")
        opened: list[int] = []
        pass_fds = list(extra_fds)
        gate = False
        try:
            args_fd = None
            if self.isolation == "bwrap":
                seccomp_fd = None
                if self._seccomp is not None:
                    seccomp_fd = _pipe_holding(self._seccomp)  # ~1 KB: fits the pipe buffer
                    opened.append(seccomp_fd)
                args_fd = _pipe_holding(_args_blob(_bwrap_flags(str(self.workdir), self.limits, seccomp_fd)))
                opened.append(args_fd)
                pass_fds += opened
            command = self._command(argv, args_fd)
            if self._cgroup is not None:
                # The command first waits for one empty line on its stdin, which the host sends once
                # it has moved the command into the sandbox's cgroup, so nothing it forks starts
                # outside (the pid stays: sh execs prlimit, which execs bwrap). sh reads a pipe a
                # byte at a time: the rest of stdin is the command's. No line (the host died): no exec.
                gate = True
                command = ["/bin/sh", "-c", 'read -r _ && exec "$@"', "sh", *command]
            env = dict(_CLEAN_ENV, HOME=str(self.workdir) if self.isolation == "unsafe_local" else SANDBOX_WORKDIR)
            identity = {"user": self._uid, "group": self._uid, "extra_groups": []} if self._uid is not None else {}
            # Started from one long-lived thread: bwrap's --die-with-parent (PR_SET_PDEATHSIG) fires
            # when the *thread* that forked it exits, and tool calls run in short-lived threads, which
            # would take a persistent shell down with them after every call.
            proc = _spawner().submit(
                subprocess.Popen, command,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                # bwrap starts from / (it changes to /work itself): a shell on the way would
                # otherwise export the host's work dir as $PWD, into what /proc/1/environ shows.
                cwd=self.workdir if self.isolation == "unsafe_local" else "/",
                env=env, start_new_session=True, pass_fds=tuple(pass_fds), close_fds=True,
                **identity,
            ).result()
            with self._procs_lock:
                self._procs.add(proc)
            if gate:
                assert self._cgroup is not None and proc.stdin is not None
                try:
                    self._cgroup.attach(proc.pid)
                    proc.stdin.write(b"\n")
                    proc.stdin.flush()
                except (OSError, ValueError):
                    self._reap(proc, kill=True)
                    raise
            return proc
        finally:
            for fd in opened:
                os.close(fd)

    def _reap(self, proc: subprocess.Popen, kill: bool = False) -> None:
        """Forget a finished (or, with ``kill``, killed) process of the sandbox."""
        if kill:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        with self._procs_lock:
            self._procs.discard(proc)

    def _memory_mark(self) -> tuple[int, int]:
        return (self._cgroup.oom_kills() if self._cgroup is not None else 0), self._memory_kills

    def _memory_since(self, mark: tuple[int, int]) -> tuple[int, bool]:
        """(kernel OOM kills since ``mark``, whether the watchdog killed for memory since)."""
        now = self._memory_mark()
        return now[0] - mark[0], now[1] > mark[1]

    def run(self, argv: Sequence[str], stdin: bytes | str = b"", wall_s: float | None = None) -> SandboxResult:
        """Run ``argv`` (cwd: the work dir) to completion or to a limit. ``stdin`` is sent and
        closed (a read past it sees EOF). Everything the command started is gone when this
        returns: bwrap tears down the pid namespace; as root the sandbox uid's processes are killed."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        limit = wall_s if wall_s is not None else self.limits.wall_s
        with self._lock:
            started = time.monotonic()
            if self._spent is not None:
                return self._budget_result(started)
            cpu_before = self._command_cpu()
            memory = self._memory_mark()
            proc = self._popen(argv, merge_stderr=False)
            state: dict[str, str | None] = {"killed": None}
            streams: list[_Collector] = []

            def check_output() -> None:
                if state["killed"] is None and sum(s.total for s in streams) > self.limits.kill_output:
                    state["killed"] = "output_limit"
                    self._kill(proc)

            out = _Collector(proc.stdout, self.limits.max_output, check_output)
            err = _Collector(proc.stderr, self.limits.max_output, check_output)
            streams += [out, err]
            threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
            timed_out = self._wait(proc, started + limit, state)
            out.join(2.0)
            err.join(2.0)
            if state["killed"] is None:  # a kill already swept the sandbox's processes
                self.kill_all()
            cpu_used = self._command_cpu()
            self._reap(proc)
            oom, watchdog_memory = self._memory_since(memory)
            killed = state["killed"]
            if self._spent is not None and killed in (None, "wall_time"):
                killed = self._spent
            elif watchdog_memory and killed is None:
                killed = "memory_limit"
            stdout, out_cut = out.text()
            stderr, err_cut = err.text()
            return SandboxResult(
                returncode=self._status(proc.returncode), stdout=stdout, stderr=stderr, timed_out=timed_out,
                killed=killed, stdout_truncated=out_cut, stderr_truncated=err_cut,
                wall_s=time.monotonic() - started, cpu_s=_delta(cpu_before, cpu_used), memory_kills=oom,
            )

    def _status(self, returncode: int | None) -> int | None:
        """bwrap exits with 128 + N when its command died of signal N; report that as ``-N``, as
        subprocess does for a direct child (a shell reads both the same way)."""
        if self.isolation == "bwrap" and returncode is not None and 128 < returncode <= 128 + 64:
            return -(returncode - 128)
        return returncode

    def _wait(self, proc: subprocess.Popen, deadline: float, state: dict) -> bool:
        """Wait for ``proc`` until ``deadline``, watching the disk quota where no tmpfs holds it.
        True when the wall limit killed it."""
        with _ExitWaiter(proc) as waiter:
            return self._wait_loop(proc, waiter, deadline, state)

    def _wait_loop(self, proc: subprocess.Popen, waiter: _ExitWaiter, deadline: float, state: dict) -> bool:
        while True:
            remaining = deadline - time.monotonic()
            if waiter.wait(max(0.0, min(remaining, 0.25))):
                return False
            if not self._mounted and state["killed"] is None and _over_disk_quota(str(self.workdir), self.limits):
                state["killed"] = "disk_limit"
                self._kill(proc)
            if time.monotonic() >= deadline:
                if state["killed"] is None:
                    state["killed"] = "wall_time"
                self._kill(proc)
                proc.wait()
                return True

    def _kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL the command's process group (bwrap and, through --die-with-parent, the pid
        namespace it owns) and every other process of the sandbox (its cgroup; as root, its uid)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.kill_all()

    def kill_all(self) -> None:
        """Kill every process the sandbox left (its cgroup's members; as root all processes of its
        uid; in bwrap mode the pid namespace already took them)."""
        if self._cgroup is not None:
            self._cgroup.kill()
            if self._cgroup.has("kill"):
                # cgroup.kill took every process: each one joined the cgroup before it ran anything.
                return
        if self._uid is not None:
            # kill(-1) as the sandbox's uid reaches exactly that uid's processes.
            subprocess.run(
                ["kill", "-KILL", "-1"], user=self._uid, group=self._uid, extra_groups=[],
                env=dict(_CLEAN_ENV), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
            )

    def shell(self, wall_s: float | None = None) -> ShellSession:
        """A persistent bash session in this sandbox (see :class:`ShellSession`)."""
        session = ShellSession(self, wall_s=wall_s)
        self._sessions.append(session)
        return session

    # -- cleanup --

    def close(self) -> None:
        """Kill everything the sandbox started and remove its work dir (idempotent, never fails on
        what the sandbox left: the removal is bounded and what it does not finish in a second
        goes on in the background)."""
        if self._closed:
            return
        self._closed = True
        _watchdog.discard(self)
        for session in self._sessions:
            try:
                session.close()
            except Exception:
                log.exception("closing a sandbox shell failed")
        try:
            self.kill_all()
        except Exception:
            log.exception("killing a sandbox's processes failed")
        with self._procs_lock:
            procs, self._procs = list(self._procs), set()
        for proc in procs:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        all_gone = None
        if self._cgroup is not None:
            all_gone = self._cgroup.remove()
            if not all_gone:
                log.warning("sandbox %s: its cgroup still had processes after 2 s", self.workdir.name)
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.workdir)], check=False, stderr=subprocess.DEVNULL)
            self._mounted = False
        if self._workdir_created:
            report = hostfs.remove_tree(self.workdir, deadline_s=1.0)
            if not report.complete:
                # Out of the way at once (one rename), removed in the background.
                trash = self.workdir.with_name(f"{os.getpid()}-trash-{os.urandom(6).hex()}")
                try:
                    os.rename(self.workdir, trash)
                    _janitor.remove(str(trash))
                except OSError:
                    _janitor.remove(str(self.workdir))
        if self._uid is not None:
            # The uid goes back to the pool only once no process of it is left (the pid namespace
            # is torn down asynchronously); one that does not go is never handed out again. An
            # emptied cgroup says so at once (every process of the sandbox joined it).
            if all_gone or _wait_until_gone(self._uid, 2.0):
                _uid_pool.release(self._uid)
            else:
                log.warning("sandbox uid %d still has processes after 2 s; it stays out of the pool", self._uid)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if sys.is_finalizing():  # the interpreter is going away: its atexit sweeps already ran
            return
        try:
            self.close()
        except Exception:
            pass


class _ExitWaiter:
    """Waits for a child to exit through a pidfd (woken the moment it exits, where Popen.wait with
    a timeout polls with growing sleeps), falling back to Popen.wait."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.fd: int | None = None
        try:
            self.fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.fd = None

    def wait(self, timeout: float) -> bool:
        """True once the child has exited (and is reaped)."""
        if self.proc.returncode is not None:
            return True
        if self.fd is None:
            try:
                self.proc.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        if poller.poll(timeout * 1000):
            self.proc.wait()
            return True
        return False

    def __enter__(self) -> _ExitWaiter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@functools.lru_cache(maxsize=1)
def _spawner() -> ThreadPoolExecutor:
    """The process-wide thread every sandbox process is started from (it lives as long as the
    process, so the parent-death signal only fires when the host process dies)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracegym-sandbox-spawner")


def _feed(pipe, data: bytes) -> None:
    try:
        if data:
            pipe.write(data)
    except (BrokenPipeError, OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _check_reachable(base: Path) -> None:
    """bwrap starts as the sandbox's own uid, which must be able to walk down to the work dir."""
    for folder in [base, *base.resolve().parents]:
        if not os.stat(folder).st_mode & 0o001:
            raise ValueError(
                f"sandbox base_dir {base} cannot be reached by the sandbox's unprivileged uid: {folder} is not "
                "searchable by others (mode o-x); use a folder under /tmp (the default) or chmod o+x it"
            )


def _mount_tmpfs(path: Path, limits: SandboxLimits, uid: int) -> bool:
    """As root: make ``path`` a tmpfs of ``disk_mb`` and ``max_files`` inodes owned by ``uid``
    (the disk quota). False when mounting is not allowed (a container without CAP_SYS_ADMIN): the
    watchdog then holds it."""
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o",
         f"size={limits.disk_mb}m,nr_inodes={limits.max_files},uid={uid},gid={uid},mode=0700,nosuid,nodev",
         "tracegym-sandbox", str(path)],
        capture_output=True, check=False,
    )
    return done.returncode == 0


def _sweep_stale(base: Path) -> None:
    """Clean up after host processes that died without closing their sandboxes: unmount and
    remove their work dirs (``<pid>-...``), bounded; what does not go at once goes to the
    janitor. (Processes they left are killed when their uid is next taken from the pool, and their
    cgroups when the next host process creates its own.)"""
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        pid = entry.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        path = entry.path
        if os.path.ismount(path):
            subprocess.run(["umount", "-l", path], check=False, stderr=subprocess.DEVNULL)
        report = hostfs.remove_tree(path, deadline_s=0.2)
        if not report.complete:
            trash = os.path.join(base, f"{os.getpid()}-trash-{os.urandom(6).hex()}")
            try:
                os.rename(path, trash)
                _janitor.remove(trash)
            except OSError:
                pass


def _after_fork_in_child() -> None:
    """A forked child shares none of its parent's sandboxes: it must not watch them (the watchdog
    would kill them at their budget), nor remove what its parent queued, and the spawner thread
    did not survive the fork."""
    _watchdog.__init__()  # type: ignore[misc]
    _janitor.__init__()  # type: ignore[misc]
    _spawner.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_warned_unsafe = False


def _warn_unsafe_once() -> None:
    global _warned_unsafe
    if not _warned_unsafe:
        _warned_unsafe = True
        warnings.warn(
            "sandbox isolation 'unsafe_local': model-written code runs WITHOUT isolation (it can read "
            "your files and reach the network); only rlimits, a cleared environment and a private work "
            "dir apply. Use bubblewrap for anything but your own trusted code.",
            RuntimeWarning, stacklevel=3,
        )


# --- a persistent shell -----------------------------------------------------------------------------

#: The status pipe's number inside a persistent shell (see :meth:`ShellSession._start`).
_SHELL_STATUS_FD = 3


class ShellSession:
    """A bash process kept alive inside the sandbox between commands: the current directory,
    variables, files and background processes persist, like a terminal.

    Each :meth:`run` sends the command base64-encoded to ``eval`` (so no quoting or syntax error
    in it can swallow what follows), with stdin from /dev/null (a command never reads the session's
    own input) and stderr merged into stdout. The end of a command is not marked in its output: the
    shell writes the exit status to a pipe of its own, closed while the command runs (so neither the
    command nor anything it starts holds it), and the host then takes what the output pipe holds.
    There is no secret in the shell for a ``DEBUG`` trap to read, and printing a fake status line
    is just output. Output is read only while a command runs: between commands a background job
    that keeps printing fills the pipe (64 KiB) and waits; nothing accumulates in the host. A
    command that runs past the wall limit, prints past the output cap or exits the shell takes the
    session down (every process in it is killed); the next command starts a new shell in the same
    work dir."""

    def __init__(self, sandbox: Sandbox, wall_s: float | None = None) -> None:
        self.sandbox = sandbox
        self.wall_s = wall_s if wall_s is not None else sandbox.limits.wall_s
        self._proc: subprocess.Popen | None = None
        self._status_read: int | None = None
        self._status_fd = -1  # the status pipe's number inside the shell
        self.restarts = 0

    def _start(self) -> None:
        status_read, status_write = os.pipe()
        try:
            self._proc = self.sandbox._popen(
                ["bash", "--noprofile", "--norc"], merge_stderr=True, extra_fds=(status_write,))
        except BaseException:
            os.close(status_read)
            raise
        finally:
            os.close(status_write)
        self._status_read = status_read
        os.set_blocking(status_read, False)
        assert self._proc.stdout is not None and self._proc.stdin is not None
        os.set_blocking(self._proc.stdout.fileno(), False)
        # pass_fds keeps the host's number for the pipe in the shell, and a busy host (many files
        # open) hands out numbers at or past the sandbox's RLIMIT_NOFILE. bash can close such an fd
        # around a command, but not put it back after (dup2 to a number past the limit is EBADF):
        # the status would be lost and the session end. So the shell first moves it to a number
        # below any workable limit, free in a new shell (it holds only 0-2 and this pipe).
        self._status_fd = _SHELL_STATUS_FD
        if status_write != _SHELL_STATUS_FD:
            try:
                self._proc.stdin.write(f"exec {_SHELL_STATUS_FD}>&{status_write} {status_write}>&-\n".encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # the shell is gone: run() reads its end

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def run(self, command: str, wall_s: float | None = None) -> SandboxResult:
        """Run one shell command in the session; ``stdout`` holds its output (stderr merged)."""
        sandbox = self.sandbox
        limits = sandbox.limits
        limit = wall_s if wall_s is not None else self.wall_s
        with sandbox._lock:
            started = time.monotonic()
            if sandbox._spent is not None:
                self._stop()
                return sandbox._budget_result(started)
            if not self.alive:
                if self._proc is not None:
                    self.restarts += 1
                    self._stop()
                self._start()
            assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
            cpu_before = sandbox._command_cpu()
            memory = sandbox._memory_mark()
            out_fd, status_fd = self._proc.stdout.fileno(), self._status_read
            assert status_fd is not None
            _drain(status_fd, 4096)  # a status line a trap forged after the last command: stale
            encoded = base64.b64encode(command.encode()).decode()
            fd = self._status_fd
            script = (
                f"__tg_cmd=$(printf %s {encoded} | base64 -d); eval \"$__tg_cmd\" </dev/null 2>&1 {fd}>&-; "
                f"printf '%d\\n' $? >&{fd}\n"
            )
            try:
                self._proc.stdin.write(script.encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            output = bytearray()
            status_text = bytearray()
            killed: str | None = None
            status: int | None = None
            poller = select.poll()
            poller.register(out_fd, select.POLLIN)
            poller.register(status_fd, select.POLLIN)
            last_disk_check = 0.0
            while True:
                remaining = started + limit - time.monotonic()
                if remaining <= 0:
                    killed = "wall_time"
                    break
                events = dict(poller.poll(min(remaining, 0.25) * 1000))
                if events.get(out_fd):
                    chunk, eof = _read_some(out_fd, limits.kill_output + 1 - len(output))
                    output += chunk
                    if eof:
                        killed = "shell_exited"
                        break
                if events.get(status_fd):
                    chunk, eof = _read_some(status_fd, 64)
                    status_text += chunk
                    if b"\n" in status_text:
                        line = bytes(status_text).split(b"\n", 1)[0].strip()
                        status = int(line) if line.lstrip(b"-").isdigit() else None
                        # Everything the command printed before the shell wrote its status is in
                        # the pipe now: take it without waiting for more.
                        rest, eof = _read_some(out_fd, limits.kill_output + 1 - len(output))
                        output += rest
                        break
                    if eof:
                        killed = "shell_exited"
                        break
                if len(output) > limits.kill_output:
                    killed = "output_limit"
                    break
                if sandbox._spent is not None:
                    killed = sandbox._spent
                    break
                if sandbox._memory_since(memory)[1]:
                    killed = "memory_limit"
                    break
                now = time.monotonic()
                if not sandbox._mounted and now - last_disk_check >= 0.25:
                    last_disk_check = now
                    if _over_disk_quota(str(sandbox.workdir), limits):
                        killed = "disk_limit"
                        break
            if killed is not None:
                if killed == "shell_exited":
                    rest, _ = _read_some(out_fd, limits.kill_output + 1 - len(output))
                    output += rest
                self._stop()
                status = self._proc.returncode if self._proc is not None else None
                if killed == "shell_exited" and status is not None:
                    status = sandbox._status(status)
            cpu_used = sandbox._command_cpu()
            oom, _ = sandbox._memory_since(memory)
            text = bytes(output[: limits.max_output]).decode(errors="replace")
            return SandboxResult(
                returncode=status, stdout=text, timed_out=killed == "wall_time", killed=killed,
                stdout_truncated=len(output) > limits.max_output, wall_s=time.monotonic() - started,
                cpu_s=_delta(cpu_before, cpu_used), memory_kills=oom,
            )

    def _stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self.sandbox._kill(proc)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.sandbox._reap(proc)
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if self._status_read is not None:
            os.close(self._status_read)
            self._status_read = None

    def close(self) -> None:
        """End the session, killing every process it started."""
        self._stop()
        self._proc = None


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else max(0.0, after - before)


def _read_some(fd: int, limit: int) -> tuple[bytes, bool]:
    """What a non-blocking pipe holds now, up to ``limit`` bytes (at least one read); (data,
    whether the writer closed it)."""
    chunks: list[bytes] = []
    got = 0
    while True:
        try:
            chunk = os.read(fd, max(1, min(65_536, limit - got)))
        except BlockingIOError:
            return b"".join(chunks), False
        except OSError:
            return b"".join(chunks), True
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
        got += len(chunk)
        if got >= limit:
            return b"".join(chunks), False


def _drain(fd: int, limit: int) -> None:
    _read_some(fd, limit)
