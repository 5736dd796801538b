"""MCP servers as tool providers (tracegym.envs.mcp), against real FastMCP stdio servers.

The servers are small scripts written to a temporary folder and run with this interpreter. Checked:
schema mapping (``$ref`` inlined, ``server__tool`` on collisions), results, ``isError``, argument
validation before the call, per-call timeouts, the ``shared`` / ``per_episode`` scopes, explicit
server environments, ``MCPToolEnv`` behaving like a ``ToolEnv``, the example env (``check_env`` and
an expert rollout), and no child process left after ``close()`` (pids collected from /proc while
open, none killed by name).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracegym.envs import Task, check_env
from tracegym.envs.check import schema_problems
from tracegym.envs.mcp import (
    MCPArgumentError,
    MCPServerConfig,
    MCPServerError,
    MCPTimeoutError,
    MCPToolEnv,
    MCPToolProvider,
    MCPUnknownToolError,
    close_shared_providers,
    shared_provider,
)
from tracegym.types import Message, StepResult, ToolCall

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[1]

SERVER_A = '''
import asyncio, os, time
from pydantic import BaseModel
from mcp.server.fastmcp import FastMCP

mcp = FastMCP("a", log_level="WARNING")
COUNT = 0

class Item(BaseModel):
    name: str
    qty: int

@mcp.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

@mcp.tool()
def boom() -> str:
    """Always fails."""
    raise ValueError("kaboom")

@mcp.tool()
def incr() -> int:
    """Count calls (server state)."""
    global COUNT
    COUNT += 1
    return COUNT

@mcp.tool()
async def hang(seconds: float = 3600.0) -> str:
    """Sleep without blocking the server."""
    await asyncio.sleep(seconds)
    return "woke"

@mcp.tool()
def block() -> str:
    """Block the server's only thread."""
    time.sleep(3600)
    return "never"

@mcp.tool()
def getenv(name: str) -> str:
    """An environment variable of the server."""
    return os.environ.get(name, "<unset>")

@mcp.tool()
def big(n: int) -> str:
    """n characters."""
    return "x" * n

@mcp.tool()
def place(item: Item, note: str = "") -> str:
    """Place an order."""
    return f"{item.qty} x {item.name}"

mcp.run()
'''

SERVER_B = '''
from mcp.server.fastmcp import FastMCP
mcp = FastMCP("b", log_level="WARNING")

@mcp.tool()
def add(a: int, b: int) -> int:
    """Add, on server b (plus 1000)."""
    return a + b + 1000

@mcp.tool()
def only_b() -> str:
    """Only on b."""
    return "b"

mcp.run()
'''


def _children() -> set[int]:
    """Pids of this process's children (zombies included: a child not reaped is still left)."""
    me, found = str(os.getpid()), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            found.add(int(entry))
    return found


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MCPServerConfig]:
    folder = tmp_path_factory.mktemp("mcp_servers")
    (folder / "a.py").write_text(SERVER_A)
    (folder / "b.py").write_text(SERVER_B)
    return {
        "a": MCPServerConfig("a", sys.executable, [str(folder / "a.py")]),
        "b": MCPServerConfig("b", sys.executable, [str(folder / "b.py")]),
    }


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = _children()
    yield
    close_shared_providers()
    deadline = time.monotonic() + 10
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _children() - before, "MCP server processes left after the test"


@pytest.fixture(scope="module")
def provider(servers):
    with MCPToolProvider([servers["a"]], call_timeout_s=10) as p:
        p.start()  # before the per-test process check looks
        yield p


# --- the provider ---------------------------------------------------------------------------------


def test_schemas_map_to_openai_functions(provider):
    schemas = {s["function"]["name"]: s for s in provider.tools()}
    assert list(schemas) == ["add", "boom", "incr", "hang", "block", "getenv", "big", "place"]
    assert schema_problems(list(schemas.values())) == []
    add = schemas["add"]
    assert add["type"] == "function" and add["function"]["description"] == "Add two integers."
    assert add["function"]["parameters"] == {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    place = schemas["place"]["function"]["parameters"]  # a pydantic model argument: $ref inlined
    assert "$defs" not in json.dumps(place) and "$ref" not in json.dumps(place)
    assert place["properties"]["item"]["type"] == "object"
    assert place["properties"]["item"]["properties"] == {"name": {"type": "string"}, "qty": {"type": "integer"}}
    assert place["required"] == ["item"]


def test_call_results_and_server_errors(provider):
    result = provider.call("add", {"a": 2, "b": 3})
    assert (result.text, result.is_error, result.structured) == ("5", False, {"result": 5})
    assert provider.call("place", {"item": {"name": "tea", "qty": 2}}).text == "2 x tea"
    failed = provider.call("boom", {})
    assert failed.is_error and "kaboom" in failed.text


def test_arguments_are_validated_before_the_call(provider):
    with pytest.raises(MCPUnknownToolError, match="unknown tool 'nope'. Available tools: add, boom"):
        provider.call("nope", {})
    cases = {
        "argument 'a': '2' is not of type 'integer'": {"a": "2", "b": 3},
        "missing required argument 'b'": {"a": 2},
        "unknown argument 'c' (allowed: a, b)": {"a": 1, "b": 2, "c": 3},
        "argument 'a': True is not of type 'integer'": {"a": True, "b": 2},
        "arguments must be a JSON object": [1, 2],
    }
    for expected, arguments in cases.items():
        with pytest.raises(MCPArgumentError) as info:
            provider.call("add", arguments)
        assert expected in str(info.value), (expected, str(info.value))
    with pytest.raises(MCPArgumentError, match="argument 'item.qty'"):
        provider.call("place", {"item": {"name": "tea", "qty": "two"}})
    # A refused call never reached the server: its counter only sees the valid calls.
    with pytest.raises(MCPArgumentError):
        provider.call("incr", {"by": 5})
    first = int(provider.call("incr").text)
    assert int(provider.call("incr").text) == first + 1


def test_timeout_is_an_error_and_the_session_goes_on(provider):
    start = time.monotonic()
    with pytest.raises(MCPTimeoutError, match="timed out after 0.3 s"):
        provider.call("hang", {}, timeout=0.3)
    assert time.monotonic() - start < 5
    assert provider.call("add", {"a": 1, "b": 1}).text == "2"


def test_async_api_from_another_event_loop(provider):
    async def main():
        tools = await provider.atools()
        results = await asyncio.gather(*(provider.acall("add", {"a": i, "b": i}) for i in range(5)))
        return tools, [r.text for r in results]

    tools, texts = asyncio.run(main())
    assert len(tools) == 8 and texts == ["0", "2", "4", "6", "8"]


def test_name_collisions_get_the_server_prefix(servers):
    with MCPToolProvider([servers["a"], servers["b"]]) as p:
        names = p.tool_names()
        assert "a__add" in names and "b__add" in names and "add" not in names
        assert "only_b" in names and "boom" in names
        assert p.call("a__add", {"a": 1, "b": 2}).text == "3"
        assert p.call("b__add", {"a": 1, "b": 2}).text == "1003"


def test_scopes_shared_keeps_state_per_episode_restarts(servers):
    shared = MCPToolProvider([servers["a"]], scope="shared")
    own = MCPToolProvider([servers["a"]], scope="per_episode")
    other = MCPToolProvider([servers["a"]], scope="per_episode")
    try:
        assert [shared.call("incr").text for _ in range(2)] == ["1", "2"]
        shared.new_episode()
        assert shared.call("incr").text == "3"

        assert [own.call("incr").text for _ in range(2)] == ["1", "2"]
        assert other.call("incr").text == "1"  # another episode's server is another process
        pids = set(own.server_pids())
        own.new_episode()
        assert own.call("incr").text == "1"  # a fresh server for the new episode
        assert pids.isdisjoint(own.server_pids()) and not any(_alive(p) for p in pids)
        idle = MCPToolProvider([servers["a"]], scope="per_episode")
        idle.start()
        pids = set(idle.server_pids())
        idle.new_episode()  # a server that served no call yet is not restarted
        assert idle.call("incr").text == "1" and set(idle.server_pids()) == pids
        idle.close()
    finally:
        for p in (shared, own, other):
            p.close()


def test_server_env_is_explicit(servers, monkeypatch):
    monkeypatch.setenv("TRACEGYM_TEST_SECRET", "s3cret")
    monkeypatch.setenv("TRACEGYM_TEST_INHERITED", "passed-on")
    a = servers["a"]
    config = MCPServerConfig("a", a.command, a.args, env={"GIVEN": "yes"}, inherit_env=("TRACEGYM_TEST_INHERITED",))
    with MCPToolProvider([config]) as p:
        assert p.call("getenv", {"name": "TRACEGYM_TEST_SECRET"}).text == "<unset>"
        assert p.call("getenv", {"name": "GIVEN"}).text == "yes"
        assert p.call("getenv", {"name": "TRACEGYM_TEST_INHERITED"}).text == "passed-on"
        assert p.call("getenv", {"name": "PATH"}).text == os.environ["PATH"]


def test_close_leaves_no_child_process(servers):
    before = _children()
    p = MCPToolProvider([servers["a"], servers["b"]], call_timeout_s=0.3)
    p.start()
    with pytest.raises(MCPTimeoutError):
        p.call("block")  # server a is now stuck in a blocking call: closing stdin will not end it
    started = _children() - before
    assert len(started) == 2 and started == set(p.server_pids())
    assert all(_alive(pid) for pid in started)
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 15
    assert not any(_alive(pid) for pid in started), "a server process outlived close()"
    assert _children() == before
    p.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        p.call("a__add", {"a": 1, "b": 2})


def test_a_server_that_cannot_start_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys; sys.exit(3)\n")
    with MCPToolProvider([MCPServerConfig("bad", sys.executable, [str(bad)], stderr="devnull")]) as p:
        with pytest.raises(MCPServerError, match="'bad'.*failed to start"):
            p.start()


# --- MCPToolEnv: same behaviour as a ToolEnv ------------------------------------------------------


class TinyEnv(MCPToolEnv):
    name = "mcp_tiny"
    default_max_turns = 3

    def tasks(self, split="train", n=100, seed=0):
        return [Task(id=f"{split}{i}", split=split, data={"a": i, "b": seed}) for i in range(n)]

    async def reset(self, task):
        self.task = task
        return [Message(role="system", content="Add."), Message(role="user", content=f"{task.data['a']}+{task.data['b']}")]

    def on_text(self, message):
        return StepResult(reward=1.0, terminated=True, info={"success": 1})

    def expert_action(self):
        return Message(role="assistant", content="done")


def _call(name, **arguments):
    return Message(role="assistant", tool_calls=(ToolCall(name=name, arguments=arguments, id="c1"),))


def test_env_tool_messages_errors_timeouts_and_truncation(servers):
    env = TinyEnv(max_turns=6, max_tool_output_chars=200, servers=[servers["a"]], call_timeout_s=0.5)
    schemas = env.tool_schemas()
    assert [s["function"]["name"] for s in schemas][:3] == ["add", "boom", "incr"]

    async def episode():
        await env.reset(env.tasks()[0])
        out = []
        for message in (_call("add", a=2, b=3), _call("add", a="2", b=3), _call("boom"),
                        _call("hang"), _call("big", n=5000), _call("nope")):
            out.append(await env.step(message))
        return out

    steps = asyncio.run(episode())
    texts = [s.messages[0].content for s in steps]
    assert texts[0] == "5" and steps[0].messages[0].tool_call_id == "c1" and steps[0].messages[0].name == "add"
    assert texts[1].startswith("Error: invalid arguments for tool 'add': argument 'a'")
    assert texts[2].startswith("Error: tool 'boom' failed:") and "kaboom" in texts[2]
    assert texts[3] == "Error: tool 'hang' timed out after 0.5 s."
    assert len(texts[4]) < 300 and "truncated 4,800 characters" in texts[4]
    assert texts[5].startswith("Error: unknown tool 'nope'. Available tools: add, boom")
    assert not any(s.terminated for s in steps) and not any(s.truncated for s in steps[:5])
    assert steps[2].info["tool_errors"] == 2 and steps[2].info["tool_calls"] == 3
    assert steps[5].info["tool_errors"] == 4 and steps[5].info["tool_calls"] == 6
    assert steps[5].info["tool_timeouts"] == 1 and steps[5].info["tool_output_truncated"] == 1
    assert steps[5].truncated  # the env's turn limit still applies


def test_per_episode_env_gets_fresh_servers_and_close_ends_them(servers):
    before = _children()
    env = TinyEnv(servers=[servers["a"]], scope="per_episode")

    async def two_episodes():
        counts = []
        for task in env.tasks()[:2]:
            await env.reset(task)
            counts.append([(await env.step(_call("incr"))).messages[0].content for _ in range(2)])
        return counts

    assert asyncio.run(two_episodes()) == [["1", "2"], ["1", "2"]]
    assert _children() - before
    env.close()
    assert _children() == before


# --- the example env (examples/mcp) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def units_env():
    from tracegym.plugins import load_plugins

    load_plugins([str(REPO / "examples" / "mcp" / "env.py")])
    return "mcp_units"


def test_example_env_passes_check_env(units_env):
    report = check_env(units_env, n_tasks=20)
    assert report.ok and report.expert_success_rate >= 0.95


def test_example_env_per_episode_scope_passes_check_env(units_env):
    from tracegym.envs import make

    report = check_env(lambda: make(units_env, scope="per_episode"), n_tasks=2)
    assert report.ok and report.expert_success_rate == 1.0
    import gc

    gc.collect()  # instances check_env did not close end their servers when collected


def test_example_env_expert_rollout_from_the_command_line(tmp_path):
    out = tmp_path / "rollout"
    cmd = [sys.executable, "-m", "tracegym", "rollout", "--plugin", "examples/mcp/env.py", "--env", "mcp_units",
           "--policy", "expert", "--tasks", "20", "--split", "test", "--no-progress", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 20
    trajectories = [json.loads(line) for line in lines]
    assert sum(t["reward"] for t in trajectories) / len(trajectories) >= 0.95, summary
    assert all(any(m.get("role") == "tool" for m in t["messages"]) for t in trajectories)


def test_shared_provider_is_one_per_configuration(servers):
    p1, p2 = shared_provider([servers["a"]]), shared_provider([servers["a"]])
    assert p1 is p2 and shared_provider([servers["b"]]) is not p1
    close_shared_providers()
    assert p1.closed and shared_provider([servers["a"]]) is not p1
