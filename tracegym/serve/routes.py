"""The HTTP routes: ``GET /health``, ``GET /v1/models[/{id}]``, ``POST /v1/chat/completions`` and
``POST /v1/completions``. Each reads the shared ``ServerState`` through the ``ServerStateDep``
dependency; planning, generation and reply shapes live in their own modules."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from tracegym.serve.backends import Handle
from tracegym.serve.errors import bad_request
from tracegym.serve.generation import Choice, score_prompt, start_generation, usage_of, wait_for_choices
from tracegym.serve.plan import plan_chat, plan_completion
from tracegym.serve.replies import chat_choice, completion_choice
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
    body = await read_body(request)
    plan = plan_chat(state, body)
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
    reply: dict[str, Any] = {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
        "system_fingerprint": None, "choices": out, "usage": usage_of(plan, choices),
    }
    if plan.return_token_ids:
        reply["prompt_token_ids"] = list(plan.prompt)
    return reply


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
