"""An engine for any OpenAI-compatible server (OpenAI, vLLM serve, llama.cpp, ``tracegym serve``), over
httpx. It speaks two endpoints:

- ``POST /chat/completions`` (``chat``, ``chat_with_errors``, ``chat_samples``): message-level. Tools
  go in the request; the server's ``tool_calls`` come back as ``ToolCall``s, and when the server has
  no tool parser (it returns none) the ``<tool_call>`` blocks of the text are parsed with the
  renderer's own parser, malformed ones reported as errors the env shows the model.
- ``POST /completions`` with token-id prompts (``generate``): token in, token out, what the rollout
  runner's token path and the RL recipe call. The prompt the server sees is exactly the prompt ids
  the trainer will score.

Log-probs (``logprobs=True``): each request asks for the sampled token's log-prob (chat:
``logprobs: true, top_logprobs: 0``; completions: ``logprobs: 0``). The sampled token ids come from
the server where it offers them (``token_ids="server"``, the default): ``tracegym serve`` always
returns them; vLLM does when asked with its extensions ``return_tokens_as_token_ids`` (each
log-prob entry's ``token`` reads ``token_id:123``) and ``return_token_ids`` (``token_ids`` on each
choice, end-of-turn token included, and ``prompt_token_ids``; since vLLM 0.10.2, PR
vllm-project/vllm#22587), both fields of vLLM's ``ChatCompletionRequest`` and ``CompletionRequest``
(``vllm/entrypoints/openai/chat_completion/protocol.py`` and ``completion/protocol.py``). vLLM
reports raw log-probs unless started with ``--logprobs-mode processed_logprobs`` (the sampling
distribution, after temperature and top-p: what the trainer compares with; see docs/serve.md).

A server that returns no ids (or ``token_ids="local"``, for servers that refuse unknown fields)
gets its text re-tokenized with the local tokenizer, and the sample says so
(``Sample.token_source == "local"``); log-probs are paired with such ids only when the counts match
(``Sample.aligned``), never shifted.

The engine can feed on-policy RL (``capabilities``) only with ``logprobs=True`` and ids from the
server. Re-tokenized ids are refused for RL unless ``allow_retokenized=True``: re-encoding text does
not give back the ids that were sampled in general (BPE merges across token boundaries, Unicode
normalisation, special tokens dropped by ``skip_special_tokens``, tool calls re-serialised by a
server-side parser), so the trainer would score tokens the sampler never drew and weight them with
log-probs of other tokens, biasing every ratio; equal counts do not prove equal ids.

Requests adapt to the server once per engine instance: ``max_tokens_param="auto"`` sends
``max_completion_tokens`` (OpenAI's newer name, which some models require) and, on a 400 that names
it, retries once with ``max_tokens`` and keeps that; a 400 naming one of vLLM's optional extensions
(``return_tokens_as_token_ids``, ``return_token_ids``, ``stop_token_ids``) drops it for good; a 400
naming ``n`` makes the engine ask one choice per request. ``n`` choices of one request are all kept
(``chat_samples``, ``generate``): a group of G samples for one prompt is one request with ``n=G``.

LoRA adapters on a vLLM server (``vllm serve BASE --enable-lora --max-loras 4 --max-lora-rank 16``
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): ``generate(prompts, params, adapters=[...])`` sends
each prompt's request with ``model=<that adapter's served name>`` (the base ``model`` for
``"__base__"`` or None); ``load_adapter(name, path)`` / ``unload_adapter(name)`` POST to vLLM's
``/load_lora_adapter`` / ``/unload_lora_adapter`` (``{"lora_name", "lora_path"}``; the path is read
by the server, so it must be on its filesystem). ``update_adapter(name, path)`` hot-swaps new
weights: it loads them under a new served name ``<name>-v<k>`` (a new name gets a new id from the
server, and recent vLLM keys prefix-cache blocks by adapter name, so reusing the name could serve
KV computed with the old weights, vllm-project/vllm#30931), routes ``name`` to it, then unloads the
previous version. See docs/multi_lora.md.

Scoring given sequences (``prompt_logprobs``, a distillation teacher): one ``POST /completions`` per
sequence with the token ids as ``prompt``, ``echo: true``, ``logprobs: 0``, ``max_tokens: 1`` and
``temperature: 1`` (the legacy OpenAI way, which vLLM and ``tracegym serve`` implement): the reply's
``logprobs.token_logprobs`` starts with the prompt's (``None`` for the first token), then the one
sampled token's, which is dropped. vLLM's own ``prompt_logprobs`` field (``[None, {"<id>":
{"logprob": ...}}, ...]``) is read instead when the reply carries it, the actual token's entry picked
by id. Where the server names the ids it scored (``token_id:123`` tokens, ``prompt_token_ids``) they
must be the ids sent. vLLM reports these under ``--logprobs-mode raw_logprobs`` (its default; at
temperature 1 with no top-p ``processed_logprobs`` gives the same numbers, the ``*_logits`` modes do
not); its context window must hold each sequence plus the one sampled token. A server that refuses
``echo`` gets a one-line error saying so.

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
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import httpx

from tracegym.engines.base import BASE_ADAPTER, Engine, EngineCapabilities
from tracegym.render.toolcalls import parse_assistant_text, serialize_assistant
from tracegym.types import FinishReason, Generation, Message, ParsedCompletion, SamplingParams, ToolCall

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})

TokenIdSource = Literal["server", "local"]
MaxTokensParam = Literal["auto", "max_tokens", "max_completion_tokens"]

# vLLM's request extensions that make it return the sampled ids (see the module docstring); a server
# that rejects one by name gets requests without it from then on.
ID_EXTENSIONS = ("return_tokens_as_token_ids", "return_token_ids")
# How vLLM writes a token under ``return_tokens_as_token_ids`` (``format_token_id_placeholder``).
TOKEN_ID_PREFIX = "token_id:"

__all__ = ["OpenAIEngine", "OpenAIEngineError", "Sample", "message_to_wire", "message_from_wire"]


class OpenAIEngineError(RuntimeError):
    """A request failed for good (after retries, or a non-retryable status). Text is redacted.

    ``detail``: the server's response body (redacted, cut), from which the engine reads which
    parameter a 400 names."""

    def __init__(self, message: str, status_code: int | None = None, detail: str = ""):
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail


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


# --- reading choices ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One choice of a request, as the engine read it.

    ``generation``: what ``HFEngine.generate`` returns for one sample (token ids, one log-prob per id
    or None, finish reason, text), so the rollout runner records it on a Turn as it is.
    ``token_source``: ``server`` (the ids the server sampled) or ``local`` (the text re-tokenized
    here: not the sampled ids in general, see the module docstring).
    ``aligned``: the log-probs, when any came back, pair one-to-one with ``generation.token_ids``.
    When False, ``generation.logprobs`` is None (never shifted onto other tokens) and what the
    server sent is still in ``server_logprobs``.
    ``parsed``: chat samples only: the assistant message, tool-call errors, whether the turn ended.
    ``prompt_token_ids``: the prompt as the server tokenized it, where it says (vLLM
    ``return_token_ids``); None otherwise.
    """

    generation: Generation
    token_source: TokenIdSource
    aligned: bool
    server_logprobs: tuple[float, ...] | None = None
    parsed: ParsedCompletion | None = None
    prompt_token_ids: tuple[int, ...] | None = None

    @property
    def retokenized(self) -> bool:
        """The ids were re-encoded from text here, not returned by the server."""
        return self.token_source == "local"


def _finish(reason: Any) -> FinishReason:
    if reason == "length":
        return "length"
    if reason == "abort":
        return "abort"
    return "stop"  # stop, tool_calls, a stop string or token, or a server that says nothing


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _placeholder_id(token: Any) -> int | None:
    """The id in vLLM's ``token_id:123`` placeholder, or None for any other token text."""
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX) and token[len(TOKEN_ID_PREFIX):].isdigit():
        return int(token[len(TOKEN_ID_PREFIX):])
    return None


def _logprob_values(values: list[Any]) -> list[float]:
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"a log-prob is not a number: {value!r:.40}")
        out.append(float(value))
    return out


def _chat_tokens(choice: dict[str, Any]) -> tuple[list[int] | None, list[float] | None]:
    """(sampled ids, log-probs) of a chat choice as the server sent them, each None when absent.
    Ids come from ``choice.token_ids`` (vLLM ``return_token_ids``, tracegym serve), else from the
    log-prob entries (``token_id`` of tracegym serve, vLLM's ``token_id:123`` token text)."""
    ids = _int_list(choice.get("token_ids"))
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        return ids, None
    values = _logprob_values([e.get("logprob") for e in entries])
    if ids is None and entries:
        found = [e["token_id"] if isinstance(e.get("token_id"), int) else _placeholder_id(e.get("token")) for e in entries]
        if all(i is not None for i in found):
            ids = [int(i) for i in found if i is not None]
    return ids, values


def _completion_tokens(choice: dict[str, Any]) -> tuple[list[int] | None, list[float] | None]:
    """(sampled ids, log-probs) of a ``/completions`` choice (``logprobs.tokens`` /
    ``logprobs.token_logprobs``), each None when absent."""
    ids = _int_list(choice.get("token_ids"))
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("token_logprobs"), list):
        return ids, None
    values = _logprob_values(logprobs["token_logprobs"])
    tokens = logprobs.get("tokens")
    if ids is None and isinstance(tokens, list) and tokens:
        found = [_placeholder_id(t) for t in tokens]
        if all(i is not None for i in found):
            ids = [int(i) for i in found if i is not None]
    return ids, values


def _prompt_scores(choice: dict[str, Any], prompt: list[int]) -> list[float]:
    """The prompt's log-probs in an ``echo`` reply (``len(prompt) - 1`` floats): vLLM's
    ``prompt_logprobs`` (the actual token's entry, by id) when present, else the first
    ``len(prompt)`` entries of ``logprobs.token_logprobs`` (the first one is None). Raises
    ``ValueError`` naming what is missing or inconsistent."""
    listed = choice.get("prompt_logprobs")
    if isinstance(listed, list) and len(listed) >= len(prompt):
        out = []
        for i in range(1, len(prompt)):
            entry = listed[i]
            if not isinstance(entry, dict):
                raise ValueError(f"prompt_logprobs[{i}] is not a mapping of token ids")
            found = entry.get(str(prompt[i]), entry.get(prompt[i]))  # type: ignore[call-overload]
            if found is None:
                raise ValueError(f"prompt_logprobs[{i}] has no entry for the prompt's token {prompt[i]}")
            out.append(found.get("logprob") if isinstance(found, dict) else found)
        return _logprob_values(out)
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list):
        raise ValueError("no logprobs.token_logprobs (and no prompt_logprobs) in the reply")
    if len(values) < len(prompt):
        raise ValueError(f"{len(values)} token log-probs for a prompt of {len(prompt)} tokens: the server did not echo it")
    tokens = logprobs.get("tokens")
    if isinstance(tokens, list) and len(tokens) >= len(prompt):
        ids = [_placeholder_id(t) for t in tokens[: len(prompt)]]
        if all(i is not None for i in ids) and ids != prompt:
            raise ValueError("the echoed token ids are not the prompt's: the server scored other tokens")
    return _logprob_values(values[1 : len(prompt)])


def _error_names(detail: str, field: str) -> bool:
    """Whether an error body names ``field``: its ``param``, or the name as a word of its message."""
    message = detail
    try:
        data = json.loads(detail)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data)  # OpenAI nests it; older vLLM answers the error object itself
        if isinstance(err, dict):
            if err.get("param") == field:
                return True
            message = str(err.get("message") or "")
        elif isinstance(err, str):
            message = err
    if len(field) == 1:  # "n" is a letter of every sentence: only a quoted name counts
        return any(f"{q}{field}{q}" in message for q in ("'", '"', "`"))
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])", message) is not None




def _server_message(text: str) -> str:
    """The error message of a server's answer (vLLM: ``{"error": {"message"}}``, older vLLM
    ``{"message"}``, FastAPI ``{"detail"}``), else the body itself, on one line."""
    message: Any = text
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            message = err.get("message") or err.get("detail") or data.get("detail") or text
        elif isinstance(err, str):
            message = err
    elif isinstance(data, str):
        message = data
    return " ".join(str(message).split())[:300]


# a different seed per prompt of one generate call: requests are seeded one by one on the server, and
# the G prompts of a group are often equal (turn 0), so one shared seed would draw G equal samples
_SEED_STRIDE = 0x9E3779B97F4A7C15


def _seed_for(seed: int | None, k: int) -> int | None:
    return None if seed is None else (int(seed) + k * _SEED_STRIDE) % 2**63


# --- the engine --------------------------------------------------------------------------------------


class OpenAIEngine(Engine):
    """Chat completions and token-in completions over HTTP.

    Args:
        model: model id sent in each request.
        base_url: server root including ``/v1`` (e.g. ``http://127.0.0.1:8000/v1``).
        api_key_env: name of the environment variable holding the key (unset: no auth header,
            fine for local servers).
        tokenizer / renderer: the policy's (``make_engine`` passes them): re-tokenizing text when
            the server returns no ids, the renderer's tool-call parser for text, its stop ids.
        logprobs: ask for the log-prob of every sampled token (what RL needs).
        token_ids: ``server`` (ask for the sampled ids: vLLM's ``return_tokens_as_token_ids`` and
            ``return_token_ids``; ``generate`` then fails on a reply without ids unless
            ``allow_retokenized``) or ``local`` (never ask: servers that refuse unknown fields,
            such as api.openai.com; ids are the text re-tokenized, and flagged).
        allow_retokenized: let re-tokenized ids feed RL (``capabilities.exact_token_ids``); off by
            default because they are not the sampled ids in general (module docstring).
        max_tokens_param: ``auto`` (``max_completion_tokens``, falling back once to ``max_tokens``
            on a 400 naming it), ``max_tokens`` or ``max_completion_tokens`` (chat requests;
            ``/completions`` only knows ``max_tokens``).
        parse_text_tool_calls: when tools were sent and the server returned no ``tool_calls`` (no
            tool parser), parse the calls from the text with the renderer's parser.
        max_concurrency: requests in flight at once for the prompts of one ``generate`` call.
        timeout_s: per-request timeout.
        max_retries: retries after the first attempt for transient failures.
        backoff_s / max_backoff_s: delay before retry k is ``min(max, backoff * 2**k)`` x jitter.
        extra_body: fields added to every request body.
        transport: an httpx transport (tests).
    """

    name = "openai"
    # without ``logprobs=True`` it returns none; the instance's ``capabilities`` say what it does
    returns_logprobs = False

    def __init__(
        self,
        model: str,
        base_url: str = "https://api.openai.com/v1",
        api_key_env: str = "OPENAI_API_KEY",
        *,
        tokenizer: Any = None,
        renderer: Any = None,
        logprobs: bool = False,
        token_ids: TokenIdSource = "server",
        allow_retokenized: bool = False,
        max_tokens_param: MaxTokensParam = "auto",
        parse_text_tool_calls: bool = True,
        max_concurrency: int = 16,
        timeout_s: float = 60.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        extra_body: dict[str, Any] | None = None,
        transport: httpx.BaseTransport | None = None,
    ):
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if token_ids not in ("server", "local"):
            raise ValueError(f"token_ids must be 'server' or 'local', got {token_ids!r}")
        if max_tokens_param not in ("auto", "max_tokens", "max_completion_tokens"):
            raise ValueError(f"max_tokens_param must be auto, max_tokens or max_completion_tokens, got {max_tokens_param!r}")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self.model_name = model
        self.base_url = base_url.rstrip("/")
        self.api_key_env = api_key_env
        self.renderer = renderer
        self.tokenizer = tokenizer if tokenizer is not None else getattr(renderer, "tokenizer", None)
        self.logprobs = bool(logprobs)
        self.returns_logprobs = self.logprobs
        self.token_ids: TokenIdSource = token_ids
        self.allow_retokenized = bool(allow_retokenized)
        self.max_tokens_param: MaxTokensParam = max_tokens_param
        self.parse_text_tool_calls = bool(parse_text_tool_calls)
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.extra_body = dict(extra_body or {})
        self._api_key = os.environ.get(api_key_env) or None
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport)
        self._lock = threading.Lock()  # counters, the pool: generate sends from several threads
        self._pool: ThreadPoolExecutor | None = None
        # what this server was found to accept (adapted on a 400 that names a field, then kept)
        self._max_tokens_key = "max_tokens" if max_tokens_param == "max_tokens" else "max_completion_tokens"
        self._dropped: set[str] = set()
        self._one_choice_per_request = False
        self.requests = 0  # HTTP attempts, retries included
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}
        self.samples = {"server": 0, "local": 0, "misaligned": 0}  # where the ids of each sample came from
        self._served: dict[str, str] = {}  # adapter name -> the name its current version is served under
        self._adapter_versions: dict[str, int] = {}

    @property
    def capabilities(self) -> EngineCapabilities:
        """Log-probs when ``logprobs=True``; exact token ids when they also come from the server
        (``token_ids="server"``; ``generate`` refuses a reply without them) or re-tokenized ids are
        explicitly allowed (``allow_retokenized``, see the module docstring for why they are not by
        default); weights live on a server the recipe cannot update."""
        exact = self.logprobs and (self.token_ids == "server" or self.allow_retokenized)
        return EngineCapabilities(returns_logprobs=self.logprobs, exact_token_ids=exact, weight_sync="none")

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

    def update_weights(self, model_or_state: Any) -> None:
        raise NotImplementedError(
            "the openai engine samples on a remote server that tracegym cannot load weights into "
            "(capabilities.weight_sync is 'none'); update the server yourself"
        )

    # -- HTTP -----------------------------------------------------------------------------------------
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
            with self._lock:
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
                    raise OpenAIEngineError(self._redact(f"{self.base_url}{path} failed: {last}"), response.status_code,
                                            self._redact(response.text[:4000]))
            if attempt < self.max_retries:
                delay = self._delay(attempt, response)
                log.warning("%s%s: %s; retry %d/%d in %.2fs", self.base_url, path, self._redact(last), attempt + 1, self.max_retries, delay)
                time.sleep(delay)
        status = response.status_code if response is not None else None
        raise OpenAIEngineError(
            self._redact(f"{self.base_url}{path} failed after {self.max_retries + 1} attempts: {last}"), status
        )

    def _adapted(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` as this server was found to accept it: refused optional fields left out, the
        completion budget under the name it takes."""
        out = {k: v for k, v in body.items() if k not in self._dropped}
        if self._max_tokens_key == "max_tokens" and "max_completion_tokens" in out:
            out["max_tokens"] = out.pop("max_completion_tokens")
        return out

    def _adapt_to(self, detail: str, body: dict[str, Any]) -> bool:
        """Learn from a 400 that names a field we can do without; True when something changed."""
        if ("max_completion_tokens" in body and self.max_tokens_param == "auto"
                and self._max_tokens_key == "max_completion_tokens" and _error_names(detail, "max_completion_tokens")):
            self._max_tokens_key = "max_tokens"
            log.info("%s does not take max_completion_tokens: sending max_tokens from now on", self.base_url)
            return True
        for key in (*ID_EXTENSIONS, "stop_token_ids"):
            if key in body and key not in self._dropped and _error_names(detail, key):
                self._dropped.add(key)
                log.info("%s refuses %r: leaving it out from now on", self.base_url, key)
                return True
        return False

    def _post_adapting(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        body = self._adapted(body)
        while True:  # ends: each adaptation happens once per engine, and a 400 that needs none is raised
            try:
                return self.post(path, body)
            except OpenAIEngineError as exc:
                if exc.status_code != 400 or not self._adapt_to(exc.detail, body):
                    raise
            body = self._adapted(body)

    def _count_usage(self, data: dict[str, Any]) -> None:
        usage = data.get("usage") or {}
        if not isinstance(usage, dict):
            return
        with self._lock:
            for key in self.usage:
                value = usage.get(key)
                self.usage[key] += int(value) if isinstance(value, (int, float)) else 0

    def _choices(self, path: str, body: dict[str, Any], n: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """``n`` choices of ``body`` as ``(choice, response)``: one request with ``n`` where the server
        takes it, more requests for choices it did not return (a server without ``n``)."""
        got: list[tuple[dict[str, Any], dict[str, Any]]] = []
        while len(got) < n:
            want = 1 if self._one_choice_per_request else n - len(got)
            request = {k: v for k, v in body.items() if k != "n"}
            if want > 1:
                request["n"] = want
            if got and request.get("seed") is not None:
                request["seed"] = _seed_for(request["seed"], len(got))  # the same seed would repeat the same samples
            try:
                data = self._post_adapting(path, request)
            except OpenAIEngineError as exc:
                if want > 1 and exc.status_code == 400 and _error_names(exc.detail, "n"):
                    self._one_choice_per_request = True
                    log.info("%s does not take n: one request per choice from now on", self.base_url)
                    continue
                raise
            choices = data.get("choices") if isinstance(data, dict) else None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
                raise OpenAIEngineError(
                    self._redact(f"malformed response from {path} (no choices): {json.dumps(data)[:300]}"))
            self._count_usage(data)
            choices = sorted(choices, key=lambda c: c["index"] if isinstance(c.get("index"), int) else 0)
            got.extend((c, data) for c in choices[: n - len(got)])
        return got

    # -- ids and log-probs of one choice --------------------------------------------------------------
    def _encode(self, text: str) -> list[int] | None:
        if self.renderer is not None:
            return list(self.renderer.encode_text(text))
        if self.tokenizer is not None:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return None

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        if params.stop_token_ids:
            return list(params.stop_token_ids)
        return list(getattr(self.renderer, "stop_token_ids", None) or [])

    def _sample(self, server_ids: list[int] | None, server_lps: list[float] | None, finish: FinishReason,
                text: str, retokenize: Callable[[], list[int] | None], stop_ids: Sequence[int],
                stop_reason: Any = None, parsed: ParsedCompletion | None = None,
                prompt_ids: list[int] | None = None) -> Sample:
        source: TokenIdSource
        if server_ids is not None:
            ids, source = server_ids, "server"
        else:
            ids, source = retokenize() or [], "local"
            # the end-of-turn token is sampled but not in the text (servers skip special tokens):
            # put it back when the log-prob count says the server counted one
            if finish == "stop" and server_lps is not None and len(server_lps) == len(ids) + 1:
                stop = stop_reason if isinstance(stop_reason, int) and not isinstance(stop_reason, bool) else (
                    stop_ids[0] if stop_ids else None)
                if stop is not None:
                    ids = [*ids, int(stop)]
        aligned = server_lps is None or len(server_lps) == len(ids)
        with self._lock:
            self.samples[source] += 1
            self.samples["misaligned"] += int(not aligned)
        if not aligned:
            log.warning("%s: %d log-probs for %d %s token ids: the log-probs are left out, never shifted",
                        self.base_url, len(server_lps or ()), len(ids), "re-tokenized" if source == "local" else "server")
        kept = tuple(server_lps) if aligned and server_lps is not None else None
        generation = Generation(token_ids=tuple(ids), logprobs=kept, finish_reason=finish, text=text)
        return Sample(generation=generation, token_source=source, aligned=aligned,
                      server_logprobs=tuple(server_lps) if server_lps is not None else None, parsed=parsed,
                      prompt_token_ids=tuple(prompt_ids) if prompt_ids is not None else None)

    # -- chat completions -----------------------------------------------------------------------------
    def request_body(self, messages: Sequence[Message], tools: Sequence[dict] | None, params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": [message_to_wire(m) for m in messages],
            "temperature": params.temperature,
            "top_p": params.top_p,
            self._max_tokens_key: params.max_tokens,
        }
        if tools:
            body["tools"] = list(tools)
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.n != 1:
            body["n"] = params.n
        if self.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = 0
            if self.token_ids == "server":
                body.update(dict.fromkeys(ID_EXTENSIONS, True))
        body.update(self.extra_body)
        return self._adapted(body)

    def _parse_text(self, text: str) -> tuple[Message, tuple[str, ...]]:
        """Tool calls written in the text, read by the renderer's own parser (the Hermes
        ``<tool_call>`` parser of ``tracegym.render.toolcalls`` without a renderer)."""
        parse = getattr(self.renderer, "_parse_assistant_text", None) or parse_assistant_text
        message, errors = parse(text)
        return message, tuple(errors)

    def _chat_sample(self, choice: dict[str, Any], data: dict[str, Any], tools_sent: bool, params: SamplingParams) -> Sample:
        wire = choice.get("message")
        try:
            parsed = message_from_wire(wire)  # type: ignore[arg-type]
            server_ids, server_lps = _chat_tokens(choice)
        except (KeyError, TypeError, ValueError) as exc:
            raise OpenAIEngineError(self._redact(f"malformed chat completion ({exc}): {json.dumps(data)[:300]}")) from None
        message, errors = parsed.message, list(parsed.errors)
        if message.role != "assistant":
            message = message.model_copy(update={"role": "assistant"})
        server_errors = wire.get("parse_errors") if isinstance(wire, dict) else None  # tracegym serve's extension
        if isinstance(server_errors, list):
            errors += [str(e) for e in server_errors]
        if tools_sent and self.parse_text_tool_calls and not message.tool_calls:
            # no tool parser on the server: the calls are still in the text
            message, text_errors = self._parse_text(message.content)
            errors += text_errors
        finish = _finish(choice.get("finish_reason"))
        # a server that parsed the text itself may report an error our parser finds again: once each
        parsed = ParsedCompletion(message=message, errors=tuple(dict.fromkeys(errors)), ended_with_eot=finish != "length")

        def retokenize() -> list[int] | None:
            if self.renderer is not None:  # the message as the model writes it, end-of-turn token left out
                try:
                    return list(self.renderer.encode_completion(message))[:-1]
                except ValueError:  # a message its template cannot write (qwen3 reasoning): the bare text
                    return self._encode(message.content)
            return self._encode(serialize_assistant(message))

        prompt_ids = _int_list(data.get("prompt_token_ids"))
        return self._sample(server_ids, server_lps, finish, message.content, retokenize, self._stop_ids(params),
                            choice.get("stop_reason"), parsed, prompt_ids)

    def chat_samples(self, messages: Sequence[Message], tools: Sequence[dict] | None,
                     params: SamplingParams) -> list[Sample]:
        """All ``params.n`` choices of one request (a group of samples for one prompt), each with
        its message, tool-call errors, and token ids and log-probs where the server gave them."""
        body = self.request_body(messages, tools, params)
        pairs = self._choices("/chat/completions", body, params.n)
        return [self._chat_sample(choice, data, bool(tools), params) for choice, data in pairs]

    def chat_with_errors(self, messages: Sequence[Message], tools: Sequence[dict] | None, params: SamplingParams) -> ParsedCompletion:
        """One assistant message, with malformed tool calls reported as errors."""
        [sample] = self.chat_samples(messages, tools, params.model_copy(update={"n": 1}))
        assert sample.parsed is not None
        return sample.parsed

    def chat(self, messages: Sequence[Message], tools: Sequence[dict] | None, params: SamplingParams) -> Message:
        return self.chat_with_errors(messages, tools, params).message

    # -- token-in completions -------------------------------------------------------------------------
    def completion_body(self, prompt: Sequence[int], params: SamplingParams, seed: int | None,
                        model: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model or self.model_name,
            "prompt": [int(t) for t in prompt],  # token ids: the server sees exactly this prompt
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if seed is not None:
            body["seed"] = seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)  # vLLM extension; dropped where refused
        if params.n != 1:
            body["n"] = params.n
        if self.logprobs:
            body["logprobs"] = 0  # the sampled token's log-prob only
        if self.token_ids == "server":
            body.update(dict.fromkeys(ID_EXTENSIONS, True))
        body.update(self.extra_body)
        return self._adapted(body)

    def _complete(self, prompt: list[int], params: SamplingParams, seed: int | None,
                  model: str | None = None) -> list[Sample]:
        pairs = self._choices("/completions", self.completion_body(prompt, params, seed, model), params.n)
        stop_ids = self._stop_ids(params)
        out = []
        for choice, data in pairs:
            try:
                server_ids, server_lps = _completion_tokens(choice)
            except (TypeError, ValueError) as exc:
                raise OpenAIEngineError(self._redact(f"malformed completion ({exc}): {json.dumps(data)[:300]}")) from None
            text = choice.get("text") if isinstance(choice.get("text"), str) else ""
            prompt_ids = _int_list(choice.get("prompt_token_ids")) or _int_list(data.get("prompt_token_ids"))
            if prompt_ids is not None and prompt_ids != prompt:
                raise OpenAIEngineError(f"{self.base_url}/completions changed the prompt ({len(prompt)} ids sent, "
                                        f"{len(prompt_ids)} used): its samples would not continue the prompt the trainer scores")
            sample = self._sample(server_ids, server_lps, _finish(choice.get("finish_reason")), text,
                                  lambda t=text: self._encode(t), stop_ids, choice.get("stop_reason"), None, prompt_ids)
            out.append(_cut_at_stop(sample, stop_ids))
        return out

    def completion_samples(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                           adapters: Sequence[str | None] | None = None) -> list[list[Sample]]:
        """For each token-id prompt, ``params.n`` samples from ``POST /completions`` (one request per
        prompt with ``n``, up to ``max_concurrency`` in flight), with where their ids came from.
        ``adapters``: one LoRA adapter name per prompt, sent as that request's ``model``
        (``model_for``)."""
        rows = [[int(t) for t in p] for p in prompts]
        for i, row in enumerate(rows):
            if not row:
                raise ValueError(f"prompt {i} is empty")
        if adapters is None:
            models: list[str | None] = [None] * len(rows)
        else:
            if isinstance(adapters, str):
                raise TypeError("adapters is one adapter name per prompt (a list), not a single string")
            if len(adapters) != len(rows):
                raise ValueError(f"adapters has {len(adapters)} names for {len(rows)} prompts: give one per prompt")
            models = [self.model_for(a) for a in adapters]
        jobs = [(row, _seed_for(params.seed, i), model) for i, (row, model) in enumerate(zip(rows, models))]
        if len(jobs) <= 1:
            return [self._complete(row, params, seed, model) for row, seed, model in jobs]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="tracegym-openai")
            pool = self._pool
        return list(pool.map(lambda job: self._complete(job[0], params, job[1], job[2]), jobs))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 adapters: Sequence[str | None] | None = None) -> list[list[Generation]]:
        """Token in, token out (``POST /completions`` with token-id prompts): ``params.n``
        generations per prompt, as ``HFEngine.generate`` returns them. With ``token_ids="server"``
        a reply without ids raises (unless ``allow_retokenized``): ids re-encoded from text must not
        pass for sampled ones. ``adapters``: one LoRA adapter name per prompt (``"__base__"`` or
        None: the base model), each request sent with ``model=`` that adapter's served name."""
        samples = self.completion_samples(prompts, params, adapters)
        if self.token_ids == "server" and not self.allow_retokenized:
            missing = sum(s.retokenized for row in samples for s in row)
            if missing:
                raise OpenAIEngineError(
                    f"{self.base_url}/completions returned no token ids for {missing} sample(s) (asked with "
                    f"{', '.join(ID_EXTENSIONS)}); use a server that returns them (vLLM >= 0.10.2, tracegym serve), "
                    "or token_ids: local with allow_retokenized: true to accept re-tokenized ids")
        return [[s.generation for s in row] for row in samples]

    # -- scoring given sequences (echo) ---------------------------------------------------------------
    def _echo(self, prompt: list[int], token_ids: bool) -> dict[str, Any]:
        """The one choice of ``POST /completions`` echoing ``prompt`` with its log-probs (see the module
        docstring); ``token_ids`` asks vLLM's id extensions too (tokens then read ``token_id:123``)."""
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": prompt,
            "echo": True,
            "logprobs": 0,  # the actual token's log-prob only, at every position
            "max_tokens": 1,  # one sampled token, dropped: some servers refuse 0
            "temperature": 1.0,
            "top_p": 1.0,
        }
        if token_ids:
            body.update(dict.fromkeys(ID_EXTENSIONS, True))
        body.update(self.extra_body)
        try:
            data = self._post_adapting("/completions", body)
        except OpenAIEngineError as exc:
            if exc.status_code == 400 and _error_names(exc.detail, "echo"):
                raise OpenAIEngineError(self._redact(
                    f"{self.base_url}/completions does not score prompts (echo with logprobs): "
                    f"{_server_message(exc.detail)}; serve the teacher with vllm serve or tracegym serve"),
                    exc.status_code, exc.detail) from None
            raise
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise OpenAIEngineError(self._redact(f"malformed response from /completions (no choices): {json.dumps(data)[:300]}"))
        self._count_usage(data)
        choice = dict(choices[0])
        if "prompt_token_ids" not in choice and "prompt_token_ids" in data:
            choice["prompt_token_ids"] = data["prompt_token_ids"]
        return choice

    def _score_one(self, prompt: list[int]) -> list[float]:
        if len(prompt) < 2:
            return []  # nothing to predict: no request
        choice = self._echo(prompt, self.token_ids == "server")
        used = _int_list(choice.get("prompt_token_ids"))
        if used is not None and used != prompt:
            raise OpenAIEngineError(f"{self.base_url}/completions scored other ids than the {len(prompt)} sent "
                                    f"({len(used)} used): its log-probs would not be the sequence's")
        try:
            return _prompt_scores(choice, prompt)
        except (TypeError, ValueError) as exc:
            raise OpenAIEngineError(self._redact(
                f"{self.base_url}/completions with echo: {exc}: {json.dumps(choice)[:300]}")) from None

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """For each token sequence, ``log p(seq[i] | seq[:i])`` for ``i >= 1`` (``len(seq) - 1`` floats)
        under the served model at temperature 1: one echo request per sequence, up to
        ``max_concurrency`` in flight, retried like every request (see the module docstring)."""
        from tracegym.engines.base import prompt_sequences

        rows = prompt_sequences(sequences)
        return self._map(self._score_one, rows)

    def prompt_token_texts(self, prompt: Sequence[int]) -> list[str] | None:
        """How the server reads each id of ``prompt``: the ``tokens`` of an echo reply asked without
        the id extensions (the server's own decoding of every id), or None when it gives no text."""
        row = [int(t) for t in prompt]
        logprobs = self._echo(row, False).get("logprobs")
        tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
        if not isinstance(tokens, list) or len(tokens) < len(row) or not all(isinstance(t, str) for t in tokens):
            return None
        if all(_placeholder_id(t) is not None for t in tokens[: len(row)]):
            return None  # ids, not text (a server that always answers with ids)
        return list(tokens[: len(row)])

    def _map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """``[fn(item) for item in items]``, up to ``max_concurrency`` at once on the engine's pool."""
        if len(items) <= 1:
            return [fn(item) for item in items]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="tracegym-openai")
            pool = self._pool
        return list(pool.map(fn, items))

    # -- LoRA adapters on a vLLM server ---------------------------------------------------------------
    def model_for(self, adapter: str | None) -> str:
        """The ``model`` a request for ``adapter`` is sent with: the base model for ``"__base__"`` or
        None, the served name of its current version after ``update_adapter``, else the name
        itself (an adapter loaded with ``load_adapter`` or the server's ``--lora-modules``)."""
        if adapter is None or adapter == BASE_ADAPTER:
            return self.model_name
        with self._lock:
            return self._served.get(adapter, adapter)

    def _adapter_post(self, path: str, body: dict[str, Any], doing: str) -> str:
        """POST to one of vLLM's adapter endpoints, once (a retried load could find the adapter
        loaded by the lost attempt); returns the server's text (vLLM answers ``Success: ...``),
        raises ``OpenAIEngineError`` with one line naming what failed and the server's message."""
        with self._lock:
            self.requests += 1
        url = f"{self.base_url}{path}"
        try:
            response = self._client.post(path, json=body)
        except httpx.TransportError as exc:
            raise OpenAIEngineError(self._redact(f"{doing} on {url} failed: {type(exc).__name__}: {exc}")) from None
        if response.status_code >= 400:
            message = _server_message(response.text)
            hint = ""
            if response.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
                hint = (" (no such endpoint: start vLLM with --enable-lora and the environment variable "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
            raise OpenAIEngineError(self._redact(f"{doing} on {url} failed (HTTP {response.status_code}): {message}{hint}"),
                                    response.status_code, self._redact(response.text[:4000]))
        return response.text

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> str:
        """Load the LoRA adapter saved in ``path`` (a folder with ``adapter_config.json``, on the
        server's filesystem) under the served name ``name``: ``POST /load_lora_adapter``. Requests
        for it then go with ``model=name``. Returns the server's answer."""
        if not name or name == BASE_ADAPTER:
            raise ValueError(f"adapter name must be a non-empty string other than {BASE_ADAPTER!r}, got {name!r}")
        lora_path = os.fspath(path)
        return self._adapter_post("/load_lora_adapter", {"lora_name": name, "lora_path": lora_path},
                                  f"loading LoRA adapter {name!r} from {lora_path!r}")

    def unload_adapter(self, name: str) -> str:
        """Unload a LoRA adapter: ``POST /unload_lora_adapter``. ``name`` is a served name, or an
        adapter name given to ``update_adapter`` (its current version is unloaded and forgotten)."""
        with self._lock:
            served = self._served.pop(name, name)
        return self._adapter_post("/unload_lora_adapter", {"lora_name": served},
                                  f"unloading LoRA adapter {served!r}")

    def update_adapter(self, name: str, path: str | os.PathLike[str]) -> str:
        """Hot-swap adapter ``name`` to the weights saved in ``path`` (on the server's filesystem):
        loads them under a new served name ``<name>-v<k>``, sends ``name``'s requests there from now
        on, then unloads the previous version (a failure to unload is logged, not raised: the new
        version is already in use). Returns the new served name."""
        if not name or name == BASE_ADAPTER:
            raise ValueError(f"adapter name must be a non-empty string other than {BASE_ADAPTER!r}, got {name!r}")
        with self._lock:
            version = self._adapter_versions.get(name, 0) + 1
            self._adapter_versions[name] = version
        served = f"{name}-v{version}"
        self.load_adapter(served, path)
        with self._lock:
            previous = self._served.get(name)
            self._served[name] = served
        if previous is not None:
            try:
                self._adapter_post("/unload_lora_adapter", {"lora_name": previous},
                                   f"unloading LoRA adapter {previous!r}")
            except OpenAIEngineError as exc:
                log.warning("%s (the new version %r is in use)", exc, served)
        return served

    @property
    def served_adapters(self) -> dict[str, str]:
        """Adapter name -> the served name of its current version (``update_adapter``)."""
        with self._lock:
            return dict(self._served)

    def models(self) -> list[str]:
        try:
            response = self._client.get("/models")
            response.raise_for_status()
            return [m["id"] for m in response.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise OpenAIEngineError(self._redact(f"{self.base_url}/models failed: {exc}")) from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


def _cut_at_stop(sample: Sample, stop_ids: Sequence[int]) -> Sample:
    """The sample up to its first stop token (included): a server that did not take
    ``stop_token_ids`` may sample past the end of the turn, and what follows is not part of it."""
    gen = sample.generation
    stops = set(stop_ids)
    at = next((i for i, t in enumerate(gen.token_ids) if t in stops), None)
    if at is None or at == len(gen.token_ids) - 1:
        return sample
    logprobs = gen.logprobs[: at + 1] if gen.logprobs is not None else None
    cut = Generation(token_ids=gen.token_ids[: at + 1], logprobs=logprobs, finish_reason="stop", text=None)
    return Sample(generation=cut, token_source=sample.token_source, aligned=sample.aligned,
                  server_logprobs=sample.server_logprobs, parsed=sample.parsed, prompt_token_ids=sample.prompt_token_ids)
