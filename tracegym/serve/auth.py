"""The API key check on ``/v1`` requests and a gateway's session routes."""

from __future__ import annotations

import hmac
from typing import Any

from tracegym.serve.errors import APIError


PROTECTED = ("/v1", "/s/", "/sessions")  # everything but /health


class APIKeyCheck:
    """ASGI middleware: ``/v1``, ``/s/...`` and ``/sessions`` requests need ``Authorization: Bearer <key>`` (compared in constant
    time; the key is never logged or echoed)."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                message = ("Incorrect API key provided" if given else
                           "You didn't provide an API key: send 'Authorization: Bearer <key>'")
                await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
