"""``tracegym rl``: reinforcement learning in an environment, from a YAML config.

    tracegym rl --config examples/rl_calculator.yaml
    tracegym rl --config examples/rl_calculator.yaml steps=20 group_size=4 policy_loss.kl_coef=0.01
    tracegym rl --config examples/rl_calculator.yaml --resume
    tracegym rl --config examples/rl_calculator.yaml --seeds 1,2,3   # runs/rl_calculator/seed_{1,2,3}/, in turn
    tracegym rl --config my_rl.yaml --plugin my_env.py     # a module that registers an env or a loss
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tracegym.commands._config import add_config_arguments

NAME = "rl"
HELP = "Reinforcement learning (GRPO/RLOO/PPO-clip/GSPO, LoRA or full) in an environment, from a YAML config."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tracegym.commands._seeds import add_seeds_argument

    add_config_arguments(
        parser, "config overrides, VALUE parsed as YAML: steps=20 group_size=4 policy_loss.clip_eps_high=0.28"
    )
    add_seeds_argument(parser, "tasks.seed")


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
    options model), ``rollout.strategy`` (a registered strategy and its options), ``advantage.intrinsic`` (a
    registered scoring pass and its options) and ``env`` (its name and options, read from the env
    factory's signature). Raises
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
    from tracegym.rollout.strategies import strategy_problems
    from tracegym.serve.harness import agent_problems  # registers the harness strategy

    problems.extend(strategy_problems(cfg.rollout.strategy, cfg.rollout.strategy_options)  # type: ignore[attr-defined]
                    or agent_problems(cfg.rollout.strategy, cfg.rollout.strategy_options))  # type: ignore[attr-defined]
    from tracegym.rl.scoring import scoring_problems

    problems.extend(scoring_problems(cfg.advantage.intrinsic, cfg.advantage.intrinsic_options))  # type: ignore[attr-defined]
    if problems:
        raise ConfigError(problems)


FINAL_KEYS = ("reward/mean", "eval/pass@1")


def train_any_rl(cfg: Any, resume: bool = False, stop_at_step: int | None = None) -> Any:
    """The loop an RL config asks for: proposer/solver self-play (``selfplay``), a team of roles with
    one adapter each (``roles``), or single-agent RL; each is a flat loop in ``tracegym.recipes``."""
    if cfg.selfplay is not None:
        from tracegym.recipes.selfplay import train_selfplay

        return train_selfplay(cfg, resume=resume, stop_at_step=stop_at_step)
    if cfg.roles:
        from tracegym.recipes.team import train_team

        return train_team(cfg, resume=resume, stop_at_step=stop_at_step)
    from tracegym.recipes.rl import train_rl

    return train_rl(cfg, resume=resume, stop_at_step=stop_at_step)


def run(args: argparse.Namespace) -> int:
    from tracegym.commands._config import print_done, train_from_config
    from tracegym.config import RLConfig

    if args.seeds is not None:
        return run_seeds(args)
    # a bad policy_loss option, env name or env option fails here, before any model loads
    result = train_from_config(RLConfig, args, "tracegym.commands.rl:train_any_rl", check=check_config)
    if isinstance(result, int):
        return result
    return print_done("rl", result, FINAL_KEYS)


def run_seeds(args: argparse.Namespace) -> int:
    """``--seeds``: one run per seed (``commands/_seeds.py``); ``--resume`` resumes each seed's run
    (a seed without a checkpoint starts, a finished one only reports its numbers)."""
    from tracegym.commands._config import load_for_command, print_done
    from tracegym.commands._seeds import last_logged, run_over_seeds, seed_override_given
    from tracegym.config import RLConfig

    if seed_override_given(args.overrides):
        print("error: seed=... and --seeds both set the training seed; give one of them", file=sys.stderr)
        return 2
    cfg = load_for_command(RLConfig, argparse.Namespace(**{**vars(args), "print_config": False}), check=check_config)
    if isinstance(cfg, int):
        return cfg

    def train_one(seed_cfg: RLConfig) -> dict[str, float]:
        result = train_any_rl(seed_cfg, resume=args.resume)
        print_done("rl", result, FINAL_KEYS)
        return last_logged(result.run_dir, FINAL_KEYS)

    return run_over_seeds(cfg, args.seeds, train_one, "rl", print_config=args.print_config)
