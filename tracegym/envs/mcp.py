"""Tools from MCP servers (stdio transport): a provider, and a ``ToolEnv`` whose tools come from it.

    from tracegym.envs.mcp import MCPServerConfig, MCPToolEnv

    class MyEnv(MCPToolEnv):
        mcp_servers = (MCPServerConfig("units", sys.executable, ["server.py"]),)
        mcp_scope = "shared"            # or "per_episode" for servers that keep state
        ...                             # tasks, reset, expert_action, on_text as for any ToolEnv

:class:`MCPToolProvider` owns the client sessions. They live on one background event-loop thread
per provider (an MCP session must be entered and left in the same task), so the provider offers a
sync API (``tools``, ``call``, ``close``) and an async one (``atools``, ``acall``, ``aclose``)
usable from any thread or event loop. What it guarantees:

- tool schemas are OpenAI function schemas (``inputSchema`` -> ``parameters``, ``$ref`` inlined,
  ``title`` noise dropped); a tool name offered by several servers becomes ``server__tool``;
- arguments are validated against the tool's ``inputSchema`` before the call (JSON Schema; with
  ``strict_arguments`` unknown arguments are refused, as ``ToolEnv`` does for Python tools);
- every call has a timeout (:class:`MCPTimeoutError`); a result with ``isError`` comes back as
  ``MCPToolResult(is_error=True)``;
- a server's environment is only the SDK's safe minimum (PATH, HOME, USER, SHELL, TERM, LOGNAME)
  plus what its config names (``env`` values, ``inherit_env`` names): no secret is inherited;
- ``close()`` ends every server process: the SDK closes stdin, then SIGTERM/SIGKILLs the process
  group; as a last resort the provider kills, by pid, processes that carry its own marker
  variable (never by name). Providers not closed are closed when collected and at exit.

Scopes. ``shared``: one process per server for every episode (``shared_provider`` keeps one
provider per configuration; ``close_shared_providers()`` ends them). ``per_episode``: each env
instance owns its provider; :meth:`MCPToolProvider.new_episode` marks the servers stale once they
have served a call, and they are restarted on the next call, so each episode sees fresh servers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import os
import signal
import sys
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Mapping, Sequence

from tracegym.envs.base import Env
from tracegym.envs.tools import ToolEnv
from tracegym.types import Message, ToolCall

__all__ = [
    "MCPError",
    "MCPArgumentError",
    "MCPServerConfig",
    "MCPServerError",
    "MCPTimeoutError",
    "MCPTool",
    "MCPToolEnv",
    "MCPToolProvider",
    "MCPToolResult",
    "MCPUnknownToolError",
    "close_shared_providers",
    "mcp_tool_schema",
    "shared_provider",
]

Scope = Literal["shared", "per_episode"]
_MARKER_VAR = "TRACEGYM_MCP_PROVIDER"
_STOP_GRACE_S = 10.0  # the SDK needs up to ~4 s (stdin close, SIGTERM, SIGKILL); then we kill by pid


class MCPError(RuntimeError):
    """Base class of the provider's errors."""


class MCPServerError(MCPError):
    """A server failed to start, or its connection failed during a call."""


class MCPUnknownToolError(MCPError, KeyError):
    """No server offers a tool of this name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class MCPArgumentError(MCPError, ValueError):
    """Arguments that do not match the tool's ``inputSchema``."""


class MCPTimeoutError(MCPError, TimeoutError):
    """A call ran past its timeout."""


@dataclass(frozen=True)
class MCPServerConfig:
    """One stdio MCP server: ``command args...``, started with an explicit environment.

    ``env``: variables set for the server; ``inherit_env``: names copied from this process's
    environment when set (e.g. ``("OPENAI_API_KEY",)``); nothing else is inherited but the SDK's
    safe minimum. ``call_timeout_s`` overrides the provider's per-call timeout for this server.
    ``stderr``: ``"inherit"`` (this process's stderr) or ``"devnull"``.
    """

    name: str
    command: str
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    inherit_env: Sequence[str] = ()
    cwd: str | None = None
    call_timeout_s: float | None = None
    startup_timeout_s: float = 30.0
    stderr: Literal["inherit", "devnull"] = "inherit"

    def __post_init__(self) -> None:
        if not self.name or "__" in self.name or not self.name.replace("-", "_").isidentifier():
            raise ValueError(f"MCP server name must be an identifier without '__', got {self.name!r}")
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))
        object.__setattr__(self, "env", {str(k): str(v) for k, v in dict(self.env).items()})
        object.__setattr__(self, "inherit_env", tuple(self.inherit_env))
        for label, value in (("call_timeout_s", self.call_timeout_s), ("startup_timeout_s", self.startup_timeout_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        if self.stderr not in ("inherit", "devnull"):
            raise ValueError(f"stderr must be 'inherit' or 'devnull', got {self.stderr!r}")

    def key(self) -> str:
        return json.dumps(
            [self.name, self.command, list(self.args), sorted(self.env.items()), list(self.inherit_env), self.cwd,
             self.call_timeout_s, self.startup_timeout_s, self.stderr]
        )

    def server_env(self, marker: str) -> dict[str, str]:
        """The variables this server gets on top of the SDK's safe defaults."""
        env = {name: os.environ[name] for name in self.inherit_env if name in os.environ}
        env.update(self.env)
        env[_MARKER_VAR] = marker
        return env


@dataclass(frozen=True)
class MCPToolResult:
    """A server's answer: text parts joined; ``is_error`` from the result's ``isError``."""

    text: str
    is_error: bool = False
    structured: Any = None


# --- schemas and validation -----------------------------------------------------------------------

_SCHEMA_MAPS = ("properties", "patternProperties")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _clean(schema: Any, defs: Mapping[str, Any], depth: int = 0) -> Any:
    """A schema with local ``$ref``s inlined and ``title``/``$defs``/``$schema`` dropped."""
    if not isinstance(schema, dict) or depth > 32:
        return schema if depth <= 32 else {}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.split("/")[-1] in defs and ref.startswith(("#/$defs/", "#/definitions/")):
        merged = {**defs[ref.split("/")[-1]], **{k: v for k, v in schema.items() if k != "$ref"}}
        return _clean(merged, defs, depth + 1)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("title", "$defs", "definitions", "$schema"):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _clean(sub, defs, depth + 1) for name, sub in value.items()}
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key] = _clean(value, defs, depth + 1)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_clean(sub, defs, depth + 1) for sub in value]
        else:
            out[key] = copy.deepcopy(value)
    return out


def mcp_tool_schema(name: str, description: str | None, input_schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """The OpenAI function schema of an MCP tool (``parameters`` = the cleaned ``inputSchema``)."""
    raw = dict(input_schema or {})
    defs = {**raw.get("definitions", {}), **raw.get("$defs", {})}
    parameters = _clean(raw, defs)
    parameters["type"] = "object"
    parameters.setdefault("properties", {})
    parameters.setdefault("required", [])
    return {"type": "function", "function": {"name": name, "description": description or "", "parameters": parameters}}


@dataclass
class MCPTool:
    """One tool as offered to the model: its exposed ``name`` and where it lives."""

    name: str
    server: str
    remote_name: str
    description: str
    input_schema: dict[str, Any]
    _validator: Any = field(default=None, repr=False)

    def schema(self) -> dict[str, Any]:
        return mcp_tool_schema(self.name, self.description, self.input_schema)

    def problems(self, arguments: Any, strict: bool = True) -> list[str]:
        """What is wrong with ``arguments`` ([] when they match the ``inputSchema``)."""
        if not isinstance(arguments, dict):
            return [f"arguments must be a JSON object, got {type(arguments).__name__}"]
        found: list[str] = []
        properties = self.input_schema.get("properties")
        extra = self.input_schema.get("additionalProperties", False if strict else True)
        if isinstance(properties, dict) and extra is False:
            allowed = ", ".join(properties) or "none"
            found += [f"unknown argument '{k}' (allowed: {allowed})" for k in arguments if k not in properties]
        if self._validator is None:
            import jsonschema

            try:
                cls = jsonschema.validators.validator_for(self.input_schema, default=jsonschema.Draft202012Validator)
                cls.check_schema(self.input_schema)
                self._validator = cls(self.input_schema)
            except jsonschema.SchemaError:
                self._validator = False  # an invalid schema: the server validates
        if self._validator:
            errors = sorted(self._validator.iter_errors(arguments), key=lambda e: (list(map(str, e.path)), e.message))
            for e in errors:
                if e.validator == "required" and not e.path:
                    missing = e.message.split("'")[1] if e.message.count("'") >= 2 else e.message
                    found.append(f"missing required argument '{missing}'")
                elif e.validator == "additionalProperties" and not e.path and found:
                    continue  # already named above
                else:
                    where = ".".join(str(p) for p in e.path) or "arguments"
                    found.append(f"argument '{where}': {e.message}")
        return found


def _result_text(result: Any) -> str:
    parts: list[str] = []
    for item in getattr(result, "content", None) or []:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource":
            resource = item.resource
            parts.append(getattr(resource, "text", None) or f"[resource {resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource {item.uri}]")
        else:
            parts.append(f"[{kind} {getattr(item, 'mimeType', '')}]".replace(" ]", "]"))
    if not parts and getattr(result, "structuredContent", None) is not None:
        parts.append(json.dumps(result.structuredContent, ensure_ascii=False, default=str))
    return "\n".join(parts)


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# --- processes ------------------------------------------------------------------------------------


def _marked_pids(marker: str) -> list[int]:
    """Pids of live processes whose marker variable is ``marker`` or starts with ``marker:``
    (Linux /proc; [] elsewhere)."""
    exact, prefix = f"{_MARKER_VAR}={marker}".encode(), f"{_MARKER_VAR}={marker}:".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if not any(v == exact or v.startswith(prefix) for v in f.read().split(b"\0")):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    continue  # a zombie is dead; its parent reaps it
        except OSError:
            continue
        found.append(int(entry))
    return found


# --- one server connection ------------------------------------------------------------------------


class _Connection:
    """One server's process and session, held open by one task on the provider's loop."""

    def __init__(self, config: MCPServerConfig, marker: str) -> None:
        self.config = config
        self.marker = f"{marker}:{config.name}"  # this server's processes, by pid, for the last resort
        self.session: Any = None
        self.tools: list[Any] = []
        self.error: str | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._stop = asyncio.Event()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._serve(ready), name=f"mcp-{self.config.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.config.startup_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            await self.stop()
            raise MCPServerError(
                f"MCP server {self.config.name!r} did not initialize within {self.config.startup_timeout_s:g} s"
            ) from None

    async def _serve(self, ready: asyncio.Future[None]) -> None:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        cfg = self.config
        params = StdioServerParameters(command=cfg.command, args=list(cfg.args), env=cfg.server_env(self.marker), cwd=cfg.cwd)
        devnull = open(os.devnull, "w") if cfg.stderr == "devnull" else None
        errlog = devnull or (sys.stderr if _has_fileno(sys.stderr) else sys.__stderr__)
        try:
            async with stdio_client(params, errlog=errlog) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    self.tools = list((await session.list_tools()).tools)
                    self.session = session
                    ready.set_result(None)
                    assert self._stop is not None
                    await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits for the start
            self.error = _describe(exc)
            if not ready.done():
                ready.set_exception(MCPServerError(f"MCP server {cfg.name!r} ({cfg.command}) failed to start: {self.error}"))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.session = None
            if devnull is not None:
                devnull.close()

    async def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), _STOP_GRACE_S)
            except (asyncio.TimeoutError, TimeoutError):
                task.cancel()
            except BaseException:  # noqa: BLE001 - already reported through self.error
                pass
        _kill_marked(self.marker)


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
        return True
    except Exception:  # noqa: BLE001
        return False


def _kill_marked(marker: str) -> None:
    """Last resort: SIGKILL the processes that carry ``marker`` (ours, found by pid)."""
    for pid in _marked_pids(marker):
        for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                kill()
            except OSError:
                pass


# --- the provider ---------------------------------------------------------------------------------


class _State:
    """Everything the provider's finalizer needs (it must not reference the provider)."""

    def __init__(self, servers: Sequence[MCPServerConfig]) -> None:
        self.servers = list(servers)
        self.marker = uuid.uuid4().hex
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.connections: dict[str, _Connection] = {}
        self.tools: dict[str, MCPTool] | None = None
        self.running = False
        self.used = False
        self.stale = False
        self.closed = False
        self.guard = threading.Lock()
        self.start_lock: asyncio.Lock | None = None

    def loop_or_start(self) -> asyncio.AbstractEventLoop:
        with self.guard:
            if self.closed:
                raise MCPError("the MCP tool provider is closed")
            if self.loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=_run_loop, args=(loop,), name="tracegym-mcp", daemon=True)
                thread.start()
                self.loop, self.thread = loop, thread
            return self.loop

    async def stop_servers(self) -> None:
        connections, self.connections = list(self.connections.values()), {}
        self.running = False
        await asyncio.gather(*(c.stop() for c in connections), return_exceptions=True)

    def close(self) -> None:
        with self.guard:
            if self.closed:
                return
            self.closed = True
            loop, thread = self.loop, self.thread
        if loop is not None and thread is not None and thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self.stop_servers(), loop)
            if threading.current_thread() is not thread:
                try:
                    future.result(_STOP_GRACE_S + 5)
                except Exception:  # noqa: BLE001 - closing must not raise
                    pass
            loop.call_soon_threadsafe(loop.stop)
            if threading.current_thread() is not thread:
                thread.join(5)
        _kill_marked(self.marker)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()


class MCPToolProvider:
    """The tools of one or more stdio MCP servers; see the module docstring.

    Servers start on first use (``start``, ``tools``, ``call``). ``call_timeout_s`` bounds each
    call (a server's own ``call_timeout_s`` wins). With ``scope="per_episode"``, ``new_episode()``
    makes the next call run on freshly started servers if the current ones served a call.
    """

    def __init__(
        self,
        servers: Sequence[MCPServerConfig],
        scope: Scope = "shared",
        call_timeout_s: float = 30.0,
        strict_arguments: bool = True,
    ) -> None:
        servers = list(servers)
        if not servers:
            raise ValueError("MCPToolProvider needs at least one server")
        names = [s.name for s in servers]
        if len(set(names)) != len(names):
            raise ValueError(f"MCP server names must be unique, got {names}")
        if scope not in ("shared", "per_episode"):
            raise ValueError(f"scope must be 'shared' or 'per_episode', got {scope!r}")
        if call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        self.scope: Scope = scope
        self.call_timeout_s = float(call_timeout_s)
        self.strict_arguments = strict_arguments
        self._state = _State(servers)
        self._finalizer = weakref.finalize(self, self._state.close)

    # -- plumbing: coroutines run on the provider's loop --

    def _submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        try:
            loop = self._state.loop_or_start()
        except BaseException:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def _wait(self, coro: Any, timeout: float | None = None) -> Any:
        if threading.current_thread() is self._state.thread:
            coro.close()
            raise MCPError("the sync API cannot be used from the provider's own loop; use the async one")
        future = self._submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own timeout (an MCPTimeoutError): keep its message
                raise
            future.cancel()
            raise MCPTimeoutError(f"no answer within {timeout:g} s") from None

    async def _await(self, coro: Any, timeout: float | None = None) -> Any:
        future = self._submit(coro)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except MCPTimeoutError:  # the coroutine's own timeout: keep its message
            raise
        except (asyncio.TimeoutError, TimeoutError):
            raise MCPTimeoutError(f"no answer within {timeout:g} s") from None

    def _start_budget(self) -> float:
        return sum(s.startup_timeout_s for s in self._state.servers) + _STOP_GRACE_S + 5

    # -- lifecycle --

    async def _ensure_running(self) -> None:
        st = self._state
        if st.start_lock is None:
            st.start_lock = asyncio.Lock()
        async with st.start_lock:
            if st.running and st.stale:
                await st.stop_servers()
            if st.running:
                return
            st.stale = st.used = False
            connections = [_Connection(cfg, st.marker) for cfg in st.servers]
            st.connections = {c.config.name: c for c in connections}
            outcomes = await asyncio.gather(*(c.start() for c in connections), return_exceptions=True)
            failures = [o for o in outcomes if isinstance(o, BaseException)]
            if failures:
                await st.stop_servers()
                raise failures[0] if isinstance(failures[0], MCPError) else MCPServerError(_describe(failures[0]))
            st.running = True
            if st.tools is None:
                st.tools = self._tool_table(connections)

    @staticmethod
    def _tool_table(connections: list[_Connection]) -> dict[str, MCPTool]:
        counts: dict[str, int] = {}
        for c in connections:
            for t in c.tools:
                counts[t.name] = counts.get(t.name, 0) + 1
        table: dict[str, MCPTool] = {}
        for c in connections:
            for t in c.tools:
                name = t.name if counts[t.name] == 1 else f"{c.config.name}__{t.name}"
                if name in table:
                    raise MCPServerError(f"two MCP tools are both exposed as {name!r}")
                table[name] = MCPTool(name, c.config.name, t.name, t.description or "", dict(t.inputSchema or {}))
        return table

    def start(self) -> None:
        """Start the servers now (otherwise they start on first use)."""
        self._wait(self._ensure_running(), self._start_budget())

    async def astart(self) -> None:
        await self._await(self._ensure_running(), self._start_budget())

    def new_episode(self) -> None:
        """``per_episode``: the next call runs on fresh servers if the current ones served a call
        (a server that was never called counts as fresh). ``shared``: nothing."""
        if self.scope == "per_episode" and self._state.used:
            self._state.stale = True

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Stop every server and the loop thread; no server process is left afterwards. Idempotent."""
        self._finalizer()

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __enter__(self) -> MCPToolProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def server_pids(self) -> list[int]:
        """Pids of the live processes this provider started (Linux; [] elsewhere)."""
        return _marked_pids(self._state.marker)

    # -- tools --

    def _table(self) -> dict[str, MCPTool]:
        if self._state.tools is None:
            self.start()
        assert self._state.tools is not None
        return self._state.tools

    async def _atable(self) -> dict[str, MCPTool]:
        if self._state.tools is None:
            await self.astart()
        assert self._state.tools is not None
        return self._state.tools

    def tool_list(self) -> list[MCPTool]:
        return list(self._table().values())

    def tools(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of every tool (starts the servers the first time)."""
        return [t.schema() for t in self._table().values()]

    async def atools(self) -> list[dict[str, Any]]:
        return [t.schema() for t in (await self._atable()).values()]

    def tool_names(self) -> list[str]:
        return list(self._table())

    def _prepare(self, table: dict[str, MCPTool], name: str, arguments: Any) -> tuple[MCPTool, float]:
        tool = table.get(name)
        if tool is None:
            raise MCPUnknownToolError(f"unknown tool '{name}'. Available tools: {', '.join(table) or 'none'}.")
        problems = tool.problems(arguments, self.strict_arguments)
        if problems:
            raise MCPArgumentError(f"invalid arguments for tool '{name}': {'; '.join(problems)}.")
        server_timeout = next(s.call_timeout_s for s in self._state.servers if s.name == tool.server)
        return tool, server_timeout or self.call_timeout_s

    async def _call(self, tool: MCPTool, arguments: dict[str, Any], timeout: float) -> MCPToolResult:
        st = self._state
        await self._ensure_running()
        connection = st.connections.get(tool.server)
        session = connection.session if connection is not None else None
        if session is None:
            detail = f": {connection.error}" if connection is not None and connection.error else ""
            raise MCPServerError(f"MCP server {tool.server!r} is not running{detail}")
        st.used = True
        try:
            result = await asyncio.wait_for(session.call_tool(tool.remote_name, arguments), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            raise MCPTimeoutError(f"tool '{tool.name}' timed out after {timeout:g} s.") from None
        except Exception as exc:
            raise MCPServerError(f"MCP server {tool.server!r} failed during '{tool.name}': {_describe(exc)}") from exc
        return MCPToolResult(_result_text(result), bool(result.isError), result.structuredContent)

    def call(self, name: str, arguments: Any = None, timeout: float | None = None) -> MCPToolResult:
        """Call tool ``name`` (its exposed name). Raises :class:`MCPUnknownToolError`,
        :class:`MCPArgumentError`, :class:`MCPTimeoutError` or :class:`MCPServerError`."""
        arguments = {} if arguments is None else arguments
        tool, limit = self._prepare(self._table(), name, arguments)
        limit = timeout or limit
        return self._wait(self._call(tool, arguments, limit), limit + self._start_budget())

    async def acall(self, name: str, arguments: Any = None, timeout: float | None = None) -> MCPToolResult:
        arguments = {} if arguments is None else arguments
        tool, limit = self._prepare(await self._atable(), name, arguments)
        limit = timeout or limit
        return await self._await(self._call(tool, arguments, limit), limit + self._start_budget())


# --- shared providers -----------------------------------------------------------------------------

_shared: dict[str, MCPToolProvider] = {}
_shared_lock = threading.Lock()


def shared_provider(servers: Sequence[MCPServerConfig], call_timeout_s: float = 30.0, strict_arguments: bool = True) -> MCPToolProvider:
    """The process-wide ``shared`` provider of this configuration (made on first request)."""
    key = json.dumps([[s.key() for s in servers], call_timeout_s, strict_arguments])
    with _shared_lock:
        provider = _shared.get(key)
        if provider is None or provider.closed:
            provider = _shared[key] = MCPToolProvider(servers, "shared", call_timeout_s, strict_arguments)
        return provider


def close_shared_providers() -> None:
    """Close every ``shared`` provider (their servers stop; later use starts new ones)."""
    with _shared_lock:
        providers = list(_shared.values())
        _shared.clear()
    for provider in providers:
        provider.close()


# --- the env --------------------------------------------------------------------------------------

_schema_cache: dict[str, list[MCPTool]] = {}


class MCPToolEnv(ToolEnv):
    """A ``ToolEnv`` whose tools also come from MCP servers.

    Set ``mcp_servers`` (and optionally ``mcp_scope``, ``mcp_call_timeout_s``) on the subclass, or
    pass ``servers=``/``scope=``/``call_timeout_s=``. MCP tools behave like ``@tool`` methods:
    validated arguments, ``Error:`` tool messages (unknown tool, bad arguments, ``isError``, a
    server failure), timeouts counted in ``tool_timeouts``, outputs cut at ``max_tool_output_chars``.
    ``@tool`` methods still work beside them (a name clash is an error). ``close()`` stops a
    ``per_episode`` provider; ``shared`` ones live until ``close_shared_providers()`` or exit.
    """

    mcp_servers: ClassVar[Sequence[MCPServerConfig]] = ()
    mcp_scope: ClassVar[Scope] = "shared"
    mcp_call_timeout_s: ClassVar[float] = 30.0

    def __init__(
        self,
        max_turns: int | None = None,
        max_tool_output_chars: int | None = None,
        *,
        servers: Sequence[MCPServerConfig] | None = None,
        scope: Scope | None = None,
        call_timeout_s: float | None = None,
    ) -> None:
        self._mcp_provider: MCPToolProvider | None = None
        super().__init__(max_turns=max_turns, max_tool_output_chars=max_tool_output_chars)
        self.mcp_servers = tuple(servers if servers is not None else type(self).mcp_servers)  # type: ignore[misc]
        self.mcp_scope = scope or type(self).mcp_scope  # type: ignore[misc]
        self.mcp_call_timeout_s = float(call_timeout_s or type(self).mcp_call_timeout_s)  # type: ignore[misc]
        if not self.mcp_servers:
            raise ValueError(f"{type(self).__name__}: no MCP servers configured (set mcp_servers or pass servers=)")
        if self.mcp_scope not in ("shared", "per_episode"):
            raise ValueError(f"scope must be 'shared' or 'per_episode', got {self.mcp_scope!r}")

    def branch_refusal(self) -> str | None:
        """MCP tools live in server processes: no snapshot can capture or restore their state."""
        reason = Env.branch_refusal(self)  # the plain env's checks first, as ToolEnv's
        if reason is not None:
            return reason
        return (f"its tools are served by MCP server processes (scope={getattr(self, 'mcp_scope', '?')!r}) "
                "whose state a snapshot cannot capture or restore")

    @property
    def mcp_provider(self) -> MCPToolProvider:
        """This env's provider: the shared one of its configuration, or its own (``per_episode``)."""
        if self._mcp_provider is None or self._mcp_provider.closed:
            if self.mcp_scope == "shared":
                self._mcp_provider = shared_provider(self.mcp_servers, self.mcp_call_timeout_s)
            else:
                self._mcp_provider = MCPToolProvider(self.mcp_servers, "per_episode", self.mcp_call_timeout_s)
        return self._mcp_provider

    def _config_key(self) -> str:
        return json.dumps([[s.key() for s in self.mcp_servers], self.mcp_scope])

    def mcp_tools(self) -> list[MCPTool]:
        """The MCP tools (listed once per configuration and process; servers start if needed)."""
        key = self._config_key()
        if key not in _schema_cache:
            _schema_cache[key] = self.mcp_provider.tool_list()
        return _schema_cache[key]

    def tool_schemas(self) -> list[dict[str, Any]]:
        own = super().tool_schemas()
        names = {s["function"]["name"] for s in own}
        clash = sorted(names & {t.name for t in self.mcp_tools()})
        if clash:
            raise ValueError(f"{type(self).__name__}: MCP tools clash with @tool methods: {', '.join(clash)}")
        return own + [t.schema() for t in self.mcp_tools()]

    def _begin_episode(self) -> None:
        super()._begin_episode()
        if getattr(self, "_mcp_provider", None) is not None:
            self._mcp_provider.new_episode()  # type: ignore[union-attr]

    async def _run_tool(self, call: ToolCall) -> Message:
        if call.name in self.tool_functions():
            return await super()._run_tool(call)
        self.counters["tool_calls"] += 1

        def error(text: str) -> Message:
            self.counters["tool_errors"] += 1
            return Message(role="tool", content=self._bounded(f"Error: {text}"), tool_call_id=call.id, name=call.name)

        names = [t.name for t in self.mcp_tools()]
        if call.name not in names:
            available = list(self.tool_functions()) + names
            return error(f"unknown tool '{call.name}'. Available tools: {', '.join(available) or 'none'}.")
        try:
            result = await self.mcp_provider.acall(call.name, call.arguments)
        except MCPArgumentError as exc:
            return error(str(exc))
        except MCPTimeoutError as exc:
            self.counters["tool_timeouts"] += 1
            return error(str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a server failure is the model's information, not a crash
            return error(f"tool '{call.name}' failed: {exc}")
        if result.is_error:
            return error(f"tool '{call.name}' failed: {result.text}")
        return Message(role="tool", content=self._bounded(result.text), tool_call_id=call.id, name=call.name)

    def close(self) -> None:
        if self.mcp_scope == "per_episode" and self._mcp_provider is not None:
            self._mcp_provider.close()
            self._mcp_provider = None
        super().close()
