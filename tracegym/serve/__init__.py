"""An OpenAI-compatible server: ``POST /v1/chat/completions``, ``POST /v1/completions`` (token-id
prompts: token in, token out), ``GET /v1/models``, ``GET /health``.

    tracegym serve smollm2-135m --port 8000            # binds 127.0.0.1 unless --host says otherwise
    TRACEGYM_API_KEY=sk-local tracegym serve smollm2-135m   # then every /v1 request needs the key

The request's messages and tools are rendered by the model's renderer (tool schemas go where the
chat template puts them); the completion is parsed back: tool calls come back as ``tool_calls``
with fresh unique ids, ``content`` null and finish reason ``tool_calls``; malformed calls are listed
in the extra field ``message.parse_errors``. See ``docs/serve.md`` for the full list of fields.

Concurrency: over an ``HFEngine`` requests are decoded by a continuous-batching stepper
(``tracegym.engines.hf_stepper``): a new request joins the running batch at the next step and
leaves it when it finishes, so a long request never blocks a short one. Any other token engine
(``generate(prompts, params)``) is served one call at a time.

What is supported, and what is refused with a 400 rather than silently ignored:

- ``stream`` (SSE chunks, tool calls included, ``stream_options.include_usage``, ``data: [DONE]``),
  ``n``, ``seed``, ``temperature``, ``top_p``, ``max_tokens``/``max_completion_tokens``, ``stop``
  (removed from the output), ``logprobs``/``top_logprobs`` (of the sampling distribution: the
  log-probs an RL trainer needs), ``logit_bias``, ``tool_choice`` ``auto``/``none``,
  ``parallel_tool_calls`` (``false`` ends the turn after the first call), ``response_format``
  ``text``, ``user`` and ``metadata`` (annotations only).
- ``tool_choice`` ``required`` or a named function, ``response_format`` ``json_object`` /
  ``json_schema``, non-zero ``frequency_penalty``/``presence_penalty``, ``store: true``, audio and
  any other field: 400 naming the parameter (this server does not constrain decoding).

Extensions: every choice carries ``token_ids`` (the sampled ids, end-of-turn token included) and
every log-prob entry its ``token_id``; ``logprobs.content`` has one entry per sampled token. vLLM's
request extensions are understood as vLLM does: ``return_tokens_as_token_ids`` (log-prob tokens read
``token_id:123``) and ``return_token_ids`` (the reply carries ``prompt_token_ids``), and on
``/v1/completions`` ``stop_token_ids`` (more ids that end the completion).

``echo`` on ``/v1/completions`` (the legacy API's, as vLLM implements it): ``text`` starts with the
prompt's text, and with ``logprobs: 0`` ``logprobs.tokens`` / ``token_logprobs`` start with the
prompt's tokens and their log-probs (None for the first token), scored by the engine's
``prompt_logprobs`` at temperature 1 (the raw distribution), then the sampled tokens'.
``max_tokens: 0`` is allowed with ``echo`` only (the prompt's scores alone, nothing sampled). This is
how a distillation teacher is served (``teacher.engine: openai``); an engine without
``prompt_logprobs`` answers ``echo`` with ``logprobs`` with a 400 naming ``echo``.

Errors are OpenAI-shaped everywhere: ``{"error": {"message", "type", "param", "code"}}`` (404
``model_not_found``, 400 for bad or unsupported parameters and for ``max_tokens`` beyond the
context, 401 ``invalid_api_key``, 429 when the queue is full). ``ServerThread`` runs the server in
a background thread (tests, notebooks).

Gateway sessions (``sessions``, ``gateway``; ``tracegym serve MODEL --record DIR``): an agent whose
``base_url`` is ``http://HOST:PORT/s/<session>/v1`` has every chat call recorded token-exact, a
later call bridged onto the earlier calls' sampled tokens, and ``POST /s/<session>/end`` merges the
session into one trajectory (token breaks counted, never re-tokenized); see docs/serve.md.

Modules: ``app`` (``create_app``), ``routes`` (one function per endpoint), ``state`` (``ServeLimits``
and the ``ServerState`` routes share), ``plan`` (request checks -> ``RequestPlan``), ``backends``
(continuous batching or one call at a time), ``generation`` (token events -> choices),
``streaming`` (SSE), ``replies`` (reply bodies), ``tokens`` (detokenizing), ``errors``, ``auth``,
``fields``, ``thread`` (``ServerThread``), ``launch`` (``build_app``, ``serve``), ``sessions``
(``SessionStore``), ``gateway`` (``Gateway``).
"""

from __future__ import annotations

from tracegym.serve.app import create_app
from tracegym.serve.backends import Submit  # noqa: F401  (re-exported)
from tracegym.serve.errors import APIError
from tracegym.serve.gateway import Gateway
from tracegym.serve.launch import API_KEY_ENV, build_app, serve
from tracegym.serve.plan import MAX_COMPLETION_LOGPROBS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS  # noqa: F401  (re-exported)
from tracegym.serve.sessions import SessionSampling, SessionStore
from tracegym.serve.state import ServeLimits
from tracegym.serve.thread import ServerThread
from tracegym.serve.tokens import NEG_INF_LOGPROB, TOKEN_ID_PREFIX  # noqa: F401  (re-exported)

__all__ = ["APIError", "Gateway", "ServeLimits", "SessionSampling", "SessionStore", "ServerThread", "build_app", "create_app", "serve", "API_KEY_ENV"]
