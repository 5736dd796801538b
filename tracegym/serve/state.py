"""What every route shares: the limits, and ``ServerState`` (built once by ``create_app``, kept on
``app.state.server``, handed to routes by the ``ServerStateDep`` dependency)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from tracegym.serve.errors import APIError
from tracegym.serve.tokens import TokenText

if TYPE_CHECKING:
    from tracegym.serve.backends import Backend


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


@dataclass(frozen=True)
class ServerState:
    """The served model and how requests are checked against it.

    ``stop_ids``: the renderer's and the engine's end-of-turn ids. ``max_n``: the largest ``n``
    (capped by the batch size under continuous batching). ``max_context``: the context window (None:
    unknown, unchecked). ``created``: when the app was made (the model card's ``created``)."""

    model_name: str
    renderer: Any
    tokenizer: Any
    backend: Backend
    limits: ServeLimits
    stop_ids: frozenset[int]
    vocab_size: int
    max_n: int
    max_context: int | None
    default_max_tokens: int | None
    token_text: TokenText
    created: int

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tracegym"}

    def model_not_found(self, name: str) -> APIError:
        return APIError(404, f"The model '{name}' does not exist (this server serves '{self.model_name}')",
                        param="model", code="model_not_found")

    def check_model(self, body: dict[str, Any]) -> None:
        """A 404 when the request names another model (leaving ``model`` out means this one)."""
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise self.model_not_found(str(model))


async def server_state(request: Request) -> ServerState:
    """The app's ``ServerState`` (async: read on the event loop, no worker thread needed)."""
    return request.app.state.server


ServerStateDep = Annotated[ServerState, Depends(server_state)]
