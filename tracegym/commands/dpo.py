"""``tracegym dpo``: preference learning (DPO, DMPO, KTO) on recorded trajectories, from a YAML config.

    tracegym dpo --config examples/dpo_calculator.yaml
    tracegym dpo --config examples/dpo_calculator.yaml loss.name=dmpo loss.gamma=0.9 max_steps=50
    tracegym dpo --config examples/dpo_calculator.yaml loss.name=kto
    tracegym dpo --config examples/dpo_calculator.yaml --resume

Like ``sft`` it needs no env: pairs (or labelled trajectories) come from a file, or are built from
rollout files (several samples per task) and written into the run folder for inspection.
"""

from __future__ import annotations

import argparse

from tracegym.commands._config import add_config_arguments

NAME = "dpo"
HELP = "Preference learning (DPO, DMPO, KTO; LoRA or full) on pairs built from rollouts, from a YAML config."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(
        parser, "config overrides, VALUE parsed as YAML: loss.name=dmpo loss.beta=0.2 data.rollouts_files=[a.jsonl]"
    )


def check_config(cfg: object) -> None:
    """The loss section against the registry (``loss.name`` known, the loss's options valid), before
    any model loads; raises ``ConfigError`` naming the key."""
    from tracegym.config import ConfigError
    from tracegym.recipes.dpo import resolve_loss

    try:
        resolve_loss(cfg)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None


def run(args: argparse.Namespace) -> int:
    from tracegym.commands._config import print_done, train_from_config
    from tracegym.config import DPOConfig

    result = train_from_config(DPOConfig, args, "tracegym.recipes.dpo:train_dpo", check=check_config)
    if isinstance(result, int):
        return result
    return print_done("dpo", result, ("loss", "accuracy", "reward_margin"), digits=4)
