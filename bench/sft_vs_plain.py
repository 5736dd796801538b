"""SFT training tokens/s: tracegym's SFT update against a plain transformers + peft loop, same work.

The work of one optimizer step, on both sides: ``--batch-size`` examples (default 8) of scripted
expert trajectories on the calculator env (``num_calls=2``: two dependent tool calls, then the
answer), cut into micro-batches of ``--micro-batch-size`` (default 4) rows, forward + backward of
the masked next-token NLL on the tokens the expert "generated", gradient clipping to norm 1.0, one
AdamW step (lr ``--lr``, weight decay 0) of a LoRA adapter on SmolLM2-135M-Instruct (fp32). LoRA
is tracegym's default ``LoraConfig`` on both sides: r=16, alpha=32, dropout 0, all linear layers.

The data is built once, in this process, the way ``tracegym sft`` builds it: the expert's
trajectories through ``load_sft_examples`` (the renderer's exact token ids and loss mask), in the
batch order ``train_sft`` uses (``epoch_order``, seed 0). Both sides get the same examples, in the
same order, in the same batches and micro-batches; both count the same trained (loss) and real
(non-pad) tokens per step, printed side by side so any difference shows.

- tracegym: ``prepare_model``, ``build_optimizer``/``build_scheduler`` and, per step, what
  ``train_sft`` does: ``accumulate_sft_gradients`` (``make_batch``, ``split_microbatches``,
  ``token_logprobs``, ``sft_loss``), ``clip_gradients``, optimizer and scheduler step.
- plain: ``AutoModelForCausalLM.from_pretrained`` of the same weights, ``peft.get_peft_model``,
  ``torch.optim.AdamW`` and the loop a user writes by hand: right-pad each micro-batch, labels -100
  off the loss mask and on padding, ``model(..., labels=labels).loss / micro_batches``, backward.

The first step's loss of both sides is printed, not compared: tracegym divides by the whole batch's
loss tokens, the plain loop averages per-micro-batch token means, so they agree only roughly.

Run from the repository root (nothing else running on the CPU)::

    .venv/bin/python bench/sft_vs_plain.py [--steps 4] [--warmup 1] [--threads 2]

Each side runs in its own subprocess, one after the other, so each peak RSS is its own. Only the
optimizer steps after ``--warmup`` are timed (model loading and the data are not). Expected running
time with the defaults on a 2-core CPU: about 3-5 minutes in all (an estimate, not measured).
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
SEED = 0
ENV, ENV_OPTIONS = "calculator", {"num_calls": 2}


# --- the job both sides read ---------------------------------------------------------------------


def build_job(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Expert trajectories -> SFT examples -> the batches of every step, with tracegym's own pieces."""
    from tracegym.config import ModelConfig, OptimConfig, SFTConfig
    from tracegym.data.store import TrajectoryWriter
    from tracegym.envs import make
    from tracegym.models import DEFAULT_MODEL, build_smollm2_cache, load_tokenizer, resolve_model_name
    from tracegym.recipes._run import epoch_order
    from tracegym.recipes.sft import load_sft_examples
    from tracegym.render import get_renderer
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    cfg = SFTConfig(model=ModelConfig(name=args.model), optim=OptimConfig(lr=args.lr), batch_size=args.batch_size,
                    micro_batch_size=args.micro_batch_size, seed=SEED)  # LoRA: tracegym's defaults
    name = resolve_model_name(args.model)
    # Build the SmolLM2 cache here, so neither side's peak RSS includes the one-time de-quantisation.
    folder = str(build_smollm2_cache()) if name == DEFAULT_MODEL else (name if Path(name).is_dir() else None)
    tokenizer = load_tokenizer(args.model)
    renderer = get_renderer(cfg.model.renderer or args.model, tokenizer)
    tasks = make(ENV, **ENV_OPTIONS).tasks("train", args.episodes, SEED)
    file = workdir / "expert.jsonl"
    with TrajectoryWriter(file) as writer:  # the same settings as the demo's expert stage
        run_rollouts_sync(ENV, tasks, "expert", renderer, RolloutConfig(max_turns=8, max_tokens_per_turn=256, seed=SEED),
                          writer=writer, progress=False, env_options=ENV_OPTIONS, policy_name="expert")
    data = load_sft_examples([file], renderer, cfg.max_length, cfg.data.only_successful, cfg.data.min_reward)
    examples = data.examples
    if len(examples) < cfg.batch_size:
        raise SystemExit(f"{len(examples)} examples ({data.counts}) is fewer than --batch-size {cfg.batch_size}")
    # train_sft's batch order: a seeded permutation per epoch, the last partial batch skipped.
    per_epoch = len(examples) // cfg.batch_size
    batches: list[list[int]] = []
    for step in range(args.warmup + args.steps):
        order = epoch_order(len(examples), cfg.seed, step // per_epoch, cfg.data.shuffle)
        position = step % per_epoch
        batches.append([int(i) for i in order[position * cfg.batch_size:(position + 1) * cfg.batch_size]])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {"config": cfg.model_dump(mode="json"), "model_folder": folder, "pad_id": int(pad_id),
            "examples": [e.model_dump(mode="json") for e in examples], "batches": batches,
            "warmup": args.warmup, "threads": args.threads, "episodes": args.episodes}


# --- the two sides (each in its own subprocess) --------------------------------------------------


def _clock(device: Any) -> float:
    import torch

    if device.type == "cuda":  # kernels run asynchronously: wait for them before reading the clock
        torch.cuda.synchronize()
    return time.perf_counter()


def run_tracegym(job: dict[str, Any], *, autocast: str = "none", micro_batch_size: int | None = None,
                 train_mode: bool | None = None) -> dict[str, Any]:
    """tracegym's SFT steps on the job's batches; ``autocast``, ``micro_batch_size`` and
    ``train_mode`` override the recipe's choices (``bench/sft_precision.py`` compares them)."""
    import torch

    from tracegym.config import SFTConfig
    from tracegym.models import load
    from tracegym.recipes.sft import accumulate_sft_gradients
    from tracegym.train.lora import prepare_model
    from tracegym.train.optim import build_optimizer, build_scheduler, clip_gradients
    from tracegym.train.precision import needs_train_mode, resolve_autocast, set_training_autocast
    from tracegym.train.seed import seed_everything
    from tracegym.types import TrainingExample

    cfg = SFTConfig.model_validate(job["config"])
    examples = [TrainingExample.model_validate(e) for e in job["examples"]]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seed_everything(cfg.seed)  # as train_sft, from here on
    model, _ = load(cfg.model.name, cfg.model.dtype)
    model = prepare_model(model, cfg.lora, cfg.model.adapter)
    if train_mode is None:  # as train_sft: eval mode without dropout, so the rows' shared prefix runs once
        train_mode = needs_train_mode(model, cfg.model.gradient_checkpointing)
    model.to(device).train(train_mode)
    set_training_autocast(model, resolve_autocast(autocast, device))
    micro_batch_size = micro_batch_size or cfg.micro_batch_size
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, len(job["batches"]))
    rows: list[tuple[float, float, int, int]] = []
    for indices in job["batches"]:  # the body of train_sft's loop, logging and checkpoints left out
        batch = [examples[i] for i in indices]
        started = _clock(device)
        optimizer.zero_grad(set_to_none=True)
        out = accumulate_sft_gradients(model, batch, micro_batch_size, device, job["pad_id"])
        clip_gradients(model.parameters(), cfg.optim.max_grad_norm)
        optimizer.step()
        scheduler.step()
        rows.append((_clock(device) - started, out["loss"], out["loss_tokens"], out["tokens"]))
    return _summary(rows, job["warmup"])


def run_plain(job: dict[str, Any]) -> dict[str, Any]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    lora, optim = job["config"]["lora"], job["config"]["optim"]
    micro_batch_size, pad_id = job["config"]["micro_batch_size"], job["pad_id"]
    examples = job["examples"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(SEED)
    if job["model_folder"] is not None:
        model = AutoModelForCausalLM.from_pretrained(job["model_folder"], dtype=torch.float32, local_files_only=True)
    else:  # tiny-random or a .gguf file: no folder to read, take tracegym's loader for the weights only
        from tracegym.models import load

        model, _ = load(job["config"]["model"]["name"], "float32")
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=lora["target_modules"],
        bias="none", task_type="CAUSAL_LM"))
    model.to(device).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    # torch's AdamW decays weights by 0.01 unless told; tracegym's default is 0, so say 0 here too.
    optimizer = torch.optim.AdamW(trainable, lr=optim["lr"], betas=tuple(optim["betas"]), eps=optim["eps"],
                                  weight_decay=optim["weight_decay"])
    rows: list[tuple[float, float, int, int]] = []
    for indices in job["batches"]:
        started = _clock(device)
        optimizer.zero_grad(set_to_none=True)
        micro_batches = [indices[i:i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
        loss_sum, loss_tokens, tokens = 0.0, 0, 0
        for micro in micro_batches:
            part = [examples[i] for i in micro]
            length = max(len(e["input_ids"]) for e in part)
            input_ids = torch.full((len(part), length), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(part), length), dtype=torch.long)
            labels = torch.full((len(part), length), -100, dtype=torch.long)
            for row, e in enumerate(part):
                ids, mask = torch.tensor(e["input_ids"]), torch.tensor(e["loss_mask"], dtype=torch.bool)
                input_ids[row, :len(ids)], attention_mask[row, :len(ids)] = ids, 1
                labels[row, :len(ids)] = torch.where(mask, ids, -100)
            output = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                           labels=labels.to(device))
            loss = output.loss / len(micro_batches)
            loss.backward()
            loss_sum += float(loss.detach())
            loss_tokens += int((labels[:, 1:] != -100).sum())  # the model shifts labels: position 0 is never a target
            tokens += int(attention_mask.sum())
        torch.nn.utils.clip_grad_norm_(trainable, optim["max_grad_norm"])
        optimizer.step()
        rows.append((_clock(device) - started, loss_sum, loss_tokens, tokens))
    return _summary(rows, job["warmup"])


def _summary(rows: list[tuple[float, float, int, int]], warmup: int) -> dict[str, Any]:
    timed = rows[warmup:]
    return {"step_s": [r[0] for r in timed], "loss_tokens": [r[2] for r in timed], "tokens": [r[3] for r in timed],
            "losses": [r[1] for r in rows], "first_loss": rows[0][1],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}  # Linux: KiB


# --- orchestration -------------------------------------------------------------------------------


def _run_side(side: str, job_file: Path) -> dict[str, Any]:
    from stages import run_side

    return run_side([sys.executable, str(Path(__file__).resolve()), "--worker", side, str(job_file)], side)


def _table(ours: dict[str, Any], plain: dict[str, Any], job: dict[str, Any]) -> str:
    import torch

    def rate(side: dict[str, Any], key: str) -> float:  # median over timed steps of tokens / seconds
        return statistics.median(n / s for n, s in zip(side[key], side["step_s"]))

    cfg, med = job["config"], {k: statistics.median(v["step_s"]) for k, v in (("ours", ours), ("plain", plain))}
    rows = [
        ("", "tracegym sft", "plain transformers + peft"),
        ("median s/step", f"{med['ours']:.2f}", f"{med['plain']:.2f}"),
        ("timed steps (s)", " ".join(f"{s:.2f}" for s in ours["step_s"]), " ".join(f"{s:.2f}" for s in plain["step_s"])),
        ("tracegym / plain (s/step)", f"{med['ours'] / med['plain']:.2f}", ""),
        ("median loss tokens/s", f"{rate(ours, 'loss_tokens'):.0f}", f"{rate(plain, 'loss_tokens'):.0f}"),
        ("median all tokens/s", f"{rate(ours, 'tokens'):.0f}", f"{rate(plain, 'tokens'):.0f}"),
        ("loss tokens per step", " ".join(map(str, ours["loss_tokens"])), " ".join(map(str, plain["loss_tokens"]))),
        ("all tokens per step", " ".join(map(str, ours["tokens"])), " ".join(map(str, plain["tokens"]))),
        ("first step loss", f"{ours['first_loss']:.4f}", f"{plain['first_loss']:.4f}"),
        ("peak RSS (MB)", f"{ours['peak_rss_mb']:.0f}", f"{plain['peak_rss_mb']:.0f}"),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, width)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in width) + "|")
    lora, lengths = cfg["lora"], [len(e["input_ids"]) for e in job["examples"]]
    header = (f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
              f"{'cuda' if torch.cuda.is_available() else 'cpu'}, {job['threads']} torch threads | "
              f"{cfg['model']['name']} {cfg['model']['dtype']}, {len(job['examples'])} examples from {job['episodes']} "
              f"expert {ENV} episodes {ENV_OPTIONS} ({min(lengths)}-{max(lengths)} tokens, mean {statistics.fmean(lengths):.0f}), "
              f"batch {cfg['batch_size']} / micro-batch {cfg['micro_batch_size']}, {job['warmup']} warmup + "
              f"{len(job['batches']) - job['warmup']} timed steps, LoRA r={lora['r']} alpha={lora['alpha']:g} "
              f"dropout={lora['dropout']:g} {lora['target_modules']} (tracegym defaults), AdamW lr={cfg['optim']['lr']:g} "
              f"wd={cfg['optim']['weight_decay']:g}, clip {cfg['optim']['max_grad_norm']:g}")
    return header + "\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--episodes", type=int, default=64, help="expert calculator episodes (num_calls=2)")
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="examples per forward/backward")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 2))
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--worker", nargs=2, metavar=("SIDE", "JOB"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:  # inside a subprocess: one side, one JSON line
        import torch

        side, job_file = args.worker
        job = json.loads(Path(job_file).read_text(encoding="utf-8"))
        torch.set_num_threads(job["threads"])
        result = (run_tracegym if side == "tracegym" else run_plain)(job)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    with tempfile.TemporaryDirectory(prefix="sft-vs-plain-") as tmp:
        job = build_job(args, Path(tmp))
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job), encoding="utf-8")
        ours = _run_side("tracegym", job_file)
        plain = _run_side("plain", job_file)
    print(_table(ours, plain, job))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
