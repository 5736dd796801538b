"""``tracegym mcp-serve ENV``: a tracegym env's tools as an MCP server over stdio.

    tracegym mcp-serve calculator                       # for any MCP client (Claude Desktop, an SDK)
    tracegym mcp-serve letter_count --plugin letter_count.py -o max_turns=20 --split train --task 3

One env instance plays one episode at a time. At start it is reset on task ``--task`` (an index
into ``--tasks`` tasks of ``--split`` with ``--seed``). The MCP tools are the env's own tools
(same names, descriptions and input schemas; each call is one env step, so the env's validation,
timeouts, output limit and turn limit apply, and an ``Error:`` answer comes back with ``isError``)
plus two control tools:

- ``reset(index=0)``: start a new episode on task ``index`` of that list; returns the task's
  system and user messages;
- ``submit(answer)``: end the episode with a final assistant message (e.g. ``<answer>42</answer>``);
  returns the reward.

After the episode ends (``submit``, a tool that ends it, or the turn limit), calls answer an
error until ``reset``. If the env has a tool named ``reset`` or ``submit`` itself, the control
tools are named ``tracegym_reset`` / ``tracegym_submit``. Logs go to stderr; stdout carries only
the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tracegym.commands._config import add_plugin_argument

NAME = "mcp-serve"
HELP = "Serve an env's tools as an MCP server over stdio (one env instance; reset/submit tools)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("env", help="env name (built-in, registered by a plugin, or an entry point)")
    parser.add_argument(
        "--option", "-o", action="append", default=[], metavar="KEY=VALUE",
        help="env option, e.g. -o num_calls=2 (VALUE is read as JSON when it parses, else as text)",
    )
    parser.add_argument("--split", choices=["train", "test"], default="test", help="task split (default test)")
    parser.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    parser.add_argument("--tasks", type=int, default=100, help="tasks the reset tool chooses from (default 100)")
    parser.add_argument("--task", type=int, default=0, help="index of the task of the first episode (default 0)")
    add_plugin_argument(parser)


class EnvToolServer:
    """The state behind the MCP handlers: one env, its task list and the current episode."""

    def __init__(self, env: Any, tasks: list[Any]) -> None:
        import asyncio

        self.env = env
        self.tasks = tasks
        self.lock = asyncio.Lock()
        self.schemas = env.tool_schemas()
        names = {s["function"]["name"] for s in self.schemas}
        prefix = "tracegym_" if names & {"reset", "submit"} else ""
        self.reset_name, self.submit_name = f"{prefix}reset", f"{prefix}submit"
        self.ended: str | None = "no episode yet; call reset"
        self.calls = 0

    def tools(self) -> list[Any]:
        import mcp.types as types

        out = [
            types.Tool(name=s["function"]["name"], description=s["function"].get("description", ""),
                       inputSchema=s["function"]["parameters"])
            for s in self.schemas
        ]
        out.append(types.Tool(
            name=self.reset_name,
            description=f"Start a new episode on task `index` (0..{len(self.tasks) - 1}); returns the task's messages.",
            inputSchema={"type": "object", "properties": {"index": {"type": "integer", "minimum": 0, "default": 0}},
                         "required": []},
        ))
        out.append(types.Tool(
            name=self.submit_name,
            description="End the episode with a final answer (the assistant's last message); returns the reward.",
            inputSchema={"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        ))
        return out

    async def reset(self, index: Any) -> str:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.tasks):
            raise ValueError(f"index must be an integer in 0..{len(self.tasks) - 1}, got {index!r}")
        task = self.tasks[index]
        messages = await self.env.reset(task)
        self.ended = None
        lines = [f"task {task.id} ({task.split})"] + [f"[{m.role}] {m.content}" for m in messages]
        return "\n".join(lines)

    def _ending(self, step: Any) -> str:
        if not (step.terminated or step.truncated):
            return ""
        how = "terminated" if step.terminated else "truncated"
        self.ended = f"the episode ended ({how}, reward {step.reward:g}); call {self.reset_name}"
        return f"\n[episode {how}: reward {step.reward:g}, success {int(step.info.get('success', 0))}]"

    async def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """(text, is_error) of one MCP tool call."""
        from tracegym.types import Message, ToolCall

        async with self.lock:
            if name == self.reset_name:
                return await self.reset(arguments.get("index", 0)), False
            if self.ended is not None:
                return f"Error: {self.ended}.", True
            if name == self.submit_name:
                answer = arguments.get("answer")
                if not isinstance(answer, str):
                    return "Error: submit needs a string 'answer'.", True
                step = await self.env.step(Message(role="assistant", content=answer))
                text = "\n".join(m.content for m in step.messages)
                summary = json.dumps({"reward": step.reward, "success": int(step.info.get("success", 0)),
                                      "terminated": step.terminated})
                return (text + "\n" if text else "") + summary + self._ending(step), False
            self.calls += 1
            call = ToolCall(name=name, arguments=arguments, id=f"mcp_{self.calls}")
            step = await self.env.step(Message(role="assistant", tool_calls=(call,)))
            text = "\n".join(m.content for m in step.messages)
            return text + self._ending(step), text.startswith("Error")


def _options(pairs: list[str]) -> dict[str, Any]:
    from tracegym.commands.envs import _options as parse

    return parse(pairs)


async def _serve(state: EnvToolServer, protocol_out: Any) -> None:
    import anyio
    import mcp.types as types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    server: Server = Server(f"tracegym-{getattr(state.env, 'name', 'env')}")

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return state.tools()

    @server.call_tool(validate_input=False)  # the env validates, with its own messages
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        try:
            text, is_error = await state.call(name, arguments or {})
        except Exception as exc:  # noqa: BLE001 - the client sees it as a tool error
            text, is_error = f"Error: {type(exc).__name__}: {exc}", True
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=is_error)

    stdout = anyio.wrap_file(protocol_out)
    async with stdio_server(stdout=stdout) as (read, write):
        await server.run(read, write, server.create_initialization_options())


def run(args: argparse.Namespace) -> int:
    import asyncio
    import io

    from tracegym.envs import make

    try:
        options = _options(args.option)
        env = make(args.env, **options)
        if args.tasks < 1 or not 0 <= args.task < args.tasks:
            raise ValueError(f"--task must be in 0..{args.tasks - 1} (--tasks {args.tasks}), got {args.task}")
        tasks = env.tasks(args.split, args.tasks, args.seed)
        if args.task >= len(tasks):
            raise ValueError(f"--task {args.task}: the env gave only {len(tasks)} tasks")
    except Exception as exc:  # noqa: BLE001 - one line, no traceback
        print(f"error: {type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else f"error: {exc}", file=sys.stderr)
        return 2

    # stdout is the protocol channel: keep a private copy of it, and send fd 1 (print, C libraries) to stderr.
    protocol_out = io.TextIOWrapper(os.fdopen(os.dup(sys.stdout.fileno()), "wb"), encoding="utf-8")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr

    async def main() -> None:
        state = EnvToolServer(env, tasks)
        await state.reset(args.task)
        await _serve(state, protocol_out)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        env.close()
    return 0
