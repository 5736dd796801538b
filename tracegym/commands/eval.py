"""``tracegym eval``: pass@k and pass@(k,T) of a policy on held-out tasks.

    tracegym eval --env calculator --model smollm2-135m --tasks 50 --samples 16 --k 1,2,4,8,16 --turns 1,2,4,8 --out runs/eval/base
    tracegym eval --env calculator --adapter runs/sft/final --tasks 50 --samples 16 --out runs/eval/sft
    tracegym eval --env calculator --policy expert --tasks 50 --samples 1 --k 1 --out runs/eval/expert
    tracegym eval --env calculator --adapter runs/rl/final --injection-rate 0.5 --out runs/eval/rl_injected

Runs ``--samples`` n episodes of each of ``--tasks`` tasks of the ``--split`` (test by default),
once, at the largest turn budget T (``max_turns = max(--turns)``); every smaller T is scored from
the same episodes (a sample counts as solved at T iff it succeeded within T assistant turns).
Episodes that failed (env error, engine error, timeout) stay in the sample as unsolved.

Writes into ``--out``: ``eval.json`` (see docs/evaluation.md), ``trajectories.jsonl`` (every
episode, failed ones included; written as episodes end, then rewritten in task order),
``pass_at_k.png`` (pass@k per T with bootstrap bands), ``pass_at_kt.png`` (k x T heat map) and
``turns.png``. Prints pass@1 and pass@k with 95% intervals, success rate and cost. With
``--injection-rate`` (docs/safety.md) the episodes of that fraction of the tasks carry a prompt
injection in a tool result; eval.json and the printout add the attack success rate (``asr``) and
the success rate of clean and injected episodes (``utility_clean``, ``utility_injected``). With
``--attempts N [--reflect]`` a failed episode is retried on its task, each attempt seeing the earlier
ones' outcomes (and the model's reflections): eval.json's ``attempts`` has pass@(attempt a) for
a = 1..N, ``attempts.jsonl`` the later attempts (docs/evaluation.md, "Attempts").
"""

from __future__ import annotations

import argparse

from tracegym.commands._policy import (
    add_env_arguments,
    add_injection_arguments,
    add_policy_arguments,
    add_run_arguments,
    positive_int,
)

NAME = "eval"
HELP = "Evaluate a model (or LoRA adapter, or the expert) on held-out tasks: pass@k, pass@(k,T), cost; eval.json + plots."

DEFAULT_KS = "1,2,4,8"
DEFAULT_TURNS = "1,2,4,8"


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (sorted, duplicates dropped); every item an integer >= 1."""
    items = [item.strip() for item in text.split(",")]
    values = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers >= 1 (e.g. 1,2,4,8), got {text!r}: {item!r} is not an integer"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}: {value} < 1")
        values.append(value)
    return sorted(set(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_env_arguments(parser, default_split="test")
    add_injection_arguments(parser)
    add_policy_arguments(parser)
    add_run_arguments(parser, default_tasks=20, default_samples=8)
    parser.add_argument("--k", type=int_list, default=int_list(DEFAULT_KS), metavar="K1,K2,...",
                        help=f"sample budgets k of pass@k (default {DEFAULT_KS}); k larger than --samples are skipped")
    parser.add_argument("--turns", type=int_list, default=None, metavar="T1,T2,...",
                        help="turn budgets T (default: 1, 2, 4, ... up to the env's own turn limit, which is "
                             "included); episodes run with max_turns = the largest")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: 1.0 when --samples > 1, since pass@k needs diverse "
                             "samples; 0.0, greedy, when --samples is 1)")
    parser.add_argument("--attempts", type=positive_int, default=1, metavar="N",
                        help="test-time learning: a failed episode is retried on its task up to N attempts in all, "
                             "each seeing the earlier attempts' outcomes; pass@(attempt) is reported next to pass@k "
                             "(default 1: off)")
    parser.add_argument("--reflect", action="store_true",
                        help="with --attempts: the model writes a reflection on each failed attempt, shown to the next")
    parser.add_argument("--bootstrap", type=positive_int, default=1000,
                        help="bootstrap resamples over tasks for the 95%% intervals (default 1000)")


def default_turns(limit: int) -> list[int]:
    """Turn budgets when ``--turns`` is not given: powers of two below the env's turn limit, then
    the limit itself (8 -> 1,2,4,8; 20 -> 1,2,4,8,16,20)."""
    turns, t = [], 1
    while t < limit:
        turns.append(t)
        t *= 2
    return turns + [limit]


def default_temperature(samples: int) -> float:
    """1.0 when several samples per task are drawn (pass@k with k > 1 measures diverse attempts;
    greedy samples would all be the same), 0.0 (greedy) for a single sample."""
    return 1.0 if samples > 1 else 0.0


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    from pathlib import Path

    from tracegym.commands._policy import (
        UsageError, build_policy, check_env_args, env_turn_limit, injection_settings, make_tasks, print_error,
        rollout_config,
    )
    from tracegym.files import atomic_write_text
    from tracegym.recipes.evaluate import evaluate_to_dir

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    notes: list[str] = []
    skipped = [k for k in args.k if k > args.samples]
    if len(skipped) == len(args.k):
        print_error(f"every k in {args.k} exceeds --samples {args.samples}; pass@k needs k <= samples per task")
        return 2
    if skipped:
        notes.append(f"k = {', '.join(map(str, skipped))} skipped: larger than --samples {args.samples}")
    temperature = args.temperature if args.temperature is not None else default_temperature(args.samples)
    if temperature == 0.0 and args.samples > 1 and args.policy == "model":
        notes.append("greedy sampling (temperature 0) with several samples: the samples are (nearly) identical, "
                     "so pass@k for k > 1 is about pass@1")
    if args.reflect and args.attempts < 2:
        print_error("--reflect needs --attempts N with N >= 2 (a reflection is shown to the next attempt)")
        return 2
    if args.attempts > 1 and (args.strategy != "chains" or getattr(args, "injection_rate", None)):
        print_error("--attempts runs the chains strategy without --injection-rate")
        return 2
    if args.reflect and args.policy == "expert":
        print_error("--reflect needs a model: the scripted expert writes no reflection")
        return 2
    try:
        check_env_args(args)  # an unknown env or option: one line, before anything loads
        injection = injection_settings(args)
        env_options, tasks = make_tasks(args)
        if args.turns is None:
            args.turns = default_turns(env_turn_limit(args))
        max_turns = max(args.turns)
        setup = build_policy(args)
        config = rollout_config(args, setup, max_turns=max_turns, temperature=temperature)
    except UsageError as exc:
        print_error(exc)
        return 2

    try:
        summary, result, written = evaluate_to_dir(
            args.env, tasks, setup.policy, setup.renderer, config, args.k, args.turns, args.out,
            env_options=env_options, policy_name=setup.policy_name, split=args.split, gap_model=setup.gap_model,
            bootstrap=args.bootstrap, progress=not args.no_progress, injection=injection,
            strategy=args.strategy, strategy_options=dict(args.strategy_option),
            attempts=args.attempts, reflect=args.reflect,
            extra={
                # "model" is what produced the episodes ("expert", the adapter folder or the model
                # name, as in Trajectory.policy); the model the adapter was merged into is base_model.
                "base_model": setup.model_name,
                "adapter": setup.adapter,
                "engine": setup.engine_name,
                "renderer": setup.describe()["renderer"],
                "untrusted_tool_output": setup.describe()["untrusted_tool_output"],
                "task_seed": args.task_seed,
            },
        )
    finally:
        setup.close()
    if result.stats.failed:
        notes.append(f"{result.stats.failed} of {result.stats.episodes} episodes failed (env/engine error or "
                     "timeout) and count as unsolved; see errors in eval.json")
    summary["notes"] = notes
    atomic_write_text(Path(args.out) / "eval.json", json.dumps(summary, indent=2) + "\n")
    _print_summary(summary, notes, written)
    return 0 if result.stats.kept > 0 else 1


def _print_summary(summary: dict, notes: list[str], written: dict) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    top = str(summary["max_turns"])
    k_max = str(summary["ks"][-1])

    def value_ci(k: str, turn: str = top) -> str:
        low, high = summary["pass_at_ci"][turn][k]
        return f"{summary['pass_at'][turn][k]:.3f} [{low:.3f}, {high:.3f}]"

    cost = summary["cost"]
    table = Table(title=f"{summary['model']} on {summary['env']} ({summary['split']}): {summary['n_tasks']} tasks x "
                        f"{summary['samples_per_task']} samples, T={top}, 95% bootstrap over tasks")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("pass@1", value_ci("1") if "1" in summary["pass_at"][top] else "-")
    if k_max != "1":
        table.add_row(f"pass@{k_max}", value_ci(k_max))
    table.add_row("success rate", f"{summary['success_rate']:.3f}")
    table.add_row("turns / episode", f"{cost['turns']:.2f}")
    table.add_row("tool calls / episode", f"{cost['tool_calls']:.2f}")
    table.add_row("generated tokens / episode", f"{cost['generated_tokens']:.1f}")
    if summary.get("tool_calls"):
        calls = summary["tool_calls"]
        table.add_row("tool calls vs expert: precision / recall",
                      f"{calls['call_precision']:.3f} / {calls['call_recall']:.3f}")
        table.add_row("conversation exact match", f"{calls['conversation_exact_match']:.3f}")
    table.add_row("invalid-call rate", f"{summary['invalid_calls']['invalid_call_rate']:.3f}")
    if "injected_episodes" in summary:
        _add_injection_rows(table, summary)
    console.print(table)

    grid = Table(title="pass@(k, T)")
    grid.add_column("T \\ k")
    for k in summary["ks"]:
        grid.add_column(str(k), justify="right")
    for turn in summary["turns"]:
        grid.add_row(str(turn), *[f"{summary['pass_at'][str(turn)][str(k)]:.3f}" for k in summary["ks"]])
    console.print(grid)
    if "attempts" in summary:
        tried = summary["attempts"]
        rows = Table(title=f"pass@(attempt): {tried['chains']} chains, each retried after a failure up to "
                           f"{tried['n']} attempts{' with reflection' if tried['reflect'] else ''}")
        rows.add_column("attempt")
        rows.add_column("played", justify="right")
        rows.add_column("pass@(attempt) [95% CI]", justify="right")
        for a, row in tried["pass_at_attempt"].items():
            rows.add_row(a, str(tried["played"][a]), f"{row['value']:.3f} [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]")
        console.print(rows)
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print("wrote " + ", ".join(str(path) for path in written.values()))



def _add_injection_rows(table, summary: dict) -> None:
    """ASR and utility rows of an evaluation with prompt-injection episodes."""

    def rate(key: str) -> str:
        value, ci = summary.get(key), summary.get(f"{key}_ci")
        if value is None:
            return "-"
        return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"

    table.add_row("injected / clean episodes", f"{summary['injected_episodes']} / {summary['clean_episodes']}")
    table.add_row("attack success rate (ASR)", rate("asr"))
    for kind, figures in summary.get("asr_by_attack", {}).items():
        table.add_row(f"  ASR {kind}", f"{figures['asr']:.3f} ({figures['episodes']} episodes)")
    table.add_row("utility, clean episodes", rate("utility_clean"))
    table.add_row("utility, injected episodes", rate("utility_injected"))
