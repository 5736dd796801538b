"""``tracegym serve MODEL``: an OpenAI-compatible chat-completions endpoint over the hf engine."""

from __future__ import annotations

import argparse

NAME = "serve"
HELP = "Serve a model as an OpenAI-compatible /v1/chat/completions endpoint (hf engine, tools supported)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a known model name (smollm2-135m, tiny-random) or a local HF folder")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--renderer", default=None, help="chat-template renderer (default: the model's)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="rows decoded together for n > 1")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def run(args: argparse.Namespace) -> int:
    from tracegym.serve import serve

    if not 0 < args.port < 65536:
        print(f"error: --port must be in 1..65535, got {args.port}")
        return 2
    serve(args.model, args.host, args.port, renderer=args.renderer, max_batch_size=args.max_batch_size, dtype=args.dtype)
    return 0
