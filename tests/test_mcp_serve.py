"""``tracegym mcp-serve ENV``: an env's tools as an MCP stdio server, driven with the MCP client SDK
against the real subprocess (``python -m tracegym mcp-serve ...``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from tracegym.envs import make

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[1]
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


async def _session_run(args: list[str], script):
    params = StdioServerParameters(command=sys.executable, args=["-m", "tracegym", "mcp-serve", *args], cwd=str(REPO), env=ENV)
    with open(os.devnull, "w") as devnull:
        async with stdio_client(params, errlog=devnull) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await script(session)


def _text(result) -> str:
    return "\n".join(part.text for part in result.content)


def test_calculator_tools_over_mcp():
    env = make("calculator")
    task = env.tasks("test", 100, 0)[2]
    expert_answer = {}

    async def script(session: ClientSession):
        tools = {t.name: t for t in (await session.list_tools()).tools}
        out = {"tools": tools}
        out["call"] = await session.call_tool("calculate", {"expression": "37 * 24 - 129"})
        out["bad"] = await session.call_tool("calculate", {"expression": 3})
        out["unknown"] = await session.call_tool("nope", {})
        out["reset"] = await session.call_tool("reset", {"index": 2})
        out["bad_reset"] = await session.call_tool("reset", {"index": 100})
        # Play the task with the expert's calls, through the MCP server.
        asyncio_env = make("calculator")
        await asyncio_env.reset(task)
        while True:
            action = asyncio_env.expert_action()
            if not action.tool_calls:
                expert_answer["text"] = action.content
                break
            call = action.tool_calls[0]
            res = await session.call_tool(call.name, call.arguments)
            assert not res.isError, _text(res)
            await asyncio_env.step(action)
        out["submit"] = await session.call_tool("submit", {"answer": expert_answer["text"]})
        out["after"] = await session.call_tool("calculate", {"expression": "1 + 1"})
        return out

    out = asyncio.run(_session_run(["calculator"], script))
    tools = out["tools"]
    assert set(tools) == {"calculate", "reset", "submit"}
    schema = env.tool_schemas()[0]["function"]
    assert tools["calculate"].inputSchema == schema["parameters"]
    assert tools["calculate"].description == schema["description"]
    assert (_text(out["call"]), out["call"].isError) == ("759", False)
    assert out["bad"].isError and _text(out["bad"]).startswith("Error: invalid arguments for tool 'calculate'")
    assert out["unknown"].isError and "unknown tool 'nope'" in _text(out["unknown"])
    assert not out["reset"].isError and task.data["question"] in _text(out["reset"]) and task.id in _text(out["reset"])
    assert out["bad_reset"].isError and "index must be an integer in 0..99" in _text(out["bad_reset"])
    submitted = _text(out["submit"])
    assert json.loads(submitted.splitlines()[0]) == {"reward": 1.0, "success": 1, "terminated": True}
    assert "[episode terminated: reward 1, success 1]" in submitted
    assert out["after"].isError and "the episode ended" in _text(out["after"]) and "call reset" in _text(out["after"])


def test_plugin_env_backed_by_mcp_is_served_again(tmp_path):
    """The example MCP env served as an MCP server: MCP tools in, MCP tools out."""

    async def script(session: ClientSession):
        names = [t.name for t in (await session.list_tools()).tools]
        result = await session.call_tool("convert", {"value": 1, "from_unit": "mi", "to_unit": "m"})
        error = await session.call_tool("convert", {"value": 1, "from_unit": "mi", "to_unit": "kg"})
        return names, result, error

    names, result, error = asyncio.run(_session_run(["mcp_units", "--plugin", "examples/mcp/env.py", "--split", "train"], script))
    assert names == ["list_units", "convert", "reset", "submit"]
    assert (_text(result), result.isError) == ("1609.34", False)
    assert error.isError and "cannot convert length (mi) to mass (kg)" in _text(error)


def test_bad_env_is_one_line_and_exit_code_2():
    proc = subprocess.run([sys.executable, "-m", "tracegym", "mcp-serve", "no_such_env"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env={**os.environ, **ENV})
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error:")
    assert proc.stdout == ""
