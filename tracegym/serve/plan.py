"""Request planning: a request body checked field by field and turned into a ``RequestPlan`` (prompt
ids, sampling parameters, what the reply must carry). Everything the server refuses is refused here,
with a 400 naming the parameter, before any work is queued."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracegym.engines.openai import message_from_wire
from tracegym.render.toolcalls import TOOL_CALL_CLOSE
from tracegym.serve.errors import APIError, bad_request, unsupported
from tracegym.serve.fields import boolean_field, integer_field, is_number, number_field
from tracegym.serve.sessions import Session
from tracegym.serve.state import ServerState
from tracegym.types import Message, SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 4
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit on ``logprobs``

# ``POST /v1/chat/completions``: the fields it takes
CHAT_FIELDS = frozenset({
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "stream",
    "stream_options", "temperature", "top_p", "n", "max_tokens", "max_completion_tokens", "stop", "seed",
    "logprobs", "top_logprobs", "logit_bias", "frequency_penalty", "presence_penalty", "user", "metadata", "store",
    # vLLM's extensions for token ids (what an RL client asks for; see docs/serve.md)
    "return_tokens_as_token_ids", "return_token_ids",
})
# ``POST /v1/completions``: one prompt (token ids or text), no streaming
COMPLETION_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "logprobs", "user",
    "stream", "echo", "stop_token_ids", "return_tokens_as_token_ids", "return_token_ids",
})
# OpenAI chat fields refused by name, with the reason
UNSUPPORTED_FIELDS = {
    "functions": "use 'tools'", "function_call": "use 'tool_choice'", "audio": "audio output is not supported",
    "modalities": "only text output is supported", "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model has no reasoning-effort setting",
    "service_tier": "there is one service tier", "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported",
}


@dataclass
class RequestPlan:
    """One checked request: what to sample and what the reply must carry."""

    prompt: list[int]
    params: SamplingParams
    tools_mode: bool  # tool schemas rendered into the prompt; the completion is parsed for calls
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    stop_after: tuple[str, ...]  # text that ends the choice once it has been sampled (kept in the output)
    logit_bias: dict[int, float]
    token_id_text: bool = False  # return_tokens_as_token_ids: log-prob tokens read ``token_id:123``
    return_token_ids: bool = False  # return_token_ids: the reply carries ``prompt_token_ids``
    stop_ids: frozenset[int] = frozenset()  # the request's own stop ids (completions' stop_token_ids)
    echo: bool = False  # completions' echo: the reply starts with the prompt (and its log-probs)
    prompt_text: str = ""  # echo: the prompt as text (the request's own string, or its ids decoded)
    # gateway sessions (``sessions.py``): the conversation asked, and how its prompt was built
    messages: tuple[Message, ...] = ()
    tools: tuple[dict[str, Any], ...] = ()
    bridged_from: int | None = None
    why_not_bridged: str | None = None


# --- shared by both endpoints ---------------------------------------------------------------------


def sampling_fields(state: ServerState,
                    body: dict[str, Any]) -> tuple[float, float, int, int | None, tuple[str, ...]]:
    """``temperature``, ``top_p``, ``n``, ``seed`` and ``stop`` of a request, checked."""
    temperature = number_field(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number_field(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise bad_request("top_p must be in (0, 1]", "top_p")
    n = integer_field(body, "n", 1)
    if not 1 <= n <= state.max_n:
        raise bad_request(f"n must be in 1..{state.max_n} on this server, got {n}", "n")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("'seed' must be an integer", "seed")
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if stop is not None:
        # anything but a string or a list becomes (None,), which the check below refuses
        stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else (None,)  # type: ignore
        if not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} such strings",
                              "stop")
    return temperature, top_p, n, seed, stops


def _context_exceeded(state: ServerState, prompt: list[int], prompt_param: str) -> APIError:
    return bad_request(f"the prompt has {len(prompt)} tokens; the context window is {state.max_context} tokens",
                       prompt_param, "context_length_exceeded")


def completion_budget(state: ServerState, body: dict[str, Any], key: str, prompt: list[int], prompt_param: str,
                      allow_zero: bool = False) -> int:
    """The completion's token budget: ``body[key]`` checked against the limits and the context
    left after ``prompt``, or (when absent) what is left of the context. ``allow_zero``: 0 means
    nothing is sampled (echo: the prompt's scores alone), for a prompt that fits the context."""
    asked = body.get(key)
    max_context, limit = state.max_context, state.limits.max_tokens
    if allow_zero and asked == 0 and not isinstance(asked, bool):
        if max_context is not None and len(prompt) > max_context:
            raise _context_exceeded(state, prompt, prompt_param)
        return 0
    if max_context is not None and len(prompt) >= max_context:
        raise _context_exceeded(state, prompt, prompt_param)
    room = None if max_context is None else max_context - len(prompt)
    if asked is None:
        candidates = [v for v in (state.default_max_tokens, room, limit) if v is not None]
        return min(candidates) if candidates else 256
    max_tokens = integer_field(body, key, 0)
    if max_tokens < 1:
        raise bad_request(f"{key} must be >= 1, got {max_tokens}", key)
    if limit is not None and max_tokens > limit:
        raise bad_request(f"{key} is {max_tokens}; this server allows at most {limit}", key)
    if room is not None and max_tokens > room:
        raise bad_request(
            f"the context window is {max_context} tokens; the prompt has {len(prompt)} and {key} asks for "
            f"{max_tokens} more ({len(prompt) + max_tokens} in all): lower {key}", key, "context_length_exceeded")
    return max_tokens


def token_ids_field(state: ServerState, value: Any, param: str) -> list[int]:
    """``value`` as a non-empty list of token ids of this vocabulary."""
    if (not isinstance(value, list) or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < state.vocab_size for t in value)):
        raise bad_request(f"'{param}' must be a non-empty list of token ids in 0..{state.vocab_size - 1}", param)
    return list(value)


# --- POST /v1/chat/completions --------------------------------------------------------------------


def _check_chat_field_names(body: dict[str, Any]) -> None:
    for key in body:
        if key in UNSUPPORTED_FIELDS:
            raise unsupported(f"'{key}' is not supported by tracegym serve: {UNSUPPORTED_FIELDS[key]}", key)
        if key not in CHAT_FIELDS:
            raise bad_request(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")


def _chat_messages(body: dict[str, Any]) -> list[Message]:
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    try:
        return [message_from_wire(m).message for m in raw_messages]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise bad_request(f"invalid 'messages': {exc}", "messages") from None


def _chat_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked."""
    tools = body.get("tools") or None
    if tools is not None:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools
        ):
            raise bad_request("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tools")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise unsupported(
            "tool_choice must be 'auto' or 'none': 'required' and named functions would need constrained "
            "decoding, which tracegym serve does not do", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return tools, tool_choice, parallel


def _refuse_unsupported_options(body: dict[str, Any]) -> None:
    """Options this server cannot honour (constrained decoding, penalties, storage) are refused."""
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        kind = response_format.get("type") if isinstance(response_format, dict) else response_format
        raise unsupported(f"response_format {kind!r} is not supported (no constrained decoding); only 'text'",
                          "response_format")
    for key in ("frequency_penalty", "presence_penalty"):
        value = body.get(key)
        if value is not None and (not is_number(value) or value != 0):
            raise unsupported(f"'{key}' is not supported (only 0)", key)
    if body.get("store"):
        raise unsupported("'store' is not supported: completions are not stored", "store")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad_request("'metadata' must be an object", "metadata")


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = boolean_field(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is None:
        return stream, False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise unsupported("stream_options supports only 'include_usage'", "stream_options")
    return stream, bool(stream_options.get("include_usage"))


def _chat_logprobs(state: ServerState, body: dict[str, Any]) -> tuple[bool, int]:
    """``logprobs`` and ``top_logprobs``, checked against each other and against the backend."""
    logprobs = boolean_field(body, "logprobs", False)
    top_logprobs = integer_field(body, "top_logprobs", 0)
    if body.get("top_logprobs") is not None:
        if not logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}", "top_logprobs")
    if logprobs and not state.backend.returns_logprobs:
        raise unsupported("this engine does not return log-probs", "logprobs")
    if top_logprobs and not state.backend.top_logprobs:
        raise unsupported("this engine does not return top log-probs", "top_logprobs")
    return logprobs, top_logprobs


def _logit_bias(state: ServerState, body: dict[str, Any]) -> dict[int, float]:
    """``logit_bias`` as token id -> bias in [-100, 100]."""
    logit_bias: dict[int, float] = {}
    if not body.get("logit_bias"):
        return logit_bias
    if not state.backend.logit_bias:
        raise unsupported("this engine does not take a logit bias", "logit_bias")
    raw_bias = body["logit_bias"]
    if not isinstance(raw_bias, dict):
        raise bad_request("'logit_bias' must map token ids to numbers", "logit_bias")
    for key, value in raw_bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < state.vocab_size or not is_number(value) or not -100 <= value <= 100:
            raise bad_request(
                f"logit_bias: token {key} must be in 0..{state.vocab_size - 1} and its value in [-100, 100]",
                "logit_bias")
        logit_bias[token] = float(value)
    return logit_bias


def plan_chat(state: ServerState, body: dict[str, Any], session: Session | None = None) -> RequestPlan:
    """A ``/v1/chat/completions`` request: the messages (and tools) rendered by the model's renderer;
    in a gateway ``session``, bridged onto an earlier call's sampled tokens where it continues one.

    Fields are checked in a fixed order, so a request with several bad fields always names the same one."""
    _check_chat_field_names(body)
    messages = _chat_messages(body)
    tools, tool_choice, parallel = _chat_tools(body)
    _refuse_unsupported_options(body)
    stream, include_usage = _stream_fields(body)
    temperature, top_p, n, seed, stops = sampling_fields(state, body)
    logprobs, top_logprobs = _chat_logprobs(state, body)
    logit_bias = _logit_bias(state, body)
    tools_mode = tools is not None and tool_choice != "none"
    if session is not None:
        if body.get("stream"):
            raise unsupported("a gateway session records non-streamed calls only; send stream: false", "stream")
        if body.get("n") not in (None, 1):
            raise unsupported("a gateway session records one choice per call; send n: 1", "n")
        prompt, bridged_from, why = session.plan_prompt(state.renderer, messages, tools if tools_mode else None)
    else:
        prompt, bridged_from, why = state.renderer.render_prompt(messages, tools if tools_mode else None), None, None
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = completion_budget(state, body, key, prompt, "messages")
    imposed = session.sampling if session is not None else None
    if imposed is not None:  # a harness run: the rollout's sampling, whatever the agent asked
        temperature, top_p = imposed.temperature, imposed.top_p
        max_tokens = min(max_tokens, imposed.max_tokens or max_tokens)
        seed = imposed.call_seed(session.id, len(session.calls)) if imposed.seed is not None else seed  # type: ignore[union-attr]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, n=n, seed=seed,
                            stop=stops, stop_token_ids=tuple(sorted(state.stop_ids)))
    # parallel_tool_calls false: the turn ends once the first call is closed
    stop_after = (TOOL_CALL_CLOSE,) if tools_mode and parallel is False else ()
    return RequestPlan(prompt=prompt, params=params, tools_mode=tools_mode, stream=stream, include_usage=include_usage,
                       logprobs=logprobs, top_logprobs=top_logprobs if logprobs else 0, stop_after=stop_after,
                       logit_bias=logit_bias, token_id_text=boolean_field(body, "return_tokens_as_token_ids", False),
                       return_token_ids=boolean_field(body, "return_token_ids", False),
                       messages=tuple(messages), tools=tuple(tools or ()) if tools_mode else (),
                       bridged_from=bridged_from, why_not_bridged=why)


# --- POST /v1/completions -------------------------------------------------------------------------


def _completion_prompt(state: ServerState, raw: Any) -> list[int]:
    """The prompt's ids: token ids as they are (token in, token out), text tokenized without special tokens."""
    if isinstance(raw, str) and raw:
        return list(state.tokenizer(raw, add_special_tokens=False)["input_ids"])
    if isinstance(raw, list) and raw and all(isinstance(t, list) for t in raw):
        raise unsupported("one prompt per request on this server", "prompt")
    return token_ids_field(state, raw, "prompt")


def _completion_logprobs(state: ServerState, body: dict[str, Any], echo: bool) -> int | None:
    """The legacy ``logprobs`` (how many alternatives per token; None: no log-probs), checked."""
    if body.get("logprobs") is None:
        return None
    logprobs = integer_field(body, "logprobs", 0)
    if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise bad_request(f"logprobs must be in 0..{MAX_COMPLETION_LOGPROBS}", "logprobs")
    if echo and logprobs:
        raise unsupported("with echo, logprobs must be 0: the prompt's tokens are scored without "
                          "alternatives", "logprobs")
    if echo and not state.backend.scores_prompts:
        raise unsupported("echo with logprobs needs an engine that scores prompts (prompt_logprobs); "
                          "this one does not", "echo")
    if not state.backend.returns_logprobs:
        raise unsupported("this engine does not return log-probs", "logprobs")
    if logprobs and not state.backend.top_logprobs:
        raise unsupported("this engine does not return top log-probs", "logprobs")
    return logprobs


def plan_completion(state: ServerState, body: dict[str, Any]) -> RequestPlan:
    """A ``/v1/completions`` request: one prompt, token ids (used as they are: token in, token
    out) or text (tokenized without special tokens)."""
    for key in body:
        if key not in COMPLETION_FIELDS:
            raise bad_request(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
    if boolean_field(body, "stream", False):
        raise unsupported("stream is not supported on /v1/completions (use /v1/chat/completions)", "stream")
    echo = boolean_field(body, "echo", False)
    raw = body.get("prompt")
    prompt = _completion_prompt(state, raw)
    temperature, top_p, n, seed, stops = sampling_fields(state, body)
    logprobs = _completion_logprobs(state, body, echo)
    extra_stops = (frozenset(token_ids_field(state, body["stop_token_ids"], "stop_token_ids"))
                   if body.get("stop_token_ids") else frozenset())
    if body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool) and not echo:
        raise bad_request("max_tokens must be >= 1 (0 only with echo: true, for the prompt's scores alone), got 0",
                          "max_tokens")
    max_tokens = completion_budget(state, body, "max_tokens", prompt, "prompt", allow_zero=echo)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, n=n, seed=seed,
                            stop=stops, stop_token_ids=tuple(sorted(state.stop_ids | extra_stops)))
    prompt_text = ""
    if echo:
        prompt_text = raw if isinstance(raw, str) else state.tokenizer.decode(
            prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return RequestPlan(prompt=prompt, params=params, tools_mode=False, stream=False, include_usage=False,
                       logprobs=logprobs is not None, top_logprobs=logprobs or 0, stop_after=(), logit_bias={},
                       token_id_text=boolean_field(body, "return_tokens_as_token_ids", False),
                       return_token_ids=boolean_field(body, "return_token_ids", False), stop_ids=extra_stops,
                       echo=echo, prompt_text=prompt_text)
