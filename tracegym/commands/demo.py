"""``tracegym demo``: the main job. Base -> SFT -> RL on the embedded SmolLM2, evaluated on held-out tasks.

    tracegym demo                                  # the many-step job (3-call calculator problems)
    tracegym demo --config examples/demo_one_call.yaml   # the one-call job of rounds 1-2
    tracegym demo rl_steps=16 test_tasks=64        # any DemoConfig field as KEY=VALUE
    tracegym demo --print-config
    tracegym demo --seeds 1,2,3                    # runs/demo/seed_{1,2,3}/, one after another, same test tasks
"""

from __future__ import annotations

import argparse
import sys

from tracegym.commands._config import add_config_arguments

NAME = "demo"
HELP = "The main job: evaluate base SmolLM2, SFT it on expert traces, RL it, evaluate each; report in runs/demo."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tracegym.commands._seeds import add_seeds_argument

    add_config_arguments(parser, "DemoConfig overrides, VALUE parsed as YAML: rl_steps=16 output_dir=runs/demo2",
                         config_help="optional YAML file of DemoConfig fields", config_required=False, resume=False)
    add_seeds_argument(parser, "task_seed")


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

    if args.seeds is not None:
        return run_seeds(args)
    cfg = load_for_command(DemoConfig, args, check=check_config)
    if isinstance(cfg, int):
        return cfg
    run_demo(cfg)
    return 0


STAGES = ("base", "sft", "rl")


def run_seeds(args: argparse.Namespace) -> int:
    """``--seeds``: the whole demo once per seed (``commands/_seeds.py``) on the test tasks of the
    config's ``task_seed`` (or, when unset, of its ``seed``); the table gives each stage's pass@1."""
    from tracegym.commands._config import load_for_command
    from tracegym.commands._seeds import run_over_seeds, seed_override_given
    from tracegym.recipes.demo import DemoConfig, run_demo

    if seed_override_given(args.overrides):
        print("error: seed=... and --seeds both set the training seed; give one of them", file=sys.stderr)
        return 2
    cfg = load_for_command(DemoConfig, argparse.Namespace(**{**vars(args), "print_config": False}), check=check_config)
    if isinstance(cfg, int):
        return cfg
    cfg = cfg.model_copy(update={"task_seed": cfg.task_draw_seed})

    def demo_one(seed_cfg: DemoConfig) -> dict[str, float]:
        results = run_demo(seed_cfg)
        top = str(max(seed_cfg.eval_turns))
        return {f"{stage} pass@1": results[stage]["pass_at"][top]["1"] for stage in STAGES if stage in results}

    code = run_over_seeds(cfg, args.seeds, demo_one, "demo", print_config=args.print_config)
    if code == 0 and not args.print_config:
        print(f"pooled over seeds, with intervals over seeds and tasks: tracegym compare --pool-seeds "
              f"{cfg.output_dir}/seed_*/{{{','.join(STAGES)}}}")
    return code
