"""An OpenAI-compatible server over the hf engine: ``POST /v1/chat/completions`` and ``GET /v1/models``.

    tracegym serve smollm2-135m --port 8000
    curl localhost:8000/v1/chat/completions -d '{"model": "smollm2-135m", "messages": [...], "tools": [...]}'

The request's messages and tools are rendered by the model's renderer (tool schemas go where the
chat template puts them), the hf engine samples with the renderer's end-of-turn ids as stop tokens,
and the completion is parsed back: tool calls are returned as ``tool_calls`` (finish reason
``tool_calls``), malformed ones are listed in the extra field ``message.parse_errors``.

Requests are served one at a time (a lock around the engine: the model is not thread-safe, and on a
CPU one batch uses every core anyway); ``n > 1`` samples are batched in one engine call.
``ServerThread`` runs the server in a background thread (tests, notebooks).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from tracegym.engines.openai import message_from_wire
from tracegym.types import SamplingParams

__all__ = ["create_app", "ServerThread", "serve"]


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind}})


def create_app(engine: Any, renderer: Any, model_name: str, *, max_context: int | None = None, default_max_tokens: int = 256):
    """A FastAPI app serving ``engine`` (a token engine, e.g. ``make_engine("hf", ...)``) with ``renderer``."""
    app = FastAPI(title="tracegym", version="0.1")
    lock = threading.Lock()
    created = int(time.time())

    def _generate(prompt: list[int], params: SamplingParams):
        with lock:
            return engine.generate([prompt], params)[0]

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "tracegym"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if body.get("stream"):
            return _error(400, "streaming is not supported by tracegym serve")
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list) or not raw_messages:
            return _error(400, "'messages' must be a non-empty list")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            return _error(400, "'tools' must be a list")
        try:
            messages = [message_from_wire(m).message for m in raw_messages]
            stop = body.get("stop") or ()
            params = SamplingParams(
                temperature=float(body.get("temperature", 1.0)),
                top_p=float(body.get("top_p", 1.0)),
                max_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens),
                n=int(body.get("n", 1)),
                seed=body.get("seed"),
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
                stop_token_ids=tuple(renderer.stop_token_ids),
            )
            prompt = renderer.render_prompt(messages, tools)
        except (ValueError, TypeError, KeyError) as exc:
            return _error(400, f"bad request: {exc}")
        if max_context is not None:
            if len(prompt) >= max_context:
                return _error(400, f"prompt has {len(prompt)} tokens; the context window is {max_context}")
            params = params.model_copy(update={"max_tokens": min(params.max_tokens, max_context - len(prompt))})
        try:
            generations = await run_in_threadpool(_generate, prompt, params)
        except ValueError as exc:
            return _error(400, str(exc))
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            return _error(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")
        choices = []
        completion_tokens = 0
        for index, gen in enumerate(generations):
            completion_tokens += len(gen.token_ids)
            parsed = renderer.parse_completion(gen.token_ids)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.message.content}
            if parsed.message.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": call.id or f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": call.name, "arguments": _json(call.arguments)},
                    }
                    for call in parsed.message.tool_calls
                ]
            if parsed.errors:
                message["parse_errors"] = list(parsed.errors)
            if gen.finish_reason == "length":
                finish = "length"
            elif parsed.message.tool_calls:
                finish = "tool_calls"
            else:
                finish = "stop"
            choices.append({"index": index, "message": message, "finish_reason": finish, "logprobs": None})
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) + completion_tokens,
            },
        }

    return app


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)


class ServerThread:
    """Run an ASGI app with uvicorn in a daemon thread on ``host:port`` (port 0: a free port).

        with ServerThread(app) as server:
            httpx.get(server.url + "/v1/models")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="tracegym-serve")
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.host}:{self.port} failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start in time")
            time.sleep(0.02)
        # the real port when port 0 was asked for
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, *, renderer: str | None = None,
          max_batch_size: int = 16, dtype: str = "float32") -> None:
    """Load ``model`` and serve it until interrupted (blocking)."""
    import uvicorn

    from tracegym.engines import make_engine
    from tracegym.models import load
    from tracegym.render import get_renderer

    lm, tokenizer = load(model, dtype=dtype)
    rend = get_renderer(renderer or model, tokenizer)
    engine = make_engine("hf", model=lm, tokenizer=tokenizer, renderer=rend, max_batch_size=max_batch_size)
    max_context = getattr(lm.config, "max_position_embeddings", None)
    app = create_app(engine, rend, model, max_context=max_context)
    uvicorn.run(app, host=host, port=port, log_level="info")
