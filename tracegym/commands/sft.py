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

from tracegym.commands._config import add_config_arguments

NAME = "sft"
HELP = "Supervised fine-tuning (LoRA or full) on trajectory JSONL files, from a YAML config."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(
        parser, "config overrides, VALUE parsed as YAML: lora.r=8 optim.lr=1e-4 data.train_files=[a.jsonl]"
    )


def run(args: argparse.Namespace) -> int:
    from tracegym.commands._config import train_from_config
    from tracegym.config import SFTConfig

    result = train_from_config(SFTConfig, args, "tracegym.recipes.sft:train_sft")
    if isinstance(result, int):
        return result
    last = result.history[-1] if result.history else {}
    loss = f", final loss {last['loss']:.4f}" if "loss" in last else ""
    print(f"sft done: {result.step} steps{loss}; model in {result.final_dir}; metrics in {result.run_dir / 'metrics.jsonl'}")
    return 0
