"""``tracegym serve MODEL``: an OpenAI-compatible chat-completions endpoint over the hf engine."""

from __future__ import annotations

import argparse
import os
import sys

from tracegym.commands._config import add_plugin_argument

NAME = "serve"
HELP = "Serve a model as an OpenAI-compatible /v1/chat/completions endpoint (streaming, tools, log-probs)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a known model name (smollm2-135m, tiny-random) or a local HF folder")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--renderer", default=None,
                        help="chat-template renderer (default: the model's; --plugin adds more)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 requests (default: $TRACEGYM_API_KEY; "
                             "prefer the variable: a command-line key is visible to other users in ps)")
    parser.add_argument("--max-batch-size", type=int, default=16,
                        help="rows decoded together by the continuous-batching scheduler (default 16)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for a place in the batch; more get HTTP 429 (default 64)")
    parser.add_argument("--max-n", type=int, default=16, help="largest n a request may ask (default 16, at most the batch size)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="largest max_tokens a request may ask (default: the context window)")
    parser.add_argument("--record", default=None, metavar="DIR",
                        help="a gateway: sessions at /s/<session>/v1 are recorded token-exact and each finished "
                             "session (POST /s/<session>/end) is appended to DIR/trajectories.jsonl")
    add_plugin_argument(parser)


def run(args: argparse.Namespace) -> int:
    from tracegym.serve import API_KEY_ENV, ServeLimits, serve

    if not 0 < args.port < 65536:
        print(f"error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    for flag, value, low in (("--max-batch-size", args.max_batch_size, 1), ("--max-queue", args.max_queue, 0),
                             ("--max-n", args.max_n, 1), ("--max-tokens", args.max_tokens, 1)):
        if value is not None and value < low:
            print(f"error: {flag} must be >= {low}, got {value}", file=sys.stderr)
            return 2
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without an API key (set {API_KEY_ENV} or --api-key)", file=sys.stderr)
    limits = ServeLimits(max_n=args.max_n, max_tokens=args.max_tokens, max_queue=args.max_queue,
                         max_batch_size=args.max_batch_size)
    try:
        serve(args.model, args.host, args.port, renderer=args.renderer, dtype=args.dtype, api_key=api_key,
              limits=limits, max_batch_size=args.max_batch_size, record_dir=args.record)
    except ValueError as exc:  # unknown model or renderer, not a model folder: a usage error
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
