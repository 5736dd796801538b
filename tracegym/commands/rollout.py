"""``tracegym rollout``: run a policy in an environment and write trajectories.

    tracegym rollout --env calculator --model smollm2-135m --tasks 16 --samples 4 --max-turns 5 --out runs/r1
    tracegym rollout --env calculator --policy expert --tasks 200 --out runs/expert      # SFT data

Writes ``OUT/trajectories.jsonl`` (one Trajectory per line, as each episode ends),
``OUT/failed.jsonl`` (episodes excluded for env errors/timeouts) and ``OUT/summary.json`` (counts,
success rate, end reasons, errors, tokens, wall time, engine/trainer log-prob gap).
"""

from __future__ import annotations

import argparse

NAME = "rollout"
HELP = "Run a model (or the scripted expert) in an environment and write trajectories + a summary."


def _key_value(text: str) -> tuple[str, object]:
    import yaml

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env", required=True, help="environment name (see `tracegym envs`)")
    parser.add_argument("--env-option", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                        help="env constructor option, value parsed as YAML (repeatable), e.g. num_calls=3")
    parser.add_argument("--model", default="smollm2-135m", help="model name or local folder (default smollm2-135m)")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm", "openai"], help="inference engine (default hf)")
    parser.add_argument("--policy", default="model", choices=["model", "expert"],
                        help="'expert' records the env's scripted expert on the same token path (SFT data)")
    parser.add_argument("--renderer", default=None, help="chat-template renderer (default: the model's)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for rendering (default: the model's; smollm2-135m for --engine openai)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="openai engine: server URL")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY", help="openai engine: env var holding the key")
    parser.add_argument("--tasks", type=int, default=8, help="number of tasks")
    parser.add_argument("--samples", type=int, default=1, help="samples K per task")
    parser.add_argument("--split", default="train", choices=["train", "test"])
    parser.add_argument("--task-seed", type=int, default=0, help="seed of the task generator")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens-per-turn", type=int, default=256)
    parser.add_argument("--max-tokens-per-episode", type=int, default=None)
    parser.add_argument("--max-context", type=int, default=None, help="default: the model's context length")
    parser.add_argument("--timeout", type=float, default=None, help="wall-clock limit per episode (s)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes alive at once")
    parser.add_argument("--on-env-error", default="exclude", choices=["exclude", "zero_reward"])
    parser.add_argument("--no-logprob-gap", action="store_true", help="skip the engine/trainer log-prob gap check")
    parser.add_argument("--parquet", action="store_true", help="also write OUT/trajectories.parquet")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", required=True, help="output folder")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import logging
    from pathlib import Path

    from pydantic import ValidationError

    from tracegym.data.store import TrajectoryWriter, export_parquet
    from tracegym.envs import make
    from tracegym.models import load, load_tokenizer
    from tracegym.render import get_renderer
    from tracegym.rollout import RolloutConfig, run_rollouts

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.tasks < 1 or args.samples < 1:
        print("error: --tasks and --samples must be >= 1")
        return 2
    env_options = dict(args.env_option)
    try:
        tasks = make(args.env, **env_options).tasks(args.split, n=args.tasks, seed=args.task_seed)
    except Exception as exc:  # noqa: BLE001 - a clear message, not a traceback
        print(f"error: cannot make env {args.env!r} with {env_options}: {exc}")
        return 2

    model = None
    engine: object
    gap_model = None
    if args.policy == "expert":
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        engine = "expert"
    elif args.engine == "hf":
        from tracegym.engines.hf import HFEngine

        model, tokenizer = load(args.model)
        if args.tokenizer:
            tokenizer = load_tokenizer(args.tokenizer)
        engine = None  # built below, once the renderer's stop ids are known
    elif args.engine == "openai":
        tokenizer = load_tokenizer(args.tokenizer or "smollm2-135m")
        engine = None
    else:
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        engine = None
    renderer = get_renderer(args.renderer or args.model, tokenizer)

    if engine is None:
        if args.engine == "hf":
            engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids, max_batch_size=args.concurrency)
            gap_model = model
        elif args.engine == "openai":
            from tracegym.engines.openai import OpenAIEngine

            engine = OpenAIEngine(args.model, base_url=args.base_url, api_key_env=args.api_key_env)
        else:
            from tracegym.engines.vllm import VLLMEngine

            engine = VLLMEngine(args.model, stop_token_ids=renderer.stop_token_ids)

    max_context = args.max_context
    if max_context is None and model is not None:
        max_context = getattr(model.config, "max_position_embeddings", None)
    try:
        config = RolloutConfig(
            max_turns=args.max_turns,
            max_tokens_per_turn=args.max_tokens_per_turn,
            max_tokens_per_episode=args.max_tokens_per_episode,
            max_context=max_context,
            episode_timeout_s=args.timeout,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            samples_per_task=args.samples,
            concurrency=args.concurrency,
            on_env_error=args.on_env_error,
            measure_logprob_gap=gap_model is not None and not args.no_logprob_gap,
        )
    except ValidationError as exc:
        print(f"error: {exc}")
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policy_name = "expert" if args.policy == "expert" else args.model
    with TrajectoryWriter(out / "trajectories.jsonl") as writer, TrajectoryWriter(out / "failed.jsonl") as failed_writer:
        result = asyncio.run(
            run_rollouts(
                args.env, tasks, engine, renderer, config, writer=writer, progress=not args.no_progress,
                failed_writer=failed_writer, env_options=env_options, policy_name=policy_name, gap_model=gap_model,
            )
        )
    stats = result.stats
    if args.parquet:
        export_parquet(out / "trajectories.jsonl", out / "trajectories.parquet")
    summary = {
        "env": args.env,
        "env_options": env_options,
        "model": args.model,
        "engine": args.engine if args.policy != "expert" else None,
        "policy": policy_name,
        "split": args.split,
        "tasks": len(tasks),
        "samples_per_task": args.samples,
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
