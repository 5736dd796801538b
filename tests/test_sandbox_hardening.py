"""The sandbox hardening of issue 29, class by class: socket families, limits per sandbox rather
than per process (memory, /dev/shm and every tmpfs, a CPU budget per episode, with and without
cgroups), uids never reused while in use, a host-side checker that hostile trees cannot crash or
stall, and what the sandbox can see of the host (its command line, the shell's end markers).

They join the escape suite of tests/test_sandbox.py. Needs bubblewrap (and root with cgroups for
the cgroup cases, which skip with the reason otherwise); under CI (``CI`` set) the bwrap cases fail
instead of skipping, as there.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from tracegym.envs import cgroups, hostfs
from tracegym.envs import sandbox as sandbox_module
from tracegym.envs.hostfs import TreeLimitError, TreeLimits
from tracegym.envs.sandbox import Sandbox, SandboxLimits, bwrap_unavailable_reason, seccomp_available

REASON = bwrap_unavailable_reason()
needs_bwrap = pytest.mark.skipif(
    REASON is not None and not os.environ.get("CI"),
    reason=f"SANDBOX ESCAPE SUITE NOT RUN: {REASON} (apt-get install bubblewrap; CI fails instead of skipping)",
)
needs_seccomp = pytest.mark.skipif(
    not seccomp_available() and not os.environ.get("CI"), reason="pyseccomp/libseccomp not installed")
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="sandbox uids are per sandbox only when the host runs as root")


def _cgroup_features() -> tuple[str, ...]:
    return cgroups.cgroup_support().features


def needs_cgroup(*features: str):
    missing = [f for f in features if f not in _cgroup_features()]
    return pytest.mark.skipif(
        bool(missing), reason=f"cgroup feature(s) {missing} not available here: {cgroups.cgroup_support().describe()}")


def _python(code: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(code)]


SMALL = dict(wall_s=10, cpu_s=5, mem_mb=256, nproc=32, fsize_mb=4, nofile=32, disk_mb=8, max_output=8192,
             kill_output=1_000_000)


@pytest.fixture
def sb(base):
    box = Sandbox(SandboxLimits(**SMALL), base_dir=base)
    yield box
    box.close()


# --- 1. socket families -----------------------------------------------------------------------------

SOCKET_PROBE = """
    import ctypes, errno, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    SYS_socket, SYS_socketpair = 41, 53   # x86_64
    def call(number, family, kind):
        ctypes.set_errno(0)
        if number == SYS_socketpair:
            pair = (ctypes.c_int * 2)()
            rc = libc.syscall(ctypes.c_long(number), ctypes.c_long(family), ctypes.c_long(kind), ctypes.c_long(0), pair)
        else:
            rc = libc.syscall(ctypes.c_long(number), ctypes.c_long(family), ctypes.c_long(kind), ctypes.c_long(0))
        return "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    for arg in sys.argv[1:]:
        name, number, family, kind = arg.split(":")
        print(name, call(int(number), int(family, 0), int(kind)))
"""

# name: (syscall, family, socket type, expected). AF_INET/AF_INET6 are allowed (the network
# namespace is empty); SOCK_DGRAM is used where the family has no SOCK_STREAM.
DENIED_FAMILIES = {
    "AF_UNSPEC": 0, "AF_AX25": 3, "AF_IPX": 4, "AF_APPLETALK": 5, "AF_X25": 9, "AF_KEY": 15, "AF_NETLINK": 16,
    "AF_PACKET": 17, "AF_RDS": 21, "AF_CAN": 29, "AF_TIPC": 30, "AF_BLUETOOTH": 31, "AF_ALG": 38, "AF_VSOCK": 40,
    "AF_QIPCRTR": 42, "AF_XDP": 44, "AF_MAX_AND_BEYOND": 46,
    # 1 (AF_UNIX) in the low 32 bits, the kernel's view; the filter compares all 64 and refuses it.
    "AF_UNIX_WITH_HIGH_BITS": 0x1_0000_0001,
}


@pytest.fixture(scope="module")
def socket_results():
    if REASON is not None:
        pytest.skip(REASON)
    # vsock has only stream sockets (a datagram one would fail with ENODEV whatever the filter said).
    probes = [f"{name}:41:{family:#x}:{1 if name == 'AF_VSOCK' else 2}" for name, family in DENIED_FAMILIES.items()]
    probes += ["AF_UNIX:41:1:1", "AF_INET:41:2:1", "AF_INET6:41:10:1", "AF_INET_DGRAM:41:2:2",
               "PAIR_UNIX:53:1:1", "PAIR_INET:53:2:1", "PAIR_NETLINK:53:16:2", "PAIR_VSOCK:53:40:1"]
    folder = Path(tempfile.mkdtemp(prefix="tracegym-sandbox-test-"))
    folder.chmod(0o755)
    try:
        with Sandbox(SandboxLimits(**SMALL), base_dir=folder) as box:
            result = box.run([*_python(SOCKET_PROBE), *probes])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert result.returncode == 0, result
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


@needs_bwrap
@needs_seccomp
@pytest.mark.parametrize("family", sorted(DENIED_FAMILIES))
def test_socket_family_is_refused_with_eperm(socket_results, family):
    assert socket_results[family] == "EPERM", socket_results


@needs_bwrap
@needs_seccomp
def test_unix_and_inet_sockets_still_work_and_socketpair_is_unix_only(socket_results):
    for family in ("AF_UNIX", "AF_INET", "AF_INET6", "AF_INET_DGRAM", "PAIR_UNIX"):
        assert socket_results[family] == "ok", (family, socket_results)
    for family in ("PAIR_INET", "PAIR_NETLINK", "PAIR_VSOCK"):
        assert socket_results[family] == "EPERM", (family, socket_results)


@needs_bwrap
@needs_seccomp
def test_vsock_port_bound_on_the_host_is_unreachable_and_python_sees_eperm(sb):
    # On a VM with vsock (this one's agent listens on it) the host's port space is shared unless refused.
    result = sb.run(_python("""
        import socket
        for family in ("AF_VSOCK", "AF_NETLINK", "AF_PACKET"):
            try:
                socket.socket(getattr(socket, family), socket.SOCK_DGRAM if family != "AF_VSOCK" else socket.SOCK_STREAM)
                print(family, "opened")
            except OSError as exc:
                print(family, exc.errno)
        s = socket.socket(socket.AF_INET); s.bind(("127.0.0.1", 0)); s.listen(); print("inet ok")
    """))
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines == {"AF_VSOCK": "1", "AF_NETLINK": "1", "AF_PACKET": "1", "inet": "ok"}, result


# --- 4. the host-side checker against hostile trees ---------------------------------------------------


def _chain(root: Path, depth: int, name: str = "d") -> None:
    """A directory chain ``depth`` levels deep, built through descriptors (no path is ever that long)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


@pytest.fixture
def tree():
    """An empty dir for a hostile tree, on a tmpfs where there is one (20,000 files cost no disk I/O)."""
    parent = Path(tempfile.mkdtemp(prefix="tracegym-tree-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    root = parent / "tree"
    root.mkdir()
    yield root
    hostfs.remove_tree(parent)


def _timed(fn):
    started = time.monotonic()
    try:
        return fn(), time.monotonic() - started
    except Exception as exc:  # the bound is part of what is measured
        return exc, time.monotonic() - started


def test_a_1500_deep_chain_fails_the_walk_by_name_and_is_removed(tree):
    _chain(tree, 1500)
    error, took = _timed(lambda: hostfs.list_tree(tree))
    assert isinstance(error, TreeLimitError) and error.reason == "the work dir is nested deeper than 32 levels"
    assert took < 1.0
    with pytest.raises(TreeLimitError, match="deeper"):
        hostfs.disk_usage(tree, 2**30)
    report, took = _timed(lambda: hostfs.remove_tree(tree, keep_root=True))
    assert report.complete and report.removed == 1500 and list(tree.iterdir()) == [] and took < 3.0, report


def test_20000_files_stop_at_the_entry_cap_quickly_and_are_removed(tree):
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(20_000):
            os.close(os.open(f"f{i}", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    error, took = _timed(lambda: hostfs.list_tree(tree, TreeLimits(max_entries=5_000)))
    assert isinstance(error, TreeLimitError) and error.reason == "the work dir holds more than 5,000 entries"
    assert took < 1.0
    report, took = _timed(lambda: hostfs.remove_tree(tree))
    assert report.complete and not tree.exists() and took < 5.0


def test_4000_hard_links_are_read_once(tree):
    import tracemalloc

    (tree / "data").write_bytes(os.urandom(256 * 1024))
    for i in range(4_000):
        os.link(tree / "data", tree / f"link{i}")
    tracemalloc.start()
    try:
        entries = hostfs.list_tree(tree, TreeLimits(read_limit=262_144, max_read_bytes=8 * 2**20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    contents = {id(e.content) for e in entries}
    assert len(entries) == 4_001 and len(contents) == 1  # one read, shared: 256 KB, not 1 GB
    assert peak < 16 * 2**20, peak


def test_sparse_files_stop_at_the_total_read_cap_and_count_no_disk(tree):
    import tracemalloc

    for i in range(200):  # 50 MB apparent, 0 bytes on disk
        with open(tree / f"sparse{i}", "wb") as out:
            out.truncate(256 * 1024)
    assert hostfs.disk_usage(tree, 2**30) < 2**20
    tracemalloc.start()
    try:
        error, took = _timed(lambda: hostfs.list_tree(tree, TreeLimits(read_limit=262_144, max_read_bytes=8 * 2**20)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(error, TreeLimitError) and "more than 8 MB of file contents" in error.reason
    assert peak < 16 * 2**20 and took < 1.0
    # Only the files a check names are read: the same tree passes when one file is asked for.
    entries = hostfs.list_tree(tree, TreeLimits(read_limit=262_144, max_read_bytes=8 * 2**20), read={"sparse7"}.__contains__)
    assert [e.path for e in entries if e.content is not None] == ["sparse7"]


def test_links_fifos_and_loops_are_listed_never_followed_or_blocked_on(tree):
    secret = tree.parent / "secret"
    secret.write_text("host secret")
    (tree / "up").symlink_to("..")
    (tree / "loop").symlink_to("loop")
    (tree / "leak").symlink_to(secret)
    os.mkfifo(tree / "fifo")
    (tree / "plain").write_text("x")
    entries, took = _timed(lambda: {e.path: e for e in hostfs.list_tree(tree)})
    assert took < 1.0
    assert {p: e.kind for p, e in entries.items()} == {"up": "symlink", "loop": "symlink", "leak": "symlink",
                                                       "fifo": "other", "plain": "file"}
    assert entries["leak"].content is None and entries["fifo"].content is None and entries["plain"].content == b"x"
    assert hostfs.remove_tree(tree).complete and secret.read_text() == "host secret" and not tree.exists()


def _sparse_member_tar_gz(claimed: int) -> bytes:
    """A gzip'd tar with one old-GNU sparse member ('S') claiming ``claimed`` bytes from a 512-byte map."""
    info = tarfile.TarInfo("big.txt")
    info.size = 512
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[156:157] = b"S"
    header[386:398] = b"%011o\0" % 0           # sparse map: one chunk at 0...
    header[398:410] = b"%011o\0" % 512         # ...of 512 bytes
    header[482:483] = b"\0"                    # not extended
    header[483:495] = b"%011o\0" % claimed if claimed < 8**11 else b"\x80" + claimed.to_bytes(11, "big")
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return gzip.compress(bytes(header) + b"x" * 512 + b"\0" * 1024)


def _pax_tar_gz(members: list[tuple[str, bytes, dict[str, str]]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data, pax in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.pax_headers = dict(pax)
            archive.addfile(info, io.BytesIO(data))
    return gzip.compress(buffer.getvalue())


@pytest.mark.parametrize("claimed", [2**30, 2**40], ids=["1GiB", "1TiB"])
def test_a_sparse_tar_member_is_refused_without_reading_it(claimed):
    import tracemalloc

    archive = _sparse_member_tar_gz(claimed)
    assert len(archive) < 200  # a few bytes claiming a gigabyte or a terabyte
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(archive))) as check:  # it is what it claims
        member = check.next()
        assert member is not None and member.issparse() and member.size == claimed
    tracemalloc.start()
    try:
        result, took = _timed(lambda: hostfs.read_tar_gz(archive))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result == "holds a sparse member" and took < 0.5 and peak < 8 * 2**20


def test_tar_members_that_claim_more_than_the_archive_or_are_too_many_are_refused():
    claims_a_terabyte = _pax_tar_gz([("a.txt", b"", {"size": str(2**40)})])
    assert hostfs.read_tar_gz(claims_a_terabyte) == "holds a member larger than the archive"
    sparse = {"GNU.sparse.realsize": str(2**40), "GNU.sparse.name": "b.txt"}
    pax_sparse_01 = _pax_tar_gz([("b.txt", b"x" * 10, {**sparse, "GNU.sparse.major": "0", "GNU.sparse.minor": "1",
                                                         "GNU.sparse.map": "0,10"})])
    pax_sparse_10 = _pax_tar_gz([("b.txt", b"1\n0\n10\n" + b"\0" * 505 + b"x" * 10,
                                  {**sparse, "GNU.sparse.major": "1", "GNU.sparse.minor": "0"})])
    assert hostfs.read_tar_gz(pax_sparse_01) == hostfs.read_tar_gz(pax_sparse_10) == "holds a sparse member"
    many = _pax_tar_gz([(f"f{i}", b"", {}) for i in range(1_500)])
    assert hostfs.read_tar_gz(many, max_members=1_000) == "holds more than 1,000 members"
    bomb = gzip.compress(b"\0" * 8_000_000)
    assert hostfs.read_tar_gz(bomb) == "decompresses to more than the checker reads"
    fine = _pax_tar_gz([("./dir/a.txt", b"alpha\n", {}), ("b.txt", b"beta\n", {})])
    assert hostfs.read_tar_gz(fine) == {"dir/a.txt": b"alpha\n", "b.txt": b"beta\n"}


def test_remove_tree_opens_directories_the_sandbox_locked(tree):
    # As a normal user a mode-000 directory cannot be entered; the removal gives it back u+rwx.
    _chain(tree, 40)
    locked = tree / "locked"
    (locked / "inner").mkdir(parents=True)
    (locked / "inner" / "f").write_text("x")
    (locked / "inner").chmod(0)
    locked.chmod(0)
    report = hostfs.remove_tree(tree)
    assert report.complete and not tree.exists(), report


# The terminal env's check on hostile work dirs the agent built: reward 0 with the bound's name,
# within a fixed time, with the event loop free meanwhile and the host's memory flat.

from tracegym.environments import terminal  # noqa: E402
from tracegym.environments.terminal import TerminalEnv  # noqa: E402
from tracegym.types import Message, ToolCall  # noqa: E402

_DONE = Message(role="assistant", content="<answer>done</answer>")


def _call(command: str, call_id: str = "c") -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name="run", arguments={"command": command}, id=call_id),))


def _py(code: str) -> str:
    import shlex
    return "python3 -c " + shlex.quote(textwrap.dedent(code))


def _archive_task(env: TerminalEnv):
    for task in env.tasks("train", 200, seed=3):
        if task.data["families"] == ["archive"]:
            return task, next(c["path"] for c in task.data["checks"] if c["kind"] == "tar_gz")
    raise AssertionError("no archive task")


def _hostile_command(kind: str, tar_path: str) -> tuple[str, str | None]:
    import base64
    if kind == "deep":
        return _py("import os\nfor _ in range(1500): os.mkdir('d'); os.chdir('d')"), "nested deeper than 32 levels"
    if kind == "wide":
        return _py("for i in range(6000): open(f'w{i}', 'w').close()"), "holds more than 5,000 entries"
    if kind == "links":  # 4,000 names of one 256 KB file: 1 GB if each were read
        return _py("import os\nopen('blob', 'wb').write(os.urandom(262144))\nfor i in range(4000): os.link('blob', f'l{i}')"), None
    encoded = base64.b64encode(_sparse_member_tar_gz(2**30)).decode()
    return _py(f"import base64, os\nos.makedirs(os.path.dirname({tar_path!r}) or '.', exist_ok=True)\n"
               f"open({tar_path!r}, 'wb').write(base64.b64decode({encoded!r}))"), "holds a sparse member"


@needs_bwrap
@pytest.mark.parametrize("kind", ["deep", "wide", "links", "sparse_tar"])
def test_terminal_check_survives_a_hostile_work_dir(kind, monkeypatch):
    import resource
    import threading

    # Which thread ran the check: asserted directly, not through event-loop latency, which a
    # loaded 2-core CI machine stretches past any fixed bound (0.67 s seen on a 0.5 s bound).
    check_threads: list[int] = []
    real_verify = terminal._verify

    def recording_verify(*args, **kwargs):
        check_threads.append(threading.get_ident())
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(terminal, "_verify", recording_verify)
    env = TerminalEnv(families="archive", chores=1)
    task, tar_path = _archive_task(env)
    command, reason = _hostile_command(kind, tar_path)

    async def go():
        await env.reset(task)
        built = await env.step(_call(command))
        assert "exit status 0" in built.messages[0].content, built.messages[0].content
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.monotonic()
        final = await env.step(_DONE)
        took = time.monotonic() - started
        grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
        return final, took, threading.get_ident(), grew_mb

    try:
        final, took, loop_thread, grew_mb = asyncio.run(go())
    finally:
        env.close()
    assert final.terminated and final.reward == 0.0
    failed = " | ".join(final.info["failed_checks"])
    if reason is not None:
        assert reason in failed, failed
    assert took < 5.0, took
    assert check_threads and loop_thread not in check_threads  # the check ran off the event loop
    assert grew_mb < 64, grew_mb


@needs_bwrap
def test_stateless_reset_after_a_deep_chain_still_works():
    env = TerminalEnv(stateless=True)
    task = env.tasks("train", 1)[0]

    async def go():
        await env.reset(task)
        await env.step(_call(_hostile_command("deep", "")[0]))
        after = await env.step(_call("ls -A | wc -l; echo ok"))
        return after.messages[0].content

    try:
        out = asyncio.run(go())
    finally:
        env.close()
    assert "ok" in out and "exit status 0" in out and "RecursionError" not in out, out


@needs_bwrap
def test_a_check_that_runs_past_its_limit_fails_cleanly_without_blocking(monkeypatch):
    monkeypatch.setattr(terminal, "_CHECK_TIMEOUT_S", 0.3)

    def slow(sandbox, checks):
        time.sleep(2.0)
        return []

    monkeypatch.setattr(terminal, "verify_sandbox", slow)
    env = TerminalEnv()
    task = env.tasks("train", 1)[0]

    async def go():
        await env.reset(task)
        started = time.monotonic()
        final = await env.step(_DONE)
        return final, time.monotonic() - started

    try:
        final, took = asyncio.run(go())
    finally:
        env.close()
    assert final.reward == 0.0 and took < 1.5
    assert "the check ran past its 0.3 s limit" in final.info["failed_checks"][0]


# --- 3. uids are never reused while in use ---------------------------------------------------------------

TEST_UID_BASE = 1_600_500_000  # outside the pool real sandboxes use


@pytest.fixture
def small_pool(monkeypatch, tmp_path):
    """A pool of 3 uids with its own lock file, so a handful of sandboxes wraps it."""
    pool = sandbox_module._UidPool(base=TEST_UID_BASE, size=3, lock_path=str(tmp_path / "uids.lock"))
    monkeypatch.setattr(sandbox_module, "_uid_pool", pool)
    return pool


@needs_bwrap
@needs_root
def test_a_wrapping_uid_pool_skips_the_uid_of_a_live_sandbox(small_pool, base):
    marker = f"keepalive{os.getpid()}"
    with Sandbox(SandboxLimits(**SMALL), base_dir=base) as first:
        shell = first.shell()
        assert shell.run(f"(exec -a {marker} sleep 300) & echo started").stdout.strip() == "started"
        seen = []
        for _ in range(8):  # wraps the 3-uid pool several times
            with Sandbox(SandboxLimits(**SMALL), base_dir=base) as other:
                seen.append(other._uid)
                # An ordinary "kill everything I own" in another episode...
                other.run(["bash", "-c", "kill -9 -1"])
        assert first._uid not in seen and len(set(seen)) == 2, (first._uid, seen)
        # ...leaves the first episode's shell and its job alone.
        after = shell.run("jobs -p | wc -l; echo alive")
        assert after.stdout.split() == ["1", "alive"] and shell.restarts == 0, after


@needs_root
def test_a_uid_another_host_process_holds_or_with_leftover_processes_is_skipped(small_pool, tmp_path):
    # Another host process (sharing the machine-wide lock file) holds uid index 0.
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, sys, time
            fd = os.open({small_pool.lock_path!r}, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            print("held", flush=True)
            time.sleep(30)
        """)], stdout=subprocess.PIPE, text=True)
    # A process left running under uid index 1 by a host killed mid-start: the host's lock went with
    # it, the byte saying "in use, not given back clean" stayed.
    leftover = subprocess.Popen(["sleep", "30"], user=TEST_UID_BASE + 1, group=TEST_UID_BASE + 1, extra_groups=[])
    state = os.open(small_pool.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(state, b"\1", 1)
    os.close(state)
    try:
        assert holder.stdout.readline().strip() == "held"
        small_pool._next = 0  # the walk starts at a random index; start at the held one
        assert small_pool.acquire() == TEST_UID_BASE + 2
        assert leftover.wait(timeout=5) == -signal.SIGKILL  # the leftover was killed, its uid not handed out
        # Now the leftover is gone, uid index 1 is free; index 0 stays taken while its holder lives.
        assert small_pool.acquire() == TEST_UID_BASE + 1
        with pytest.raises(sandbox_module.SandboxUnavailable, match="no free sandbox uid"):
            small_pool.acquire()
    finally:
        holder.kill()
        holder.wait()
        if leftover.poll() is None:
            leftover.kill()
    # The holder is gone: its uid is free again.
    for uid in list(small_pool._held):
        small_pool.release(uid)
    assert TEST_UID_BASE in {small_pool.acquire() for _ in range(3)}


# --- 2. limits per sandbox: /dev, every tmpfs, memory, CPU ------------------------------------------------


@needs_bwrap
def test_dev_is_minimal_and_read_only_and_shm_tmp_and_inodes_are_capped(base):
    limits = SandboxLimits(**{**SMALL, "fsize_mb": 32, "shm_mb": 4, "tmp_mb": 8, "max_files": 2_000})
    with Sandbox(limits, base_dir=base) as box:
        result = box.run(_python("""
            import os, multiprocessing
            print("dev", sorted(os.listdir("/dev")))
            for path in ("/dev/evil", "/dev/pts/evil"):
                try:
                    open(path, "w"); print(path, "written")
                except OSError as exc:
                    print(path, exc.errno)
            open("/dev/null", "w").write("fine"); print("null ok")
            multiprocessing.Lock(); print("semaphore ok")   # POSIX shm still works
            for folder, size in (("/dev/shm", 16), ("/tmp", 16)):
                written = 0
                try:
                    with open(f"{folder}/fill", "wb") as out:
                        for _ in range(size):
                            out.write(b"x" * 2**20); out.flush(); written += 1
                except OSError as exc:
                    print(folder, "stopped", written, exc.errno)
                os.unlink(f"{folder}/fill")
            made = 0
            try:
                for i in range(3_000):
                    open(f"f{i}", "w").close(); made += 1
            except OSError as exc:
                print("files stopped", made, exc.errno)
        """))
    lines = result.stdout.splitlines()
    out = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines}
    assert result.returncode == 0, result
    assert out["dev"] == str(sorted(["core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin",
                                     "stdout", "tty", "urandom", "zero"])), out["dev"]
    assert out["/dev/evil"] == "30" and out["/dev/pts/evil"] in ("13", "30")  # EROFS; devpts takes no files
    assert out["null"] == "ok" and out["semaphore"] == "ok"
    assert out["/dev/shm"].split()[:2] == ["stopped", "4"] and out["/dev/shm"].endswith(" 28")  # ENOSPC at 4 MB
    assert out["/tmp"].split()[:2] == ["stopped", "8"] and out["/tmp"].endswith(" 28")
    if IS_ROOT:  # the work dir's tmpfs has max_files inodes
        made = int(out["files"].split()[1])
        assert 1_900 <= made < 2_000 and out["files"].endswith(" 28"), out["files"]


HOLDER = """
import os, sys, time
size = int(sys.argv[1]) * 2**20
block = bytearray(size)
block[::4096] = b"x" * (size // 4096)     # touch every page: resident, not just reserved
print("holding", flush=True)
open(f"held.{os.getpid()}", "w").close()
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end and not os.path.exists("release"):   # the seconds, or until released
    time.sleep(0.02)
"""


def _hold_command(count: int, mb: int, seconds: float, shm_mb: int) -> str:
    """``count`` processes holding ``mb`` each for ``seconds``, after ``shm_mb`` written to /dev/shm
    (needs holder.py in the work dir)."""
    holders = " ".join(f"python3 holder.py {mb} {seconds} &" for _ in range(count))
    return f"head -c {shm_mb * 2**20} /dev/zero > /dev/shm/fill; {holders} wait; echo finished"


def _hold_at_once_command(count: int, mb: int, shm_mb: int) -> str:
    """``count`` holders of ``mb`` each started together after ``shm_mb`` written to /dev/shm, each
    holding until released. Once every one has either touched all its pages or died, prints
    ``at_once N settled M``: how many are alive and holding 0.3 s after that moment (a killed holder,
    reaped or a zombie, does not count; the pause lets a kill in flight land), then releases them. On a loaded machine the holders may
    run one after another, and the OOM killer may take one that already held to make room for
    the next, so how many ever printed "holding" says nothing about how many held together."""
    return textwrap.dedent(f"""\
        head -c {shm_mb * 2**20} /dev/zero > /dev/shm/fill
        pids=""
        for i in $(seq {count}); do python3 holder.py {mb} 60 & pids="$pids $!"; done
        settled=0; at_once=0; tries=0
        while [ $settled -lt {count} ] && [ $tries -lt 1000 ]; do
          sleep 0.02; tries=$((tries + 1)); settled=0; at_once=0
          for p in $pids; do
            state=Z; {{ read -r _ _ state _ < /proc/$p/stat; }} 2>/dev/null
            if [ "$state" = Z ]; then settled=$((settled + 1))
            elif [ -e held.$p ]; then settled=$((settled + 1)); at_once=$((at_once + 1)); fi
          done
        done
        # a holder the OOM killer has picked may not be a zombie yet at that poll: count again
        # once the kills in flight have landed (a live holder holds until released)
        sleep 0.3; at_once=0
        for p in $pids; do
          state=Z; {{ read -r _ _ state _ < /proc/$p/stat; }} 2>/dev/null
          if [ "$state" != Z ] && [ -e held.$p ]; then at_once=$((at_once + 1)); fi
        done
        echo "at_once $at_once settled $settled"
        touch release; wait; echo finished""")


@needs_bwrap
@needs_cgroup("memory")
def test_memory_is_limited_per_sandbox_not_per_process(base):
    # The case, scaled down: each process is under its own limit (mem_mb), together they
    # are not. 3 x 100 MB + 8 MB of shm against a sandbox limit of 192 MB.
    limits = SandboxLimits(**{**SMALL, "mem_mb": 160, "sandbox_mem_mb": 192, "shm_mb": 8, "fsize_mb": 16})
    with Sandbox(limits, base_dir=base, files={"holder.py": HOLDER}) as box:
        shell = box.shell()
        result = shell.run(_hold_at_once_command(3, 100, 8), wall_s=40)
        peak = box._cgroup.memory_peak()
        assert shell.run("echo alive").stdout == "alive\n"  # the episode goes on
    # (With a 400 MB limit all three hold at once and the peak is ~320 MB.)
    counts = result.stdout.split("at_once ", 1)[-1].split()
    assert result.ok and counts[1:3] == ["settled", "3"] and result.stdout.endswith("finished\n"), result
    # Two holders alone are 200 MB + 8 MB of shm, past the sandbox's 192 MB: never more than one at once.
    assert int(counts[0]) <= 1 and result.memory_kills >= 1 and "Killed" in result.stdout, result
    assert peak <= 192 * 2**20, peak >> 20
    assert "killed for the memory limit" in result.describe()


@needs_bwrap
def test_without_a_memory_cgroup_the_watchdog_kills_past_the_sandbox_limit(base):
    limits = SandboxLimits(**{**SMALL, "mem_mb": 160, "sandbox_mem_mb": 192})
    with Sandbox(limits, base_dir=base, cgroup=False, files={"holder.py": HOLDER}) as box:
        assert box.accounting == "watchdog"
        started = time.monotonic()
        result = box.run(["bash", "-c", _hold_command(3, 100, 4.0, 1)], wall_s=20)
    assert result.killed == "memory_limit", result
    assert time.monotonic() - started < 3.5  # killed by the watchdog, not the holders' own end
    assert result.describe() == "killed: the sandbox's processes used more memory than it allows"


BURNERS = "(while :; do timeout 0.3 sh -c 'while :; do :; done'; done) >/dev/null 2>&1 &"
# Children reaped automatically (SIGCHLD ignored): their time never reaches a parent's cutime.
AUTOREAP = _py("""
    import os, signal, time
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        if os.fork() == 0:
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                pass
            os._exit(0)
        time.sleep(0.31)
""") + " >/dev/null 2>&1 &"


def _budget_case(base, cgroup: bool, spawner: str, budget: float) -> tuple[Sandbox, float, float]:
    limits = SandboxLimits(**{**SMALL, "cpu_budget_s": budget})
    box = Sandbox(limits, base_dir=base, cgroup=cgroup)
    shell = box.shell()
    assert shell.run(f"{spawner} echo started").stdout.strip() == "started"
    # No command runs now: only the watchdog stands between the burners and the host's CPU.
    deadline = time.monotonic() + budget * 4 + 3
    while box._spent is None and time.monotonic() < deadline:
        time.sleep(0.05)
    used = box.cpu_seconds()
    after = shell.run("echo should-not-run")
    return box, used, after


@needs_bwrap
@needs_cgroup("cpu_usage")
def test_cpu_budget_per_episode_stops_burners_between_calls_with_a_cgroup(base):
    box, used, after = _budget_case(base, True, BURNERS, 1.0)
    try:
        assert box._spent == "cpu_budget" and 1.0 <= used < 1.8, used
        assert after.killed == "cpu_budget" and after.stdout == "" and after.wall_s < 0.5
        assert "CPU time budget" in after.describe()
        # SIGKILLed members leave cgroup.procs once the kernel has torn them down: on a loaded
        # 2-core machine (the full suite, two workers) that took longer than the check right after
        deadline = time.monotonic() + 2.0
        while box._cgroup.pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert box._cgroup.pids() == []
        time.sleep(0.5)
        assert box.cpu_seconds() - used < 0.05  # nothing runs any more
    finally:
        box.close()


@needs_bwrap
@pytest.mark.parametrize("spawner", [BURNERS, AUTOREAP], ids=["reaped", "auto_reaped"])
def test_cpu_budget_without_cgroups_is_held_by_the_process_tree_watchdog(base, spawner):
    box, used, after = _budget_case(base, False, spawner, 0.8)
    try:
        assert box.accounting == "watchdog"
        assert box._spent == "cpu_budget" and 0.8 <= used < 1.8, used
        assert after.killed == "cpu_budget"
        with box._procs_lock:
            assert not box._procs
    finally:
        box.close()


@needs_bwrap
@needs_cgroup("cpu_quota", "cpu_usage")
def test_cpu_rate_of_the_whole_sandbox_is_capped(base):
    limits = SandboxLimits(**{**SMALL, "cpu_cores": 0.25})
    with Sandbox(limits, base_dir=base) as box:
        result = box.run(["bash", "-c", "timeout 1 sh -c 'while :; do :; done' & timeout 1 sh -c 'while :; do :; done' & wait"])
    # Two busy processes for 1 s of wall time: 2 CPU s unlimited, 0.25 s at a quarter core.
    assert result.cpu_s is not None and result.cpu_s < 0.5, result


# --- 5. what the sandbox sees of the host ------------------------------------------------------------------


@needs_bwrap
def test_the_sandbox_sees_nothing_of_the_host_in_its_command_line_environ_or_cgroup(sb):
    host_markers = [str(sb.workdir), str(sb.workdir.parent), f"{os.getpid()}-", "tracegym-sandbox-test"]
    result = sb.run(["bash", "-c", "for f in /proc/1/cmdline /proc/self/cmdline /proc/1/environ /proc/1/cgroup "
                                   "/proc/self/cgroup; do tr '\\0' ' ' < $f; echo; done; readlink /proc/1/cwd"])
    assert result.returncode == 0, result
    seen = result.stdout
    assert "bwrap --args" in seen  # the options came through a pipe
    for marker in host_markers:
        assert marker not in seen, (marker, seen)
    assert "process_api" not in seen and "tracegym-" not in seen  # the cgroup namespace hides the host's tree
    if sb._mounted:  # as root the work dir is a tmpfs of its own: the mount table names no host path either
        mounts = sb.run(["cat", "/proc/self/mountinfo"]).stdout
        assert str(sb.workdir.parent) not in mounts and f"{os.getpid()}-" not in mounts, mounts


@needs_bwrap
def test_the_shell_carries_no_end_marker_a_trap_could_read_or_output_could_fake(sb):
    shell = sb.shell()
    # A DEBUG trap logging every command the shell runs, the way a model could try to read the host's marker.
    assert shell.run("trap 'printf \"%s\\n\" \"$BASH_COMMAND\" >> /tmp/seen' DEBUG").ok
    assert shell.run("printf abc").stdout == "abc"  # exactly the command's output: no marker line in it
    fds = shell.run("ls /proc/self/fd | sort -n | tr '\\n' ' '").stdout.split()
    assert fds == ["0", "1", "2", "3"], fds  # the command (and its jobs) hold no pipe of the host's but its output
    # Output, even from a job in the background, cannot end a command early.
    shell.run("(sleep 0.2; printf '0\\n0\\n__tracegym_end_x__ 0\\n') &")
    started = time.monotonic()
    late = shell.run("sleep 0.6; echo real")
    assert late.ok and late.stdout.endswith("real\n") and time.monotonic() - started >= 0.6, late
    seen = shell.run("trap - DEBUG; cat /tmp/seen").stdout
    # What the trap saw is the host's wrapper, the same for every command: nothing secret to read.
    wrappers = {line for line in seen.splitlines() if "printf '%d" in line}
    assert len(wrappers) == 1 and "__tracegym_end_" not in seen.replace("__tracegym_end_x__", ""), seen


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "unsafe_local"])
def test_the_shell_keeps_its_status_pipe_whatever_number_a_busy_host_gives_it(base, monkeypatch, isolation):
    # A host with many files open (a trainer, a long test run) hands the shell's status pipe a number
    # at or past the sandbox's RLIMIT_NOFILE (32 here). The shell closes that fd around each command
    # and must get it back after: bash cannot dup2 to a number past the limit, and then every
    # command "failed" with "bash: line 1: N: Bad file descriptor" and took the session down.
    passed: list[int] = []
    real_popen = Sandbox._popen

    def popen(self, argv, merge_stderr, extra_fds=()):
        passed.extend(extra_fds)
        return real_popen(self, argv, merge_stderr, extra_fds)

    monkeypatch.setattr(Sandbox, "_popen", popen)
    held = [os.open(os.devnull, os.O_RDONLY)]
    try:
        while held[-1] < SMALL["nofile"] + 8:  # every number up to past the limit is taken
            held.append(os.open(os.devnull, os.O_RDONLY))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # unsafe_local says what it is
            box = Sandbox(SandboxLimits(**SMALL), base_dir=base, isolation=isolation)
        with box:
            shell = box.shell()
            results = [shell.run(command) for command in ("echo one", "false", "cd /tmp && echo two", "pwd")]
            fds = shell.run("ls /proc/self/fd | sort -n | tr '\\n' ' '").stdout.split()
    finally:
        for fd in held:
            os.close(fd)
    assert passed and min(passed) >= SMALL["nofile"], passed  # the case: the pipe's number is past the limit
    assert [(r.returncode, r.stdout, r.killed) for r in results] == [
        (0, "one\n", None), (1, "", None), (0, "two\n", None), (0, "/tmp\n", None)], results
    assert shell.restarts == 0
    assert fds == ["0", "1", "2", "3"], fds  # still nothing of the host's in a command but its output


# --- the cgroup layer on a pure v2 machine (a fake cgroupfs: this machine and CI are hybrid) -------------


def test_pure_v2_puts_sandboxes_where_controllers_are_passed_down_and_writes_v2_limits(tmp_path, monkeypatch):
    proc_self, mount = tmp_path / "proc_self", tmp_path / "cgroup"
    proc_self.mkdir()
    (proc_self / "mountinfo").write_text(f"30 1 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    (proc_self / "cgroup").write_text("0::/system.slice/trainer.service\n")
    own = mount / "system.slice" / "trainer.service"
    own.mkdir(parents=True)
    files = {
        mount / "cgroup.subtree_control": "cpu memory pids",
        mount / "system.slice" / "cgroup.controllers": "cpu memory pids io",
        mount / "system.slice" / "cgroup.subtree_control": "memory pids cpu",  # passes them to its children
        mount / "system.slice" / "cgroup.procs": "",
        own / "cgroup.controllers": "cpu memory pids", own / "cgroup.subtree_control": "", own / "cgroup.procs": "1234",
    }
    base = mount / "system.slice" / f"tracegym-{os.getpid()}"
    base.mkdir()
    files.update({base / "cgroup.controllers": "cpu memory pids", base / "cgroup.subtree_control": "",
                  base / "cgroup.procs": "", base / "cgroup.kill": ""})
    for path, text in files.items():
        path.write_text(text)

    def write(path, value):  # a fake cgroupfs: control files come into being when written
        with open(path, "a" if path.name == "cgroup.subtree_control" else "w") as out:
            out.write(value + (" " if path.name == "cgroup.subtree_control" else ""))

    monkeypatch.setattr(cgroups, "_PROC_SELF", proc_self)
    monkeypatch.setattr(cgroups, "_write", write)
    monkeypatch.setattr(cgroups, "_rmdir_when_empty", lambda directory, timeout_s: True)
    monkeypatch.setattr(cgroups.atexit, "register", lambda *args: None)
    cgroups.cgroup_support.cache_clear()
    try:
        support = cgroups.cgroup_support()
        # The own cgroup holds processes and can pass nothing down; its parent passes all three.
        assert support.describe() == "memory v2, pids v2, cpu_quota v2, cpu_usage v2, kill v2"
        assert {h.base for h in support.providers.values()} == {base}
        assert sorted((base / "cgroup.subtree_control").read_text().split()) == ["+cpu", "+memory", "+pids"]
        box = cgroups.SandboxCgroup(support, 300 * 2**20, 80, 0.25)
        folder = next(iter(box.dirs.values()))
        assert folder.parent == base and len(box.dirs) == 1
        assert (folder / "memory.max").read_text() == str(300 * 2**20)
        assert (folder / "pids.max").read_text() == "80"
        assert (folder / "cpu.max").read_text() == "25000 100000"
        box.attach(4321)
        assert (folder / "cgroup.procs").read_text() == "4321"
        (folder / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
        (folder / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
        assert box.cpu_seconds() == 1.5 and box.oom_kills() == 1
        box.kill()
        assert (folder / "cgroup.kill").read_text() == "1"
    finally:
        cgroups.cgroup_support.cache_clear()


@needs_bwrap
def test_cgroups_can_be_turned_off_and_then_the_watchdog_holds(monkeypatch, base):
    monkeypatch.setenv("TRACEGYM_SANDBOX_CGROUPS", "off")
    cgroups.cgroup_support.cache_clear()
    try:
        support = cgroups.cgroup_support()
        assert support.providers == {} and "TRACEGYM_SANDBOX_CGROUPS" in support.describe()
        with Sandbox(SandboxLimits(**SMALL), base_dir=base) as box:
            assert box.accounting == "watchdog" and box._cgroup is None
            result = box.run(["bash", "-c", "echo hi"])
            assert result.ok and result.stdout == "hi\n" and result.cpu_s is None
    finally:
        cgroups.cgroup_support.cache_clear()
