"""``tracegym rl``: reinforcement learning in an environment, from a YAML config.

    tracegym rl --config examples/rl_calculator.yaml
    tracegym rl --config examples/rl_calculator.yaml steps=20 group_size=4 policy_loss.kl_coef=0.01
    tracegym rl --config examples/rl_calculator.yaml --resume
    tracegym rl --config my_rl.yaml --plugin my_env.py     # a module that registers an env or a loss
"""

from __future__ import annotations

import argparse

from tracegym.commands._config import add_config_arguments

NAME = "rl"
HELP = "Reinforcement learning (GRPO/RLOO/PPO-clip/GSPO, LoRA or full) in an environment, from a YAML config."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(
        parser, "config overrides, VALUE parsed as YAML: steps=20 group_size=4 policy_loss.clip_eps_high=0.28"
    )


def check_policy_loss(options: dict) -> None:
    """Validate the ``policy_loss`` section (common keys and the chosen loss's own options); raise
    ``ConfigError`` naming each bad key as ``policy_loss.<key>`` with the nearest valid key (as for
    every other section)."""
    from tracegym.algos.config import policy_loss_problems
    from tracegym.config import ConfigError

    problems = policy_loss_problems(options)
    if problems:
        raise ConfigError(problems, "policy_loss")


def check_config(cfg: object) -> None:
    """Sections ``RLConfig`` cannot validate alone: ``policy_loss``, ``advantage`` (the estimator's
    options model) and ``env`` (its name and options, read from the env factory's signature). Raises
    one ``ConfigError`` listing every problem."""
    from tracegym.algos import estimator_problems
    from tracegym.commands._config import check_env_config
    from tracegym.config import ConfigError

    problems: list[str] = []
    try:
        check_policy_loss(cfg.policy_loss)  # type: ignore[attr-defined]
    except ConfigError as exc:
        problems.extend(exc.problems)
    problems.extend(check_env_config(cfg.env.name, cfg.env.options))  # type: ignore[attr-defined]
    problems.extend(estimator_problems(cfg.advantage.estimator, cfg.advantage.options))  # type: ignore[attr-defined]
    if problems:
        raise ConfigError(problems)


def run(args: argparse.Namespace) -> int:
    from tracegym.commands._config import print_done, train_from_config
    from tracegym.config import RLConfig

    # a bad policy_loss option, env name or env option fails here, before any model loads
    result = train_from_config(RLConfig, args, "tracegym.recipes.rl:train_rl", check=check_config)
    if isinstance(result, int):
        return result
    return print_done("rl", result, ("reward/mean", "eval/pass@1"))
