"""``tracegym envs``: list environments, show one, or measure the scripted experts.

    tracegym envs                                  # one line per env
    tracegym envs show calculator                  # tool schemas + a sample task's first messages
    tracegym envs expert calculator sokoban --tasks 200 --split test
    tracegym envs --plugin my_env.py                # also the envs that a plugin module registers
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tracegym.commands._config import add_plugin_argument

NAME = "envs"
HELP = "List environments, show one (tools, a sample task), or measure the scripted experts."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["list", "show", "expert"], default="list", help="what to do (default: list)")
    parser.add_argument("names", nargs="*", help="env names (show: exactly one; expert: default all)")
    parser.add_argument("--tasks", type=int, default=200, help="expert: tasks per env (default 200)")
    parser.add_argument("--split", choices=["train", "test"], default="test", help="task split (default test)")
    parser.add_argument("--seed", type=int, default=0, help="task seed (default 0)")
    parser.add_argument("--concurrency", type=int, default=32, help="expert: episodes at once (default 32)")
    parser.add_argument(
        "--option", "-o", action="append", default=[], metavar="KEY=VALUE",
        help="env option, e.g. -o num_calls=3 (VALUE is read as JSON when it parses, else as text)",
    )
    add_plugin_argument(parser)


def _options(pairs: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option expects KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _list() -> int:
    from tracegym.envs import env_factory, list_envs

    for name in list_envs():
        try:
            factory = env_factory(name)
            description = getattr(factory, "description", "") or (factory.__doc__ or "").strip().split("\n")[0]
        except Exception as exc:  # a broken plugin must not hide the others
            description = f"(unavailable: {exc})"
        print(f"{name:<14} {description}")
    return 0


def _show(name: str, options: dict[str, Any], split: str, seed: int) -> int:
    import asyncio

    from tracegym.envs import make

    env = make(name, **options)
    print(f"# {name}: {getattr(env, 'description', '')}")
    print(f"reward_range: {env.reward_range}   max_turns: {getattr(env, 'max_turns', 'n/a')}")
    print("\n## Tools")
    for schema in env.tool_schemas():
        print(json.dumps(schema, indent=2))
    task = env.tasks(split, 1, seed)[0]
    print(f"\n## Sample task {task.id} ({task.split})")
    for message in asyncio.run(env.reset(task)):
        print(f"--- {message.role}\n{message.content}")
    reference = task.data.get("reference_calls")
    if reference:
        print(f"\n## Reference calls ({len(reference)})")
        for call in reference:
            print(f"{call['name']}({json.dumps(call['arguments'])})")
    return 0


def _expert(names: list[str], options: dict[str, Any], n_tasks: int, split: str, seed: int, concurrency: int) -> int:
    import asyncio
    import time

    from tracegym.envs import list_envs, make
    from tracegym.envs.episode import run_episodes

    explicit = bool(names)
    names = names or list_envs()
    failed = False
    print(f"{'env':<14} {'solved':>9} {'rate':>7} {'turns':>6} {'errors':>6} {'time':>7}")
    for name in names:
        try:
            env = make(name, **options)
            tasks = env.tasks(split, n_tasks, seed)
        except Exception as exc:
            print(f"{name:<14} skipped: {type(exc).__name__}: {exc}")
            failed = failed or explicit
            continue
        start = time.perf_counter()
        results = asyncio.run(
            run_episodes(lambda: make(name, **options), tasks, lambda e: e.expert_action, concurrency=concurrency,
                         policy_name="expert")
        )
        elapsed = time.perf_counter() - start
        solved = sum(r.success for r in results)
        errors = sum(r.error is not None for r in results)
        turns = sum(m.role == "assistant" for r in results for m in r.messages) / max(1, len(results))
        print(f"{name:<14} {solved:>4}/{len(results):<4} {solved / max(1, len(results)):>7.1%} {turns:>6.1f} {errors:>6} {elapsed:>6.1f}s")
        for r in results:
            if r.error:
                print(f"  {r.task_id}: {r.error}")
                break
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    try:
        options = _options(args.option)
        if args.action == "list":
            return _list()
        if args.action == "show":
            if len(args.names) != 1:
                print("usage: tracegym envs show NAME", file=sys.stderr)
                return 2
            return _show(args.names[0], options, args.split, args.seed)
        if args.tasks < 1:
            raise ValueError("--tasks must be >= 1")
        return _expert(args.names, options, args.tasks, args.split, args.seed, args.concurrency)
    except (ValueError, TypeError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
