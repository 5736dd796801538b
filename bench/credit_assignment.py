"""Multi-turn credit assignment: grpo vs turn_grpo vs gigpo vs tree rollouts, from one SFT start.

    .venv/bin/python bench/credit_assignment.py            # full: 2 seeds x 4 methods (about 50 min on 2 cores)
    .venv/bin/python bench/credit_assignment.py --quick    # 1 seed, grpo vs tree, tiny budget (< 5 min)

Task: FrozenLake 4x4 (``frozenlake``, size 4, ``--holes`` 0.1 by default): start and goal are at
least 3 moves apart, so every solution takes >= 3 dependent turns (one ``move`` per turn as the
expert plays), and the boards of one task recur across its samples (GiGPO's step groups can be
larger than 1). With few holes a wrong move mostly costs a turn, not the episode, so a 135M model that has
the format but little spatial sense still earns rewards to learn from.

1. SFT start (shared by every run, cached in ``<out>/sft`` unless ``--fresh``): the scripted
   expert's trajectories on train tasks, LoRA SFT of SmolLM2-135M-Instruct.
2. For each seed and method, ``train_rl`` from that adapter with the same tasks, steps, learning
   rate and loss (PPO-clip, token-mean); only the credit assignment differs:

   - ``grpo``: one advantage per episode (group mean/std), on every turn;
   - ``turn_grpo``: per-turn returns against a leave-one-out baseline over episodes;
   - ``gigpo``: episode advantage + step advantage over turns that saw the same board;
   - ``tree``: tree-search rollouts (``rollout.strategy: tree``, entropy-guided forks) with the
     ``tree`` estimator (TreeRL advantages, 1/|L(n)| token weights). Budget: the chain methods
     sample ``group`` episodes per task; the tree has ``tree_leaves`` leaves, half of them forked
     at turn boundaries, chosen so the generated tokens per step come out about equal (measured and
     printed: compare the ``tokens/step`` column).
3. Held-out pass@1 of every final adapter (greedy, the same test tasks), 95% bootstrap CI over
   (seed, task) pairs, and the paired difference to ``grpo``; train reward per step (mean over
   seeds), generated tokens, wall time, and for gigpo the mean step-group size.

Writes ``<out>/results.json``, ``<out>/credit_assignment.png`` and prints the table. Runs every
stage one after another (never two torch jobs at once on a 2-core machine).

**From a strong start** (``--start DEMO_DIR``): the FrozenLake start above is weak (SFT pass@1 0.17,
most groups all-failure), so it could not show a difference. With ``--start`` the methods start
from the SFT adapter of a finished 3-call calculator ``tracegym demo`` run (pass@1 about 0.6, most
groups carry signal) and use the demo's RL stage unchanged (``recipes/demo.py``: derived learning
rate, 2 warmup steps, PPO-clip 0.2/0.28, reward parts ``{answer: 1, calls: 0.3}`` so turns carry
their own rewards, trust region 0.02, expert replay 1.0, LUFFY guidance for all-failure groups,
train and eval temperature both the demo's 0.7); only the estimator (and for ``tree`` the rollout
strategy) differs. Every seed trains on the same train tasks; all are judged on the demo's held-out
tasks with the same sampling seeds, paired per (seed, task) with the SFT start (the demo's own
evaluation when its samples per task are ``--eval-samples``, else evaluated here) and with
``grpo``. ``tree`` runs without guidance (the config refuses guidance for tree rollouts). A run
whose evaluation is already in ``<out>`` is read back, not repeated (``--fresh`` repeats it).

    .venv/bin/python bench/credit_assignment.py --start runs/demo --out runs/credit_strong \\
        --seeds 0 1 --steps 5 --eval-samples 1
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS: dict[str, dict[str, Any]] = {
    "grpo": {"advantage": {"estimator": "grpo"}},
    "turn_grpo": {"advantage": {"estimator": "turn_grpo", "options": {"gamma": 1.0}}},
    "gigpo": {"advantage": {"estimator": "gigpo", "options": {"gamma": 1.0}}},
    "tree": {"advantage": {"estimator": "tree"}, "rollout": {"strategy": "tree", "tree": {"branch": "entropy"}}},
}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def log(started: float, text: str) -> None:
    print(f"[{time.perf_counter() - started:6.0f}s] {text}", flush=True)


def sft_start(args: argparse.Namespace, out: Path, renderer: Any, started: float) -> Path:
    """The SFT adapter every run starts from (trained once, reused unless --fresh)."""
    from tracegym.config import LoraConfig, ModelConfig, OptimConfig, SFTConfig
    from tracegym.data.store import TrajectoryWriter
    from tracegym.envs import make
    from tracegym.recipes.sft import train_sft
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    final = out / "sft" / "train" / "final"
    if final.exists() and not args.fresh:
        log(started, f"SFT start: reusing {final}")
        return final
    shutil.rmtree(out / "sft", ignore_errors=True)
    tasks = make("frozenlake", **args.env_options).tasks("train", args.expert_tasks, 0)
    with TrajectoryWriter(out / "sft" / "expert.jsonl") as writer:
        expert = run_rollouts_sync("frozenlake", tasks, "expert", renderer, RolloutConfig(max_turns=args.max_turns),
                                   writer=writer, progress=False, env_options=args.env_options, policy_name="expert")
    log(started, f"expert: success {expert.stats.success_rate:.3f} on {expert.stats.episodes} train tasks")
    cfg = SFTConfig(
        model=ModelConfig(name=args.model), lora=LoraConfig(r=16, alpha=32),
        optim=OptimConfig(lr=3e-4, warmup_steps=1, schedule="cosine"),
        data={"train_files": [str(out / "sft" / "expert.jsonl")]},
        max_steps=args.sft_steps, batch_size=8, micro_batch_size=4, seed=0, output_dir=str(out / "sft" / "train"),
        checkpoint={"every": 0, "keep_last": 1}, logging={"tensorboard": False, "progress": True},
    )
    result = train_sft(cfg)
    log(started, f"SFT: {args.sft_steps} steps -> {result.final_dir}")
    return Path(result.final_dir)


def evaluate(args: argparse.Namespace, adapter: Path, renderer: Any, test_tasks: list[Any]) -> dict[str, bool]:
    """Greedy success per test task of the adapter (one episode each)."""
    from tracegym.engines import make_engine
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    engine = make_engine("hf", model=str(adapter), renderer=renderer, max_batch_size=64)
    config = RolloutConfig(max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens, temperature=0.0, seed=0,
                           concurrency=64)
    result = run_rollouts_sync("frozenlake", test_tasks, engine, renderer, config, progress=False,
                               env_options=args.env_options, policy_name=adapter.name)
    solved = {task.id: False for task in test_tasks}
    for trajectory in result.trajectories:
        solved[trajectory.task_id] = bool(trajectory.success)
    engine.close()
    return solved


def rl_run(args: argparse.Namespace, method: str, seed: int, adapter: Path, out: Path) -> dict[str, Any]:
    """One RL run; returns its final adapter and per-step curves read back from metrics.jsonl."""
    from tracegym.config import RLConfig, load_config
    from tracegym.recipes.rl import train_rl
    from tracegym.train.logging import read_metrics

    run_dir = out / "runs" / f"{method}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    data: dict[str, Any] = {
        "model": {"name": args.model, "adapter": str(adapter)},
        "lora": {"r": 16, "alpha": 32},
        "optim": {"lr": args.lr},
        "env": {"name": "frozenlake", "options": args.env_options},
        "tasks": {"train": args.steps * args.tasks_per_step, "test": 0, "seed": seed},
        "tasks_per_step": args.tasks_per_step,
        "group_size": args.tree_leaves if method == "tree" else args.group,
        "rollout": {"max_turns": args.max_turns, "max_tokens_per_turn": args.max_tokens, "temperature": 1.0,
                    "concurrency": 64},
        "policy_loss": {"loss": "ppo_clip", "aggregation": "token_mean"},
        "micro_batch_size": 4, "steps": args.steps, "max_length": 2048, "seed": seed,
        "eval": {"every": 0, "at_start": False}, "save_rollouts": False,
        "checkpoint": {"every": 0, "keep_last": 1}, "output_dir": str(run_dir),
        "logging": {"tensorboard": False, "progress": True},
    }
    for key, value in METHODS[method].items():
        data[key] = {**data.get(key, {}), **value}
    cfg = load_config(RLConfig, data=data)
    t0 = time.perf_counter()
    result = train_rl(cfg)
    wall = time.perf_counter() - t0
    rows = [row for row in read_metrics(run_dir) if row["step"] > 0]
    return {
        "adapter": str(result.final_dir), "wall_s": wall,
        "reward": [row["reward/mean"] for row in rows],
        "tokens": [row.get("rollout/generated_tokens", 0.0) for row in rows],
        "no_signal": [row.get("groups/no_signal", 0.0) for row in rows],
        "step_group_size": [row["advantage/step_group_size"] for row in rows if "advantage/step_group_size" in row],
        "tree_shared_turns": [row["advantage/tree_shared_turns"] for row in rows if "advantage/tree_shared_turns" in row],
        "prefix_tokens_reused": [row.get("tree/prefix_tokens_reused", 0.0) for row in rows],
    }


def pooled(solved: dict[int, dict[str, bool]]) -> dict[str, tuple[int, int]]:
    """(seed, task) -> (n=1, solved) for the paired bootstrap."""
    return {f"{seed}/{task}": (1, int(ok)) for seed, per_task in solved.items() for task, ok in per_task.items()}


def pass_at_1(solved: dict[str, tuple[int, int]]) -> float:
    """Mean over the keys of solved / samples (``{task: (n, c)}``, or pooled ``{seed/task: (n, c)}``)."""
    return sum(c / n for n, c in solved.values()) / len(solved)


def strong_start_run(args: argparse.Namespace, demo: Any, method: str, seed: int, run_dir: Path) -> Any:
    """The demo's RL stage from its SFT adapter with ``method``'s credit assignment: the RLConfig."""
    from tracegym.config import RLConfig, load_config
    from tracegym.recipes.demo import rl_stage_config

    data = rl_stage_config(demo.model_copy(update={"seed": seed}), args.start / "train_sft" / "final",
                           run_dir).model_dump(mode="json")
    data["tasks"]["seed"] = demo.seed  # every seed trains on the same tasks
    data["advantage"] = METHODS[method]["advantage"]
    data["health"]["mutual_information"] = False  # a monitor (15 s a step here); not what is compared
    data["logging"]["tensorboard"] = False
    if method == "tree":  # leaves, half of them forked, sized so generated tokens come out about equal
        data["rollout"] = {**data["rollout"], **METHODS["tree"]["rollout"]}
        data["group_size"] = args.tree_leaves
        data["guidance"] = None  # guidance joins groups of independent chains only
    return load_config(RLConfig, data=data)


def strong_start_main(args: argparse.Namespace) -> int:
    """``--start``: every method from a finished 3-call demo run's SFT adapter (module docstring)."""
    from tracegym.config import load_config
    from tracegym.envs import make
    from tracegym.eval.metrics import bootstrap_ci, paired_bootstrap_diff
    from tracegym.models import load_tokenizer
    from tracegym.recipes.demo import DemoConfig, demo_rl_lr, evaluate_stage
    from tracegym.recipes.rl import train_rl
    from tracegym.render import get_renderer
    from tracegym.train.logging import read_metrics

    started = time.perf_counter()
    saved = json.loads((args.start / "demo_config.json").read_text(encoding="utf-8"))
    kept = {k: v for k, v in saved.items() if not k.startswith("rl_")}  # the RL stage: today's defaults
    demo = load_config(DemoConfig, data={
        **kept, "rl_steps": args.steps, "rl_tasks_per_step": args.tasks_per_step, "rl_group_size": args.group,
        "eval_samples": args.eval_samples, "eval_ks": [1], "progress": False})
    renderer = get_renderer(demo.model, load_tokenizer(demo.model))
    test_tasks = make(demo.env, **demo.env_options).tasks("test", demo.test_tasks, demo.seed)
    turns = str(max(demo.eval_turns))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def solved_of(summary: dict[str, Any]) -> dict[str, tuple[int, int]]:
        return {task: (v["n"], v["solved"][turns]) for task, v in summary["per_task"].items()}

    # The SFT start judged like the runs. The demo's own SFT evaluation serves when its samples per
    # task are these; else it is evaluated here: episode i of an evaluation samples with seeds drawn
    # from i, so equal settings give every run and the start the same random numbers per episode,
    # and the paired differences lose the noise of sampling that a barely moved policy shares.
    sft_eval = args.start / "sft" / "eval.json"
    if json.loads(sft_eval.read_text(encoding="utf-8"))["samples_per_task"] != demo.eval_samples:
        sft_eval = out / "sft_eval" / "eval.json"
        if args.fresh or not sft_eval.is_file():
            evaluate_stage(demo, test_tasks, renderer, args.start / "train_sft" / "final", sft_eval.parent, "sft")
    sft = solved_of(json.loads(sft_eval.read_text(encoding="utf-8")))
    log(started, f"SFT start {args.start}: pass@1 {pass_at_1(sft):.3f} "
                 f"on {len(sft)} tasks ({sft_eval})")

    records: list[dict[str, Any]] = []
    for seed in args.seeds:
        for method in args.methods:
            run_dir = out / f"{method}_seed{seed}"
            eval_json = run_dir / "eval" / "eval.json"
            if args.fresh or not eval_json.is_file():
                shutil.rmtree(run_dir, ignore_errors=True)
                cfg = strong_start_run(args, demo, method, seed, run_dir)
                log(started, f"RL {method} seed {seed}: {cfg.steps} steps x {cfg.tasks_per_step} tasks x "
                             f"{cfg.group_size} episodes, lr {cfg.optim.lr:.3g}")
                t0 = time.perf_counter()
                result = train_rl(cfg)
                wall = time.perf_counter() - t0
                evaluate_stage(demo, test_tasks, renderer, result.final_dir, run_dir / "eval", method)
                (run_dir / "wall_s.txt").write_text(f"{wall}\n", encoding="utf-8")
            rows = [row for row in read_metrics(run_dir) if row["step"] > 0]
            record = {
                "method": method, "seed": seed,
                "wall_s": float((run_dir / "wall_s.txt").read_text()),
                "solved": solved_of(json.loads(eval_json.read_text(encoding="utf-8"))),
                "reward": [row["reward/mean"] for row in rows],
                "tokens": [row.get("rollout/generated_tokens", 0.0) for row in rows],
                "informative_groups": [row.get("health/informative_groups", 0.0) for row in rows],
                "guided_groups": [row.get("guidance/groups", 0.0) for row in rows],
                "drift_kl": [row.get("drift/kl", 0.0) for row in rows],
                "step_group_size": [row["advantage/step_group_size"] for row in rows
                                    if "advantage/step_group_size" in row],
            }
            records.append(record)
            rate = pass_at_1(record["solved"])
            log(started, f"  {method} seed {seed}: pass@1 {rate:.3f}, groups with signal "
                         f"{sum(record['informative_groups']):.0f}/{args.steps * args.tasks_per_step}, "
                         f"{record['wall_s'] / 60:.1f} min")
            write_strong_results(out, args, demo, records, sft)

    def pooled_runs(method: str) -> dict[str, tuple[int, int]]:
        return {f"{r['seed']}/{task}": nc for r in records if r["method"] == method for task, nc in r["solved"].items()}

    sft_pooled = {f"{seed}/{task}": nc for seed in args.seeds for task, nc in sft.items()}
    table = {}
    for method in args.methods:
        values = pooled_runs(method)
        runs = [r for r in records if r["method"] == method]
        low, high = bootstrap_ci([c / n for n, c in values.values()])
        row: dict[str, Any] = {"pass@1": pass_at_1(values), "ci": [low, high],
                               "per_seed": {r["seed"]: pass_at_1(r["solved"]) for r in runs}}
        diff, dlow, dhigh, shared = paired_bootstrap_diff(sft_pooled, values, 1)
        row["vs_sft"] = {"diff": diff, "ci": [dlow, dhigh], "pairs": shared}
        if method != "grpo" and "grpo" in args.methods:
            diff, dlow, dhigh, shared = paired_bootstrap_diff(pooled_runs("grpo"), values, 1)
            row["vs_grpo"] = {"diff": diff, "ci": [dlow, dhigh], "pairs": shared}
        row["informative_groups"] = sum(sum(r["informative_groups"]) for r in runs)
        row["groups"] = len(runs) * args.steps * args.tasks_per_step
        row["guided_groups"] = sum(sum(r["guided_groups"]) for r in runs)
        row["tokens_per_step"] = statistics.fmean(t for r in runs for t in r["tokens"])
        row["wall_s"] = statistics.fmean(r["wall_s"] for r in runs)
        row["reward_curve"] = [statistics.fmean(r["reward"][i] for r in runs) for i in range(args.steps)]
        sizes = [v for r in runs for v in r["step_group_size"]]
        row["step_group_size"] = statistics.fmean(sizes) if sizes else None
        table[method] = row
    results = write_strong_results(out, args, demo, records, sft, table)
    plot(results, out / "credit_assignment.png")
    print(f"\n3-call calculator, SmolLM2-135M + LoRA from {args.start} (SFT pass@1 {results['sft_pass@1']:.3f}); "
          f"seeds {args.seeds}; {args.steps} RL steps x {args.tasks_per_step} tasks x {args.group} episodes "
          f"(tree: {args.tree_leaves} leaves); lr {demo_rl_lr(demo):.3g}; {len(test_tasks)} test tasks x "
          f"{demo.eval_samples} samples, temperature {demo.temperature} (train and eval)")
    print("| method | pass@1 [95% CI] | vs SFT | vs grpo | groups with signal | guided | train reward first -> last | "
          "tokens/step | wall min/run | step-group size |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda d: f"{d['diff']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"  # noqa: E731
    for method, row in table.items():
        size = f"{row['step_group_size']:.2f}" if row["step_group_size"] is not None else "-"
        print(f"| {method} | {row['pass@1']:.3f} [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}] | {fmt(row['vs_sft'])} | "
              f"{fmt(row['vs_grpo']) if 'vs_grpo' in row else '-'} | {row['informative_groups']:.0f}/{row['groups']} | "
              f"{row['guided_groups']:.0f} | {row['reward_curve'][0]:.3f} -> {row['reward_curve'][-1]:.3f} | "
              f"{row['tokens_per_step']:.0f} | {row['wall_s'] / 60:.1f} | {size} |")
    print(f"\ntotal {(time.perf_counter() - started) / 60:.1f} min, peak RSS {peak_rss_mb():.0f} MB; "
          f"{out / 'results.json'}, {out / 'credit_assignment.png'}")
    return 0


def write_strong_results(out: Path, args: argparse.Namespace, demo: Any, records: list[dict[str, Any]],
                         sft: dict[str, tuple[int, int]], table: dict[str, Any] | None = None) -> dict[str, Any]:
    """``<out>/results.json`` (rewritten after every run, so a cut-off run keeps what finished)."""
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "demo": demo.model_dump(mode="json"), "sft_pass@1": pass_at_1(sft),
               "runs": records, "methods": table or {}, "peak_rss_mb": peak_rss_mb(),
               "date": time.strftime("%Y-%m-%d")}
    (out / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, grpo vs tree, 1 step, 8 test tasks")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tasks-per-step", type=int, default=None, help="default 2 (--start: 8, the demo's)")
    parser.add_argument("--group", type=int, default=None,
                        help="episodes per task of the chain methods; default 4 (--start: 6, the demo's)")
    parser.add_argument("--tree-leaves", type=int, default=None, help="leaves per tree, half forked; default 6 (--start: 8)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--holes", type=float, default=0.1, help="hole fraction of the lakes")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per turn")
    parser.add_argument("--test-tasks", type=int, default=24)
    parser.add_argument("--expert-tasks", type=int, default=128)
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--out", default="runs/credit_assignment")
    parser.add_argument("--fresh", action="store_true", help="retrain the SFT start (with --start: rerun every run)")
    parser.add_argument("--start", type=Path, default=None,
                        help="a finished 3-call `tracegym demo` run: start from its SFT adapter (module docstring)")
    parser.add_argument("--eval-samples", type=int, default=1, help="with --start: samples per test task")
    args = parser.parse_args()
    if args.start is not None:
        if args.quick:
            parser.error("--quick is the FrozenLake mode; with --start pass --steps/--seeds/--methods")
        if not (args.start / "train_sft" / "final" / "adapter_config.json").is_file():
            parser.error(f"--start {args.start}: no train_sft/final adapter (not a finished demo run)")
        args.tasks_per_step, args.group = args.tasks_per_step or 8, args.group or 6  # the demo's
        args.tree_leaves = args.tree_leaves or 8
        if args.out == parser.get_default("out"):
            args.out = "runs/credit_strong"
        import torch

        torch.set_num_threads(2)
        return strong_start_main(args)
    args.tasks_per_step, args.group, args.tree_leaves = args.tasks_per_step or 2, args.group or 4, args.tree_leaves or 6
    if args.quick:
        args.seeds, args.methods, args.steps, args.tasks_per_step, args.max_turns = [0], ["grpo", "tree"], 1, 2, 4
        args.group, args.tree_leaves, args.test_tasks, args.expert_tasks, args.sft_steps = 4, 6, 8, 16, 3
        args.out = args.out + "_quick"
    args.env_options = {"size": 4, "hole_fraction": args.holes}

    import torch

    torch.set_num_threads(2)
    from tracegym.envs import make
    from tracegym.eval.metrics import bootstrap_ci, paired_bootstrap_diff
    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer

    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    renderer = get_renderer(args.model, load_tokenizer(args.model))
    test_tasks = make("frozenlake", **args.env_options).tasks("test", args.test_tasks, 0)

    adapter = sft_start(args, out, renderer, started)
    sft_solved = evaluate(args, adapter, renderer, test_tasks)
    log(started, f"SFT start: greedy pass@1 {statistics.fmean(sft_solved.values()):.3f} on {len(test_tasks)} test tasks")

    runs: dict[str, dict[int, dict[str, Any]]] = {m: {} for m in args.methods}
    solved: dict[str, dict[int, dict[str, bool]]] = {m: {} for m in args.methods}
    for seed in args.seeds:
        for method in args.methods:
            log(started, f"RL {method} seed {seed}: {args.steps} steps x {args.tasks_per_step} tasks")
            runs[method][seed] = run = rl_run(args, method, seed, adapter, out)
            solved[method][seed] = evaluate(args, Path(run["adapter"]), renderer, test_tasks)
            log(started, f"  {method} seed {seed}: pass@1 {statistics.fmean(solved[method][seed].values()):.3f}, "
                         f"train reward {run['reward'][0]:.3f} -> {run['reward'][-1]:.3f}, {run['wall_s']:.0f} s")

    # table
    table: dict[str, dict[str, Any]] = {}
    sft_pooled = {f"{seed}/{task}": (1, int(ok)) for seed in args.seeds for task, ok in sft_solved.items()}
    for method in args.methods:
        values = pooled(solved[method])
        successes = [c for _, c in values.values()]
        low, high = bootstrap_ci(successes)
        row: dict[str, Any] = {"pass@1": statistics.fmean(successes), "ci": [low, high],
                               "per_seed": {s: statistics.fmean(v.values()) for s, v in solved[method].items()}}
        diff, dlow, dhigh, _ = paired_bootstrap_diff(sft_pooled, values, 1)
        row["vs_sft"] = {"diff": diff, "ci": [dlow, dhigh]}
        if method != "grpo" and "grpo" in solved:
            diff, dlow, dhigh, _ = paired_bootstrap_diff(pooled(solved["grpo"]), values, 1)
            row["vs_grpo"] = {"diff": diff, "ci": [dlow, dhigh]}
        per_seed_runs = list(runs[method].values())
        row["reward_curve"] = [statistics.fmean(r["reward"][i] for r in per_seed_runs) for i in range(args.steps)]
        row["tokens_per_step"] = statistics.fmean(t for r in per_seed_runs for t in r["tokens"])
        row["wall_s"] = statistics.fmean(r["wall_s"] for r in per_seed_runs)
        row["no_signal_groups"] = statistics.fmean(t for r in per_seed_runs for t in r["no_signal"])
        sizes = [v for r in per_seed_runs for v in r["step_group_size"]]
        row["step_group_size"] = statistics.fmean(sizes) if sizes else None
        shared = [v for r in per_seed_runs for v in r["tree_shared_turns"]]
        row["tree_shared_turns"] = statistics.fmean(shared) if shared else None
        table[method] = row

    results = {"args": {k: v for k, v in vars(args).items()}, "sft_pass@1": statistics.fmean(sft_solved.values()),
               "methods": table, "wall_s": time.perf_counter() - started, "peak_rss_mb": peak_rss_mb(),
               "date": time.strftime("%Y-%m-%d"), "machine": f"{torch.get_num_threads()} torch threads, CPU"}
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    plot(results, out / "credit_assignment.png")

    print(f"\nFrozenLake 4x4 (holes {args.holes}), SmolLM2-135M + LoRA, SFT start pass@1 {results['sft_pass@1']:.3f}; seeds {args.seeds}; "
          f"{args.steps} RL steps x {args.tasks_per_step} tasks; {len(test_tasks)} test tasks, greedy")
    print("| method | pass@1 [95% CI] | vs SFT | vs grpo | train reward first -> last | tokens/step | wall s/run | "
          "step-group size | no-signal groups/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, row in table.items():
        vs_grpo = row.get("vs_grpo")
        fmt = lambda d: f"{d['diff']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"  # noqa: E731
        size = f"{row['step_group_size']:.2f}" if row["step_group_size"] is not None else "-"
        print(f"| {method} | {row['pass@1']:.3f} [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}] | {fmt(row['vs_sft'])} | "
              f"{fmt(vs_grpo) if vs_grpo else '-'} | {row['reward_curve'][0]:.3f} -> {row['reward_curve'][-1]:.3f} | "
              f"{row['tokens_per_step']:.0f} | {row['wall_s']:.0f} | {size} | {row['no_signal_groups']:.2f} |")
    print(f"\ntotal {results['wall_s'] / 60:.1f} min, peak RSS {results['peak_rss_mb']:.0f} MB; "
          f"{out / 'results.json'}, {out / 'credit_assignment.png'}")
    return 0


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(11, 4))
    methods = results["methods"]
    for method, row in methods.items():
        curves.plot(range(1, len(row["reward_curve"]) + 1), row["reward_curve"], marker="o", label=method)
    curves.set(xlabel="RL step", ylabel="train reward (mean over seeds)", title="Training reward")
    curves.legend()
    names = list(methods)
    means = [methods[m]["pass@1"] for m in names]
    errors = [[m - methods[n]["ci"][0] for m, n in zip(means, names)], [methods[n]["ci"][1] - m for m, n in zip(means, names)]]
    bars.bar(names, means, yerr=errors, capsize=4)
    bars.axhline(results["sft_pass@1"], color="grey", linestyle="--", label="SFT start")
    bars.set(ylabel="held-out pass@1 (greedy)", title="Held-out pass@1, 95% CI")
    bars.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
