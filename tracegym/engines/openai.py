"""An engine for any OpenAI-compatible ``/v1/chat/completions`` server (OpenAI, vLLM serve, llama.cpp,
``tracegym serve``), over httpx.

It is message-level: ``chat(messages, tools, params) -> Message``. Tools go in the request; the
server's ``tool_calls`` come back as ``ToolCall``s. There are no token ids or log-probs, so
``generate`` is not available and the rollout runner takes its message-level path: the Turn's
``completion_ids`` are the local renderer's encoding of the returned message and
``completion_logprobs`` is None. Such trajectories serve SFT (teacher data) and evaluation.

The API key is read from the environment variable named by ``api_key_env`` (default
``OPENAI_API_KEY``) when the engine is built. It is sent only in the ``Authorization`` header; it
never appears in ``repr``, logs, error messages (every error text is redacted) or trajectories.

Transient failures (HTTP 429 and 5xx, connection errors, timeouts) are retried with exponential
backoff and jitter (``Retry-After`` honoured, capped at ``max_backoff_s``); other errors raise
``OpenAIEngineError`` at once.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from typing import Any, Sequence

import httpx

from tracegym.engines.base import Engine, EngineCapabilities
from tracegym.types import Generation, Message, ParsedCompletion, SamplingParams, ToolCall

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})

__all__ = ["OpenAIEngine", "OpenAIEngineError", "message_to_wire", "message_from_wire"]


class OpenAIEngineError(RuntimeError):
    """A request failed for good (after retries, or a non-retryable status). Text is redacted."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


# --- wire format <-> Message (shared with tracegym.serve) -------------------------------------------


def message_to_wire(message: Message) -> dict[str, Any]:
    """A ``Message`` in the OpenAI chat format (tool-call arguments as a JSON string)."""
    item: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        item["tool_calls"] = [
            {
                "id": call.id or f"call_{i}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
            }
            for i, call in enumerate(message.tool_calls)
        ]
        if not message.content:
            item["content"] = None
    if message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        item["name"] = message.name
    return item


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise ValueError(f"unsupported message content of type {type(content).__name__}")


def message_from_wire(item: dict[str, Any]) -> ParsedCompletion:
    """An OpenAI-format message -> ``Message``. Tool calls whose ``arguments`` are not a JSON object
    are left out and reported in ``errors`` (the same contract as ``Renderer.parse_completion``)."""
    if not isinstance(item, dict) or "role" not in item:
        raise ValueError(f"not a chat message: {item!r:.200}")
    role = item["role"]
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise ValueError(f"unsupported message role {role!r}")
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, call in enumerate(item.get("tool_calls") or []):
        fn = call.get("function") or {}
        name, raw = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            errors.append(f"tool call {i}: no function name")
            continue
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as exc:
            errors.append(f"tool call {i} ({name}): arguments are not valid JSON ({exc.msg})")
            continue
        if not isinstance(args, dict):
            errors.append(f"tool call {i} ({name}): arguments must be a JSON object")
            continue
        calls.append(ToolCall(name=name, arguments=args, raw=raw if isinstance(raw, str) else json.dumps(raw), id=call.get("id")))
    message = Message(
        role=role,
        content=_content_text(item.get("content")),
        tool_calls=tuple(calls),
        tool_call_id=item.get("tool_call_id"),
        name=item.get("name"),
    )
    return ParsedCompletion(message=message, errors=tuple(errors))


# --- the engine --------------------------------------------------------------------------------------


class OpenAIEngine(Engine):
    """Chat completions over HTTP.

    Args:
        model: model id sent in each request.
        base_url: server root including ``/v1`` (e.g. ``http://127.0.0.1:8000/v1``).
        api_key_env: name of the environment variable holding the key (unset: no auth header,
            fine for local servers).
        timeout_s: per-request timeout.
        max_retries: retries after the first attempt for transient failures.
        backoff_s / max_backoff_s: delay before retry k is ``min(max, backoff * 2**k)`` x jitter.
        transport: an httpx transport (tests).
    """

    name = "openai"
    returns_logprobs = False

    @property
    def capabilities(self) -> EngineCapabilities:
        """Message-level: no log-probs, completions re-encoded by the renderer, a server the recipe
        cannot update."""
        return EngineCapabilities(returns_logprobs=False, exact_token_ids=False, weight_sync="none")

    def __init__(
        self,
        model: str,
        base_url: str = "https://api.openai.com/v1",
        api_key_env: str = "OPENAI_API_KEY",
        *,
        timeout_s: float = 60.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        extra_body: dict[str, Any] | None = None,
        transport: httpx.BaseTransport | None = None,
    ):
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.model_name = model
        self.base_url = base_url.rstrip("/")
        self.api_key_env = api_key_env
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.extra_body = dict(extra_body or {})
        self._api_key = os.environ.get(api_key_env) or None
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport)
        self.requests = 0  # HTTP attempts, retries included
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}

    def __repr__(self) -> str:
        state = "set" if self._api_key else "unset"
        return f"OpenAIEngine(model={self.model_name!r}, base_url={self.base_url!r}, api_key_env={self.api_key_env!r} [{state}])"

    __str__ = __repr__

    def __getstate__(self) -> dict[str, Any]:  # never pickle the key (or the client)
        raise TypeError("OpenAIEngine is not picklable (it holds a client and a secret)")

    def _redact(self, text: str) -> str:
        if self._api_key:
            text = text.replace(self._api_key, "***")
        return text

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        raise NotImplementedError(
            "the openai engine is message-level (no token ids or log-probs): use chat(); "
            "the rollout runner does this automatically"
        )

    def request_body(self, messages: Sequence[Message], tools: Sequence[dict] | None, params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": [message_to_wire(m) for m in messages],
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
        }
        if tools:
            body["tools"] = list(tools)
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.n != 1:
            body["n"] = params.n
        body.update(self.extra_body)
        return body

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        if response is not None:
            retry_after = response.headers.get("retry-after")
            try:
                if retry_after is not None:
                    return min(self.max_backoff_s, max(0.0, float(retry_after)))
            except ValueError:
                pass
        return min(self.max_backoff_s, self.backoff_s * (2**attempt)) * random.uniform(0.5, 1.0)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST with retries; returns the decoded JSON body."""
        last = ""
        for attempt in range(self.max_retries + 1):
            response: httpx.Response | None = None
            self.requests += 1
            try:
                response = self._client.post(path, json=body)
            except httpx.TransportError as exc:  # connection refused/reset, timeouts
                last = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError:
                        raise OpenAIEngineError(
                            self._redact(f"{self.base_url}{path}: response is not JSON: {response.text[:200]!r}"),
                            response.status_code,
                        ) from None
                last = f"HTTP {response.status_code}: {response.text[:500]}"
                if response.status_code not in RETRY_STATUS:
                    raise OpenAIEngineError(self._redact(f"{self.base_url}{path} failed: {last}"), response.status_code)
            if attempt < self.max_retries:
                delay = self._delay(attempt, response)
                log.warning("%s%s: %s; retry %d/%d in %.2fs", self.base_url, path, self._redact(last), attempt + 1, self.max_retries, delay)
                time.sleep(delay)
        status = response.status_code if response is not None else None
        raise OpenAIEngineError(
            self._redact(f"{self.base_url}{path} failed after {self.max_retries + 1} attempts: {last}"), status
        )

    def chat_with_errors(self, messages: Sequence[Message], tools: Sequence[dict] | None, params: SamplingParams) -> ParsedCompletion:
        """One assistant message, with malformed tool calls reported as errors."""
        data = self.post("/chat/completions", self.request_body(messages, tools, params))
        try:
            choice = data["choices"][0]
            parsed = message_from_wire(choice["message"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise OpenAIEngineError(self._redact(f"malformed chat completion ({exc}): {json.dumps(data)[:300]}")) from None
        usage = data.get("usage") or {}
        for key in self.usage:
            self.usage[key] += int(usage.get(key) or 0)
        message = parsed.message
        if message.role != "assistant":
            message = message.model_copy(update={"role": "assistant"})
        ended = choice.get("finish_reason") != "length"
        return ParsedCompletion(message=message, errors=parsed.errors, ended_with_eot=ended)

    def chat(self, messages: Sequence[Message], tools: Sequence[dict] | None, params: SamplingParams) -> Message:
        return self.chat_with_errors(messages, tools, params).message

    def models(self) -> list[str]:
        try:
            response = self._client.get("/models")
            response.raise_for_status()
            return [m["id"] for m in response.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise OpenAIEngineError(self._redact(f"{self.base_url}/models failed: {exc}")) from None

    def close(self) -> None:
        self._client.close()
