"""The terminal env: generated chores, host-side verification of the final work dir, persistent vs
stateless shells, timeouts, bounded output, cleanup, fail-closed isolation, and the expert's solve
rate with check_env in both modes."""

from __future__ import annotations

import asyncio
import collections
import gzip
import io
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tracegym.environments import terminal
from tracegym.environments.terminal import FAMILIES, TerminalEnv, score, verify_work_dir
from tracegym.envs.base import SnapshotUnsupported, Task
from tracegym.envs.check import check_env
from tracegym.envs.episode import run_episodes
from tracegym.envs.sandbox import FileEntry, SandboxUnavailable, bwrap_unavailable_reason
from tracegym.types import Message, StepResult, ToolCall

# On CI (CI=true) a missing bubblewrap fails these tests instead of skipping them.
needs_bwrap = pytest.mark.skipif(
    bwrap_unavailable_reason() is not None and not os.environ.get("CI"),
    reason=f"bubblewrap cannot isolate here: {bwrap_unavailable_reason()}",
)
unsafe_ok = pytest.mark.filterwarnings("ignore:sandbox isolation 'unsafe_local'")


def _call(command: str, call_id: str = "c") -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name="run", arguments={"command": command}, id=call_id),))


_DONE = Message(role="assistant", content="<answer>done</answer>")


def _task(env: TerminalEnv, families: list[str], index: int = 0) -> Task:
    """The ``index``-th train task whose chores are exactly ``families`` (in order)."""
    found = [t for t in env.tasks("train", 200, seed=7) if t.data["families"] == families]
    return found[index]


async def _play(env: TerminalEnv, task: Task, commands: list[str]) -> tuple[list[str], StepResult]:
    """Run ``commands`` one per turn, then answer; (tool outputs, final step)."""
    await env.reset(task)
    outputs = []
    for i, command in enumerate(commands):
        step = await env.step(_call(command, f"c{i}"))
        assert not step.terminated and not step.truncated
        outputs.append(step.messages[0].content)
    return outputs, await env.step(_DONE)


# --- generation, options, verification (no sandbox needed) -------------------------------------------


def test_splits_are_seeded_disjoint_and_cover_every_family() -> None:
    env = TerminalEnv(isolation="unsafe_local")  # no episode runs: tasks only
    train = env.tasks("train", 300, seed=0)
    test = env.tasks("test", 100, seed=0)
    assert [t.model_dump() for t in TerminalEnv(isolation="unsafe_local").tasks("train", 300, seed=0)] == [t.model_dump() for t in train]
    assert [t.id for t in env.tasks("train", 300, seed=1)] != [t.id for t in train]
    assert {t.id for t in train}.isdisjoint({t.id for t in test})
    assert {t.data["prompt"] for t in train}.isdisjoint({t.data["prompt"] for t in test})
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    assert len({t.data["prompt"] for t in train}) == 300
    seen = collections.Counter(f for t in train for f in t.data["families"])
    assert set(seen) == set(FAMILIES) and len(FAMILIES) >= 10
    assert {len(t.data["families"]) for t in train} == {1, 2}
    # Chores of one task never share a family when there are enough families.
    assert all(len(set(t.data["families"])) == len(t.data["families"]) for t in train)


@unsafe_ok
def test_options() -> None:
    env = TerminalEnv(isolation="unsafe_local", chores="2..3", families="count,concat")
    assert (env.min_chores, env.max_chores, env.max_turns, env.families) == (2, 3, 16, ("count", "concat"))
    tasks = env.tasks("train", 40)
    assert {len(t.data["families"]) for t in tasks} == {2, 3}
    assert {f for t in tasks for f in t.data["families"]} == {"count", "concat"}
    assert TerminalEnv(isolation="unsafe_local", chores=[1, 1], max_turns=3).max_turns == 3
    for bad in (
        {"chores": 0}, {"chores": "x"}, {"chores": (3, 1)}, {"chores": True}, {"chores": 6},
        {"families": ["nope"]}, {"families": []}, {"reward": "most"}, {"isolation": "docker"},
        {"wall_s": 0}, {"wall_s": 1000}, {"test_fraction": 1.0}, {"mem_mb": 0}, {"cpu_budget_s": 0},
    ):
        with pytest.raises(ValueError):
            TerminalEnv(**{"isolation": "unsafe_local", **bad})
    # The stateless reference is the same steps joined into one command.
    steps = tasks[0].data["steps"]
    stateless = TerminalEnv(isolation="unsafe_local", chores="2..3", families="count,concat", stateless=True)
    assert stateless.tasks("train", 1)[0].data["reference_calls"] == [{"name": "run", "arguments": {"command": " && ".join(steps)}}]
    assert len(tasks[0].data["reference_calls"]) == len(steps) >= 2


def test_example_task_is_stable() -> None:
    # Golden: the generator defines the dataset; a change here changes every split.
    task = TerminalEnv(isolation="unsafe_local").tasks("test", 1, seed=0)[0]
    assert task.id == "term-32dd278c179d" and task.data["families"] == ["move_by_ext", "make_dirs"]
    assert task.data["prompt"].startswith("Do these chores:\n1. Move every .txt file in bemi/ into a new directory guvibe/")
    assert task.data["steps"] == [
        "mkdir -p guvibe", "mv bemi/*.txt guvibe/",
        "mkdir -p dabinu/bobelo dabinu/neka/tetova", "touch dabinu/neka/tetova/.keep",
    ]


def _entry(path: str, content: bytes | None = None, kind: str = "file", mode: int = 0o644, target: str | None = None) -> FileEntry:
    return FileEntry(path, kind, mode, len(content or b""), content=content, target=target)  # type: ignore[arg-type]


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_verification_reads_no_links_and_bounds_archives() -> None:
    checks: list[dict[str, Any]] = [
        {"kind": "file", "path": "a.txt", "text": "x\n"},
        {"kind": "dir", "path": "d"},
        {"kind": "mode", "path": "s.sh", "mode": 0o100, "mask": 0o100},
        {"kind": "number", "path": "n.txt", "value": 12},
        {"kind": "absent", "path": "gone"},
        {"kind": "tar_gz", "path": "p.tar.gz", "members": {"p/a.txt": "hi\n"}},
    ]
    good = [
        _entry("a.txt", b"x"), _entry("d", kind="dir", mode=0o755), _entry("s.sh", b"#!", mode=0o755),
        _entry("n.txt", b"12\n"), _entry("p.tar.gz", _tar_gz({"./p/a.txt": b"hi\n"})),
    ]
    assert [o.passed for o in verify_work_dir(good, checks)] == [True] * 6
    # Links never count as the file or directory they point to; wrong modes, numbers, archives fail.
    bad = [
        _entry("a.txt", kind="symlink", target="/etc/passwd"), _entry("d", kind="symlink", target="/tmp"),
        _entry("s.sh", b"#!", mode=0o644), _entry("n.txt", b"12 n.txt\n"), _entry("gone", b""),
        _entry("p.tar.gz", gzip.compress(b"\0" * (terminal._MAX_TAR_BYTES + 1))),
    ]
    outcomes = verify_work_dir(bad, checks)
    assert [o.passed for o in outcomes] == [False] * 6
    assert "symlink" in outcomes[0].detail and "symlink" in outcomes[1].detail
    assert "more than the checker reads" in outcomes[5].detail
    assert not verify_work_dir([_entry("p.tar.gz", b"plain text")], checks[5:])[0].passed
    assert not verify_work_dir([_entry("p.tar.gz", _tar_gz({"p/a.txt": b"other\n"}))], checks[5:])[0].passed


def test_score_all_fraction_and_guards() -> None:
    checks = [{"kind": "absent", "path": "x"}, {"kind": "absent", "path": "y"}, {"kind": "file", "path": "k", "text": "", "guard": True}]
    outcome = terminal.CheckOutcome
    half = [outcome(True, ""), outcome(False, ""), outcome(True, "")]
    assert score(checks, half, "all") == 0.0 and score(checks, half, "fraction") == 0.5
    wiped = [outcome(True, ""), outcome(True, ""), outcome(False, "")]  # goals met by deleting everything
    assert score(checks, wiped, "fraction") == 0.0
    assert score(checks, [outcome(True, "")] * 3, "all") == 1.0


def test_fails_closed_without_bubblewrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(terminal, "bwrap_unavailable_reason", lambda: "bubblewrap is not installed (test)")
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap is not installed \(test\).*unsafe_local"):
        TerminalEnv()
    with pytest.raises(SandboxUnavailable):
        TerminalEnv(stateless=True, isolation="bwrap")


@unsafe_ok
def test_unsafe_local_runs_unisolated(monkeypatch: pytest.MonkeyPatch) -> None:
    # Even where bubblewrap is missing, unsafe_local is an explicit opt-in that works.
    monkeypatch.setattr(terminal, "bwrap_unavailable_reason", lambda: "bubblewrap is not installed (test)")
    env = TerminalEnv(isolation="unsafe_local")
    task = env.tasks("test", 3, seed=0)[2]

    async def go() -> tuple[str, str, StepResult]:
        await env.reset(task)
        assert env.sandbox is not None
        workdir = str(env.sandbox.workdir)
        where = (await env.step(_call("pwd"))).messages[0].content
        while True:
            step = await env.step(env.expert_action())
            if step.terminated or step.truncated:
                return workdir, where, step

    workdir, where, final = asyncio.run(go())
    assert where == f"{workdir}\n[exit status 0]"  # the host path: no private mount namespace
    assert final.terminated and final.reward == 1.0 and final.info["success"] == 1
    assert not Path(workdir).exists()


# --- episodes in the sandbox ----------------------------------------------------------------------------


@needs_bwrap
def test_expert_solves_60_test_tasks_persistent() -> None:
    tasks = TerminalEnv().tasks("test", 60, seed=0)
    results = asyncio.run(run_episodes(lambda: TerminalEnv(), tasks, lambda e: e.expert_action, concurrency=8))
    solved = sum(r.success for r in results)
    assert solved >= 57, [(r.end_reason, r.error, r.metrics) for r in results if not r.success][:3]
    assert {f for t in tasks for f in t.data["families"]} == set(FAMILIES)
    for task, result in zip(tasks[:20], results[:20]):
        made = [{"name": c.name, "arguments": c.arguments} for m in result.messages if m.role == "assistant" for c in m.tool_calls]
        assert made == task.data["reference_calls"] and len(made) == len(task.data["steps"])
        assert result.metrics["checks_passed"] == result.metrics["checks_total"] == len(task.data["checks"])


@needs_bwrap
def test_expert_solves_60_test_tasks_stateless() -> None:
    tasks = TerminalEnv(stateless=True).tasks("test", 60, seed=0)
    results = asyncio.run(run_episodes(lambda: TerminalEnv(stateless=True), tasks, lambda e: e.expert_action, concurrency=8))
    assert sum(r.success for r in results) >= 57
    # One joined command, then the answer.
    assert all(sum(m.role == "assistant" for m in r.messages) == 2 for r in results)


@needs_bwrap
@pytest.mark.parametrize("stateless", [False, True])
def test_check_env_passes(stateless: bool) -> None:
    report = check_env(lambda: TerminalEnv(stateless=stateless), n_tasks=10)
    assert report.ok and report.expert_success_rate == 1.0
    assert "branching" in report.skipped and "live shell" in report.skipped["branching"]


@needs_bwrap
def test_cannot_branch() -> None:
    env = TerminalEnv()
    assert not env.can_branch
    with pytest.raises(SnapshotUnsupported, match="live shell session"):
        env.snapshot()


_PROBE = ["mkdir -p sub; cd sub; GREETING=hello; sleep 300 & echo started > made.txt", "pwd; echo \"[$GREETING]\"; jobs -r | wc -l; ls"]


@needs_bwrap
def test_persistent_shell_keeps_cwd_variables_and_background_jobs() -> None:
    env = TerminalEnv()
    task = env.tasks("train", 1)[0]
    outputs, final = asyncio.run(_play(env, task, _PROBE))
    assert outputs[1] == "/work/sub\n[hello]\n1\nmade.txt\n[exit status 0]"
    assert final.info["shell_restarts"] == 0


@needs_bwrap
def test_stateless_calls_start_from_the_initial_files() -> None:
    env = TerminalEnv(stateless=True)
    task = env.tasks("train", 1)[0]
    first_file = next(iter(task.data["files"]))
    outputs, final = asyncio.run(_play(env, task, [*_PROBE, f"rm {first_file}; ls sub", f"cat {first_file}"]))
    assert outputs[1].startswith("/work\n[]\n0\n")  # no cd, no variable, no job, no sub/made.txt
    assert "sub" not in outputs[1].splitlines()
    assert "No such file" in outputs[2]
    assert outputs[3] == task.data["files"][first_file] + "[exit status 0]"  # the deleted file is back
    assert final.reward == 0.0  # the last call did nothing towards the goal


@needs_bwrap
def test_wrong_final_state_scores_zero_and_partial_credit_is_partial() -> None:
    def half_done(reward: str) -> StepResult:
        env = TerminalEnv(reward=reward, families=["count", "concat", "sort_lines"], chores=2)
        task = _task(env, ["count", "concat"])
        first_chore_steps = task.data["steps"][:1]  # count is one command: the concat is left undone
        return asyncio.run(_play(env, task, first_chore_steps))[1]

    strict, partial = half_done("all"), half_done("fraction")
    assert strict.terminated and strict.reward == 0.0 and strict.info["success"] == 0
    assert 0.0 < partial.reward < 1.0 and partial.info["success"] == 0
    assert partial.info["checks_passed"] < partial.info["checks_total"] and partial.info["failed_checks"]


@needs_bwrap
def test_wiping_the_work_dir_earns_no_partial_credit() -> None:
    env = TerminalEnv(reward="fraction", families=["delete_ext"], chores=1)
    task = env.tasks("train", 1)[0]
    _, final = asyncio.run(_play(env, task, ["rm -rf ./*"]))
    assert final.reward == 0.0  # every .ext file is gone, but so are the files to keep


@needs_bwrap
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_doing_nothing_earns_nothing(family: str) -> None:
    env = TerminalEnv(reward="fraction", families=[family], chores=1)
    task = env.tasks("train", 1)[0]
    _, final = asyncio.run(_play(env, task, ["ls -R"]))
    assert final.reward == 0.0 and final.info["checks_passed"] < final.info["checks_total"]


@needs_bwrap
def test_symlink_to_a_host_file_with_the_right_content_earns_nothing(tmp_path: Path) -> None:
    env = TerminalEnv(families=["write_file"], chores=1)
    task = env.tasks("train", 1)[0]
    (goal,) = task.data["checks"]
    host_file = tmp_path / "expected.txt"
    host_file.write_text(goal["text"])  # what a verifier following links would read
    folder = goal["path"].rsplit("/", 1)[0]
    commands = [f"mkdir -p {folder} && ln -s {host_file} {goal['path']}", f"ln -s /etc/passwd {folder}/passwd && ls -l {folder}"]
    outputs, final = asyncio.run(_play(env, task, commands))
    assert f"-> {host_file}" in outputs[1]
    assert final.reward == 0.0 and "symlink" in final.info["failed_checks"][0]
    assert host_file.read_text() == goal["text"]


@needs_bwrap
def test_timeout_restarts_the_shell_and_the_episode_goes_on() -> None:
    env = TerminalEnv(wall_s=1.5)
    task = env.tasks("train", 1)[0]
    commands = ["cd /tmp; X=1", "sleep 60", "pwd; echo \"[$X]\"", *task.data["steps"]]
    outputs, final = asyncio.run(_play(env, task, commands))
    assert "time limit" in outputs[1] and "a new one starts at the next command" in outputs[1]
    assert outputs[2] == "/work\n[]\n[exit status 0]"  # a fresh shell, in the work dir, variables gone
    assert final.reward == 1.0  # the files survived and the work could finish
    assert final.info["command_timeouts"] == 1 and final.info["shell_restarts"] == 1

    stateless = TerminalEnv(wall_s=1.5, stateless=True)
    outputs, final = asyncio.run(_play(stateless, task, ["sleep 60", "echo ok"]))
    assert "time limit" in outputs[0] and outputs[1] == "ok\n[exit status 0]"
    assert final.info["command_timeouts"] == 1 and final.info["shell_restarts"] == 0


@needs_bwrap
@pytest.mark.parametrize("stateless", [False, True])
def test_output_is_bounded_and_keeps_the_status(stateless: bool) -> None:
    env = TerminalEnv(stateless=stateless)
    task = env.tasks("train", 1)[0]
    outputs, final = asyncio.run(_play(env, task, ["seq 1 5000", "seq 1 200000", "ls nope; echo after; false"]))
    # Head and tail of the output around a marker, the status line intact.
    assert len(outputs[0]) < env.max_tool_output_chars + 100 and "truncated" in outputs[0]
    assert outputs[0].startswith("1\n2\n3\n") and outputs[0].endswith("4999\n5000\n[exit status 0]")
    # Past what the sandbox keeps (64 kB), the rest is dropped, and the agent is told.
    assert len(outputs[1]) < env.max_tool_output_chars + 100 and outputs[1].endswith("[more output was dropped]\n[exit status 0]")
    assert "No such file or directory" in outputs[2] and outputs[2].endswith("after\n[exit status 1]")
    assert final.info["tool_output_truncated"] == 2


def _sandbox_processes(sandbox) -> list[int]:
    """Host pids of a sandbox's processes: the commands it started and everything under them (its
    bwrap's command line no longer names the host work dir, so it is found by ancestry)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                stat = (entry / "stat").read_bytes()
                parents[int(entry.name)] = int(stat[stat.rfind(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found = [p.pid for p in sandbox._procs if p.pid in parents]
    for pid in found:  # grows while walked: breadth first
        found.extend(child for child, parent in parents.items() if parent == pid and child not in found)
    return found


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        if state[state.rfind(b")") + 2:][:1] != b"Z":
            alive.append(pid)
    return alive


@needs_bwrap
def test_work_dir_and_processes_are_gone_after_the_episode() -> None:
    env = TerminalEnv()
    task = env.tasks("train", 2)[0]

    async def go() -> None:
        await env.reset(task)
        await env.step(_call("sleep 300 &"))
        assert env.sandbox is not None
        workdir = env.sandbox.workdir
        running = _sandbox_processes(env.sandbox)
        assert workdir.exists() and len(running) >= 3  # bwrap, the shell, the background job
        await env.step(_DONE)
        assert env.sandbox is None and not workdir.exists() and not _alive(running)
        # A new reset in the middle of an episode closes the old sandbox; so does close(), twice.
        await env.reset(task)
        workdir = env.sandbox.workdir
        await env.step(_call("echo x > f; sleep 300 &"))
        running = _sandbox_processes(env.sandbox)
        assert len(running) >= 3
        await env.reset(task)
        assert not workdir.exists() and not _alive(running)
        workdir = env.sandbox.workdir
        await env.step(_call("echo x > f"))
        env.close()
        env.close()
        assert not workdir.exists()

    asyncio.run(go())
