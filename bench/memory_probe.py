"""Memory across episodes, measured where it helps by construction (issue "Long horizons", item 4).

The ``vault`` env (``tracegym/environments/vault.py``): a building's code never changes and is told
by a keeper on some train visits only, never on a test visit. This script

1. plays the env's memory expert on the train visits in order (``expert_memory``, the ``memory``
   option with a store file): the keeper's visits end with ``remember("Vault code of X: ...")``,
   the others start with ``recall``; that store is the run's memory, built from train episodes only;
2. SFTs SmolLM2-135M (LoRA) on those episodes;
3. evaluates the SFT model on held-out test visits (same buildings, other decoys, nobody at the
   desk) with the memory option (a copy of the train store: test writes are never read back) and
   without it, on the same tasks and seeds, and prints pass@1 of each with the paired difference.

    .venv/bin/python bench/memory_probe.py --out runs/memory_probe [--sft-steps 40] [--test-tasks 48]

Torch-heavy (the SFT and two evaluations): run it alone on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--families", type=int, default=16)
    parser.add_argument("--train-tasks", type=int, default=96)
    parser.add_argument("--sft-steps", type=int, default=40)
    parser.add_argument("--test-tasks", type=int, default=48)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse", action="store_true",
                        help="OUT already holds the expert's store and the SFT adapter: evaluate only")
    args = parser.parse_args()

    from tracegym.config import LoraConfig, ModelConfig, OptimConfig, SFTConfig
    from tracegym.data.store import TrajectoryWriter
    from tracegym.envs import make
    from tracegym.models import load_tokenizer
    from tracegym.recipes.sft import train_sft
    from tracegym.render import get_renderer
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    started = time.perf_counter()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    store = out / "memory.jsonl"
    renderer = get_renderer(args.model, load_tokenizer(args.model))
    probe = make("vault", families=args.families)
    adapter = out / "sft" / "final"
    if args.reuse:
        if not (store.is_file() and (adapter / "adapter_config.json").is_file()):
            raise SystemExit(f"--reuse: {out} lacks memory.jsonl or sft/final")
        evaluate(args, out, store, adapter, renderer, probe, started, expert_success=None)
        return
    store.unlink(missing_ok=True)

    # 1. the memory expert on the train visits, one at a time (a visit reads the notes of those before)
    train_tasks = probe.tasks("train", args.train_tasks, args.seed)
    expert_options = {"families": args.families, "expert_memory": True, "memory": {"store": str(store)}}
    with TrajectoryWriter(out / "expert" / "trajectories.jsonl") as writer:
        expert = run_rollouts_sync("vault", train_tasks, "expert", renderer,
                                   RolloutConfig(max_turns=4, max_context=None, concurrency=1, seed=args.seed),
                                   writer=writer, env_options=expert_options, progress=False, policy_name="expert")
    notes = sum(1 for _ in store.open(encoding="utf-8"))
    print(f"expert: {expert.stats.success_rate:.3f} on {expert.stats.episodes} train visits; {notes} notes in {store}",
          flush=True)

    # 2. SFT on the expert's episodes
    sft = train_sft(SFTConfig(
        model=ModelConfig(name=args.model), lora=LoraConfig(r=16, alpha=32),
        optim=OptimConfig(lr=3e-4, warmup_steps=1, schedule="cosine"),
        data={"train_files": [str(out / "expert" / "trajectories.jsonl")]},
        max_steps=args.sft_steps, batch_size=8, micro_batch_size=1, seed=args.seed, output_dir=str(out / "sft"),
        checkpoint={"every": 0, "keep_last": 1}, logging={"tensorboard": False, "progress": False},
    ))
    print(f"SFT: {args.sft_steps} steps in {(time.perf_counter() - started) / 60:.1f} min (since start)", flush=True)
    evaluate(args, out, store, sft.final_dir, renderer, probe, started, expert.stats.success_rate)


def evaluate(args: argparse.Namespace, out: Path, store: Path, adapter: Path, renderer, probe, started: float,
             expert_success: float | None) -> None:
    """Step 3: the SFT model on the same test visits with and without memory; prints and writes the table."""
    from tracegym.engines import make_engine
    from tracegym.eval.metrics import paired_bootstrap_diff
    from tracegym.recipes.evaluate import evaluate_to_dir
    from tracegym.rollout import RolloutConfig

    notes = sum(1 for _ in store.open(encoding="utf-8"))
    # 3. the same test visits with and without memory (a copy of the train store per evaluation)
    test_tasks = probe.tasks("test", args.test_tasks, args.seed)
    config = RolloutConfig(max_turns=4, max_tokens_per_turn=48, temperature=args.temperature,
                           samples_per_task=args.samples, seed=args.seed + 12345, concurrency=64)
    engine = make_engine("hf", model=str(adapter), renderer=renderer, max_batch_size=64)
    summaries = {}
    for label, memory in (("with memory", True), ("without memory", False)):
        folder = out / ("eval_memory" if memory else "eval_no_memory")
        options: dict = {"families": args.families}
        if memory:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(store, folder / "memory.jsonl")
            options["memory"] = {"store": str(folder / "memory.jsonl")}
        summary, result, _ = evaluate_to_dir("vault", test_tasks, engine, renderer, config, [1], [4], folder,
                                             env_options=options, policy_name=label, plots=False, progress=False)
        recalls = sum(1 for t in result.trajectories for m in t.messages if m.role == "tool" and m.name == "recall")
        summaries[label] = summary
        low, high = summary["pass_at_ci"]["4"]["1"]
        print(f"{label}: pass@1 {summary['pass_at']['4']['1']:.3f} [{low:.3f}, {high:.3f}]  recall calls "
              f"{recalls} in {result.stats.episodes} episodes", flush=True)
    solved = {label: {tid: (row["n"], row["solved"]["4"]) for tid, row in s["per_task"].items()}
              for label, s in summaries.items()}
    diff, low, high, paired = paired_bootstrap_diff(solved["without memory"], solved["with memory"], 1)
    chance = 1.0 / probe.candidates
    print(f"with - without memory: {diff:+.3f} [{low:+.3f}, {high:+.3f}] paired over {paired} test tasks "
          f"(a guess among {probe.candidates} candidates: {chance:.3f})")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "expert_success": expert_success,
              "notes": notes, "pass@1": {k: s["pass_at"]["4"]["1"] for k, s in summaries.items()},
              "pass@1_ci": {k: s["pass_at_ci"]["4"]["1"] for k, s in summaries.items()},
              "diff": diff, "diff_ci": [low, high], "paired_tasks": paired, "chance": chance,
              "minutes": (time.perf_counter() - started) / 60}
    (out / "memory_probe.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(f"total {(time.perf_counter() - started) / 60:.1f} min, peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
