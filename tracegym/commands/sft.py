"""``tracegym sft``: supervised fine-tuning on recorded trajectories.

    tracegym sft --config examples/sft_calculator.yaml
    tracegym sft --config examples/sft_calculator.yaml lora.r=8 optim.lr=1e-4 max_steps=50
    tracegym sft --config examples/sft_calculator.yaml --resume
    tracegym sft --config examples/sft_calculator.yaml --print-config

SFT has no env: it trains on trajectory files recorded earlier (``tracegym rollout``, with whatever
env, built-in or plugin, they came from). ``--plugin`` / ``plugins:`` still import modules first
(e.g. ones that register algorithms, or envs that a plugin recipe needs).
"""

from __future__ import annotations

import argparse
import sys

from tracegym.commands._config import add_plugin_argument

NAME = "sft"
HELP = "Supervised fine-tuning (LoRA or full) on trajectory JSONL files, from a YAML config."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", required=True, metavar="FILE", help="run config (YAML, see examples/)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE",
        help="config overrides, VALUE parsed as YAML: lora.r=8 optim.lr=1e-4 data.train_files=[a.jsonl]",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_plugin_argument(parser)


def run(args: argparse.Namespace) -> int:
    from tracegym.commands._config import load_for_command
    from tracegym.config import SFTConfig

    cfg = load_for_command(SFTConfig, args)
    if isinstance(cfg, int):
        return cfg

    from tracegym.recipes.sft import train_sft

    try:
        result = train_sft(cfg, resume=args.resume)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    last = result.history[-1] if result.history else {}
    loss = f", final loss {last['loss']:.4f}" if "loss" in last else ""
    print(f"sft done: {result.step} steps{loss}; model in {result.final_dir}; metrics in {result.run_dir / 'metrics.jsonl'}")
    return 0
