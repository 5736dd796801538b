"""``tracegym inspect FILE``: show every token of a trajectory and whether it is trained on."""

from __future__ import annotations

import argparse
import sys

NAME = "inspect"
HELP = "Show the tokens of trajectories (or training examples) and which ones are trained on."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="JSONL (or .parquet) of Trajectory or TrainingExample rows")
    parser.add_argument("--index", type=int, default=None, help="show only record N (0-based); default all")
    parser.add_argument("--plain", action="store_true", help="plain text, trained spans as [[...]] (default when not a terminal)")
    parser.add_argument("--max-tokens", type=int, default=None, help="show at most N tokens of each example")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="tokenizer to use when the file does not name one (default: smollm2-135m)",
    )
    parser.add_argument("--renderer", default=None, help="renderer name (default: the model's)")


def run(args: argparse.Namespace) -> int:
    from tracegym.trajectory_view import inspect_plain, inspect_rich, load_records, tokenizer_name_from
    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer

    if args.max_tokens is not None and args.max_tokens < 0:
        print("error: --max-tokens must be >= 0", file=sys.stderr)
        return 2
    try:
        loaded = load_records(args.file)
        model = tokenizer_name_from(loaded.records) or args.model
        tokenizer = load_tokenizer(model)
        renderer = get_renderer(args.renderer or model, tokenizer) if loaded.kind == "trajectory" else None
        if args.plain or not sys.stdout.isatty():
            sys.stdout.write(inspect_plain(loaded, tokenizer, renderer, args.index, args.max_tokens))
        else:
            from rich.console import Console

            inspect_rich(loaded, tokenizer, Console(), renderer, args.index, args.max_tokens)
    except (OSError, ValueError, IndexError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
