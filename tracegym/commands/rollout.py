"""``tracegym rollout``: run a policy in an environment and write trajectories.

    tracegym rollout --env calculator --model smollm2-135m --tasks 16 --samples 4 --max-turns 5 --out runs/r1
    tracegym rollout --env calculator --policy expert --tasks 200 --out runs/expert      # SFT data
    tracegym rollout --env calculator --adapter runs/sft/final --tasks 16 --out runs/r2  # a trained LoRA
    tracegym rollout --env calculator --policy expert --tasks 200 --injection-rate 0.5 --out runs/e2  # ignores injections

Writes ``OUT/trajectories.jsonl`` (one Trajectory per line, as each episode ends),
``OUT/failed.jsonl`` (episodes excluded for env errors/timeouts) and ``OUT/summary.json`` (counts,
success rate, end reasons, errors, tokens, wall time, engine/trainer log-prob gap).
The policy arguments (``--model``, ``--adapter``, ``--engine``, ...) are shared with ``tracegym
eval`` (``tracegym/commands/_policy.py``).
"""

from __future__ import annotations

import argparse

from tracegym.commands._policy import (
    add_env_arguments,
    add_injection_arguments,
    add_policy_arguments,
    add_run_arguments,
)

NAME = "rollout"
HELP = "Run a model (or the scripted expert) in an environment and write trajectories + a summary."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_env_arguments(parser, default_split="train")
    add_injection_arguments(parser)
    add_policy_arguments(parser)
    add_run_arguments(parser, default_tasks=8, default_samples=1)
    parser.add_argument("--max-turns", type=int, default=None,
                        help="assistant turns per episode (default: the env's own turn limit, its max_turns)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--on-env-error", default="exclude", choices=["exclude", "zero_reward"])
    parser.add_argument("--no-logprob-gap", action="store_true", help="skip the engine/trainer log-prob gap check")
    parser.add_argument("--parquet", action="store_true", help="also write OUT/trajectories.parquet")


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    from pathlib import Path

    from tracegym.commands._policy import (
        UsageError, build_policy, check_env_args, env_turn_limit, injection_settings, make_tasks, print_error,
        rollout_config, run_policy,
    )
    from tracegym.data.store import TrajectoryWriter, export_parquet

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_env_args(args)  # an unknown env or option: one line, before anything loads
        injection = injection_settings(args)
        env_options, tasks = make_tasks(args)
        if args.max_turns is None:
            args.max_turns = env_turn_limit(args)
        setup = build_policy(args)
        config = rollout_config(args, setup, max_turns=args.max_turns, temperature=args.temperature,
                                on_env_error=args.on_env_error, measure_logprob_gap=not args.no_logprob_gap)
    except UsageError as exc:
        print_error(exc)
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with TrajectoryWriter(out / "trajectories.jsonl") as writer, TrajectoryWriter(out / "failed.jsonl") as failed:
            result = run_policy(args, setup, tasks, env_options, config, writer=writer, failed_writer=failed)
    finally:
        setup.close()
    stats = result.stats
    if args.parquet:
        export_parquet(out / "trajectories.jsonl", out / "trajectories.parquet")
    summary = {
        "env": args.env,
        "env_options": env_options,
        **({"injection": injection.model_dump(mode="json")} if injection is not None else {}),
        **setup.describe(),
        "split": args.split,
        "tasks": len(tasks),
        "samples_per_task": args.samples,
        "strategy": args.strategy,
        **stats.to_dict(),
        "config": config.model_dump(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    print(f"episodes {stats.episodes}  kept {stats.kept}  failed {stats.failed}  success rate {stats.success_rate:.3f}  "
          f"mean reward {stats.mean_reward:.3f}")
    print(f"end reasons {stats.end_reasons}")
    print(f"generated tokens {stats.generated_tokens}  in {stats.wall_time_s:.1f}s  ({stats.tokens_per_s:.1f} tok/s, "
          f"{stats.generate_calls} generate calls, mean batch {stats.mean_batch_size:.1f})")
    if stats.logprob_gap is not None:
        g = stats.logprob_gap
        print(f"engine/trainer log-prob gap over {g.tokens} tokens: mean {g.mean:.2e}  max {g.max:.2e}")
    for line in stats.errors[:5]:
        print(f"error: {line}")
    print(f"wrote {out / 'trajectories.jsonl'} and {out / 'summary.json'}")
    return 0 if stats.kept > 0 else 1
