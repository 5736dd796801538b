"""ToolEnv robustness: a sync tool that never returns cannot starve other episodes or keep the
process alive, and a huge tool output is cut to a bounded, marked size that is counted."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from tracegym.envs import Task, ToolEnv, tool
from tracegym.envs.episode import run_episode
from tracegym.types import Message, StepResult, ToolCall, Trajectory

# Set at the end of a test so the stuck threads of that test finish instead of idling forever.
_release = threading.Event()


class Hangs(ToolEnv):
    name = "hangs"
    default_max_turns = 3

    def tasks(self, split: str = "train", n: int = 1, seed: int = 0) -> list[Task]:
        return [Task(id=f"{split}-{i}", split=split) for i in range(n)]

    async def reset(self, task: Task) -> list[Message]:
        return [Message(role="user", content="go")]

    @tool(timeout=0.3)
    def stuck(self) -> str:
        """Blocks its thread (until the test releases it: 'forever' as far as the episode knows)."""
        _release.wait(60)
        return "too late"

    @tool(timeout=1.5)
    def quick(self, x: int) -> int:
        """A healthy blocking tool."""
        time.sleep(0.01)
        return x + 1

    @tool
    def huge(self, n: int) -> str:
        """Returns n characters."""
        return "h" * (n // 2) + "t" * (n - n // 2)

    @tool
    def huge_async_error(self, n: int) -> str:
        """Raises with a huge message."""
        raise ValueError("e" * n)

    def score_answer(self, answer: str) -> float:
        return 1.0

    def expert_action(self) -> Message:
        return Message(role="assistant", content="<answer>1</answer>")


def _call(name: str, **arguments: object) -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name=name, arguments=arguments, id="c"),))


def test_hanging_sync_tools_do_not_starve_healthy_episodes() -> None:
    """40 episodes stuck in a blocking tool (more than any default thread pool) and 20 healthy ones
    started right after them: every healthy call answers, none reports a timeout."""

    async def play(name: str, **arguments: object) -> StepResult:
        env = Hangs()
        await env.reset(env.tasks()[0])
        return await env.step(_call(name, **arguments))

    async def go() -> tuple[list[StepResult], list[StepResult]]:
        stuck = [asyncio.create_task(play("stuck")) for _ in range(40)]
        await asyncio.sleep(0.05)  # the stuck calls hold their threads first
        healthy = await asyncio.gather(*(play("quick", x=i) for i in range(20)))
        return list(await asyncio.gather(*stuck)), list(healthy)

    _release.clear()
    started = time.perf_counter()
    try:
        stuck, healthy = asyncio.run(go())
    finally:
        _release.set()
    assert time.perf_counter() - started < 4.0
    assert [r.messages[0].content for r in healthy] == [str(i + 1) for i in range(20)]
    assert all(r.info["tool_timeouts"] == 0 and r.info["tool_errors"] == 0 for r in healthy)
    assert all(r.messages[0].content == "Error: tool 'stuck' timed out after 0.3 s." for r in stuck)
    assert all(r.info["tool_timeouts"] == 1 for r in stuck)


def test_a_process_with_a_tool_that_never_returns_exits(tmp_path: Path) -> None:
    """The episode times the call out and the process ends right after, result written, instead of
    waiting forever for the stuck worker thread (as asyncio.run's executor shutdown would)."""
    script = tmp_path / "hang.py"
    out = tmp_path / "result.txt"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, time
            from tracegym.envs import Task, ToolEnv, tool
            from tracegym.types import Message, ToolCall

            class Forever(ToolEnv):
                def tasks(self, split="train", n=1, seed=0):
                    return [Task(id="t", split=split)]

                async def reset(self, task):
                    return [Message(role="user", content="go")]

                @tool(timeout=0.5)
                def sleepy(self) -> str:
                    \"\"\"Never returns.\"\"\"
                    time.sleep(10**6)
                    return "never"

                def score_answer(self, answer):
                    return 1.0

                def expert_action(self):
                    return Message(role="assistant", content="<answer>1</answer>")

            async def main():
                env = Forever()
                await env.reset(env.tasks()[0])
                call = ToolCall(name="sleepy", arguments={{}}, id="c")
                result = await env.step(Message(role="assistant", tool_calls=(call,)))
                return result.messages[0].content

            content = asyncio.run(main())
            open({str(out)!r}, "w").write(content)
            print("RESULT", content, flush=True)
            """
        )
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=20)
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    assert "RESULT Error: tool 'sleepy' timed out after 0.5 s." in done.stdout
    assert out.read_text() == "Error: tool 'sleepy' timed out after 0.5 s."
    assert elapsed < 5.0, f"the process lingered {elapsed:.1f} s after a 0.5 s tool timeout"


def test_a_huge_tool_output_is_cut_with_a_marker_and_counted() -> None:
    async def go(env: Hangs, message: Message) -> StepResult:
        await env.reset(env.tasks()[0])
        return await env.step(message)

    env = Hangs(max_tool_output_chars=1000)
    size = 10_000_000
    result = asyncio.run(go(env, _call("huge", n=size)))
    (reply,) = result.messages
    marker = f"\n...[truncated {size - 1000:,} characters]...\n"
    assert marker in reply.content
    assert len(reply.content) == 1000 + len(marker)
    head, tail = reply.content.split(marker)
    assert head and set(head) == {"h"} and tail and set(tail) == {"t"}  # the start and the end are kept
    assert result.info["tool_output_truncated"] == 1
    assert result.info["tool_errors"] == 0

    # The default limit applies without any option; an exception's huge text is cut the same way.
    default = Hangs()
    assert default.max_tool_output_chars == 16_000
    result = asyncio.run(go(default, _call("huge_async_error", n=size)))
    (reply,) = result.messages
    assert reply.content.startswith("Error: tool 'huge_async_error' failed: ValueError: eee")
    assert "characters]...\n" in reply.content and len(reply.content) < 16_100
    assert result.info["tool_output_truncated"] == 1 and result.info["tool_errors"] == 1

    # Short outputs are untouched and not counted; 0 means no limit.
    result = asyncio.run(go(Hangs(max_tool_output_chars=1000), _call("huge", n=1000)))
    assert result.messages[0].content == "h" * 500 + "t" * 500 and result.info["tool_output_truncated"] == 0
    result = asyncio.run(go(Hangs(max_tool_output_chars=0), _call("huge", n=100_000)))
    assert len(result.messages[0].content) == 100_000 and result.info["tool_output_truncated"] == 0


def test_the_truncation_count_reaches_the_trajectory_metrics() -> None:
    env = Hangs(max_tool_output_chars=100)
    calls = iter([_call("huge", n=5000), _call("huge", n=50), _call("huge", n=700)])
    result = asyncio.run(run_episode(env, env.tasks()[0], lambda: next(calls), max_turns=3))
    # run_episode returns the Trajectory (older versions: a result with .to_trajectory)
    trajectory = result if isinstance(result, Trajectory) else result.to_trajectory("hangs")
    cut = [len(f"\n...[truncated {n:,} characters]...\n") for n in (4900, 600)]
    assert [len(m.content) for m in trajectory.messages if m.role == "tool"] == [100 + cut[0], 50, 100 + cut[1]]
    assert trajectory.metrics["tool_output_truncated"] == 2.0
    assert all(len(m.content) < 200 for m in trajectory.messages)
