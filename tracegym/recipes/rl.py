"""Reinforcement learning in an environment (``tracegym rl``): a flat loop, top to bottom.

Each step:

1. **Tasks.** Take ``tasks_per_step`` train tasks in a seeded order (a pure function of the seed and
   the epoch, so a resumed run picks up the same tasks).
2. **Rollouts.** Run ``group_size`` episodes per task with the current policy through the rollout
   runner: token in, token out, every turn's prompt ids, sampled ids and engine log-probs kept.
3. **Advantages.** Episode rewards -> advantages with the registered estimator (GRPO by default:
   ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``). Groups whose rewards are all equal carry
   no signal and are skipped (``skip_uniform_groups``); an optional KL-in-reward penalty is applied
   first.
4. **Examples.** The renderer turns each trajectory into a token sequence whose loss mask is 1 only
   on the tokens the model generated; the advantage rides on those tokens, and the engine's sampled
   log-probs come along as ``engine_logprobs``.
5. **Update.** ``ppo_epochs`` passes over the batch. Before the first, the trainer re-scores the
   sampled tokens under no_grad (``old_logprobs``; the PPO ratio's denominator, and the numerator
   of truncated importance sampling against the engine). Every micro-batch loss comes from
   ``compute_policy_loss`` (PPO-clip / GSPO / plain PG, clip-higher, dual clip, KL to the reference,
   entropy bonus, TIS) normalised by the whole batch, so accumulation equals one big batch.
   Gradient clipping, AdamW, LR schedule.
6. **Weight sync.** The hf engine holds the trainer's model object, so the next rollout samples from
   the updated weights with no copy (LoRA included: the engine calls the peft model). Other engines
   get ``update_weights``.
7. **Evaluate** on held-out test tasks every ``eval.every`` steps (pass@1 and success rate),
   **log** everything to metrics.jsonl / TensorBoard, **checkpoint** atomically.

The model stays in eval mode (dropout off) for sampling and training alike, and the trainer scores
tokens at the sampling temperature: then the engine's log-probs and the trainer's agree to ~1e-6 on
the same weights, and the PPO ratio is exactly 1 on the first pass. (With gradient checkpointing the
update runs in train mode, the only mode in which transformers recomputes activations; dropout
probabilities are 0 unless configured.)

The reference policy for the KL term, when ``policy_loss.kl_coef > 0``: with LoRA it is the same
network with the adapter disabled (no second copy in memory); with full fine-tuning a frozen copy.
"""

from __future__ import annotations

import logging
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from tracegym.algos import compute_advantages
from tracegym.algos.compose import compute_policy_loss
from tracegym.algos.config import PolicyLossConfig
from tracegym.algos.kl import kl_penalized_rewards
from tracegym.batch import make_batch, merge_microbatch_rows, split_microbatches
from tracegym.config import RLConfig, dump_config
from tracegym.data.store import TrajectoryWriter
from tracegym.render import BuildStats, get_renderer
from tracegym.rollout import RolloutConfig, run_rollouts_sync
from tracegym.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint, save_final
from tracegym.train.logging import MetricsLogger, ProgressBar, process_rss_mb
from tracegym.train.logprobs import token_logprobs, token_logprobs_and_entropy
from tracegym.train.lora import count_parameters, is_peft_model, prepare_model
from tracegym.train.optim import build_optimizer, build_scheduler, clip_gradients
from tracegym.train.seed import seed_everything
from tracegym.types import TrainingExample, Trajectory

log = logging.getLogger(__name__)


@dataclass
class RLResult:
    run_dir: Path
    final_dir: Path | None  # None when the run stopped early (``stop_at_step``)
    step: int
    history: list[dict[str, Any]] = field(default_factory=list)  # rows logged by this invocation


# --- pieces of one step (each small enough to test on its own) ---------------------------------


def task_order(num_tasks: int, seed: int, epoch: int) -> np.ndarray:
    """Train-task order of one epoch: a pure function of (seed, epoch), so resume needs no RNG state."""
    return np.random.default_rng([seed, 7919, epoch]).permutation(num_tasks)


def tasks_for_step(tasks: Sequence[Any], per_step: int, seed: int, step: int) -> list[Any]:
    """The ``per_step`` tasks of (0-based) ``step``; epochs wrap around the task list."""
    out = []
    for slot in range(step * per_step, (step + 1) * per_step):
        epoch, position = divmod(slot, len(tasks))
        out.append(tasks[int(task_order(len(tasks), seed, epoch)[position])])
    return out


def group_advantages(
    trajectories: Sequence[Trajectory], estimator: str, options: dict[str, Any], rewards: Sequence[float] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Episode rewards -> (advantages [N], group ids [N]); a group is the samples of one task."""
    group_of: dict[str, int] = {}
    group_ids = torch.tensor([group_of.setdefault(t.task_id, len(group_of)) for t in trajectories], dtype=torch.long)
    values = torch.tensor(list(rewards) if rewards is not None else [t.reward for t in trajectories], dtype=torch.float32)
    return compute_advantages(estimator, values, group_ids, **options), group_ids


def policy_logprobs(model: torch.nn.Module, batch: Any, micro_batch_size: int, disable_adapter: bool = False,
                    temperature: float = 1.0) -> torch.Tensor:
    """Trainer log-probs of the batch's target tokens under no_grad, [B, T] (on the batch's device);
    with ``disable_adapter`` those of the LoRA base model (the reference policy)."""
    parts = split_microbatches(batch, micro_batch_size)
    values = []
    device = next(model.parameters()).device
    context = model.disable_adapter() if disable_adapter else nullcontext()
    with torch.no_grad(), context:
        for part in parts:
            values.append(token_logprobs(model, part.input_ids.to(device), part.attention_mask.to(device), temperature,
                                         first_column=part.first_loss_column))
    return merge_microbatch_rows(batch, parts, values)


def reference_logprobs(model: torch.nn.Module, reference: torch.nn.Module | None, batch: Any, micro_batch_size: int,
                       temperature: float = 1.0) -> torch.Tensor:
    """Reference-policy log-probs [B, T]: the frozen copy (full fine-tuning) or the LoRA base."""
    if reference is not None:
        return policy_logprobs(reference, batch, micro_batch_size, temperature=temperature)
    return policy_logprobs(model, batch, micro_batch_size, disable_adapter=True, temperature=temperature)


def _mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else 0.0


def _weighted(rows: list[dict[str, float]], key: str) -> float | None:
    """Token-weighted mean of a micro-batch metric (metrics are per part; see compute_policy_loss)."""
    pairs = [(r[key], r.get("num_tokens", 1.0)) for r in rows if key in r]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def evaluate_policy(cfg: RLConfig, engine: Any, renderer: Any, tasks: Sequence[Any], seed: int) -> dict[str, float]:
    """pass@1 and success rate of the current policy on held-out tasks (as many samples as configured)."""
    from tracegym.eval import summarize

    rollout_cfg = RolloutConfig(
        **cfg.rollout.model_dump(exclude={"engine", "engine_options", "temperature", "measure_logprob_gap", "concurrency"}),
        temperature=cfg.eval.temperature,
        samples_per_task=cfg.eval.samples_per_task,
        concurrency=cfg.rollout.concurrency,
        seed=seed,
    )
    result = run_rollouts_sync(cfg.env.name, tasks, engine, renderer, rollout_cfg, progress=False,
                               env_options=cfg.env.options, policy_name="policy")
    trajectories = result.trajectories + result.failed  # failed episodes count as unsolved
    summary = summarize(trajectories, ks=[1], turns=[cfg.rollout.max_turns], env=cfg.env.name, n_bootstrap=200)
    pass1 = summary["pass_at"][str(cfg.rollout.max_turns)]["1"]
    return {"eval/pass@1": pass1, "eval/success_rate": summary["success_rate"],
            "eval/turns": summary["cost"]["turns"], "eval/env_errors": float(result.stats.failed)}


# --- the loop ----------------------------------------------------------------------------------


def train_rl(cfg: RLConfig, resume: bool = False, stop_at_step: int | None = None) -> RLResult:
    """Run RL as ``cfg`` says; ``resume`` continues from the latest checkpoint in ``cfg.output_dir``.

    ``stop_at_step`` returns right after that step without saving, as if the process had been killed
    there (tests use it to check that resume reproduces an uninterrupted run exactly).
    """
    from tracegym.engines.hf import HFEngine
    from tracegym.envs import make
    from tracegym.models import load

    run_dir = Path(cfg.output_dir)
    if not resume and list_checkpoints(run_dir):
        raise FileExistsError(f"{run_dir} already holds checkpoints: pass --resume to continue, or pick another output_dir")
    loss_cfg = PolicyLossConfig(**cfg.policy_loss)
    if cfg.rollout.engine != "hf":
        raise ValueError(
            f"rollout.engine={cfg.rollout.engine!r}: the RL recipe samples with the in-process 'hf' engine on this "
            "release; vllm weight sync is implemented in tracegym.engines.vllm but not wired into the recipe yet"
        )
    dump_config(cfg, run_dir)
    seed_everything(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # -- model, reference, engine ----------------------------------------------------------------
    model, tokenizer = load(cfg.model.name, cfg.model.dtype)
    reference = None
    if loss_cfg.kl_coef > 0 and not cfg.lora.enabled:
        import copy

        reference = copy.deepcopy(model).eval().requires_grad_(False).to(device)
    model = prepare_model(model, cfg.lora, cfg.model.adapter)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if cfg.lora.enabled:
            model.enable_input_require_grads()
    model.to(device).eval()  # eval mode throughout: no dropout, engine and trainer agree (see docstring)
    if reference is None and loss_cfg.kl_coef > 0 and not is_peft_model(model):
        raise ValueError("kl_coef > 0 needs a reference policy: LoRA (adapter disabled) or full fine-tuning")
    trainable, total = count_parameters(model)
    # The trainer scores tokens under the distribution they were sampled from (logits / T), so the
    # engine's log-probs are the old policy's and the first PPO ratio is 1 at any temperature.
    temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    renderer = get_renderer(cfg.model.renderer or cfg.model.name, tokenizer)
    # The engine holds the trainer's model object: weight sync after each update is free and exact.
    engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids,
                      max_batch_size=cfg.rollout.concurrency, pad_token_id=pad_id)

    # -- tasks -----------------------------------------------------------------------------------
    probe = make(cfg.env.name, **cfg.env.options)
    train_tasks = probe.tasks("train", cfg.tasks.train, cfg.tasks.seed)
    test_tasks = probe.tasks("test", cfg.tasks.test, cfg.tasks.seed) if cfg.tasks.test else []
    probe.close()

    # -- optimizer, schedule, resume -------------------------------------------------------------
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps * cfg.ppo_epochs)
    step = 0
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if checkpoint is not None:
        restored = load_checkpoint(checkpoint, model, optimizer, scheduler)
        saved_tasks = restored.state.get("tasks", {})
        if saved_tasks.get("seed") != cfg.tasks.seed or saved_tasks.get("train") != len(train_tasks):
            raise ValueError(f"{checkpoint} was trained on other tasks (seed or count differ); cannot resume on this config")
        step = restored.step
        engine.update_weights(model)
    logger = MetricsLogger(run_dir, cfg.logging.tensorboard, cfg.logging.wandb, cfg.logging.wandb_project,
                           config=cfg.model_dump(mode="json"), resume_step=step if resume else None)
    history: list[dict[str, Any]] = []
    if step == 0:
        row = {"params/trainable": trainable, "params/total": total}
        if test_tasks and cfg.eval.at_start:
            row.update(evaluate_policy(cfg, engine, renderer, test_tasks, seed=cfg.seed + 1_000_003))
        history.append(logger.log(0, row))
    progress = ProgressBar(cfg.steps, "rl", enabled=cfg.logging.progress, completed=step)
    rollout_cfg_base = cfg.rollout.model_dump(exclude={"engine", "engine_options", "measure_logprob_gap"})
    rollouts_dir = run_dir / "rollouts"
    if cfg.save_rollouts:
        rollouts_dir.mkdir(parents=True, exist_ok=True)

    final_dir = None
    try:
        while step < cfg.steps:
            metrics: dict[str, Any] = {}
            t_start = time.perf_counter()

            # 1-2. rollouts with the current policy (sampling seed fixed per step: resumable)
            tasks = tasks_for_step(train_tasks, cfg.tasks_per_step, cfg.seed, step)
            rollout_cfg = RolloutConfig(**rollout_cfg_base, samples_per_task=cfg.group_size,
                                        seed=cfg.seed * 1_000_003 + step, measure_logprob_gap=cfg.rollout.measure_logprob_gap)
            writer = TrajectoryWriter(rollouts_dir / f"step_{step + 1:06d}.jsonl") if cfg.save_rollouts else None
            try:
                result = run_rollouts_sync(cfg.env.name, tasks, engine, renderer, rollout_cfg, writer=writer,
                                           progress=False, env_options=cfg.env.options, policy_name="policy",
                                           gap_model=model)
            finally:
                if writer is not None:
                    writer.close()
            trajectories = result.trajectories
            t_rollout = time.perf_counter() - t_start
            rewards = [t.reward for t in trajectories]
            metrics.update({
                "reward/mean": _mean(rewards),
                "reward/std": float(np.std(rewards)) if rewards else 0.0,
                "success_rate": _mean([float(t.success) for t in trajectories]),
                "episode/turns": _mean([len(t.turns) for t in trajectories]),
                "episode/generated_tokens": _mean([t.num_generated_tokens for t in trajectories]),
                "env/errors": float(result.stats.failed),
                "rollout/tokens_per_s": result.stats.tokens_per_s,
                "time/rollout_s": t_rollout,
            })
            for reason, count in result.stats.end_reasons.items():
                metrics[f"end/{reason}"] = float(count)
            if result.stats.logprob_gap is not None:
                metrics["logprob_gap/mean"] = result.stats.logprob_gap.mean
                metrics["logprob_gap/max"] = result.stats.logprob_gap.max

            # 3. examples (token-exact, loss mask on generated tokens), then advantages. With the KL
            # penalty in the reward, each episode's summed KL to the reference is taken off its reward
            # before the estimator runs (this needs the log-probs of every example first).
            build_stats = BuildStats()
            examples: list[TrainingExample] = []
            owner: list[int] = []  # trajectory index of each example
            for i, traj in enumerate(trajectories):
                for ex in renderer.build_examples(traj, stats=build_stats):
                    if len(ex) > cfg.max_length:
                        metrics["examples/dropped_too_long"] = metrics.get("examples/dropped_too_long", 0.0) + 1
                        continue
                    examples.append(ex)
                    owner.append(i)
            rewards_t = torch.tensor(rewards, dtype=torch.float32)
            kl_in_reward = loss_cfg.kl_coef > 0 and loss_cfg.kl_penalty == "reward"
            if kl_in_reward and examples:
                probe_batch = make_batch(examples, pad_token_id=pad_id)
                penalty = kl_penalized_rewards(  # = -beta * sum_t kl_t per example, [E]
                    torch.zeros(len(examples)), policy_logprobs(model, probe_batch, cfg.micro_batch_size, temperature=temperature),
                    reference_logprobs(model, reference, probe_batch, cfg.micro_batch_size, temperature),
                    probe_batch.loss_mask, loss_cfg.kl_coef, loss_cfg.kl_estimator)
                for row, i in enumerate(owner):
                    rewards_t[i] += penalty[row]
                metrics["reward/kl_penalty"] = float(-penalty.sum()) / max(len(trajectories), 1)
            kept: list[TrainingExample] = []
            if trajectories:
                advantages, group_ids = group_advantages(trajectories, cfg.advantage.estimator, cfg.advantage.options,
                                                         rewards=rewards_t.tolist())
                # A group whose advantages are all zero (e.g. GRPO on equal rewards) has no signal: skip it.
                silent = {int(g) for g in group_ids.unique() if bool((advantages[group_ids == g] == 0).all())}
                metrics["groups/no_signal"] = float(len(silent))
                for ex, i in zip(examples, owner):
                    if cfg.skip_uniform_groups and int(group_ids[i]) in silent:
                        continue
                    a = float(advantages[i])
                    kept.append(ex.model_copy(update={"advantages": tuple(a * m for m in ex.loss_mask)}))
            metrics["examples/count"] = float(len(kept))
            metrics["examples/template_splits"] = float(build_stats.splits)

            # 4-5. the update. Old log-probs: with one pass and no TIS the engine's sampled log-probs
            # are the old policy's (the hf engine matches the trainer to ~1e-6), so no extra forward.
            t_train = time.perf_counter()
            part_metrics: list[dict[str, float]] = []
            epoch_losses: list[float] = []  # full-batch loss of each pass (sum of the micro-batch shares)
            grad_norms: list[float] = []
            if kept:
                batch = make_batch(kept, pad_token_id=pad_id)
                # (top-p sampling renormalises over the nucleus: the trainer's full softmax differs from it)
                recompute_old = (cfg.ppo_epochs > 1 or loss_cfg.tis_cap is not None or cfg.rollout.top_p < 1.0
                                 or not bool(batch.has_engine_logprobs.all()))
                old = policy_logprobs(model, batch, cfg.micro_batch_size, temperature=temperature) if recompute_old else None
                ref = None
                if loss_cfg.kl_coef > 0 and loss_cfg.kl_penalty == "loss":
                    ref = reference_logprobs(model, reference, batch, cfg.micro_batch_size, temperature)
                batch = batch.with_logprobs(old=old, ref=ref)
                # transformers recomputes activations only in train mode; dropout stays off (p = 0) unless configured
                model.train(cfg.model.gradient_checkpointing)
                for _ in range(cfg.ppo_epochs):
                    optimizer.zero_grad(set_to_none=True)
                    epoch_losses.append(0.0)
                    for part in split_microbatches(batch, cfg.micro_batch_size):
                        part = part.to(device)
                        # entropy comes from the same logits: logged every step, and used by entropy_coef/entropy_clip
                        logprobs, entropy = token_logprobs_and_entropy(model, part.input_ids, part.attention_mask, temperature,
                                                                       first_column=part.first_loss_column)
                        loss, m = compute_policy_loss(part, logprobs, entropy, loss_cfg)
                        loss.backward()
                        part_metrics.append(m)
                        epoch_losses[-1] += m["loss"]
                    grad_norms.append(clip_gradients(model.parameters(), cfg.optim.max_grad_norm))
                    metrics["lr"] = scheduler.get_last_lr()[0]
                    optimizer.step()
                    scheduler.step()
                model.eval()
                # 6. weight sync: the hf engine calls this very model object (a no-op kept for other engines)
                engine.update_weights(model)
            t_train = time.perf_counter() - t_train
            # per-token metrics: token-weighted over the micro-batches; the loss: each pass's sum of shares
            for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl", "kl_ref", "entropy",
                        "tis_truncated_frac"):
                value = _weighted(part_metrics, key)
                if value is not None:
                    metrics[f"train/{key}"] = value
            if "train/clip_frac_low" in metrics and "train/clip_frac_high" in metrics:
                metrics["train/clip_frac"] = metrics["train/clip_frac_low"] + metrics["train/clip_frac_high"]
            for key, reduce in (("ratio_min", min), ("ratio_max", max)):
                if any(key in m for m in part_metrics):
                    metrics[f"train/{key}"] = reduce(m[key] for m in part_metrics if key in m)
            if epoch_losses:
                metrics["train/loss"] = _mean(epoch_losses)
            if grad_norms:
                metrics["train/grad_norm"] = _mean(grad_norms)
            step += 1
            metrics.update({"time/train_s": t_train, "time/step_s": time.perf_counter() - t_start,
                            "rss_mb": process_rss_mb(),
                            "train/tokens_per_s": (float(batch.attention_mask.sum()) * cfg.ppo_epochs / t_train)
                            if kept and t_train > 0 else 0.0})

            # 7. evaluation, logging, checkpoint
            if test_tasks and ((cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.steps):
                metrics.update(evaluate_policy(cfg, engine, renderer, test_tasks, seed=cfg.seed + 1_000_003))
            if step % cfg.logging.log_every == 0 or step == cfg.steps:
                history.append(logger.log(step, metrics))
            progress.update(1, info=f"reward {metrics['reward/mean']:.3f}")
            if stop_at_step is not None and step >= stop_at_step and step < cfg.steps:
                return RLResult(run_dir, None, step, history)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.steps:
                state = {"tasks": {"seed": cfg.tasks.seed, "train": len(train_tasks)}}
                save_checkpoint(run_dir, step, model, optimizer, scheduler, state, keep_last=cfg.checkpoint.keep_last)
        final_dir = save_final(model, tokenizer, run_dir, {"base_model": cfg.model.name, "lora": cfg.lora.enabled,
                                                             "renderer": cfg.model.renderer or cfg.model.name,
                                                             "recipe": "rl", "env": cfg.env.name})
    finally:
        progress.close()
        logger.close()
    return RLResult(run_dir, final_dir, step, history)
