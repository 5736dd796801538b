"""Run model-written code and shell commands in an isolated sandbox that fails closed.

    with Sandbox(SandboxLimits(wall_s=10), files={"main.py": code}) as sb:
        result = sb.run(["python3", "main.py"], stdin=b"")   # -> SandboxResult
        shell = sb.shell()                                    # a persistent bash session
        out = shell.run("cd data && ls")                      # files and processes survive calls

Isolation (``isolation="bwrap"``, the default) uses bubblewrap (Debian package ``bubblewrap``):
new user, pid, network, ipc, uts and cgroup namespaces, so the command sees no host process, no
network (not even the host's loopback) and cannot create namespaces of its own
(``--disable-userns``); a private file system view (``/usr`` read-only, ``/bin``, ``/lib`` links,
a fresh ``/proc`` and ``/dev``, a size-limited ``/tmp``, and the per-sandbox work dir at
``/work``; no ``/etc``, no home, no repository); a cleared environment (no secrets); all
capabilities dropped; and, when libseccomp is installed (``pyseccomp``), a seccomp filter that
answers ``ptrace``, ``mount``, ``unshare``, ``bpf``, ``keyctl``, module loading, ``io_uring`` and
the like with EPERM.

Limits, from :class:`SandboxLimits`: wall time (the whole sandbox is killed: every process in its
pid namespace dies with it, orphans included), CPU seconds, address space, processes, file size,
open files, bytes of output kept (and a hard cap past which the run is killed), and the work dir's
disk use. The resource limits are rlimits set by util-linux ``prlimit`` before ``bwrap`` starts.
When the host process runs as root, each sandbox also runs as its own unprivileged uid, so the
process limit counts only that sandbox's processes, a ``kill -9 -1`` as that uid removes any
leftover, and its work dir is a tmpfs of ``disk_mb``; as a normal user the process limit is added
to the user's current count and a watchdog enforces ``disk_mb``.

Where bubblewrap is missing or cannot create namespaces, :class:`Sandbox` raises
:class:`SandboxUnavailable` (fail closed) unless the caller opts into ``isolation="unsafe_local"``:
the same rlimits, cleared environment, private work dir and process-group kill, but no namespaces:
the code can read the host's files and reach its network. It is for a developer's own laptop and
trusted code only, and says so in a warning.

Why not a library: the PyPI packages named after bubblewrap are unrelated, container runtimes
(docker, podman) need a daemon or privileges these machines do not give, and hosted sandboxes need
a network. bubblewrap + rlimits + seccomp is what Flatpak builds on and is available everywhere
Debian is.
"""

from __future__ import annotations

import base64
import functools
import itertools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping, Sequence

__all__ = [
    "FileEntry",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "ShellSession",
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

#: uids handed to sandboxes when the host runs as root: far above any real user's uid.
_SANDBOX_UID_BASE = 1_600_000_000
_uid_counter = itertools.count()


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be provided on this machine (fail closed)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of every command run in one :class:`Sandbox`."""

    wall_s: float = 15.0
    """Wall-clock seconds per command (per :meth:`ShellSession.run` call); then the sandbox is killed."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU)."""
    mem_mb: int = 512
    """Address space per process, MB (RLIMIT_AS)."""
    nproc: int = 64
    """Processes and threads at once (RLIMIT_NPROC; fork bombs stop here)."""
    fsize_mb: int = 16
    """Largest file a process may write, MB (RLIMIT_FSIZE)."""
    nofile: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    disk_mb: int = 64
    """Bytes the work dir may hold, MB (a tmpfs as root; a watchdog otherwise)."""
    tmp_mb: int = 16
    """Size of the sandbox's private ``/tmp`` (a tmpfs), MB."""
    max_output: int = 64_000
    """Bytes of stdout (and of stderr) kept; the rest is dropped and the result marked truncated."""
    kill_output: int = 8_000_000
    """Bytes of output past which the command is killed (a 100 MB print loop ends here)."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "mem_mb", "nproc", "fsize_mb", "nofile", "disk_mb", "tmp_mb", "max_output", "kill_output"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")


@dataclass
class SandboxResult:
    """What a sandboxed command did. ``returncode`` is negative for a signal (``-9``: killed)."""

    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    killed: str | None = None  # "wall_time" | "output_limit" | "disk_limit" | "shell_exited"
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0

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
        if self.killed == "shell_exited":
            return f"the shell exited (status {self.returncode}); a new shell starts at the next command"
        if self.returncode is not None and self.returncode < 0:
            name = _signal_name(-self.returncode)
            hint = " (CPU time limit)" if name == "SIGXCPU" else " (file size limit)" if name == "SIGXFSZ" else ""
            return f"killed by {name}{hint}"
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
            argv = ["bwrap", *_bwrap_flags(work, SandboxLimits(), seccomp_fd=None), "true"]
            done = subprocess.run(
                argv, capture_output=True, timeout=20, env=dict(_CLEAN_ENV),
                **({"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}),
            )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap failed to start: {type(exc).__name__}: {exc}"
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip().splitlines()
        return f"bubblewrap cannot create the sandbox here: {detail[-1] if detail else f'exit {done.returncode}'}"
    return None


@functools.lru_cache(maxsize=1)
def _seccomp_program() -> bytes | None:
    """The compiled BPF program for :data:`SECCOMP_DENY` (EPERM), or None without libseccomp."""
    try:
        import pyseccomp
    except (ImportError, OSError):
        return None
    try:
        program = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
        for name in SECCOMP_DENY:
            try:
                program.add_rule(pyseccomp.ERRNO(1), name)  # 1 = EPERM
            except (ValueError, RuntimeError, OSError):
                pass  # a syscall this architecture does not have
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
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.tmp_mb * 2**20), "--tmpfs", "/tmp",
        "--bind", workdir, SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR,
        "--setenv", "HOME", SANDBOX_WORKDIR,
        "--remount-ro", "/",  # the sandbox's own root (a tmpfs bwrap made) takes no stray files
    ]
    for key, value in _CLEAN_ENV.items():
        flags += ["--setenv", key, value]
    if seccomp_fd is not None:
        flags += ["--seccomp", str(seccomp_fd)]
    return flags


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


def _count_processes_of(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except OSError:
                continue
    return count


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


def _disk_usage(root: str) -> int:
    total = 0
    for path, dirs, files in os.walk(root, followlinks=False):
        for name in files:
            try:
                total += os.lstat(os.path.join(path, name)).st_blocks * 512
            except OSError:
                continue
    return total


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
        self._seccomp = _seccomp_program() if (seccomp and isolation == "bwrap") else None
        self._uid = _uid_range(os.getpid())[next(_uid_counter) % 1000] if _is_root() else None
        base = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir()) / "tracegym-sandbox"
        base.mkdir(parents=True, exist_ok=True)
        if self._uid is not None:
            _check_reachable(base)
        _sweep_stale(base)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base))
        self._mounted = False
        if self._uid is not None:
            os.chown(self.workdir, self._uid, self._uid)
            self._mounted = _mount_tmpfs(self.workdir, self.limits.disk_mb, self._uid)
        self.workdir.chmod(0o700)
        self._lock = threading.Lock()
        self._closed = False
        self._sessions: list[ShellSession] = []
        if files:
            self.write_files(files)

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
        """Empty the work dir (killing every process of the sandbox first) and write ``files``."""
        self.kill_all()
        for entry in list(self.workdir.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if files:
            self.write_files(files)

    def list_files(self, read_limit: int = 65_536) -> list[FileEntry]:
        """Every entry under the work dir, never following a link (a link to ``/etc/shadow`` is
        reported as a link, not read). File contents up to ``read_limit`` bytes are included."""
        entries: list[FileEntry] = []
        for path, dirs, files in os.walk(self.workdir, followlinks=False):
            for name in sorted(dirs) + sorted(files):
                full = os.path.join(path, name)
                rel = os.path.relpath(full, self.workdir).replace(os.sep, "/")
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                mode = st.st_mode & 0o7777
                if os.path.islink(full):
                    entries.append(FileEntry(rel, "symlink", mode, st.st_size, target=os.readlink(full)))
                elif os.path.isdir(full):
                    entries.append(FileEntry(rel, "dir", mode, st.st_size))
                elif os.path.isfile(full):
                    content = None
                    if st.st_size <= read_limit:
                        try:
                            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                            with os.fdopen(fd, "rb") as src:
                                content = src.read(read_limit + 1)[:read_limit]
                        except OSError:
                            content = None
                    entries.append(FileEntry(rel, "file", mode, st.st_size, content=content))
                else:
                    entries.append(FileEntry(rel, "other", mode, st.st_size))
        return sorted(entries, key=lambda e: e.path)

    # -- running --

    def _command(self, argv: Sequence[str], seccomp_fd: int | None) -> list[str]:
        nproc = self.limits.nproc
        if self._uid is None:  # RLIMIT_NPROC counts all of this user's processes
            nproc += _count_processes_of(os.getuid())
        prefix = _rlimit_prefix(self.limits, nproc)
        if self.isolation == "bwrap":
            return [*prefix, "bwrap", *_bwrap_flags(str(self.workdir), self.limits, seccomp_fd), "--", *argv]
        return [*prefix, *argv]

    def _popen(self, argv: Sequence[str], merge_stderr: bool) -> subprocess.Popen:
        if self._closed:
            raise RuntimeError("sandbox is closed")
        seccomp_fd = None
        pass_fds: tuple[int, ...] = ()
        if self._seccomp is not None:
            read_end, write_end = os.pipe()
            os.write(write_end, self._seccomp)  # ~300 bytes: fits the pipe buffer
            os.close(write_end)
            seccomp_fd, pass_fds = read_end, (read_end,)
        env = dict(_CLEAN_ENV, HOME=str(self.workdir) if self.isolation == "unsafe_local" else SANDBOX_WORKDIR)
        identity = {"user": self._uid, "group": self._uid, "extra_groups": []} if self._uid is not None else {}
        try:
            # Started from one long-lived thread: bwrap's --die-with-parent (PR_SET_PDEATHSIG) fires
            # when the *thread* that forked it exits, and tool calls run in short-lived threads, which
            # would take a persistent shell down with them after every call.
            return _spawner().submit(
                subprocess.Popen, self._command(argv, seccomp_fd),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                cwd=self.workdir, env=env, start_new_session=True, pass_fds=pass_fds, close_fds=True, **identity,
            ).result()
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)

    def run(self, argv: Sequence[str], stdin: bytes | str = b"", wall_s: float | None = None) -> SandboxResult:
        """Run ``argv`` (cwd: the work dir) to completion or to a limit. ``stdin`` is sent and
        closed (a read past it sees EOF). Everything the command started is gone when this
        returns: bwrap tears down the pid namespace; as root the sandbox uid's processes are killed."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        limit = wall_s if wall_s is not None else self.limits.wall_s
        with self._lock:
            started = time.monotonic()
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
            stdout, out_cut = out.text()
            stderr, err_cut = err.text()
            return SandboxResult(
                returncode=self._status(proc.returncode), stdout=stdout, stderr=stderr, timed_out=timed_out,
                killed=state["killed"], stdout_truncated=out_cut, stderr_truncated=err_cut,
                wall_s=time.monotonic() - started,
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
        while True:
            remaining = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(0.0, min(remaining, 0.25)))
                return False
            except subprocess.TimeoutExpired:
                pass
            if not self._mounted and state["killed"] is None and _disk_usage(str(self.workdir)) > self.limits.disk_mb * 2**20:
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
        namespace it owns) and, as root, every process of the sandbox's uid."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.kill_all()

    def kill_all(self) -> None:
        """Kill every process the sandbox left (root: all processes of its uid; otherwise its
        shell sessions' process groups; in bwrap mode the pid namespace already took them)."""
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
        """Kill everything the sandbox started and remove its work dir (idempotent)."""
        if self._closed:
            return
        for session in self._sessions:
            session.close()
        self.kill_all()
        self._closed = True
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.workdir)], check=False, stderr=subprocess.DEVNULL)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


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


def _mount_tmpfs(path: Path, size_mb: int, uid: int) -> bool:
    """As root: make ``path`` a tmpfs of ``size_mb`` owned by ``uid`` (the disk quota). False
    when mounting is not allowed (a container without CAP_SYS_ADMIN): the watchdog then holds it."""
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,uid={uid},gid={uid},mode=0700,nosuid,nodev",
         "tracegym-sandbox", str(path)],
        capture_output=True, check=False,
    )
    return done.returncode == 0


def _uid_range(pid: int) -> range:
    """The sandbox uids a host process of this pid hands out (as root)."""
    first = _SANDBOX_UID_BASE + (pid % 100_000) * 1000
    return range(first, first + 1000)


def _sweep_stale(base: Path) -> None:
    """Clean up after host processes that died without closing their sandboxes: kill what still
    runs under their sandbox uids (a host killed while bwrap was starting, before bwrap armed its
    parent-death signal) and remove their work dirs (``<pid>-...``)."""
    for entry in base.iterdir():
        pid = entry.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or Path(f"/proc/{pid}").exists():
            continue
        if _is_root():
            uids = _uid_range(int(pid))
            for proc in os.scandir("/proc"):
                try:
                    if proc.name.isdigit() and proc.stat().st_uid in uids:
                        os.kill(int(proc.name), signal.SIGKILL)
                except OSError:
                    continue
        if os.path.ismount(entry):
            subprocess.run(["umount", "-l", str(entry)], check=False, stderr=subprocess.DEVNULL)
        shutil.rmtree(entry, ignore_errors=True)


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


class ShellSession:
    """A bash process kept alive inside the sandbox between commands: the current directory,
    variables, files and background processes persist, like a terminal.

    Each :meth:`run` sends the command base64-encoded to ``eval`` (so no quoting or syntax error
    in it can swallow what follows), with stdin from /dev/null (a command never reads the session's
    own input) and stderr merged into stdout, then waits for an end marker carrying a fresh random
    nonce and the exit status. A command that runs past the wall limit, prints past the output cap
    or exits the shell takes the session down (every process in it is killed); the next command
    starts a new shell in the same work dir."""

    def __init__(self, sandbox: Sandbox, wall_s: float | None = None) -> None:
        self.sandbox = sandbox
        self.wall_s = wall_s if wall_s is not None else sandbox.limits.wall_s
        self._proc: subprocess.Popen | None = None
        self._buffer = bytearray()
        self._cond = threading.Condition()
        self._eof = False
        self.restarts = 0

    def _start(self) -> None:
        self._proc = self.sandbox._popen(["bash", "--noprofile", "--norc"], merge_stderr=True)
        self._buffer = bytearray()
        self._eof = False
        threading.Thread(target=self._pump, args=(self._proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        stream = proc.stdout
        try:
            while chunk := stream.read1(65536):
                with self._cond:
                    if proc is self._proc:
                        self._buffer += chunk
                        self._cond.notify_all()
        except (OSError, ValueError):
            pass
        with self._cond:
            if proc is self._proc:
                self._eof = True
                self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def run(self, command: str, wall_s: float | None = None) -> SandboxResult:
        """Run one shell command in the session; ``stdout`` holds its output (stderr merged)."""
        limits = self.sandbox.limits
        limit = wall_s if wall_s is not None else self.wall_s
        with self.sandbox._lock:
            if not self.alive:
                if self._proc is not None:
                    self.restarts += 1
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            nonce = secrets.token_hex(16)
            marker = f"__tracegym_end_{nonce}__".encode()
            encoded = base64.b64encode(command.encode()).decode()
            script = (
                f"__tg_cmd=$(printf %s {encoded} | base64 -d); eval \"$__tg_cmd\" </dev/null 2>&1; "
                f"printf '\\n{marker.decode()} %d\\n' $?\n"
            )
            started = time.monotonic()
            try:
                self._proc.stdin.write(script.encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            killed: str | None = None
            status: int | None = None
            output = b""
            with self._cond:
                while True:
                    at = self._buffer.find(marker)
                    if at >= 0:
                        end = self._buffer.find(b"\n", at)
                        if end >= 0:
                            output = bytes(self._buffer[:at])
                            status = int(self._buffer[at + len(marker):end].strip() or b"0")
                            del self._buffer[: end + 1]
                            break
                    if self._eof:
                        killed, output = "shell_exited", bytes(self._buffer)
                        break
                    if len(self._buffer) > limits.kill_output:
                        killed, output = "output_limit", bytes(self._buffer)
                        break
                    remaining = started + limit - time.monotonic()
                    if remaining <= 0:
                        killed, output = "wall_time", bytes(self._buffer)
                        break
                    if not self.sandbox._mounted and _disk_usage(str(self.sandbox.workdir)) > limits.disk_mb * 2**20:
                        killed, output = "disk_limit", bytes(self._buffer)
                        break
                    self._cond.wait(timeout=min(remaining, 0.25))
            if killed is not None:
                self._stop()
                status = self._proc.returncode if self._proc is not None else None
            if output.endswith(b"\n"):
                output = output[:-1]  # the newline the marker line starts with
            text = output[: limits.max_output].decode(errors="replace")
            return SandboxResult(
                returncode=status, stdout=text, timed_out=killed == "wall_time", killed=killed,
                stdout_truncated=len(output) > limits.max_output, wall_s=time.monotonic() - started,
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

    def close(self) -> None:
        """End the session, killing every process it started."""
        self._stop()
        self._proc = None
