"""Reply bodies from finished choices: the assistant message (tool calls parsed back), log-prob
entries in the chat and legacy completions shapes, and the choice objects of both endpoints."""

from __future__ import annotations

import json
import uuid
from typing import Any

from tracegym.render.toolcalls import parse_assistant_text
from tracegym.serve.generation import Choice
from tracegym.serve.plan import RequestPlan
from tracegym.serve.state import ServerState
from tracegym.serve.tokens import TOKEN_ID_PREFIX, finite


def _wire_tool_calls(message: Any) -> list[dict[str, Any]]:
    """The parsed calls in OpenAI's shape, each with a fresh unique id."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for call in message.tool_calls]


def final_message(state: ServerState, plan: RequestPlan,
                  choice: Choice) -> tuple[dict[str, Any], str, tuple[str, ...]]:
    """A finished choice as ``({"content", ["tool_calls"]}, finish_reason, parse_errors)``."""
    tokens = choice.tokens
    visible = tokens[:-1] if tokens and tokens[-1] in state.stop_ids else tokens
    errors: tuple[str, ...] = ()
    calls: list[dict[str, Any]] = []
    if plan.tools_mode:
        if choice.cut_text is None:
            parsed = state.renderer.parse_completion(tokens)
            message, errors = parsed.message, parsed.errors
        else:  # a stop string cut the text: parse what is left of it
            message, errors = parse_assistant_text(choice.cut_text)
        content = message.content
        calls = _wire_tool_calls(message)
    else:
        text = choice.cut_text if choice.cut_text is not None else state.tokenizer.decode(
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


def shown(state: ServerState, plan: RequestPlan, token: int) -> tuple[str, list[int]]:
    """A token's text and bytes in a log-prob entry; vLLM's ``token_id:123`` placeholder under
    ``return_tokens_as_token_ids`` (its bytes stay the token's own)."""
    text, raw = state.token_text(token)
    return (f"{TOKEN_ID_PREFIX}{token}" if plan.token_id_text else text), raw


def logprob_entry(state: ServerState, choice: Choice, k: int, plan: RequestPlan) -> dict[str, Any]:
    """The chat ``logprobs.content`` entry of the choice's ``k``-th token."""
    token = choice.tokens[k]
    text, raw = shown(state, plan, token)
    entry: dict[str, Any] = {"token": text, "logprob": finite(choice.logprobs[k]), "bytes": raw, "token_id": token,
                             "top_logprobs": []}
    for alt, lp in choice.tops[k] or ():
        alt_text, alt_raw = shown(state, plan, alt)
        entry["top_logprobs"].append({"token": alt_text, "logprob": finite(lp), "bytes": alt_raw, "token_id": alt})
    return entry


def chat_choice(state: ServerState, plan: RequestPlan, choice: Choice) -> dict[str, Any]:
    """One choice of a non-streamed chat completion."""
    message, finish, errors = final_message(state, plan, choice)
    wire: dict[str, Any] = {"role": "assistant", **message, "refusal": None}
    if errors:
        wire["parse_errors"] = list(errors)
    logprobs = None
    if plan.logprobs:
        logprobs = {"content": [logprob_entry(state, choice, k, plan) for k in range(len(choice.tokens))],
                    "refusal": None}
    return {"index": choice.index, "message": wire, "finish_reason": finish, "logprobs": logprobs,
            "token_ids": list(choice.tokens)}


def completion_text(state: ServerState, plan: RequestPlan, choice: Choice) -> str:
    """The completion's text: up to a stop string, stop tokens left out (as vLLM's
    ``skip_special_tokens`` leaves out the end-of-turn token)."""
    if choice.cut_text is not None:
        return choice.cut_text
    stops = state.stop_ids | plan.stop_ids
    return state.tokenizer.decode([t for t in choice.tokens if t not in stops], skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)


def completion_logprobs(state: ServerState, plan: RequestPlan, choice: Choice,
                        prompt_scores: list[float] | None = None) -> dict[str, Any]:
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
            text, _ = shown(state, plan, token)
            tokens.append(text)
            offsets.append(offset)
            offset += len(state.token_text(token)[0])
            value = None if k == 0 else finite(prompt_scores[k - 1])
            values.append(value)
            tops.append(None if value is None else {text: value})
    for k, token in enumerate(choice.tokens):
        text, _ = shown(state, plan, token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(state.token_text(token)[0])
        top = {text: finite(choice.logprobs[k])}
        for alt, lp in choice.tops[k] or ():
            top.setdefault(shown(state, plan, alt)[0], finite(lp))
        values.append(finite(choice.logprobs[k]))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def completion_choice(state: ServerState, plan: RequestPlan, choice: Choice,
                      prompt_scores: list[float] | None) -> dict[str, Any]:
    """One choice of a ``/v1/completions`` reply."""
    item: dict[str, Any] = {
        "index": choice.index, "text": plan.prompt_text + completion_text(state, plan, choice),
        "logprobs": completion_logprobs(state, plan, choice, prompt_scores) if plan.logprobs else None,
        "finish_reason": "length" if choice.finish == "length" else "stop",
        "token_ids": list(choice.tokens),
    }
    if plan.return_token_ids:
        item["prompt_token_ids"] = list(plan.prompt)
    return item
