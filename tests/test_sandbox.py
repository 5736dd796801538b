"""The sandbox escape suite: every case is blocked or contained, the host is unaffected, and the
work dir is gone afterwards.

Needs bubblewrap. Without it the bwrap cases skip with the reason, except under CI (``CI`` set),
where .ci/run installs bubblewrap and a skip would hide a broken sandbox, so they fail instead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tracegym.envs import sandbox as sandbox_module
from tracegym.envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, bwrap_unavailable_reason

REASON = bwrap_unavailable_reason()
needs_bwrap = pytest.mark.skipif(
    REASON is not None and not os.environ.get("CI"),
    reason=f"SANDBOX ESCAPE SUITE NOT RUN: {REASON} (apt-get install bubblewrap; CI fails instead of skipping)",
)

SECRET = "sk-tracegym-test-secret-5f3a9c"


def _python(code: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(code)]


def _processes_with(marker: str, argv0: bool = False) -> list[int]:
    """Host pids whose command line contains ``marker`` (``argv0``: whose program name is it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (cmdline.split(" ", 1)[0] == marker) if argv0 else (marker in cmdline):
            found.append(int(entry))
    return found


def _wait_gone(marker: str, seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def sb(base):
    box = Sandbox(SandboxLimits(wall_s=10, cpu_s=5, mem_mb=256, nproc=32, fsize_mb=4, nofile=32, disk_mb=8,
                                max_output=4096, kill_output=1_000_000), base_dir=base)
    yield box
    workdir = box.workdir
    box.close()
    assert not workdir.exists(), "the work dir must be removed when the sandbox closes"


# --- fail closed ------------------------------------------------------------------------------------


def test_refuses_without_bubblewrap_unless_unsafe_local(monkeypatch, base):
    monkeypatch.setattr(sandbox_module, "bwrap_unavailable_reason", lambda: "bubblewrap is not installed")
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed.*unsafe_local"):
        Sandbox(base_dir=base)
    with pytest.warns(RuntimeWarning, match="WITHOUT isolation"):
        monkeypatch.setattr(sandbox_module, "_warned_unsafe", False)
        with Sandbox(isolation="unsafe_local", base_dir=base, files={"a.py": "print(6 * 7)"}) as box:
            result = box.run(["python3", "a.py"])
    assert result.ok and result.stdout.strip() == "42"


def test_unsafe_local_still_clears_the_environment_and_limits_time(monkeypatch, base):
    monkeypatch.setenv("TRACEGYM_TEST_API_KEY", SECRET)
    monkeypatch.setattr(sandbox_module, "_warned_unsafe", True)
    with Sandbox(SandboxLimits(wall_s=1.5), isolation="unsafe_local", base_dir=base) as box:
        shown = box.run(["env"])
        slept = box.run(["sleep", "30"])
    assert SECRET not in shown.stdout and "TRACEGYM_TEST_API_KEY" not in shown.stdout
    assert slept.killed == "wall_time" and slept.wall_s < 5


def test_bad_limits_and_paths_are_named():
    with pytest.raises(ValueError, match="wall_s must be > 0"):
        SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="isolation must be"):
        Sandbox(isolation="docker")  # type: ignore[arg-type]


# --- the escape suite ---------------------------------------------------------------------------------


@needs_bwrap
def test_benign_code_runs_and_sees_only_its_work_dir(sb):
    sb.write_files({"main.py": "import os; print(sorted(os.listdir('.')), os.getcwd())", "data/in.txt": "x"})
    result = sb.run(["python3", "main.py"])
    assert result.ok, result
    assert result.stdout.strip() == "['data', 'main.py'] /work"


@needs_bwrap
def test_writes_outside_the_work_dir_fail_and_the_host_is_untouched(sb, tmp_path):
    canary = Path("/tmp") / f"tracegym-escape-canary-{os.getpid()}"
    result = sb.run(_python(f"""
        import os
        for path in ["/evil", "/usr/evil", "/etc/evil", "/work/../evil", "/proc/evil", "{canary}", "/root/evil"]:
            try:
                open(path, "w").write("x")
                print("WROTE", path, os.path.exists(path))
            except OSError as exc:
                print("blocked", path, type(exc).__name__)
    """))
    assert result.returncode == 0, result
    # /tmp is the sandbox's private tmpfs: a write there is allowed but never reaches the host's /tmp.
    escaped = [line for line in result.stdout.splitlines() if line.startswith("WROTE") and str(canary) not in line]
    assert escaped == [], escaped
    assert not canary.exists() and not Path("/evil").exists() and not Path("/usr/evil").exists()


@needs_bwrap
def test_secrets_of_the_host_are_not_visible(sb, monkeypatch):
    monkeypatch.setenv("TRACEGYM_TEST_API_KEY", SECRET)
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    result = sb.run(["bash", "-c",
                     "env; cat /proc/1/environ; cat /proc/*/environ; ls -a ~ /root /home; cat ~/.ssh/id_rsa; "
                     "cat /etc/shadow /etc/passwd; echo done"])
    everything = result.stdout + result.stderr
    assert "done" in result.stdout
    assert SECRET not in everything and "API_KEY" not in everything
    assert "root:" not in everything  # no /etc at all


@needs_bwrap
def test_symlink_and_dotdot_traversal_stay_inside(sb, tmp_path):
    host_file = tmp_path / "host-secret.txt"
    host_file.write_text(SECRET)
    result = sb.run(["bash", "-c",
                     f"ln -s {host_file} leak; cat leak; ln -s /proc/1/root/.. up; ls up; cat ../../{host_file}; echo done"])
    assert "done" in result.stdout and SECRET not in result.stdout + result.stderr
    # The host never follows a link the sandbox left: listing reports it, writing through it is refused.
    entries = {e.path: e for e in sb.list_files()}
    assert entries["leak"].kind == "symlink" and entries["leak"].content is None
    with pytest.raises(OSError):
        sb.write_files({"leak": "overwritten"})
    assert host_file.read_text() == SECRET
    with pytest.raises(ValueError, match="inside the work dir"):
        sb.write_files({"../escape.txt": "x"})


@needs_bwrap
def test_a_server_on_the_host_loopback_is_unreachable(sb):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted: list[object] = []
    server.settimeout(3)
    waiter = threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True)
    waiter.start()
    try:
        result = sb.run(_python(f"""
            import socket
            for host in ["127.0.0.1", "10.0.2.2", "8.8.8.8"]:
                s = socket.socket(); s.settimeout(1)
                print(host, s.connect_ex((host, {port})))
        """))
    finally:
        waiter.join(4)
        server.close()
    assert result.returncode == 0, result
    assert all(line.split()[1] != "0" for line in result.stdout.splitlines()), result.stdout
    assert accepted == [None], "the sandbox reached the host's listener"


def _accept(server: socket.socket) -> object:
    try:
        conn, _ = server.accept()
        conn.close()
        return "connected"
    except OSError:
        return None


@needs_bwrap
def test_fork_bomb_is_contained_and_leaves_nothing(sb):
    marker = f"forkbomb{os.getpid()}"
    started = time.monotonic()
    result = sb.run(["bash", "-c", f"bomb() {{ bomb | bomb & }}; bomb; sleep 2; echo {marker}"], wall_s=6)
    assert time.monotonic() - started < 15
    assert result.killed in (None, "wall_time")
    assert _wait_gone(marker) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


@needs_bwrap
def test_memory_bomb_hits_the_address_space_limit(sb):
    result = sb.run(_python("""
        blocks = []
        try:
            while True:
                blocks.append(bytearray(64 * 1024 * 1024))
        except MemoryError:
            print("MemoryError after", len(blocks) * 64, "MB")
    """))
    assert "MemoryError after" in result.stdout, result
    assert int(result.stdout.split()[2]) <= 256


@needs_bwrap
def test_cpu_loop_is_stopped_by_the_cpu_limit(base):
    with Sandbox(SandboxLimits(cpu_s=1, wall_s=20), base_dir=base) as box:
        started = time.monotonic()
        result = box.run(_python("while True: pass"))
    assert result.returncode == -signal.SIGXCPU, result
    assert result.describe() == "killed by SIGXCPU (CPU time limit)"
    assert time.monotonic() - started < 10


@needs_bwrap
def test_sleep_forever_is_killed_at_the_wall_limit_with_its_whole_group(sb):
    marker = f"sleeper{os.getpid()}"
    result = sb.run(["bash", "-c", f"(exec -a {marker} sleep 1000) & (exec -a {marker} sleep 1000)"], wall_s=1.5)
    assert result.timed_out and result.killed == "wall_time"
    assert 1.4 < result.wall_s < 5
    assert result.describe().startswith("killed: the command ran past")
    assert _wait_gone(marker) == []


@needs_bwrap
def test_disk_fill_stops_at_the_quota(sb):
    result = sb.run(_python("""
        import os
        written = 0
        try:
            for i in range(10_000):
                with open(f"fill{i}", "wb") as out:
                    for _ in range(4):
                        out.write(b"x" * 1024 * 1024)
                        written += 1
        except OSError as exc:
            print("stopped", type(exc).__name__, written)
    """))
    usage = sum(e.size for e in sb.list_files(read_limit=0) if e.kind == "file")
    assert usage <= 8 * 2**20 + 4 * 2**20, usage  # the quota, plus at most one file in flight
    assert "stopped" in result.stdout or result.killed == "disk_limit" or result.returncode != 0, result


@needs_bwrap
def test_single_file_size_is_limited(sb):
    result = sb.run(_python("""
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            open("big", "wb").write(b"x" * 6 * 1024 * 1024)
        except OSError as exc:
            print("blocked", exc.errno)
    """))
    assert "blocked 27" in result.stdout, result  # EFBIG


@needs_bwrap
def test_fd_exhaustion_is_contained(sb):
    result = sb.run(_python("""
        files = []
        try:
            while True:
                files.append(open("/dev/null"))
        except OSError as exc:
            print("stopped at", len(files), exc.errno)
    """))
    assert "stopped at" in result.stdout and int(result.stdout.split()[2]) < 32, result


@needs_bwrap
def test_100_mb_of_stdout_is_cut_and_the_run_killed_early(sb):
    started = time.monotonic()
    result = sb.run(["bash", "-c", "head -c 100000000 /dev/zero | tr '\\0' 'x'"])
    assert result.killed == "output_limit" and result.stdout_truncated
    assert len(result.stdout) == 4096
    assert time.monotonic() - started < 10


@needs_bwrap
def test_stdin_reads_see_end_of_file(sb):
    result = sb.run(_python("import sys; data = sys.stdin.read(); print(repr(data))"), stdin=b"hello")
    assert result.stdout.strip() == "'hello'"
    result = sb.run(["cat"])
    assert result.ok and result.stdout == ""


@needs_bwrap
def test_an_orphan_does_not_outlive_the_run(sb):
    marker = f"orphan{os.getpid()}"
    result = sb.run(["bash", "-c", f"setsid bash -c '(exec -a {marker} sleep 1000) & disown' & sleep 0.3; echo parent-exits"])
    assert "parent-exits" in result.stdout
    assert _wait_gone(marker) == []


@needs_bwrap
def test_killing_the_sandbox_init_ends_the_run(sb):
    result = sb.run(["bash", "-c", "kill -9 1; kill -9 $PPID; sleep 5; echo survived"], wall_s=8)
    assert "survived" not in result.stdout or result.wall_s < 8


@needs_bwrap
def test_ptrace_mount_unshare_and_privileges_are_denied(sb):
    result = sb.run(_python("""
        import ctypes, os, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        child = subprocess.Popen(["sleep", "5"])
        print("ptrace", libc.ptrace(16, child.pid, 0, 0), ctypes.get_errno())   # PTRACE_ATTACH
        child.kill()
        print("unshare", libc.unshare(0x10000000), ctypes.get_errno())           # CLONE_NEWUSER
        print("mount", libc.mount(b"none", b"/tmp", b"tmpfs", 0, None), ctypes.get_errno())
        status = open("/proc/self/status").read()
        print("caps", [l.split()[1] for l in status.splitlines() if l.startswith("CapEff")][0])
        print("nnp", [l.split()[1] for l in status.splitlines() if l.startswith("NoNewPrivs")][0])
        print("uid", os.getuid())
    """))
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["ptrace"].startswith("-1"), result
    assert lines["unshare"].startswith("-1") and lines["mount"].startswith("-1")
    assert lines["caps"] == "0000000000000000" and lines["nnp"] == "1"
    assert lines["uid"] != "0"
    shell = sb.run(["bash", "-c", "unshare -r id -u; echo rc=$?"])
    assert "rc=0" not in shell.stdout


@needs_bwrap
def test_host_process_killed_takes_its_sandboxes_with_it(base):
    marker = f"parentdies{os.getpid()}"
    script = textwrap.dedent(f"""
        import sys
        from tracegym.envs.sandbox import Sandbox, SandboxLimits
        box = Sandbox(SandboxLimits(wall_s=60), base_dir={str(base)!r})
        print("ready", flush=True)
        box.run(["bash", "-c", "exec -a {marker} sleep 1000"])
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 10
    while not _processes_with(marker, argv0=True) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker, argv0=True), "the sandboxed command did not start"
    parent.kill()
    parent.wait()
    left = _wait_gone(marker)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:300] for pid in left]
    # The next sandbox sweeps the dead process's work dir.
    Sandbox(base_dir=base).close()
    assert list(base.iterdir()) == []


@needs_bwrap
def test_shell_session_survives_the_thread_that_started_it(sb):
    # Tool calls run in short-lived threads; the shell must outlive each of them.
    shell = sb.shell()
    results: list = []
    for command in ("cd /tmp && export SEEN=yes", "echo $SEEN $(pwd)"):
        worker = threading.Thread(target=lambda c=command: results.append(shell.run(c)))
        worker.start()
        worker.join()
    assert results[-1].stdout.split() == ["yes", "/tmp"] and shell.restarts == 0


@needs_bwrap
def test_awk_works_and_etc_holds_only_alternatives(sb):
    result = sb.run(["bash", "-c", "echo 3 4 | awk '{print $1 * $2}'; ls /etc"])
    assert result.stdout.split() == ["12", "alternatives"], result


@needs_bwrap
def test_shell_session_persists_and_recovers_from_a_hang(sb):
    shell = sb.shell()
    assert shell.run("mkdir -p a/b && cd a/b && export COLOR=teal").ok
    result = shell.run("pwd; echo $COLOR")
    assert result.stdout.split() == ["/work/a/b", "teal"]
    hung = shell.run("sleep 100", wall_s=1)
    assert hung.killed == "wall_time" and "time limit" in hung.describe()
    after = shell.run("pwd; ls /work/a")
    assert after.stdout.split() == ["/work", "b"] and shell.restarts == 1
    # A command cannot read the session's own input, and a spoofed end marker is just text.
    spoof = shell.run("cat; echo __tracegym_end_0000__ 0; echo real")
    assert spoof.ok and spoof.stdout.splitlines()[-1] == "real"
    # A syntax error is the command's error, not the session's.
    broken = shell.run("echo 'unterminated")
    assert broken.returncode == 2 and "unexpected EOF" in broken.stdout
    assert shell.run("exit 7").killed == "shell_exited"
    assert shell.run("echo again").stdout == "again\n"


@needs_bwrap
def test_disk_watchdog_holds_the_quota_where_no_tmpfs_can_be_mounted(monkeypatch, base):
    # A normal user (or a container without CAP_SYS_ADMIN) gets no tmpfs: the watchdog must hold.
    monkeypatch.setattr(sandbox_module, "_mount_tmpfs", lambda *args: False)
    fill = "for i in $(seq 2000); do head -c 1000000 /dev/zero > f$i; done; sleep 30"
    with Sandbox(SandboxLimits(disk_mb=4, fsize_mb=2, wall_s=20), base_dir=base) as box:
        assert not box._mounted
        result = box.run(["bash", "-c", fill])
        assert result.killed == "disk_limit" and result.wall_s < 10, result
        box.reset_files()
        shell = box.shell()
        in_shell = shell.run(fill)
        assert in_shell.killed == "disk_limit" and in_shell.wall_s < 10, in_shell
