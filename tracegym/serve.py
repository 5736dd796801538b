"""An OpenAI-compatible server: ``POST /v1/chat/completions``, ``POST /v1/completions`` (token-id
prompts: token in, token out), ``GET /v1/models``, ``GET /health``.

    tracegym serve smollm2-135m --port 8000            # binds 127.0.0.1 unless --host says otherwise
    TRACEGYM_API_KEY=sk-local tracegym serve smollm2-135m   # then every /v1 request needs the key

The request's messages and tools are rendered by the model's renderer (tool schemas go where the
chat template puts them); the completion is parsed back: tool calls come back as ``tool_calls``
with fresh unique ids, ``content`` null and finish reason ``tool_calls``; malformed calls are listed
in the extra field ``message.parse_errors``. See ``docs/serve.md`` for the full list of fields.

Concurrency: over an ``HFEngine`` requests are decoded by a continuous-batching stepper
(``tracegym.engines.hf_stepper``): a new request joins the running batch at the next step and
leaves it when it finishes, so a long request never blocks a short one. Any other token engine
(``generate(prompts, params)``) is served one call at a time.

What is supported, and what is refused with a 400 rather than silently ignored:

- ``stream`` (SSE chunks, tool calls included, ``stream_options.include_usage``, ``data: [DONE]``),
  ``n``, ``seed``, ``temperature``, ``top_p``, ``max_tokens``/``max_completion_tokens``, ``stop``
  (removed from the output), ``logprobs``/``top_logprobs`` (of the sampling distribution: the
  log-probs an RL trainer needs), ``logit_bias``, ``tool_choice`` ``auto``/``none``,
  ``parallel_tool_calls`` (``false`` ends the turn after the first call), ``response_format``
  ``text``, ``user`` and ``metadata`` (annotations only).
- ``tool_choice`` ``required`` or a named function, ``response_format`` ``json_object`` /
  ``json_schema``, non-zero ``frequency_penalty``/``presence_penalty``, ``store: true``, audio and
  any other field: 400 naming the parameter (this server does not constrain decoding).

Extensions: every choice carries ``token_ids`` (the sampled ids, end-of-turn token included) and
every log-prob entry its ``token_id``; ``logprobs.content`` has one entry per sampled token. vLLM's
request extensions are understood as vLLM does: ``return_tokens_as_token_ids`` (log-prob tokens read
``token_id:123``) and ``return_token_ids`` (the reply carries ``prompt_token_ids``), and on
``/v1/completions`` ``stop_token_ids`` (more ids that end the completion).

``echo`` on ``/v1/completions`` (the legacy API's, as vLLM implements it): ``text`` starts with the
prompt's text, and with ``logprobs: 0`` ``logprobs.tokens`` / ``token_logprobs`` start with the
prompt's tokens and their log-probs (None for the first token), scored by the engine's
``prompt_logprobs`` at temperature 1 (the raw distribution), then the sampled tokens'.
``max_tokens: 0`` is allowed with ``echo`` only (the prompt's scores alone, nothing sampled). This is
how a distillation teacher is served (``teacher.engine: openai``); an engine without
``prompt_logprobs`` answers ``echo`` with ``logprobs`` with a 400 naming ``echo``.

Errors are OpenAI-shaped everywhere: ``{"error": {"message", "type", "param", "code"}}`` (404
``model_not_found``, 400 for bad or unsupported parameters and for ``max_tokens`` beyond the
context, 401 ``invalid_api_key``, 429 when the queue is full). ``ServerThread`` runs the server in
a background thread (tests, notebooks).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tracegym.engines.base import scores_prompts
from tracegym.engines.openai import message_from_wire
from tracegym.render.toolcalls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_assistant_text
from tracegym.types import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["APIError", "ServeLimits", "ServerThread", "build_app", "create_app", "serve", "API_KEY_ENV"]

API_KEY_ENV = "TRACEGYM_API_KEY"
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 4
NEG_INF_LOGPROB = -9999.0  # what JSON carries for a token outside the sampling distribution

# request fields, by how they are handled
_SUPPORTED = frozenset({
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "stream",
    "stream_options", "temperature", "top_p", "n", "max_tokens", "max_completion_tokens", "stop", "seed",
    "logprobs", "top_logprobs", "logit_bias", "frequency_penalty", "presence_penalty", "user", "metadata", "store",
    # vLLM's extensions for token ids (what an RL client asks for; see docs/serve.md)
    "return_tokens_as_token_ids", "return_token_ids",
})
# ``POST /v1/completions``: one prompt (token ids or text), no streaming
_COMPLETION_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "logprobs", "user",
    "stream", "echo", "stop_token_ids", "return_tokens_as_token_ids", "return_token_ids",
})
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit on ``logprobs``
TOKEN_ID_PREFIX = "token_id:"  # vLLM's token text under ``return_tokens_as_token_ids``
_UNSUPPORTED = {
    "functions": "use 'tools'", "function_call": "use 'tool_choice'", "audio": "audio output is not supported",
    "modalities": "only text output is supported", "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model has no reasoning-effort setting",
    "service_tier": "there is one service tier", "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported",
}


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body())


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _unsupported(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


@dataclass(frozen=True)
class ServeLimits:
    """Per-request and queue limits.

    ``max_n``: largest ``n``. ``max_tokens``: largest ``max_tokens`` a request may ask (None: the
    context window). ``max_queue``: requests that may wait for a place in the batch; one more is
    answered 429. ``max_batch_size``: rows decoded together (continuous batching).
    """

    max_n: int = 16
    max_tokens: int | None = None
    max_queue: int = 64
    max_batch_size: int = 16


# --- per-request plan and per-choice state ---------------------------------------------------------


@dataclass
class _Plan:
    prompt: list[int]
    params: SamplingParams
    tools_mode: bool
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    stop_after: tuple[str, ...]
    logit_bias: dict[int, float]
    token_id_text: bool = False  # return_tokens_as_token_ids: log-prob tokens read ``token_id:123``
    return_token_ids: bool = False  # return_token_ids: the reply carries ``prompt_token_ids``
    stop_ids: frozenset[int] = frozenset()  # the request's own stop ids (completions' stop_token_ids)
    echo: bool = False  # completions' echo: the reply starts with the prompt (and its log-probs)
    prompt_text: str = ""  # echo: the prompt as text (the request's own string, or its ids decoded)


class _Decoder:
    """Incremental detokenizer for one choice (worker thread): text so far, stop strings.

    The text is built from the tokens before any stop-id token; an incomplete UTF-8 sequence at the
    end is held back until its next byte arrives."""

    def __init__(self, tokenizer: Any, stop_ids: frozenset[int], stops: tuple[str, ...],
                 stop_after: tuple[str, ...], need_text: bool):
        self.tokenizer, self.stop_ids, self.stops, self.stop_after = tokenizer, stop_ids, stops, stop_after
        self.need_text = need_text or bool(stops) or bool(stop_after)
        self.tokens: list[int] = []
        self.text = ""
        self.cut_text: str | None = None  # the text before the first stop string, once one is hit
        self._prefix = 0
        self._read = 0
        self._searched = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> bool:
        """Append ``token``; True when a stop string (or ``stop_after`` text) ends the choice."""
        self.tokens.append(token)
        if token in self.stop_ids or not self.need_text or self.cut_text is not None:
            return False
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
        start = self._searched
        self._searched = len(self.text)
        for stop in self.stops:
            at = self.text.find(stop, max(0, start - len(stop) + 1))
            if at >= 0 and (self.cut_text is None or at < len(self.cut_text)):
                self.cut_text = self.text[:at]
        if self.cut_text is not None:
            return True
        return any(s in self.text[max(0, start - len(s) + 1):] for s in self.stop_after)


@dataclass
class _Choice:
    """One choice as the async side assembles it from the worker's events."""

    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[Any] = field(default_factory=list)
    text: str = ""
    cut_text: str | None = None
    finish: str | None = None
    sent: str = ""  # content already streamed
    pending_ids: list[int] = field(default_factory=list)
    pending_lps: list[dict[str, Any]] = field(default_factory=list)


# --- backends: the stepper (hf) or one engine call at a time (anything else) -----------------------

Submit = Callable[[int, int, float, Any], bool]


class _Handle:
    def __init__(self, cancel: Callable[[], None]):
        self.cancel = cancel


class _StepperBackend:
    """Continuous batching over an ``HFEngine``'s model."""

    top_logprobs = True
    logit_bias = True
    returns_logprobs = True

    def __init__(self, engine: Any, limits: ServeLimits):
        from tracegym.engines.hf_stepper import HFStepper

        self.engine = engine
        self.stepper = HFStepper(lambda: engine.model, max_batch_size=limits.max_batch_size,
                                 pad_token_id=engine.pad_token_id).start()
        self.scores_prompts = scores_prompts(engine)
        self._scoring = threading.Lock()  # one prompt scored at a time: bounded memory

    def score(self, prompt: list[int]) -> list[float]:
        """The prompt's log-probs (``HFEngine.prompt_logprobs``). It runs beside the stepper's steps
        on the same eval-mode model: forward passes under inference mode share no state."""
        with self._scoring:
            return self.engine.prompt_logprobs([prompt])[0]

    def queued(self) -> int:
        return self.stepper.waiting_requests

    def submit(self, plan: _Plan, stop_ids: frozenset[int], on_token: Submit, on_finish: Callable[[int, str], None]) -> _Handle:
        from tracegym.engines.hf_stepper import StepRequest

        p = plan.params
        request = StepRequest(
            prompt=plan.prompt, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, n=p.n,
            seed=p.seed, stop_token_ids=stop_ids, top_logprobs=plan.top_logprobs, logit_bias=plan.logit_bias,
            on_token=on_token, on_finish=on_finish,
        )
        self.stepper.submit(request)
        return _Handle(request.cancel)

    def stats(self) -> dict[str, Any]:
        s = self.stepper
        return {"active_rows": s.active_rows, "queued_requests": s.waiting_requests, "steps": s.steps,
                "max_active_rows": s.max_active_rows}

    def close(self) -> None:
        self.stepper.close()


class _SerialBackend:
    """Any token engine: one ``generate`` call at a time, replayed as token events."""

    top_logprobs = False
    logit_bias = False

    def __init__(self, engine: Any):
        self.engine = engine
        self.lock = threading.Lock()
        self.waiting = 0
        self._count = threading.Lock()
        caps = getattr(engine, "capabilities", None)
        self.returns_logprobs = bool(getattr(caps, "returns_logprobs", getattr(engine, "returns_logprobs", False)))
        self.scores_prompts = scores_prompts(engine)

    def score(self, prompt: list[int]) -> list[float]:
        """The prompt's log-probs (the engine's ``prompt_logprobs``), between ``generate`` calls."""
        with self.lock:
            return self.engine.prompt_logprobs([prompt])[0]

    def queued(self) -> int:
        return self.waiting

    def submit(self, plan: _Plan, stop_ids: frozenset[int], on_token: Submit, on_finish: Callable[[int, str], None]) -> _Handle:
        cancelled = threading.Event()
        with self._count:
            self.waiting += 1

        def work() -> None:
            with self.lock:
                with self._count:
                    self.waiting -= 1
                n = plan.params.n
                if cancelled.is_set():
                    for i in range(n):
                        on_finish(i, "abort")
                    return
                try:
                    generations = self.engine.generate([plan.prompt], plan.params)[0]
                except Exception:  # noqa: BLE001 - reported to the client as a 500
                    log.exception("serve: generation failed")
                    for i in range(n):
                        on_finish(i, "abort")
                    return
            for i, gen in enumerate(generations):
                reason = gen.finish_reason
                lps = gen.logprobs or (0.0,) * len(gen.token_ids)
                for j, (tok, lp) in enumerate(zip(gen.token_ids, lps)):
                    if on_token(i, int(tok), float(lp), None):
                        reason = "stop"
                        break
                    if tok in stop_ids:
                        reason = "stop"
                        break
                on_finish(i, reason)

        threading.Thread(target=work, daemon=True, name="tracegym-serve-call").start()
        return _Handle(cancelled.set)

    def stats(self) -> dict[str, Any]:
        return {"queued_requests": self.waiting}

    def close(self) -> None:
        pass


# --- token text for log-probs ---------------------------------------------------------------------


def _byte_level_table() -> dict[str, int]:
    """The printable-character alphabet byte-level BPE tokenizers write bytes in: printable Latin-1
    bytes stand for themselves, the others are shifted to code points 256 and up, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    table: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


class _TokenText:
    """Token id -> (text, UTF-8 bytes) for log-prob entries, cached."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.table = _byte_level_table()
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token)
        if hit is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and piece and all(ch in self.table for ch in piece):
                raw = [self.table[ch] for ch in piece]
            else:
                raw = list(text.encode("utf-8"))
            hit = self.cache[token] = (text, raw)
        return hit


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


# --- the app --------------------------------------------------------------------------------------


def create_app(engine: Any, renderer: Any, model_name: str, *, max_context: int | None = None,
               default_max_tokens: int | None = None, api_key: str | None = None,
               limits: ServeLimits | None = None) -> FastAPI:
    """A FastAPI app serving ``engine`` with ``renderer`` under the model id ``model_name``.

    ``engine``: an ``HFEngine`` (served with continuous batching) or any token engine with
    ``generate(prompts, params)`` (served one call at a time). ``max_context``: the context window
    (default: the hf model's ``max_position_embeddings``). ``default_max_tokens``: used when a
    request names none (default: what is left of the context, capped by ``limits.max_tokens``).
    ``api_key``: when set, every ``/v1`` request must send ``Authorization: Bearer <api_key>``.
    """
    from tracegym.engines.hf import HFEngine

    limits = limits or ServeLimits()
    app = FastAPI(title="tracegym", version="0.1")
    created = int(time.time())
    tokenizer = renderer.tokenizer
    token_text = _TokenText(tokenizer)
    vocab_size = len(tokenizer)
    stop_ids = frozenset(int(i) for i in renderer.stop_token_ids) | frozenset(getattr(engine, "stop_token_ids", ()))
    if isinstance(engine, HFEngine):
        backend: Any = _StepperBackend(engine, limits)
        if max_context is None:
            max_context = getattr(getattr(engine.model, "config", None), "max_position_embeddings", None)
        max_n = min(limits.max_n, limits.max_batch_size)
    else:
        backend = _SerialBackend(engine)
        max_n = limits.max_n
    app.state.backend = backend
    app.state.stepper = getattr(backend, "stepper", None)
    if api_key:
        app.add_middleware(_APIKeyCheck, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _bad(f"invalid request: {exc.errors()}").response()

    @app.exception_handler(Exception)
    async def _server_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("serve: unexpected error")
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "tracegym"}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, **backend.stats()}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise _model_not_found(model_id)
        return model_card()

    def _model_not_found(name: str) -> APIError:
        return APIError(404, f"The model '{name}' does not exist (this server serves '{model_name}')",
                        param="model", code="model_not_found")

    def plan_request(body: dict[str, Any]) -> _Plan:
        for key in body:
            if key in _UNSUPPORTED:
                raise _unsupported(f"'{key}' is not supported by tracegym serve: {_UNSUPPORTED[key]}", key)
            if key not in _SUPPORTED:
                raise _bad(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list) or not raw_messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        try:
            messages = [message_from_wire(m).message for m in raw_messages]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise _bad(f"invalid 'messages': {exc}", "messages") from None
        tools = body.get("tools") or None
        if tools is not None:
            if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools
            ):
                raise _bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise _unsupported(
                "tool_choice must be 'auto' or 'none': 'required' and named functions would need constrained "
                "decoding, which tracegym serve does not do", "tool_choice")
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
        response_format = body.get("response_format")
        if response_format is not None and response_format != {"type": "text"}:
            kind = response_format.get("type") if isinstance(response_format, dict) else response_format
            raise _unsupported(f"response_format {kind!r} is not supported (no constrained decoding); only 'text'",
                               "response_format")
        for key in ("frequency_penalty", "presence_penalty"):
            value = body.get(key)
            if value is not None and (not _is_number(value) or value != 0):
                raise _unsupported(f"'{key}' is not supported (only 0)", key)
        if body.get("store"):
            raise _unsupported("'store' is not supported: completions are not stored", "store")
        if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
            raise _bad("'metadata' must be an object", "metadata")
        stream = _boolean(body, "stream", False)
        stream_options = body.get("stream_options")
        include_usage = False
        if stream_options is not None:
            if not stream:
                raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
            if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
                raise _unsupported("stream_options supports only 'include_usage'", "stream_options")
            include_usage = bool(stream_options.get("include_usage"))
        temperature, top_p, n, seed, stops = sampling_fields(body)
        logprobs = _boolean(body, "logprobs", False)
        top_logprobs = _integer(body, "top_logprobs", 0)
        if body.get("top_logprobs") is not None:
            if not logprobs:
                raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
                raise _bad(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}", "top_logprobs")
        if logprobs and not backend.returns_logprobs:
            raise _unsupported("this engine does not return log-probs", "logprobs")
        if top_logprobs and not backend.top_logprobs:
            raise _unsupported("this engine does not return top log-probs", "top_logprobs")
        logit_bias: dict[int, float] = {}
        if body.get("logit_bias"):
            if not backend.logit_bias:
                raise _unsupported("this engine does not take a logit bias", "logit_bias")
            raw_bias = body["logit_bias"]
            if not isinstance(raw_bias, dict):
                raise _bad("'logit_bias' must map token ids to numbers", "logit_bias")
            for key, value in raw_bias.items():
                try:
                    token = int(key)
                except (TypeError, ValueError):
                    raise _bad(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
                if not 0 <= token < vocab_size or not _is_number(value) or not -100 <= value <= 100:
                    raise _bad(f"logit_bias: token {key} must be in 0..{vocab_size - 1} and its value in [-100, 100]",
                               "logit_bias")
                logit_bias[token] = float(value)
        tools_mode = tools is not None and tool_choice != "none"
        prompt = renderer.render_prompt(messages, tools if tools_mode else None)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = completion_budget(body, key, prompt, "messages")
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, n=n, seed=seed,
                                stop=stops, stop_token_ids=tuple(sorted(stop_ids)))
        stop_after = (TOOL_CALL_CLOSE,) if tools_mode and parallel is False else ()
        return _Plan(prompt=prompt, params=params, tools_mode=tools_mode, stream=stream, include_usage=include_usage,
                     logprobs=logprobs, top_logprobs=top_logprobs if logprobs else 0, stop_after=stop_after,
                     logit_bias=logit_bias, token_id_text=_boolean(body, "return_tokens_as_token_ids", False),
                     return_token_ids=_boolean(body, "return_token_ids", False))

    def sampling_fields(body: dict[str, Any]) -> tuple[float, float, int, int | None, tuple[str, ...]]:
        """``temperature``, ``top_p``, ``n``, ``seed`` and ``stop`` of a request, checked."""
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p <= 0.0:
            raise _bad("top_p must be in (0, 1]", "top_p")
        n = _integer(body, "n", 1)
        if not 1 <= n <= max_n:
            raise _bad(f"n must be in 1..{max_n} on this server, got {n}", "n")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _bad("'seed' must be an integer", "seed")
        stop = body.get("stop")
        stops: tuple[str, ...] = ()
        if stop is not None:
            stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else (None,)  # type: ignore[assignment]
            if not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
                raise _bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} such strings", "stop")
        return temperature, top_p, n, seed, stops

    def completion_budget(body: dict[str, Any], key: str, prompt: list[int], prompt_param: str,
                          allow_zero: bool = False) -> int:
        """The completion's token budget: ``body[key]`` checked against the limits and the context
        left after ``prompt``, or (when absent) what is left of the context. ``allow_zero``: 0 means
        nothing is sampled (echo: the prompt's scores alone), for a prompt that fits the context."""
        asked = body.get(key)
        if allow_zero and asked == 0 and not isinstance(asked, bool):
            if max_context is not None and len(prompt) > max_context:
                raise _bad(f"the prompt has {len(prompt)} tokens; the context window is {max_context} tokens",
                           prompt_param, "context_length_exceeded")
            return 0
        if max_context is not None and len(prompt) >= max_context:
            raise _bad(f"the prompt has {len(prompt)} tokens; the context window is {max_context} tokens",
                       prompt_param, "context_length_exceeded")
        room = None if max_context is None else max_context - len(prompt)
        if asked is not None:
            max_tokens = _integer(body, key, 0)
            if max_tokens < 1:
                raise _bad(f"{key} must be >= 1, got {max_tokens}", key)
            if limits.max_tokens is not None and max_tokens > limits.max_tokens:
                raise _bad(f"{key} is {max_tokens}; this server allows at most {limits.max_tokens}", key)
            if room is not None and max_tokens > room:
                raise _bad(
                    f"the context window is {max_context} tokens; the prompt has {len(prompt)} and {key} asks for "
                    f"{max_tokens} more ({len(prompt) + max_tokens} in all): lower {key}", key, "context_length_exceeded")
            return max_tokens
        candidates = [v for v in (default_max_tokens, room, limits.max_tokens) if v is not None]
        return min(candidates) if candidates else 256

    def _token_ids(value: Any, param: str) -> list[int]:
        if (not isinstance(value, list) or not value
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value)):
            raise _bad(f"'{param}' must be a non-empty list of token ids in 0..{vocab_size - 1}", param)
        return list(value)

    def plan_completion(body: dict[str, Any]) -> _Plan:
        """A ``/v1/completions`` request: one prompt, token ids (used as they are: token in, token
        out) or text (tokenized without special tokens)."""
        for key in body:
            if key not in _COMPLETION_FIELDS:
                raise _bad(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
        if _boolean(body, "stream", False):
            raise _unsupported("stream is not supported on /v1/completions (use /v1/chat/completions)", "stream")
        echo = _boolean(body, "echo", False)
        raw = body.get("prompt")
        if isinstance(raw, str) and raw:
            prompt = list(tokenizer(raw, add_special_tokens=False)["input_ids"])
        elif isinstance(raw, list) and raw and all(isinstance(t, list) for t in raw):
            raise _unsupported("one prompt per request on this server", "prompt")
        else:
            prompt = _token_ids(raw, "prompt")
        temperature, top_p, n, seed, stops = sampling_fields(body)
        logprobs = body.get("logprobs")
        if logprobs is not None:
            logprobs = _integer(body, "logprobs", 0)
            if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
                raise _bad(f"logprobs must be in 0..{MAX_COMPLETION_LOGPROBS}", "logprobs")
            if echo and logprobs:
                raise _unsupported("with echo, logprobs must be 0: the prompt's tokens are scored without "
                                   "alternatives", "logprobs")
            if echo and not backend.scores_prompts:
                raise _unsupported("echo with logprobs needs an engine that scores prompts (prompt_logprobs); "
                                   "this one does not", "echo")
            if not backend.returns_logprobs:
                raise _unsupported("this engine does not return log-probs", "logprobs")
            if logprobs and not backend.top_logprobs:
                raise _unsupported("this engine does not return top log-probs", "logprobs")
        extra_stops = frozenset(_token_ids(body["stop_token_ids"], "stop_token_ids")) if body.get("stop_token_ids") else frozenset()
        if body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool) and not echo:
            raise _bad("max_tokens must be >= 1 (0 only with echo: true, for the prompt's scores alone), got 0",
                       "max_tokens")
        max_tokens = completion_budget(body, "max_tokens", prompt, "prompt", allow_zero=echo)
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, n=n, seed=seed,
                                stop=stops, stop_token_ids=tuple(sorted(stop_ids | extra_stops)))
        prompt_text = ""
        if echo:
            prompt_text = raw if isinstance(raw, str) else tokenizer.decode(
                prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return _Plan(prompt=prompt, params=params, tools_mode=False, stream=False, include_usage=False,
                     logprobs=logprobs is not None, top_logprobs=logprobs or 0, stop_after=(), logit_bias={},
                     token_id_text=_boolean(body, "return_tokens_as_token_ids", False),
                     return_token_ids=_boolean(body, "return_token_ids", False), stop_ids=extra_stops,
                     echo=echo, prompt_text=prompt_text)

    async def read_body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise _bad("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return body

    def check_model(body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != model_name:
            raise _model_not_found(str(model))

    def start(plan: _Plan, body: dict[str, Any]) -> tuple[list[_Choice], asyncio.Queue, _Handle]:
        """Check the model and the queue, then hand ``plan`` to the backend; its tokens arrive as
        events on the returned queue."""
        check_model(body)
        if backend.queued() >= limits.max_queue:
            raise APIError(429, f"the server is busy: {backend.queued()} requests are already waiting; retry later",
                           type="rate_limit_error", code="rate_limit_exceeded")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        n = plan.params.n
        stops = stop_ids | plan.stop_ids
        decoders = [_Decoder(tokenizer, stops, plan.params.stop, plan.stop_after, plan.stream) for _ in range(n)]

        def on_token(row: int, token: int, logprob: float, top: Any) -> bool:
            decoder = decoders[row]
            stop = decoder.add(token)
            loop.call_soon_threadsafe(events.put_nowait, ("token", row, token, logprob, top, decoder.text, decoder.cut_text))
            return stop

        def on_finish(row: int, reason: str) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ("finish", row, reason))

        try:
            handle = backend.submit(plan, stops, on_token, on_finish)
        except ValueError as exc:
            raise _bad(str(exc)) from None
        return [_Choice(i) for i in range(n)], events, handle

    async def finish_all(request: Request, choices: list[_Choice], events: asyncio.Queue, handle: _Handle) -> JSONResponse | None:
        """Wait until every choice finished; a 499 response when the client went away first."""
        finished = 0
        while finished < len(choices):
            try:
                event = await asyncio.wait_for(events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    handle.cancel()
                    return JSONResponse(status_code=499, content=APIError(499, "client closed the request").body())
                continue
            finished += _apply(choices, event)
        if any(c.finish == "abort" for c in choices):
            raise APIError(500, "generation failed (see the server log)", type="server_error")
        return None

    def usage_of(plan: _Plan, choices: list[_Choice]) -> dict[str, int]:
        completion_tokens = sum(len(c.tokens) for c in choices)
        return {"prompt_tokens": len(plan.prompt), "completion_tokens": completion_tokens,
                "total_tokens": len(plan.prompt) + completion_tokens}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        plan = plan_request(body)
        choices, events, handle = start(plan, body)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if plan.stream:
            return StreamingResponse(
                _stream(plan, choices, events, handle, completion_id),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            )
        gone = await finish_all(request, choices, events, handle)
        if gone is not None:
            return gone
        out = []
        for choice in choices:
            message, finish, errors = _final_message(plan, choice)
            wire: dict[str, Any] = {"role": "assistant", **message, "refusal": None}
            if errors:
                wire["parse_errors"] = list(errors)
            out.append({
                "index": choice.index, "message": wire, "finish_reason": finish,
                "logprobs": {"content": [_lp_entry(choice, k, plan) for k in range(len(choice.tokens))], "refusal": None}
                if plan.logprobs else None,
                "token_ids": list(choice.tokens),
            })
        reply: dict[str, Any] = {
            "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
            "system_fingerprint": None, "choices": out, "usage": usage_of(plan, choices),
        }
        if plan.return_token_ids:
            reply["prompt_token_ids"] = list(plan.prompt)
        return reply

    async def score_prompt(plan: _Plan, handle: _Handle | None) -> list[float]:
        """The prompt's log-probs for an echo reply (engine errors: 400 for a ``ValueError``, else 500;
        the generation in flight, if any, is cancelled)."""
        try:
            scores = await asyncio.to_thread(backend.score, plan.prompt)
        except ValueError as exc:
            if handle is not None:
                handle.cancel()
            raise _bad(str(exc), "prompt") from None
        except Exception:  # noqa: BLE001 - reported to the client as a 500
            log.exception("serve: scoring the prompt failed")
            if handle is not None:
                handle.cancel()
            raise APIError(500, "scoring the prompt failed (see the server log)", type="server_error") from None
        if len(scores) != len(plan.prompt) - 1:
            raise APIError(500, f"the engine scored {len(scores)} of the prompt's {len(plan.prompt) - 1} tokens",
                           type="server_error")
        return scores

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        plan = plan_completion(body)
        running: tuple[asyncio.Queue, _Handle] | None = None
        if plan.params.max_tokens == 0:  # echo only: nothing is sampled
            check_model(body)
            choices = [_Choice(i, finish="length") for i in range(plan.params.n)]
        else:
            choices, events, handle = start(plan, body)
            running = (events, handle)
        # the prompt is scored while the completion is sampled
        prompt_scores = None
        if plan.echo and plan.logprobs:
            prompt_scores = await score_prompt(plan, running[1] if running is not None else None)
        if running is not None:
            gone = await finish_all(request, choices, *running)
            if gone is not None:
                return gone
        out = []
        for choice in choices:
            item: dict[str, Any] = {
                "index": choice.index, "text": plan.prompt_text + _completion_text(plan, choice),
                "logprobs": _completion_logprobs(plan, choice, prompt_scores) if plan.logprobs else None,
                "finish_reason": "length" if choice.finish == "length" else "stop",
                "token_ids": list(choice.tokens),
            }
            if plan.return_token_ids:
                item["prompt_token_ids"] = list(plan.prompt)
            out.append(item)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name, "system_fingerprint": None, "choices": out, "usage": usage_of(plan, choices)}

    # -- helpers that need the renderer ---------------------------------------------------------------
    def _apply(choices: list[_Choice], event: tuple) -> int:
        """Fold one worker event into its choice; 1 when it finished the choice."""
        if event[0] == "token":
            _, row, token, logprob, top, text, cut_text = event
            c = choices[row]
            c.tokens.append(token)
            c.logprobs.append(logprob)
            c.tops.append(top)
            c.text, c.cut_text = text, cut_text
            return 0
        _, row, reason = event
        choices[row].finish = reason
        return 1

    def _final_message(plan: _Plan, choice: _Choice) -> tuple[dict[str, Any], str, tuple[str, ...]]:
        tokens = choice.tokens
        visible = tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens
        errors: tuple[str, ...] = ()
        calls: list[dict[str, Any]] = []
        if plan.tools_mode:
            if choice.cut_text is None:
                parsed = renderer.parse_completion(tokens)
                message, errors = parsed.message, parsed.errors
            else:
                message, errors = parse_assistant_text(choice.cut_text)
            content = message.content
            calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                     for call in message.tool_calls]
        else:
            text = choice.cut_text if choice.cut_text is not None else tokenizer.decode(
                visible, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            content = text.strip()
        if choice.finish == "length":
            finish = "length"
        elif calls:
            finish = "tool_calls"
        else:
            finish = "stop"
        wire: dict[str, Any] = {"content": content if content or not calls else None}
        if calls:
            wire["tool_calls"] = calls
        return wire, finish, errors

    def _shown(plan: _Plan, token: int) -> tuple[str, list[int]]:
        """A token's text and bytes in a log-prob entry; vLLM's ``token_id:123`` placeholder under
        ``return_tokens_as_token_ids`` (its bytes stay the token's own)."""
        text, raw = token_text(token)
        return (f"{TOKEN_ID_PREFIX}{token}" if plan.token_id_text else text), raw

    def _lp_entry(choice: _Choice, k: int, plan: _Plan) -> dict[str, Any]:
        token = choice.tokens[k]
        text, raw = _shown(plan, token)
        entry: dict[str, Any] = {"token": text, "logprob": _finite(choice.logprobs[k]), "bytes": raw, "token_id": token,
                                 "top_logprobs": []}
        for alt, lp in choice.tops[k] or ():
            alt_text, alt_raw = _shown(plan, alt)
            entry["top_logprobs"].append({"token": alt_text, "logprob": _finite(lp), "bytes": alt_raw, "token_id": alt})
        return entry

    def _completion_text(plan: _Plan, choice: _Choice) -> str:
        """The completion's text: up to a stop string, stop tokens left out (as vLLM's
        ``skip_special_tokens`` leaves out the end-of-turn token)."""
        if choice.cut_text is not None:
            return choice.cut_text
        stops = stop_ids | plan.stop_ids
        return tokenizer.decode([t for t in choice.tokens if t not in stops], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)

    def _completion_logprobs(plan: _Plan, choice: _Choice, prompt_scores: list[float] | None = None) -> dict[str, Any]:
        """The legacy completions shape: one entry per sampled token (stop tokens included), after
        one per prompt token with ``echo`` (``prompt_scores``: ``len(prompt) - 1`` log-probs; the
        first prompt token has None, as nothing predicts it)."""
        tokens: list[str] = []
        offsets: list[int] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offset = 0
        if plan.echo:
            assert prompt_scores is not None
            for k, token in enumerate(plan.prompt):
                text, _ = _shown(plan, token)
                tokens.append(text)
                offsets.append(offset)
                offset += len(token_text(token)[0])
                value = None if k == 0 else _finite(prompt_scores[k - 1])
                values.append(value)
                tops.append(None if value is None else {text: value})
        for k, token in enumerate(choice.tokens):
            text, _ = _shown(plan, token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(token_text(token)[0])
            top = {text: _finite(choice.logprobs[k])}
            for alt, lp in choice.tops[k] or ():
                top.setdefault(_shown(plan, alt)[0], _finite(lp))
            values.append(_finite(choice.logprobs[k]))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _stream_content(plan: _Plan, choice: _Choice, final: bool) -> str:
        """The content that can be sent now without ever being taken back."""
        text = choice.cut_text if choice.cut_text is not None else choice.text
        end = len(text)
        if choice.cut_text is None and not final and plan.params.stop:
            end -= max(len(s) for s in plan.params.stop) - 1  # could be the start of a stop string
        if plan.tools_mode:
            at = text.find(TOOL_CALL_OPEN)
            if at >= 0:
                end = min(end, at)
            else:
                for j in range(len(TOOL_CALL_OPEN) - 1, 0, -1):
                    if text[:end].endswith(TOOL_CALL_OPEN[:j]):
                        end -= j
                        break
        candidate = text[:max(end, 0)].strip()
        return candidate if candidate.startswith(choice.sent) else choice.sent

    def _chunk(completion_id: str, choice_items: list[dict[str, Any]], usage: Any = None, with_usage: bool = False,
               prompt_ids: list[int] | None = None) -> str:
        payload: dict[str, Any] = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                                   "model": model_name, "system_fingerprint": None, "choices": choice_items}
        if with_usage:
            payload["usage"] = usage
        if prompt_ids is not None:  # return_token_ids: on the first chunk only, as vLLM sends it
            payload["prompt_token_ids"] = list(prompt_ids)
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def _stream(plan: _Plan, choices: list[_Choice], events: asyncio.Queue, handle: _Handle,
                      completion_id: str) -> AsyncIterator[str]:
        n = len(choices)
        finished = 0
        usage_flag = plan.include_usage

        def item(choice: _Choice, delta: dict[str, Any], finish: str | None = None, flush: bool = True) -> dict[str, Any]:
            out: dict[str, Any] = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": finish}
            if plan.logprobs:
                out["logprobs"] = {"content": choice.pending_lps, "refusal": None}
            out["token_ids"] = choice.pending_ids
            if flush:
                choice.pending_ids, choice.pending_lps = [], []
            return out

        try:
            for choice in choices:
                yield _chunk(completion_id, [item(choice, {"role": "assistant", "content": ""})], None, usage_flag,
                             prompt_ids=plan.prompt if plan.return_token_ids and choice.index == 0 else None)
            while finished < n:
                event = await events.get()
                done = _apply(choices, event)
                choice = choices[event[1]]
                if not done:
                    choice.pending_ids.append(choice.tokens[-1])
                    if plan.logprobs:
                        choice.pending_lps.append(_lp_entry(choice, len(choice.tokens) - 1, plan))
                    now = _stream_content(plan, choice, final=False)
                    if len(now) > len(choice.sent) or plan.logprobs:
                        delta = {"content": now[len(choice.sent):]} if len(now) > len(choice.sent) else {}
                        choice.sent = now
                        yield _chunk(completion_id, [item(choice, delta)], None, usage_flag)
                    continue
                finished += 1
                if choice.finish == "abort":
                    yield f"data: {json.dumps(APIError(500, 'generation failed', type='server_error').body())}\n\n"
                    return
                message, finish, errors = _final_message(plan, choice)
                content = message["content"] or ""
                if content.startswith(choice.sent) and len(content) > len(choice.sent):
                    yield _chunk(completion_id, [item(choice, {"content": content[len(choice.sent):]})], None, usage_flag)
                    choice.sent = content
                for k, call in enumerate(message.get("tool_calls", ())):
                    head = {"index": k, "id": call["id"], "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": ""}}
                    yield _chunk(completion_id, [item(choice, {"tool_calls": [head]})], None, usage_flag)
                    args = {"index": k, "function": {"arguments": call["function"]["arguments"]}}
                    yield _chunk(completion_id, [item(choice, {"tool_calls": [args]})], None, usage_flag)
                last = item(choice, {}, finish)
                if errors:
                    last["parse_errors"] = list(errors)
                yield _chunk(completion_id, [last], None, usage_flag)
            if usage_flag:
                completion_tokens = sum(len(c.tokens) for c in choices)
                usage = {"prompt_tokens": len(plan.prompt), "completion_tokens": completion_tokens,
                         "total_tokens": len(plan.prompt) + completion_tokens}
                yield _chunk(completion_id, [], usage, True)
            yield "data: [DONE]\n\n"
        finally:
            if finished < n:
                handle.cancel()  # the client went away: free the rows

    return app


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise _bad(f"{key} must be a number in [{low:g}, {high:g}], got {value!r}", key)
    return float(value)


def _integer(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer, got {value!r}", key)
    return value


def _boolean(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{key} must be a boolean, got {value!r}", key)
    return value


class _APIKeyCheck:
    """ASGI middleware: ``/v1`` requests need ``Authorization: Bearer <key>`` (compared in constant
    time; the key is never logged or echoed)."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                message = ("Incorrect API key provided" if given else
                           "You didn't provide an API key: send 'Authorization: Bearer <key>'")
                await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ServerThread:
    """Run an ASGI app with uvicorn in a daemon thread on ``host:port`` (port 0: a free port).

        with ServerThread(app) as server:
            httpx.get(server.url + "/v1/models")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.app = app
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
        backend = getattr(getattr(self.app, "state", None), "backend", None)
        if backend is not None:
            backend.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_app(model: str, *, renderer: str | None = None, max_batch_size: int = 16, dtype: str = "float32",
              api_key: str | None = None, limits: ServeLimits | None = None) -> FastAPI:
    """Load ``model`` (a known name or a local folder), its renderer and an hf engine; return the app.

    Raises ``ValueError``/``FileNotFoundError`` (one-line messages) for unknown models or renderers."""
    from tracegym.engines import make_engine
    from tracegym.models import load
    from tracegym.render import get_renderer

    limits = limits or ServeLimits(max_batch_size=max_batch_size)
    lm, tokenizer = load(model, dtype=dtype)
    rend = get_renderer(renderer or model, tokenizer)
    engine = make_engine("hf", model=lm, tokenizer=tokenizer, renderer=rend, max_batch_size=limits.max_batch_size)
    return create_app(engine, rend, model, api_key=api_key, limits=limits)


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, *, renderer: str | None = None,
          max_batch_size: int = 16, dtype: str = "float32", api_key: str | None = None,
          limits: ServeLimits | None = None) -> None:
    """Load ``model`` and serve it until interrupted (blocking). ``api_key`` defaults to the
    ``TRACEGYM_API_KEY`` environment variable; without either, requests need no key."""
    import uvicorn

    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    app = build_app(model, renderer=renderer, max_batch_size=max_batch_size, dtype=dtype, api_key=api_key,
                    limits=limits)
    print(f"tracegym serve: {model} on http://{host}:{port}/v1 "
          f"({'an API key is required' if api_key else 'no API key required'})", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info")
