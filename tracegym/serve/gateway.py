"""``Gateway``: the OpenAI-compatible server with sessions, in a background thread, for code that
runs an unmodified agent against the policy and wants its trajectories back.

    with Gateway(engine, renderer, "policy") as gateway:
        client = gateway.client("task-7/0")        # an openai.AsyncOpenAI bound to that session
        answer = await my_agent(task, client)       # the agent needs nothing but its base_url
        trajectory = gateway.finish("task-7/0", reward=verify(answer))

Each session's calls are recorded token-exact and merged into one ``Trajectory``
(``tracegym.serve.sessions``); ``tracegym serve MODEL --record DIR`` is the same from the command line.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from tracegym.serve.app import create_app
from tracegym.serve.sessions import SessionSampling, SessionStore
from tracegym.serve.state import ServeLimits
from tracegym.serve.thread import ServerThread
from tracegym.types import Trajectory


class Gateway:
    """Serve ``engine`` with ``renderer`` on loopback with sessions (a random API key unless one is
    given: the agent's client carries it, nothing else on the machine can use the policy).
    ``sampling``: what every session call samples with, whatever the agent asks (``SessionSampling``)."""

    def __init__(self, engine: Any, renderer: Any, model_name: str = "policy", *, record_dir: str | Path | None = None,
                 limits: ServeLimits | None = None, max_context: int | None = None, api_key: str | None = None,
                 sampling: SessionSampling | None = None):
        self.model_name = model_name
        self.api_key = api_key or f"sk-tracegym-{secrets.token_hex(12)}"
        self.sessions = SessionStore(record_dir, model=model_name, sampling=sampling)
        self.app = create_app(engine, renderer, model_name, max_context=max_context, api_key=self.api_key,
                              limits=limits, sessions=self.sessions)
        self._thread = ServerThread(self.app)

    def __enter__(self) -> "Gateway":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.stop()

    def base_url(self, session_id: str) -> str:
        """The OpenAI base URL of one session (``.../s/<id>/v1``)."""
        return f"{self._thread.url}/s/{session_id}/v1"

    def client(self, session_id: str, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` bound to ``session_id`` (``kwargs`` go to the client)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url(session_id), api_key=self.api_key,
                                  **{"max_retries": 0, **kwargs})

    def finish(self, session_id: str, *, reward: float = 0.0, success: bool | None = None,
               info: dict[str, Any] | None = None, task_id: str | None = None) -> Trajectory:
        """The session's calls merged into one trajectory (``SessionStore.finish``)."""
        return self.sessions.finish(session_id, reward=reward, success=success, info=info, task_id=task_id)

    def discard(self, session_id: str) -> None:
        """Forget a session without merging it (its agent failed)."""
        self.sessions.discard(session_id)


__all__ = ["Gateway"]
