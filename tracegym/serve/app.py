"""``create_app``: the FastAPI app over an engine and a renderer."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI

from tracegym.serve.auth import APIKeyCheck
from tracegym.serve.backends import StepperBackend, make_backend
from tracegym.serve.errors import add_error_handlers
from tracegym.serve.routes import router
from tracegym.serve.state import ServeLimits, ServerState
from tracegym.serve.tokens import TokenText


def _server_state(engine: Any, renderer: Any, model_name: str, max_context: int | None,
                  default_max_tokens: int | None, limits: ServeLimits) -> ServerState:
    created = int(time.time())
    tokenizer = renderer.tokenizer
    stop_ids = frozenset(int(i) for i in renderer.stop_token_ids) | frozenset(getattr(engine, "stop_token_ids", ()))
    backend = make_backend(engine, limits)
    max_n = limits.max_n
    if isinstance(backend, StepperBackend):
        if max_context is None:
            max_context = getattr(getattr(engine.model, "config", None), "max_position_embeddings", None)
        max_n = min(limits.max_n, limits.max_batch_size)  # all of a request's choices decode in one batch
    return ServerState(model_name=model_name, renderer=renderer, tokenizer=tokenizer, backend=backend,
                       limits=limits, stop_ids=stop_ids, vocab_size=len(tokenizer), max_n=max_n,
                       max_context=max_context, default_max_tokens=default_max_tokens,
                       token_text=TokenText(tokenizer), created=created)


def create_app(engine: Any, renderer: Any, model_name: str, *, max_context: int | None = None,
               default_max_tokens: int | None = None, api_key: str | None = None,
               limits: ServeLimits | None = None, sessions: Any = None) -> FastAPI:
    """A FastAPI app serving ``engine`` with ``renderer`` under the model id ``model_name``.

    ``engine``: an ``HFEngine`` (served with continuous batching) or any token engine with
    ``generate(prompts, params)`` (served one call at a time). ``max_context``: the context window
    (default: the hf model's ``max_position_embeddings``). ``default_max_tokens``: used when a
    request names none (default: what is left of the context, capped by ``limits.max_tokens``).
    ``api_key``: when set, every ``/v1`` request must send ``Authorization: Bearer <api_key>``.
    ``sessions``: a ``SessionStore`` makes the app a gateway (``tracegym.serve.sessions``): the
    session routes record every call token-exact and merge each session into a trajectory.

    The app's ``state`` holds ``server`` (the ``ServerState`` routes read), ``backend`` (closed by
    ``ServerThread.stop``) and ``stepper`` (the continuous-batching scheduler, or None).
    """
    state = _server_state(engine, renderer, model_name, max_context, default_max_tokens, limits or ServeLimits())
    app = FastAPI(title="tracegym", version="0.1")
    app.state.server = state
    app.state.backend = state.backend
    app.state.stepper = getattr(state.backend, "stepper", None)
    app.state.sessions = sessions
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)
    add_error_handlers(app)
    app.include_router(router)
    return app
