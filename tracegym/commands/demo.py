"""``tracegym demo``: the main job. Base -> SFT -> RL on the embedded SmolLM2, evaluated on held-out tasks.

    tracegym demo                                  # about 20 minutes on a 2-core CPU
    tracegym demo rl_steps=16 test_tasks=64        # any DemoConfig field as KEY=VALUE
    tracegym demo --print-config
"""

from __future__ import annotations

import argparse

from tracegym.commands._config import add_config_arguments

NAME = "demo"
HELP = "The main job: evaluate base SmolLM2, SFT it on expert traces, RL it, evaluate each; report in runs/demo."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "DemoConfig overrides, VALUE parsed as YAML: rl_steps=16 output_dir=runs/demo2",
                         config_help="optional YAML file of DemoConfig fields", config_required=False, resume=False)


def check_config(cfg: object) -> None:
    """The env and both option sets exist and fit the env's signature (before any model loads)."""
    from tracegym.commands._config import check_env_config
    from tracegym.config import ConfigError

    problems = check_env_config(cfg.env, cfg.env_options, "env", "env_options")  # type: ignore[attr-defined]
    if not problems:
        problems = check_env_config(cfg.env, cfg.sft_env_options, "env", "sft_env_options")  # type: ignore[attr-defined]
    if problems:
        raise ConfigError(problems)


def run(args: argparse.Namespace) -> int:
    from tracegym.commands._config import load_for_command
    from tracegym.recipes.demo import DemoConfig, run_demo

    cfg = load_for_command(DemoConfig, args, check=check_config)
    if isinstance(cfg, int):
        return cfg
    run_demo(cfg)
    return 0
