"""Running a planned request: hand it to the backend, collect the worker thread's token events on the
event loop into one ``Choice`` per ``n``, and wait for them (or for the client to go away)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tracegym.serve.backends import Handle
from tracegym.serve.errors import APIError, bad_request
from tracegym.serve.plan import RequestPlan
from tracegym.serve.state import ServerState
from tracegym.serve.tokens import Decoder

log = logging.getLogger(__name__)


@dataclass
class Choice:
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


def apply_event(choices: list[Choice], event: tuple) -> int:
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


class _EventForwarder:
    """The backend's callbacks: they run on the worker thread, so each one detokenizes there (stop
    strings must end the choice before the next token is sampled) and posts an event to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue, decoders: list[Decoder]):
        self.loop, self.events, self.decoders = loop, events, decoders

    def on_token(self, row: int, token: int, logprob: float, top: Any) -> bool:
        decoder = self.decoders[row]
        stop = decoder.add(token)
        self.loop.call_soon_threadsafe(self.events.put_nowait,
                                       ("token", row, token, logprob, top, decoder.text, decoder.cut_text))
        return stop

    def on_finish(self, row: int, reason: str) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, ("finish", row, reason))


def start_generation(state: ServerState, plan: RequestPlan,
                     body: dict[str, Any]) -> tuple[list[Choice], asyncio.Queue, Handle]:
    """Check the model and the queue, then hand ``plan`` to the backend; its tokens arrive as
    events on the returned queue."""
    state.check_model(body)
    backend = state.backend
    if backend.queued() >= state.limits.max_queue:
        raise APIError(429, f"the server is busy: {backend.queued()} requests are already waiting; retry later",
                       type="rate_limit_error", code="rate_limit_exceeded")
    events: asyncio.Queue = asyncio.Queue()
    n = plan.params.n
    stops = state.stop_ids | plan.stop_ids
    decoders = [Decoder(state.tokenizer, stops, plan.params.stop, plan.stop_after, plan.stream) for _ in range(n)]
    forwarder = _EventForwarder(asyncio.get_running_loop(), events, decoders)
    try:
        handle = backend.submit(plan, stops, forwarder.on_token, forwarder.on_finish)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return [Choice(i) for i in range(n)], events, handle


async def wait_for_choices(request: Request, choices: list[Choice], events: asyncio.Queue,
                           handle: Handle) -> JSONResponse | None:
    """Wait until every choice finished; a 499 response when the client went away first."""
    finished = 0
    while finished < len(choices):
        try:
            event = await asyncio.wait_for(events.get(), timeout=1.0)
        except asyncio.TimeoutError:
            # no token for a second: a good moment to see whether anyone still wants the answer
            if await request.is_disconnected():
                handle.cancel()
                return JSONResponse(status_code=499, content=APIError(499, "client closed the request").body())
            continue
        finished += apply_event(choices, event)
    if any(c.finish == "abort" for c in choices):
        raise APIError(500, "generation failed (see the server log)", type="server_error")
    return None


async def score_prompt(state: ServerState, plan: RequestPlan, handle: Handle | None) -> list[float]:
    """The prompt's log-probs for an echo reply (engine errors: 400 for a ``ValueError``, else 500;
    the generation in flight, if any, is cancelled)."""
    try:
        scores = await asyncio.to_thread(state.backend.score, plan.prompt)
    except ValueError as exc:
        if handle is not None:
            handle.cancel()
        raise bad_request(str(exc), "prompt") from None
    except Exception:  # noqa: BLE001 - reported to the client as a 500
        log.exception("serve: scoring the prompt failed")
        if handle is not None:
            handle.cancel()
        raise APIError(500, "scoring the prompt failed (see the server log)", type="server_error") from None
    if len(scores) != len(plan.prompt) - 1:
        raise APIError(500, f"the engine scored {len(scores)} of the prompt's {len(plan.prompt) - 1} tokens",
                       type="server_error")
    return scores


def usage_of(plan: RequestPlan, choices: list[Choice]) -> dict[str, int]:
    completion_tokens = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": len(plan.prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(plan.prompt) + completion_tokens}
