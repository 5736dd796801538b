"""``tracegym rl``: reinforcement learning in an environment, from a YAML config.

    tracegym rl --config examples/rl_calculator.yaml
    tracegym rl --config examples/rl_calculator.yaml steps=20 group_size=4 policy_loss.kl_coef=0.01
    tracegym rl --config examples/rl_calculator.yaml --resume
"""

from __future__ import annotations

import argparse
import sys

NAME = "rl"
HELP = "Reinforcement learning (GRPO/RLOO/PPO-clip/GSPO, LoRA or full) in an environment, from a YAML config."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", required=True, metavar="FILE", help="run config (YAML, see examples/)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE",
        help="config overrides, VALUE parsed as YAML: steps=20 group_size=4 policy_loss.clip_eps_high=0.28",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def check_policy_loss(options: dict) -> None:
    """Validate the ``policy_loss`` section with ``PolicyLossConfig``; raise ``ConfigError`` naming
    each bad key as ``policy_loss.<key>`` with the nearest valid key (as for every other section)."""
    import difflib

    from pydantic import ValidationError

    from tracegym.algos.config import PolicyLossConfig
    from tracegym.config import ConfigError

    try:
        PolicyLossConfig.model_validate(options)
    except ValidationError as exc:
        allowed = sorted(PolicyLossConfig.model_fields)
        problems = []
        for err in exc.errors():
            key = ".".join(["policy_loss", *(str(part) for part in err["loc"])])
            if err["type"] == "extra_forbidden":
                near = difflib.get_close_matches(str(err["loc"][-1]), allowed, n=1, cutoff=0.0)
                hint = f"; did you mean 'policy_loss.{near[0]}'?" if near else ""
                problems.append(f"unknown key '{key}'{hint} allowed keys here: {', '.join(allowed)}")
            else:
                given = f", got {err['input']!r}" if "input" in err and not isinstance(err["input"], dict) else ""
                problems.append(f"bad value for '{key}': {err['msg']}{given}")
        raise ConfigError(problems, "policy_loss") from None


def run(args: argparse.Namespace) -> int:
    from tracegym.commands._config import load_for_command
    from tracegym.config import RLConfig

    # a bad policy_loss option fails here, before any model loads
    cfg = load_for_command(RLConfig, args, check=lambda c: check_policy_loss(c.policy_loss))
    if isinstance(cfg, int):
        return cfg

    from tracegym.recipes.rl import train_rl

    try:
        result = train_rl(cfg, resume=args.resume)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    last = result.history[-1] if result.history else {}
    shown = ", ".join(f"{k} {last[k]:.3f}" for k in ("reward/mean", "eval/pass@1") if k in last)
    print(f"rl done: {result.step} steps{', ' + shown if shown else ''}; model in {result.final_dir}; "
          f"metrics in {result.run_dir / 'metrics.jsonl'}")
    return 0
