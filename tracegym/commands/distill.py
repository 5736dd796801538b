"""``tracegym distill``: on-policy distillation from a local teacher in an environment, from a YAML config.

    tracegym distill --config examples/distill_calculator.yaml
    tracegym distill --config examples/distill_calculator.yaml steps=20 teacher.model=runs/sft_calculator/final
    tracegym distill --config examples/distill_calculator.yaml loss=jsd jsd_beta=0.5
    tracegym distill --config examples/distill_calculator.yaml --resume

The teacher must share the student's tokenizer (checked before training starts).
"""

from __future__ import annotations

import argparse

from tracegym.commands._config import add_config_arguments

NAME = "distill"
HELP = "On-policy distillation (reverse KL per token, or GKD's JSD) from a local teacher, from a YAML config."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(
        parser, "config overrides, VALUE parsed as YAML: steps=20 teacher.model=runs/sft/final loss=jsd"
    )


def check_config(cfg: object) -> None:
    """The env section (its name and options, read from the env factory's signature), before any
    model loads; raises ``ConfigError`` naming the key."""
    from tracegym.commands._config import check_env_config
    from tracegym.config import ConfigError

    problems = check_env_config(cfg.env.name, cfg.env.options)  # type: ignore[attr-defined]
    if problems:
        raise ConfigError(problems)


def run(args: argparse.Namespace) -> int:
    from tracegym.commands._config import print_done, train_from_config
    from tracegym.config import DistillConfig

    result = train_from_config(DistillConfig, args, "tracegym.recipes.distill:train_distill", check=check_config)
    if isinstance(result, int):
        return result
    return print_done("distill", result, ("distill/reverse_kl", "eval/pass@1"), digits=4)
