"""``ServerThread``: the server in a background thread (tests, notebooks)."""

from __future__ import annotations

import threading
import time
from typing import Any


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
