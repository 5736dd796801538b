"""Loading a model by name and serving it: ``build_app`` and the blocking ``serve`` behind
``tracegym serve``."""

from __future__ import annotations

import os

from fastapi import FastAPI

from tracegym.serve.app import create_app
from tracegym.serve.sessions import SessionStore
from tracegym.serve.state import ServeLimits

API_KEY_ENV = "TRACEGYM_API_KEY"


def build_app(model: str, *, renderer: str | None = None, max_batch_size: int = 16, dtype: str = "float32",
              api_key: str | None = None, limits: ServeLimits | None = None,
              record_dir: str | None = None) -> FastAPI:
    """Load ``model`` (a known name or a local folder), its renderer and an hf engine; return the app.

    ``record_dir``: make it a gateway whose finished sessions go to ``record_dir/trajectories.jsonl``.
    Raises ``ValueError``/``FileNotFoundError`` (one-line messages) for unknown models or renderers."""
    from tracegym.engines import make_engine
    from tracegym.models import load
    from tracegym.render import get_renderer

    limits = limits or ServeLimits(max_batch_size=max_batch_size)
    lm, tokenizer = load(model, dtype=dtype)
    rend = get_renderer(renderer or model, tokenizer)
    engine = make_engine("hf", model=lm, tokenizer=tokenizer, renderer=rend, max_batch_size=limits.max_batch_size)
    sessions = SessionStore(record_dir, model=model) if record_dir is not None else None
    return create_app(engine, rend, model, api_key=api_key, limits=limits, sessions=sessions)


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, *, renderer: str | None = None,
          max_batch_size: int = 16, dtype: str = "float32", api_key: str | None = None,
          limits: ServeLimits | None = None, record_dir: str | None = None) -> None:
    """Load ``model`` and serve it until interrupted (blocking). ``api_key`` defaults to the
    ``TRACEGYM_API_KEY`` environment variable; without either, requests need no key."""
    import uvicorn

    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    app = build_app(model, renderer=renderer, max_batch_size=max_batch_size, dtype=dtype, api_key=api_key,
                    limits=limits, record_dir=record_dir)
    print(f"tracegym serve: {model} on http://{host}:{port}/v1 "
          f"({'an API key is required' if api_key else 'no API key required'})", flush=True)
    if record_dir is not None:
        print(f"gateway: sessions at http://{host}:{port}/s/<session>/v1, POST /s/<session>/end to close one; "
              f"trajectories -> {record_dir}/trajectories.jsonl", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info")
