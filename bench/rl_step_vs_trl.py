"""Seconds per RL step: ``tracegym rl`` against TRL's ``GRPOTrainer``, same work on both sides.

The work of one step, on both sides: 2 single-turn calculator prompts (``num_calls=1``, one reply,
no tool turn) x 8 sampled completions of at most 64 new tokens from SmolLM2-135M-Instruct (fp32,
CPU), reward 1 when ``<answer>`` holds the right number, then one policy-gradient update of a LoRA
adapter (r=16, alpha=32, all linear layers, AdamW, lr 1e-5, no KL term: TRL ``beta=0``). The first
``--warmup`` steps are not timed. The prompts are the exact token ids tracegym's renderer builds (system
prompt with the calculator tool, user question); TRL gets them as raw text that re-tokenises to
the same ids (checked). Our side runs with ``skip_uniform_groups=false`` so it trains on every step
like TRL does even when all rewards in a group are equal (the base model is rarely right).

TRL is not a dependency of tracegym: it lives in its own virtualenv, made once (see bench/README.md)::

    python3 -m venv bench/.venv-trl
    bench/.venv-trl/bin/pip install torch==2.13.0        # first, so trl cannot pull another torch
    bench/.venv-trl/bin/pip install trl==1.16.0 transformers==5.24.0 peft==0.21.2 accelerate==1.15.0

Then, from the repository root::

    .venv/bin/python bench/rl_step_vs_trl.py [--steps 3] [--warmup 1]

Each side runs in its own subprocess (ours with this interpreter, TRL with the bench venv's), so
their peak RSS are separate; they run one after the other, never at once. Prints one table: median
seconds per step, the ratio ours / TRL, where our step's time goes (rollout = generation and reward,
train = old-log-prob pass, forward/backward and optimizer, from our metrics ``time/rollout_s`` and
``time/train_s``), and the peak RSS of each process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRL_PYTHON = REPO / "bench" / ".venv-trl" / "bin" / "python"

# The shared settings of both sides.
PROMPTS_PER_STEP = 2
GROUP_SIZE = 8
MAX_NEW_TOKENS = 64
LORA_R, LORA_ALPHA = 16, 32
LEARNING_RATE = 1e-5
SEED = 0


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


# --- the job both sides read ---------------------------------------------------------------------


def build_job(steps: int, warmup: int) -> dict[str, Any]:
    """The prompts (token ids and text), answers and model folder, made with tracegym's own pieces."""
    import asyncio

    from tracegym.envs import make
    from tracegym.models import build_smollm2_cache, load_tokenizer
    from tracegym.render import get_renderer

    tokenizer = load_tokenizer("smollm2-135m")
    renderer = get_renderer("smollm2-135m", tokenizer)
    env = make("calculator", num_calls=1)
    tasks = env.tasks("train", PROMPTS_PER_STEP, SEED)
    prompts = []
    for task in tasks:
        messages = asyncio.run(env.reset(task))
        ids = list(renderer.render_prompt(messages, env.tool_schemas()))
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
            raise RuntimeError(f"prompt of {task.id} does not re-tokenise to the same ids; TRL would see another prompt")
        prompts.append({"task_id": task.id, "ids": ids, "text": text, "answer": float(task.data["answer"])})
    env.close()
    return {"model_folder": str(build_smollm2_cache()), "prompts": prompts, "steps": steps, "warmup": warmup}


# --- our side ------------------------------------------------------------------------------------


def run_ours(job: dict[str, Any], workdir: Path) -> dict[str, Any]:
    from tracegym.config import RLConfig, load_config
    from tracegym.data.store import read_trajectories
    from tracegym.recipes.rl import train_rl

    total = job["steps"] + job["warmup"]
    cfg = load_config(RLConfig, data={
        "model": {"name": "smollm2-135m"},
        "lora": {"enabled": True, "r": LORA_R, "alpha": LORA_ALPHA, "target_modules": "all-linear"},
        "optim": {"lr": LEARNING_RATE, "max_grad_norm": 1.0},
        "env": {"name": "calculator", "options": {"num_calls": 1}},
        "tasks": {"train": PROMPTS_PER_STEP, "test": 0, "seed": SEED},  # both prompts every step
        "tasks_per_step": PROMPTS_PER_STEP,
        "group_size": GROUP_SIZE,
        "rollout": {"max_turns": 1, "max_tokens_per_turn": MAX_NEW_TOKENS, "temperature": 1.0,
                    "concurrency": PROMPTS_PER_STEP * GROUP_SIZE},
        "policy_loss": {"loss": "ppo_clip", "kl_coef": 0.0},
        "skip_uniform_groups": False,  # train on every step, as TRL does
        # Our default of 4 rows per forward/backward (gradients accumulate over the 16): one pass of 16 rows
        # computes [16, ~470, 49152] float32 logits over prompt and completion (peak RSS 18 GB measured),
        # where TRL keeps only the completion's logits (``logits_to_keep``).
        "micro_batch_size": 4,
        # --micro-batch-tokens: cut the update by computed tokens instead (a shared prompt counted
        # once), e.g. 1536: one part of 16 rows here (316 + 16 x ~64), about what 4 unshared rows cost
        "micro_batch_tokens": job.get("micro_batch_tokens"),
        "steps": total,
        "eval": {"at_start": False, "every": 0},
        "seed": SEED,
        "output_dir": str(workdir / "ours"),
        "save_rollouts": True,
        "logging": {"progress": False, "tensorboard": False},
    })
    started = time.perf_counter()
    result = train_rl(cfg)
    rows = [r for r in result.history if r.get("step", 0) > 0]
    # The prompts our rollouts used are the job's prompts, token for token.
    used = {t.task_id: list(t.turns[0].prompt_ids) for t in read_trajectories(result.run_dir / "rollouts" / "step_000001.jsonl")}
    same = all(used.get(p["task_id"]) == p["ids"] for p in job["prompts"])
    timed = rows[job["warmup"]:]
    return {
        "step_s": [r["time/step_s"] for r in timed],
        "rollout_s": [r["time/rollout_s"] for r in timed],
        "train_s": [r["time/train_s"] for r in timed],
        "reward": [r["reward/mean"] for r in rows],
        "generated_tokens": [r["episode/generated_tokens"] for r in timed],
        "same_prompts": same,
        "total_s": time.perf_counter() - started,
        "peak_rss_mb": _peak_rss_mb(),
    }


# --- TRL's side (runs in bench/.venv-trl) --------------------------------------------------------


def run_trl(job: dict[str, Any], workdir: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO))  # the env's own answer reading (pure Python: pydantic is in the venv)
    from tracegym.environments.calculator import parse_number
    from tracegym.envs.tools import extract_answer

    folder = job["model_folder"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    same = all(tokenizer(p["text"], add_special_tokens=False)["input_ids"] == p["ids"] for p in job["prompts"])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    dataset = Dataset.from_dict({"prompt": [p["text"] for p in job["prompts"]],
                                 "answer": [p["answer"] for p in job["prompts"]]})

    def correct_answer(prompts: list[str], completions: list[str], answer: list[float], **_: Any) -> list[float]:
        """The calculator env's reward: 1 when the last <answer> holds exactly the right number."""
        scores = []
        for completion, expected in zip(completions, answer):
            text = extract_answer(completion)
            value = parse_number(text) if text is not None else None
            scores.append(1.0 if value is not None and abs(value - expected) < 1e-6 else 0.0)
        return scores

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.started = 0.0
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            self.seconds.append(time.perf_counter() - self.started)

    total = job["steps"] + job["warmup"]
    config = GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,  # completions per step
        num_generations=GROUP_SIZE,
        gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=total,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=SEED,
        disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct_answer,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear",
                               task_type="CAUSAL_LM"),
        callbacks=[timer],
    )
    started = time.perf_counter()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "step_s": timer.seconds[job["warmup"]:],
        "reward": [h["reward"] for h in logs],
        "generated_tokens": [h.get("completions/mean_length") for h in logs][job["warmup"]:],
        "same_prompts": same,
        "total_s": time.perf_counter() - started,
        "peak_rss_mb": _peak_rss_mb(),
        "versions": {"trl": __import__("trl").__version__, "transformers": __import__("transformers").__version__,
                     "torch": torch.__version__},
    }


# --- orchestration -------------------------------------------------------------------------------


def _run_side(python: Path | str, side: str, job_file: Path, workdir: Path) -> dict[str, Any]:
    from stages import run_side

    return run_side([str(python), str(Path(__file__).resolve()), "--worker", side, str(job_file), str(workdir)], side)


def _table(ours: dict[str, Any], trl: dict[str, Any], job: dict[str, Any]) -> str:
    med_ours, med_trl = statistics.median(ours["step_s"]), statistics.median(trl["step_s"])
    rollout, train = statistics.median(ours["rollout_s"]), statistics.median(ours["train_s"])
    rows = [
        ("", "tracegym rl", "TRL GRPOTrainer"),
        ("median s/step", f"{med_ours:.2f}", f"{med_trl:.2f}"),
        ("timed steps (s)", " ".join(f"{s:.2f}" for s in ours["step_s"]), " ".join(f"{s:.2f}" for s in trl["step_s"])),
        ("ours / TRL", f"{med_ours / med_trl:.2f} (target <= 0.5)", ""),
        ("our step: rollout (generate + reward)", f"{rollout:.2f} s ({100 * rollout / med_ours:.0f}%)", ""),
        ("our step: train (fwd/bwd + optimizer)", f"{train:.2f} s ({100 * train / med_ours:.0f}%)", ""),
        ("mean new tokens per completion", f"{statistics.fmean(ours['generated_tokens']):.1f}",
         f"{statistics.fmean(t for t in trl['generated_tokens'] if t is not None):.1f}" if trl["generated_tokens"] else "?"),
        ("reward per step (warmup first)", " ".join(f"{r:.2f}" for r in ours["reward"]),
         " ".join(f"{r:.2f}" for r in trl["reward"])),
        ("peak RSS (MB)", f"{ours['peak_rss_mb']:.0f}", f"{trl['peak_rss_mb']:.0f}"),
        ("same prompt token ids", str(ours["same_prompts"]), str(trl["same_prompts"])),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, width)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in width) + "|")
    setup = (f"{PROMPTS_PER_STEP} prompts x {GROUP_SIZE} samples, <= {MAX_NEW_TOKENS} new tokens, LoRA r={LORA_R}, "
             f"prompts of {', '.join(str(len(p['ids'])) for p in job['prompts'])} tokens, "
             f"{job['warmup']} warmup + {job['steps']} timed steps, OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS') or 'unset'}, "
             f"TRL {trl.get('versions', {}).get('trl', '?')}")
    return setup + "\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="our update's micro-batches by computed tokens (default: 4 rows each)")
    parser.add_argument("--trl-python", default=str(TRL_PYTHON), help="python of the virtualenv that has TRL")
    parser.add_argument("--worker", nargs=3, metavar=("SIDE", "JOB", "WORKDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:  # inside a subprocess: one side, one JSON line
        side, job_file, workdir = args.worker
        job = json.loads(Path(job_file).read_text(encoding="utf-8"))
        result = (run_ours if side == "ours" else run_trl)(job, Path(workdir))
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    if not Path(args.trl_python).exists():
        raise SystemExit(f"{args.trl_python} not found: make the TRL virtualenv first (see bench/README.md)")
    job = build_job(args.steps, args.warmup)
    job["micro_batch_tokens"] = args.micro_batch_tokens
    with tempfile.TemporaryDirectory(prefix="rl-vs-trl-") as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job), encoding="utf-8")
        ours = _run_side(sys.executable, "ours", job_file, Path(tmp))
        trl = _run_side(args.trl_python, "trl", job_file, Path(tmp))
    print(_table(ours, trl, job))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
