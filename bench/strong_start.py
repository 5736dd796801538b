"""The experiment that decides whether RL improves a competent multi-step agent (issue "RL that
improves a competent multi-step agent").

From the SFT adapter of a finished 3-call demo run (pass@1 >= 0.6 on its held-out tasks), RL with
the demo's RL stage (``recipes/demo.py``) and these settings: learning rate derived from the SFT rate
and the batch (``rl_lr=None``), 2 warmup steps whose first already moves, LUFFY guidance for
all-failure groups, the calculator's ``calls`` reward part (weight 0.3), a trust region on the
update (0.02) — for each seed, evaluated on N
held-out tasks; prints and writes the paired RL - SFT difference of pass@1 with its 95% CI per seed,
the solve rate per operator (SFT vs RL, paired CI per operator), and the health columns (groups
with signal per step, guided groups, drift).

    .venv/bin/python bench/strong_start.py runs/strong_sft --seeds 0,1 --test-tasks 120 \\
        --out runs/strong_start

The demo run's own ``rl_*`` values are ignored (they are the settings that lost); ``--set`` changes
any of the above. Torch-heavy: run it alone on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path
from typing import Any

OPERATORS = ("*", "+", "-", "//", "%")


def operators_of(task: Any) -> set[str]:
    """The operators a calculator task's reference calls use (``{x} - 129`` -> ``-``)."""
    found = set()
    for template in task.data["templates"]:
        found |= {op for op in OPERATORS if f" {op} " in template}
    return found


def per_operator(tasks: list[Any], sft: dict[str, Any], rl: dict[str, Any], turns: str) -> dict[str, Any]:
    """Per operator: tasks using it, SFT and RL solve rates on them, the paired difference with its CI."""
    from tracegym.eval.metrics import paired_bootstrap_diff

    out = {}
    for op in OPERATORS:
        ids = [t.id for t in tasks if op in operators_of(t)]
        if not ids:
            continue
        solved = {label: {i: (s["per_task"][i]["n"], s["per_task"][i]["solved"][turns]) for i in ids if i in s["per_task"]}
                  for label, s in (("sft", sft), ("rl", rl))}
        diff, low, high, shared = paired_bootstrap_diff(solved["sft"], solved["rl"], 1)
        rate = {label: sum(c for _, c in v.values()) / max(sum(n for n, _ in v.values()), 1) for label, v in solved.items()}
        out[op] = {"tasks": shared, "sft": rate["sft"], "rl": rate["rl"], "diff": diff, "ci": [low, high]}
    return out


def against_row(tasks: list[Any], other: dict[str, Any], rl: dict[str, Any], turns: str) -> dict[str, Any]:
    """This run's RL evaluation against another run's on the same tasks: pass@1 of the other, the
    paired difference RL - other with its CI, and per operator (``per_operator``'s "sft" is the other)."""
    from tracegym.eval.metrics import paired_bootstrap_diff

    solved = [{t: (v["n"], v["solved"][turns]) for t, v in s["per_task"].items()} for s in (other, rl)]
    diff, low, high, shared = paired_bootstrap_diff(solved[0], solved[1], 1)
    if shared != len(tasks):
        raise SystemExit(f"the other evaluation shares {shared} of the {len(tasks)} test tasks: not the same test set")
    return {"pass@1": other["pass_at"][turns]["1"], "diff": diff, "ci": [low, high], "tasks": shared,
            "operators": per_operator(tasks, other, rl, turns)}


def wait_for(path: Path, timeout_s: float = 1800.0) -> Path:
    """``path`` once it exists (another process writes it atomically); an error after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {timeout_s:.0f} s")
        time.sleep(2.0)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("demo_dir", type=Path, help="a finished 3-call `tracegym demo` run (train_sft/final)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1", help="RL seeds, one run each, one after another")
    parser.add_argument("--test-tasks", type=int, default=120)
    parser.add_argument("--eval-samples", type=int, default=None, help="samples per test task (default: the demo's)")
    parser.add_argument("--sft-dir", type=Path, default=None,
                        help="the SFT evaluation's folder (default: OUT/sft_test<N>x<samples>)")
    parser.add_argument("--wait-sft", action="store_true",
                        help="another process evaluates the SFT start into --sft-dir: train first, then wait for it")
    parser.add_argument("--reuse-trained", action="store_true",
                        help="a seed whose RL run already finished (train_rl/final) is evaluated, not trained again")
    parser.add_argument("--label", default="", help="a name for these settings in the results")
    parser.add_argument("--against", nargs="*", default=[], metavar="LABEL=EVAL_JSON",
                        help="other runs' evaluations of the same test tasks, samples and seeds (e.g. a demo's "
                             "rl/eval.json): each seed's RL is also compared with each, paired, per operator too")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="demo RL settings other than the defaults, e.g. rl_steps=10 rl_tasks_per_step=8")
    args = parser.parse_args()

    from tracegym.config import load_config
    from tracegym.envs import make
    from tracegym.models import load_tokenizer
    from tracegym.recipes.demo import DemoConfig, compare_summaries, demo_rl_lr, evaluate_stage, rl_stage_config
    from tracegym.recipes.rl import RLResult, train_rl
    from tracegym.render import get_renderer

    saved = json.loads((args.demo_dir / "demo_config.json").read_text(encoding="utf-8"))
    kept = {k: v for k, v in saved.items() if not k.startswith("rl_")}  # the RL settings are today's defaults
    if args.eval_samples:
        kept["eval_samples"] = args.eval_samples
        kept["eval_ks"] = [k for k in kept.get("eval_ks", [1]) if k <= args.eval_samples]
    holds = {"rl_lr": None, "rl_warmup_steps": 2, "rl_guidance": True, "rl_reward_parts": {"answer": 1.0, "calls": 0.3},
             "rl_max_policy_drift": 0.02}  # the settings under test (docs/algorithms.md, "Why RL lost the strong start")
    demo = load_config(DemoConfig, data={**kept, **holds, "test_tasks": args.test_tasks}, overrides=list(args.set))
    sft_adapter = args.demo_dir / "train_sft" / "final"
    if not (sft_adapter / "adapter_config.json").is_file():
        raise SystemExit(f"{sft_adapter} holds no adapter: {args.demo_dir} is not a finished demo run")
    renderer = get_renderer(demo.model, load_tokenizer(demo.model))
    test_tasks = make(demo.env, **demo.env_options).tasks("test", demo.test_tasks, demo.seed)
    turns = str(max(demo.eval_turns))
    against = {}
    for item in args.against:
        label, sep, path = item.partition("=")
        if not sep or not label or not Path(path).is_file():
            raise SystemExit(f"--against {item!r}: expected LABEL=PATH of an eval.json")
        against[label] = json.loads(Path(path).read_text(encoding="utf-8"))
        unseen = {t.id for t in test_tasks} - set(against[label].get("per_task", {}))
        if unseen:  # found before hours of training, not after
            raise SystemExit(f"--against {label}: {path} did not evaluate {len(unseen)} of the {len(test_tasks)} test tasks")

    sft_dir = args.sft_dir or args.out / f"sft_test{demo.test_tasks}x{demo.eval_samples}"
    if not (sft_dir / "eval.json").is_file() and not args.wait_sft:
        started = time.perf_counter()
        evaluate_stage(demo, test_tasks, renderer, sft_adapter, sft_dir, "sft")
        print(f"SFT evaluated in {(time.perf_counter() - started) / 60:.1f} min", flush=True)

    results = []
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        run = args.out / f"seed_{seed}"
        stage = demo.model_copy(update={"seed": seed})
        cfg = rl_stage_config(stage, sft_adapter, run / "train_rl")
        # every seed trains on the same train tasks and is judged on the same test tasks
        cfg = cfg.model_copy(update={"tasks": cfg.tasks.model_copy(update={"seed": demo.seed}),
                                     "logging": cfg.logging.model_copy(update={"tensorboard": False})})
        finished = run / "train_rl" / "final" / "adapter_config.json"
        if args.reuse_trained and finished.is_file():  # trained before, evaluation not finished: evaluate only
            history = [json.loads(line) for line in (run / "train_rl" / "metrics.jsonl").read_text().splitlines()]
            trained = RLResult(run / "train_rl", finished.parent, history[-1]["step"], history)
            rl_minutes = sum(row.get("time/step_s", 0.0) for row in history) / 60
        else:
            shutil.rmtree(run / "train_rl", ignore_errors=True)
            started = time.perf_counter()
            trained = train_rl(cfg)
            rl_minutes = (time.perf_counter() - started) / 60
        rows = trained.history[1:]
        for row in rows:
            print(f"seed {seed} step {row['step']:3d}  reward {row['reward/mean']:.3f}  calls part "
                  f"{row.get('reward/calls', float('nan')):.3f}  groups with signal {row.get('health/informative_groups', 0):.0f}"
                  f"/{cfg.tasks_per_step}  guided {row.get('guidance/groups', 0):.0f}  drift {row.get('drift/kl', 0):.4f}"
                  f"  step scale {row.get('drift/step_scale', 1):.2f}  probe nll {row.get('drift/probe_nll', 0):.4f}", flush=True)
        summary = evaluate_stage(stage.model_copy(update={"seed": demo.seed}), test_tasks, renderer, trained.final_dir,
                                 run / "rl", "rl")
        sft = json.loads(wait_for(sft_dir / "eval.json").read_text(encoding="utf-8"))
        comparison = compare_summaries({"sft": sft, "rl": summary}, turns)
        diff = comparison["paired_diff_pass@1"]["rl-sft"]
        result = {
            "label": args.label, "estimator": cfg.advantage.estimator, "seed": seed, "rl_minutes": rl_minutes, "lr": demo_rl_lr(demo), "steps": cfg.steps,
            "tasks_per_step": cfg.tasks_per_step, "group_size": cfg.group_size, "kl_coef": cfg.policy_loss.get("kl_coef", 0.0),
            "guidance_groups": cfg.guidance.groups if cfg.guidance else None,
            "expert_replay": cfg.expert_replay.model_dump() if cfg.expert_replay else None,
            "train_temperature": cfg.rollout.temperature, "eval_temperature": demo.temperature,
            "sft": comparison["stages"]["sft"]["pass@1"], "sft_ci": comparison["stages"]["sft"]["pass@1_ci"],
            "rl": comparison["stages"]["rl"]["pass@1"], "rl_ci": comparison["stages"]["rl"]["pass@1_ci"],
            "diff": diff["diff"], "diff_ci": diff["ci"], "paired_tasks": diff["tasks"],
            "informative_groups_per_step": [row.get("health/informative_groups", 0.0) for row in rows],
            "guided_groups_per_step": [row.get("guidance/groups", 0.0) for row in rows],
            "drift_kl_per_step": [row.get("drift/kl", 0.0) for row in rows],
            "probe_nll": [row.get("drift/probe_nll") for row in trained.history],
            "operators": per_operator(test_tasks, sft, summary, turns),
        }
        result["against"] = {label: against_row(test_tasks, other, summary, turns) for label, other in against.items()}
        results.append(result)
        (args.out / "strong_start.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
        print(f"seed {seed}: SFT {result['sft']:.3f} -> RL {result['rl']:.3f}  RL - SFT {result['diff']:+.3f} "
              f"[{result['diff_ci'][0]:+.3f}, {result['diff_ci'][1]:+.3f}] paired over {result['paired_tasks']} tasks; "
              f"groups with signal {sum(result['informative_groups_per_step']):.0f}/{cfg.tasks_per_step * len(rows)}; "
              f"RL {rl_minutes:.1f} min", flush=True)
        for op, row in result["operators"].items():
            print(f"  {op:>2}: {row['tasks']:3d} tasks  SFT {row['sft']:.3f}  RL {row['rl']:.3f}  "
                  f"{row['diff']:+.3f} [{row['ci'][0]:+.3f}, {row['ci'][1]:+.3f}]", flush=True)
        for label, row in result["against"].items():
            print(f"seed {seed}: RL {result['rl']:.3f} - {label} {row['pass@1']:.3f} = {row['diff']:+.3f} "
                  f"[{row['ci'][0]:+.3f}, {row['ci'][1]:+.3f}] paired over {row['tasks']} tasks", flush=True)
            for op, part in row["operators"].items():
                print(f"  {op:>2}: {part['tasks']:3d} tasks  {label} {part['sft']:.3f}  RL {part['rl']:.3f}  "
                      f"{part['diff']:+.3f} [{part['ci'][0]:+.3f}, {part['ci'][1]:+.3f}]", flush=True)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
