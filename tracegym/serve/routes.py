"""The HTTP routes: ``GET /health``, ``GET /v1/models[/{id}]``, ``POST /v1/chat/completions`` and
``POST /v1/completions``; on a gateway (``create_app(..., sessions=...)``) also the session routes
``POST /s/{session}/v1/chat/completions`` (or the ``X-Tracegym-Session`` header on the plain path),
``GET /s/{session}/v1/models``, ``POST /s/{session}/end`` and ``GET /sessions``. Each reads the shared
``ServerState`` through the ``ServerStateDep`` dependency; planning, generation, reply shapes and
session recording live in their own modules."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from tracegym.engines.openai import message_from_wire
from tracegym.serve.backends import Handle
from tracegym.serve.errors import APIError, bad_request
from tracegym.serve.generation import Choice, score_prompt, start_generation, usage_of, wait_for_choices
from tracegym.serve.plan import plan_chat, plan_completion
from tracegym.serve.replies import chat_choice, completion_choice
from tracegym.serve.sessions import SESSION_HEADER, RecordedCall, Session, SessionStore
from tracegym.serve.state import ServerStateDep
from tracegym.serve.streaming import ChatStream

router = APIRouter()


async def read_body(request: Request) -> dict[str, Any]:
    """The request's JSON object (a 400 for anything else)."""
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


@router.get("/health")
async def health(state: ServerStateDep) -> dict[str, Any]:
    return {"status": "ok", "model": state.model_name, **state.backend.stats()}


@router.get("/v1/models")
async def list_models(state: ServerStateDep) -> dict[str, Any]:
    return {"object": "list", "data": [state.model_card()]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: ServerStateDep) -> dict[str, Any]:
    if model_id != state.model_name:
        raise state.model_not_found(model_id)
    return state.model_card()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, state: ServerStateDep) -> Response | dict[str, Any]:
    header = request.headers.get(SESSION_HEADER)
    return await _chat(request, state, _session(request, header) if header else None)


@router.post("/s/{session_id:path}/v1/chat/completions", response_model=None)
async def session_chat_completions(session_id: str, request: Request, state: ServerStateDep) -> Response | dict[str, Any]:
    return await _chat(request, state, _session(request, session_id))


@router.get("/s/{session_id:path}/v1/models")
async def session_models(session_id: str, request: Request, state: ServerStateDep) -> dict[str, Any]:
    _sessions(request)
    return {"object": "list", "data": [state.model_card()]}


@router.post("/s/{session_id:path}/end")
async def end_session(session_id: str, request: Request) -> dict[str, Any]:
    """Close a session: its calls merged into one trajectory (the reply), recorded when the gateway
    records. Body (optional): ``{"reward": float, "success": bool, "info": {...}}``."""
    store = _sessions(request)
    body = await read_body(request) if await request.body() else {}
    reward = body.get("reward", 0.0)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise bad_request("'reward' must be a number", "reward")
    success = body.get("success")
    if success is not None and not isinstance(success, bool):
        raise bad_request("'success' must be a boolean", "success")
    info = body.get("info") or {}
    if not isinstance(info, dict):
        raise bad_request("'info' must be an object", "info")
    try:
        trajectory = store.finish(session_id, reward=float(reward), success=success, info=info)
    except (KeyError, ValueError) as exc:
        raise APIError(404, str(exc).strip("'\""), param="session", code="session_not_found") from None
    return {"session": session_id, "token_breaks": trajectory.info["token_breaks"],
            "trajectory": trajectory.model_dump(mode="json")}


@router.get("/sessions")
async def list_sessions(request: Request) -> dict[str, Any]:
    return _sessions(request).stats()


def _sessions(request: Request) -> SessionStore:
    store = getattr(request.app.state, "sessions", None)
    if store is None:
        raise APIError(404, "this server records no sessions (start it with `tracegym gateway`)",
                       type="not_found_error", code="no_sessions")
    return store


def _session(request: Request, session_id: str) -> Session:
    if not session_id or len(session_id) > 200:
        raise bad_request("a session id is 1 to 200 characters", "session")
    return _sessions(request).get(session_id)


async def _chat(request: Request, state: ServerStateDep, session: Session | None) -> Response | dict[str, Any]:
    body = await read_body(request)
    plan = plan_chat(state, body, session)
    choices, events, handle = start_generation(state, plan, body)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    if plan.stream:
        return StreamingResponse(
            ChatStream(state, plan, choices, events, handle, completion_id).sse(),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
        )
    gone = await wait_for_choices(request, choices, events, handle)
    if gone is not None:
        return gone
    out = [chat_choice(state, plan, choice) for choice in choices]
    if session is not None:
        _record(session, plan, choices[0], out[0])
    reply: dict[str, Any] = {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
        "system_fingerprint": None, "choices": out, "usage": usage_of(plan, choices),
    }
    if plan.return_token_ids:
        reply["prompt_token_ids"] = list(plan.prompt)
    return reply


def _record(session: Session, plan: Any, choice: Choice, wire: dict[str, Any]) -> None:
    """Keep the call: the exact prompt, the sampled ids and log-probs, the reply as the agent got it."""
    reply = message_from_wire({k: v for k, v in wire["message"].items() if k in ("role", "content", "tool_calls")})
    session.record(RecordedCall(
        messages=plan.messages, tools=plan.tools, prompt_ids=tuple(plan.prompt), completion_ids=tuple(choice.tokens),
        logprobs=tuple(choice.logprobs) if len(choice.logprobs) == len(choice.tokens) else None,
        finish_reason="length" if choice.finish == "length" else "stop", reply=reply.message,
        parse_errors=tuple(wire["message"].get("parse_errors", ())), bridged_from=plan.bridged_from,
        why_not_bridged=plan.why_not_bridged))


@router.post("/v1/completions", response_model=None)
async def completions(request: Request, state: ServerStateDep) -> Response | dict[str, Any]:
    body = await read_body(request)
    plan = plan_completion(state, body)
    running: tuple[asyncio.Queue, Handle] | None = None
    if plan.params.max_tokens == 0:  # echo only: nothing is sampled
        state.check_model(body)
        choices = [Choice(i, finish="length") for i in range(plan.params.n)]
    else:
        choices, events, handle = start_generation(state, plan, body)
        running = (events, handle)
    # the prompt is scored while the completion is sampled
    prompt_scores = None
    if plan.echo and plan.logprobs:
        prompt_scores = await score_prompt(state, plan, running[1] if running is not None else None)
    if running is not None:
        gone = await wait_for_choices(request, choices, *running)
        if gone is not None:
            return gone
    out = [completion_choice(state, plan, choice, prompt_scores) for choice in choices]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "system_fingerprint": None, "choices": out, "usage": usage_of(plan, choices)}
