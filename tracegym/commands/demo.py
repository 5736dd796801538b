"""``tracegym demo``: the main job. Base -> SFT -> RL on the embedded SmolLM2, evaluated on held-out tasks.

    tracegym demo                                  # about 20 minutes on a 2-core CPU
    tracegym demo rl_steps=16 test_tasks=64        # any DemoConfig field as KEY=VALUE
    tracegym demo --print-config
"""

from __future__ import annotations

import argparse
import sys

NAME = "demo"
HELP = "The main job: evaluate base SmolLM2, SFT it on expert traces, RL it, evaluate each; report in runs/demo."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="DemoConfig overrides, VALUE parsed as YAML: rl_steps=16 output_dir=runs/demo2")
    parser.add_argument("--config", "-c", metavar="FILE", help="optional YAML file of DemoConfig fields")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def run(args: argparse.Namespace) -> int:
    import yaml

    from tracegym.config import ConfigError, load_config
    from tracegym.recipes.demo import DemoConfig, run_demo

    try:
        cfg = load_config(DemoConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    run_demo(cfg)
    return 0
