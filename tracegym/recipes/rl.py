"""Reinforcement learning in an environment (``tracegym rl``): a flat loop of named steps.

One step, top to bottom (``train_rl`` below reads exactly like this)::

    batch   = executor.next_batch(step, cursor, round)     # the step's tasks (seeded order, resumable cursor) and
    groups  = batch.groups                                  # their TrajectoryGroups (chains or a tree's leaves),
                                                            # sampled now (local) or ahead by a recent version
    groups, adv = score_and_estimate(groups, ...)           # optional scoring (branching, KL in the reward,
                                                            # InfoPO), then one advantage per turn
    data    = examples_from_groups(groups, renderer, adv)   # each turn's advantage (and weight) on its sampled tokens
    batch   = score_batch(model, ref, make_batch(data))     # old / reference log-probs where the loss needs them
    metrics = policy_update(model, batch, loss, optimizer)  # per-token loss; masks, TIS, aggregation, KL once
    sampler.update_weights(model)                           # free and exact for hf (it holds this very model)
    executor.publish(model, version=step)                   # rollout threads / Ray workers follow
    log(step, metrics); maybe_evaluate(step); maybe_checkpoint(step)

Every piece is a function of its inputs, tested on its own. The math lives in registries that a
user's module extends (``--plugin MODULE``): estimators map groups to per-turn advantages
(``grpo``, ``dr_grpo``, ``rloo``, ``reinforce``, ``turn_rloo``, ``turn_grpo``, ``gigpo``,
``info_gain``, ``mc_continuation``, ``tree`` with per-turn token weights, ...), losses map log-probs
and advantages to a per-token loss (``ppo_clip``, ``gspo``, ``policy_gradient``, ...).

Groups whose advantages are all zero (equal rewards) carry no signal and are skipped
(``skip_uniform_groups``); with ``resample_rounds`` (DAPO's dynamic sampling) further tasks are
sampled until ``tasks_per_step`` groups carry signal.

The model stays in eval mode (dropout off) for sampling and training alike, and the trainer scores
tokens at the sampling temperature: then the engine's log-probs and the trainer's agree to ~1e-6 on
the same weights and the PPO ratio is exactly 1 on the first pass. With gradient checkpointing the
update runs in train mode (transformers recomputes activations only there); dropout stays 0.

The reference policy (``policy_loss.kl_coef > 0``) is the policy at step 0: the LoRA base with the
adapter disabled for a fresh adapter (no second copy in memory), a frozen copy with the SFT adapter
merged when RL starts from one (``model.adapter``), or a frozen copy with full fine-tuning.

Executors (``executor.kind``, docs/scale.md): ``local`` samples in this loop with this model (lag 0,
exact resume); ``threads`` (a rollout thread with its own policy copy) and ``ray`` (rollout actors)
sample the next batches while this loop updates, each batch at most ``executor.max_staleness``
versions behind; every trajectory records ``info["policy_version"]``, and the ``decoupled_ppo`` loss
corrects for the lag.

Prompt-injection safety (docs/safety.md): with ``env.injection`` every episode (training, branching,
evaluation) runs in ``InjectionEnv`` around the env, so a share of the tasks carry an attack in a
tool result and following it costs ``env.injection.penalty`` of reward; the rows then log
``attack/asr`` (and ``eval/asr``) next to the utility of clean and injected episodes.
``rollout.untrusted_tool_output`` renders tool results as untrusted input.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tracegym.algos import estimator_problems, has_signal
from tracegym.algos.config import PolicyLossConfig
from tracegym.batch import examples_from_groups, make_batch
from tracegym.config import RLConfig, dump_config
from tracegym.data.store import TrajectoryWriter
from tracegym.envs.injection import InjectionEnv
from tracegym.recipes._run import check_resumed_tasks, check_run_dir, split_tasks, start_logging, step_times, stops_here
from tracegym.rl.collect import drop_overlong, evaluate_policy, expert_replay_pool, guide_groups, replay_examples, rollout_metrics
from tracegym.rl.collect import starting_probe
from tracegym.rl.executors.base import batch_seed
from tracegym.rl.executors.factory import make_executor
from tracegym.rl.policy import load_policy, make_renderer, make_sampler
from tracegym.rl.judge import Judge, judge_groups
from tracegym.rl.scoring import score_and_estimate
from tracegym.train.checkpoint import load_latest_intact, save_checkpoint, save_final
from tracegym.train.drift import build_probe, cap_drift, drift_rows, measure_drift, probe_nll, trainable_state
from tracegym.train.guidance import guidance_rows, shape_guidance, without_guidance
from tracegym.train.health import HealthMonitor, group_health, mutual_information_proxy
from tracegym.train.logging import MetricsLogger, ProgressBar
from tracegym.train.lora import count_parameters
from tracegym.train.optim import build_optimizer, build_scheduler
from tracegym.train.policy_update import (batch_logprobs, every_row_needs_rescoring, old_from_forward_is_exact, policy_update,
                                          score_batch)
from tracegym.train.precision import training_autocast
from tracegym.train.result import TrainResult
from tracegym.train.seed import seed_everything
from tracegym.types import TrajectoryGroup

log = logging.getLogger(__name__)

__all__ = ["RLResult", "train_rl"]

# names that lived here before the pieces of a step moved to tracegym.rl (kept for one release)
_MOVED = {
    "task_order": "tracegym.rl.tasks", "tasks_at": "tracegym.rl.tasks", "tasks_for_step": "tracegym.rl.tasks",
    "collect_groups": "tracegym.rl.collect", "drop_overlong": "tracegym.rl.collect", "guide_groups": "tracegym.rl.collect",
    "expert_episodes": "tracegym.rl.collect", "starting_probe": "tracegym.rl.collect",
    "rollout_metrics": "tracegym.rl.collect", "reward_part_metrics": "tracegym.rl.collect",
    "injection_metrics": "tracegym.rl.collect", "evaluate_policy": "tracegym.rl.collect",
    "kl_in_reward": "tracegym.rl.scoring", "score_and_estimate": "tracegym.rl.scoring",
    "with_reward_offset": "tracegym.rl.scoring",
    "load_policy": "tracegym.rl.policy", "make_renderer": "tracegym.rl.policy", "make_sampler": "tracegym.rl.policy",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        warnings.warn(f"tracegym.recipes.rl.{name} moved to {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RLResult(TrainResult):
    """What ``train_rl`` returns: the run folder, the final model folder (None when stopped early),
    the last step and the rows this invocation logged."""


@dataclass
class RLRun:
    """What the loop holds from one step to the next (built by ``prepare_run``)."""

    cfg: RLConfig
    loss_cfg: PolicyLossConfig
    run_dir: Path
    model: Any
    tokenizer: Any
    reference: Any
    renderer: Any
    sampler: Any
    optimizer: Any
    scheduler: Any
    executor: Any
    logger: MetricsLogger
    progress: ProgressBar
    health_monitor: HealthMonitor
    probe: Any
    pad_id: int
    temperature: float  # the trainer scores under the distribution the engine sampled from (logits / T)
    train_tasks: list[Any]
    test_tasks: list[Any]
    step: int = 0
    cursor: int = 0  # task slots consumed so far (more than steps x tasks_per_step with resampling)
    history: list[dict[str, Any]] = field(default_factory=list)
    replay_pool: list[list[Any]] = field(default_factory=list)  # expert_replay: each solved train task's examples
    judge: Any = None  # reward.judge: the LLM judge (its cache lives in the run folder)

    @property
    def eval_seed(self) -> int:
        return self.cfg.seed + 1_000_003


@dataclass
class Collected:
    """One step's groups, as the estimator saw them, with what the rows report about them."""

    groups: list[TrajectoryGroup] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    advantages: list[Any] = field(default_factory=list)
    weights: list[Any] = field(default_factory=list)
    estimator_metrics: list[dict[str, float]] = field(default_factory=list)
    sampled: list[TrajectoryGroup] = field(default_factory=list)  # every episode as sampled (the rows' reward figures)
    rounds: int = 0
    with_signal: int = 0
    dropped_too_long: int = 0
    guided_groups: int = 0
    judge: Any = None  # reward.judge: the step's JudgeStats (all rounds)
    kl_penalty: float = 0.0
    stale: bool = False  # sampled by an older policy version (an asynchronous executor ran ahead)


# --- the loop --------------------------------------------------------------------------------------


def train_rl(cfg: RLConfig, resume: bool = False, stop_at_step: int | None = None) -> RLResult:
    """Run RL as ``cfg`` says; ``resume`` continues from the latest intact checkpoint in ``cfg.output_dir``.

    ``stop_at_step`` returns right after that step without saving, as if the process had been killed
    there (tests use it to check that resume reproduces an uninterrupted run exactly). Teams
    (``roles``) and self-play (``selfplay``) have their own loops (``recipes/team.py``,
    ``recipes/selfplay.py``; ``tracegym rl`` picks the right one).
    """
    if cfg.selfplay is not None or cfg.roles:
        which = "tracegym.recipes.selfplay.train_selfplay" if cfg.selfplay is not None else "tracegym.recipes.team.train_team"
        raise ValueError(f"this config trains {'self-play' if cfg.selfplay is not None else 'a team'}: run it with {which} "
                         "(the tracegym rl command picks it)")
    if cfg.rollout.strategy == "harness":
        import tracegym.serve.harness  # noqa: F401  (registers the strategy: it lives beside the gateway it needs)
    run = prepare_run(cfg, resume)
    final_dir = None
    try:
        while run.step < cfg.steps:
            t_start = time.perf_counter()
            collected = collect_step(run)                          # 1-2. groups (resampled for signal), advantages
            metrics = step_metrics(run, collected, t_start)        # rewards, health, estimator figures
            skip = [cfg.skip_uniform_groups and not has_signal(a) for a in collected.advantages]
            data = examples_from_groups(collected.groups, run.renderer, collected.advantages, weights=collected.weights,
                                        max_length=cfg.max_length, skip_groups=skip)  # 3. advantages on sampled tokens
            t_train = time.perf_counter()
            metrics.update({"examples/count": float(len(data.examples)), "examples/template_splits": float(data.template_splits),
                            "examples/dropped_too_long": float(data.dropped_too_long),
                            "episodes/dropped_too_long": float(collected.dropped_too_long)})
            if data.examples:
                metrics.update(update_policy(run, collected, data, t_train))  # 4. update, drift, weight sync
            run.step += 1
            run.executor.publish(run.model, run.step)  # version = updates so far (a step without examples changes nothing)
            metrics.update(step_times(t_start, t_train))
            end_of_step(run, metrics, collected)                   # 5. evaluate, warn, log
            if stops_here(run.step, stop_at_step, cfg.steps):
                return RLResult(run.run_dir, None, run.step, run.history)
            maybe_checkpoint(run)
        final_dir = save_final(run.model, run.tokenizer, run.run_dir, {
            "base_model": cfg.model.name, "lora": cfg.lora.enabled, "renderer": cfg.model.renderer or cfg.model.name,
            "recipe": "rl", "env": cfg.env.name, "untrusted_tool_output": cfg.rollout.untrusted_tool_output})
    finally:
        run.executor.close()
        if run.judge is not None:
            run.judge.close()
        run.progress.close()
        run.logger.close(final_dir)
    return RLResult(run.run_dir, final_dir, run.step, run.history)


# --- the steps of the loop -------------------------------------------------------------------------


def prepare_run(cfg: RLConfig, resume: bool) -> RLRun:
    """Check the config, load tasks and policy, restore a checkpoint, log step 0 and start the executor."""
    from tracegym.envs import make

    run_dir = Path(cfg.output_dir)
    check_run_dir(run_dir, resume)
    loss_cfg = PolicyLossConfig(**cfg.policy_loss)
    problems = estimator_problems(cfg.advantage.estimator, cfg.advantage.options)
    if problems:  # a bad estimator name or option fails before anything loads
        raise ValueError("; ".join(problems))
    probe_env = make(cfg.env.name, **cfg.env.options)  # a bad env name/option fails before the model loads
    if cfg.env.injection is not None:  # so does a tool that clashes with the injection's honeypot
        InjectionEnv.from_config(probe_env, cfg.env.injection).tool_schemas()
    train_tasks, test_tasks = split_tasks(cfg, probe_env)
    dump_config(cfg, run_dir)
    seed_everything(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, reference = load_policy(cfg, loss_cfg, device)
    renderer = make_renderer(cfg, tokenizer)
    sampler = make_sampler(cfg, model, tokenizer, renderer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps * cfg.ppo_epochs)
    run = RLRun(cfg, loss_cfg, run_dir, model, tokenizer, reference, renderer, sampler, optimizer, scheduler,
                executor=None, logger=None, progress=None,  # type: ignore[arg-type]  (set below)
                health_monitor=HealthMonitor.from_config(cfg.health),
                probe=build_probe(starting_probe(cfg, train_tasks, renderer), pad_id), pad_id=pad_id,
                temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
                train_tasks=train_tasks, test_tasks=test_tasks,
                replay_pool=expert_replay_pool(cfg, train_tasks, renderer),
                judge=Judge(cfg.reward.judge, run_dir / "judge_cache.jsonl") if cfg.reward.judge is not None else None)
    # the newest intact checkpoint: a corrupt one is named in a warning and skipped, never silently ignored
    restored = load_latest_intact(run_dir, model, optimizer, scheduler) if resume else None
    if restored is not None:
        check_resumed_tasks(restored, cfg, train_tasks)
        run.step = restored.step
        run.cursor = int(restored.state.get("task_cursor", run.step * cfg.tasks_per_step))
        run.health_monitor.load_state_dict(restored.state.get("health", {}))
        sampler.update_weights(model)
    start_logging(run, resume, cfg.steps, "rl", lambda: log_start(run))
    if cfg.save_rollouts:
        (run_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    # where rollouts come from: this loop (local), a rollout thread or Ray actors (docs/scale.md);
    # the policy version is the number of updates applied, so it starts at the step resumed at
    run.executor = make_executor(cfg, model, tokenizer, renderer, sampler, train_tasks, version=run.step,
                                 gap_model=model if cfg.rollout.measure_logprob_gap else None)
    if restored is not None:  # the executor's own state (the curriculum's pass-rate estimates)
        run.executor.load_state_dict(restored.state.get("executor", {}))
    return run


def log_start(run: RLRun) -> None:
    """Row 0: parameter counts, both temperatures, the probe's NLL and optionally an evaluation."""
    cfg = run.cfg
    trainable, total = count_parameters(run.model)
    row = {"params/trainable": trainable, "params/total": total, "rollout/temperature": cfg.rollout.temperature,
           "eval/temperature": cfg.eval.temperature}
    if run.probe is not None:
        row["drift/probe_nll"] = probe_nll(run.model, run.probe, cfg.micro_batch_size)
    if run.test_tasks and cfg.eval.at_start:
        row.update(evaluate_policy(cfg, run.sampler, run.renderer, run.test_tasks, run.eval_seed))
    run.history.append(run.logger.log(0, row))


def collect_step(run: RLRun) -> Collected:
    """The step's groups from the executor (sampled now, or ahead by a recent policy version), each
    round: over-long episodes out, guides into all-failure groups, scoring and advantages; with
    ``resample_rounds``, more tasks until ``tasks_per_step`` groups carry signal."""
    cfg, out = run.cfg, Collected()
    writer = TrajectoryWriter(run.run_dir / "rollouts" / f"step_{run.step + 1:06d}.jsonl") if cfg.save_rollouts else None
    try:
        while True:
            batch = run.executor.next_batch(run.step, run.cursor, out.rounds)
            tasks, new, result = batch.tasks, batch.groups, batch.result
            out.stale = out.stale or batch.version != run.step
            run.cursor += len(tasks)
            if writer is not None:
                writer.write_all(result.trajectories)
            seed = batch_seed(cfg.seed, run.step, out.rounds)
            out.sampled += new
            # over-long episodes leave their groups before the estimator sees them (their advantages
            # would not sum to 0 over the rows that train)
            new, tasks, overlong = drop_overlong(new, tasks, run.renderer, cfg.max_length)
            out.dropped_too_long += overlong
            # groups whose samples all failed get the env's expert trajectory (LUFFY guidance)
            new, guided = guide_groups(new, tasks, cfg, run.renderer, seed + 7_919)
            out.guided_groups += guided
            # reward.judge: an LLM judge's score joins each reward by weight; unjudgeable groups leave
            if run.judge is not None:
                new, tasks, judged = judge_groups(run.judge, new, tasks, seed + 15_485_863)
                out.judge = judged if out.judge is None else out.judge.merge(judged)
            # optional scoring steps (branching, KL in the reward, InfoPO), then one advantage per turn
            new, estimated, out.kl_penalty = score_and_estimate(
                new, tasks, cfg, run.loss_cfg, sampler=run.sampler, model=run.model, reference=run.reference,
                renderer=run.renderer, pad_token_id=run.pad_id, temperature=run.temperature, seed=seed + 104_729)
            out.groups += new
            out.results.append(result)
            out.advantages += estimated.advantages
            # per-turn token weights (a tree's 1/|L(n)|), 1 where the estimator gives none
            out.weights += estimated.weights or [[[1.0] * len(a) for a in group] for group in estimated.advantages]
            out.estimator_metrics.append(estimated.metrics)
            out.with_signal = sum(has_signal(a) for a in out.advantages)
            if out.rounds >= cfg.resample_rounds or out.with_signal >= cfg.tasks_per_step:
                return out
            out.rounds += 1
    finally:
        if writer is not None:
            writer.close()


def step_metrics(run: RLRun, collected: Collected, t_start: float) -> dict[str, Any]:
    """The row's rollout figures: rewards and episode shape, signal, guidance, health (of the policy's
    own episodes: a guide would hide the echo trap) and the estimator's own metrics."""
    cfg, groups = run.cfg, collected.groups
    metrics: dict[str, Any] = rollout_metrics(collected.sampled, collected.results)
    metrics.update({"time/rollout_s": time.perf_counter() - t_start,
                    "groups/no_signal": float(len(groups) - collected.with_signal),
                    "groups/resample_rounds": float(collected.rounds), **run.executor.metrics()})
    if run.loss_cfg.kl_coef > 0 and run.loss_cfg.kl_penalty == "reward":
        metrics["reward/kl_penalty"] = collected.kl_penalty
    if collected.judge is not None:  # judge/*: cost, failures, position bias, mean score
        metrics.update(collected.judge.metrics())
    if cfg.guidance is not None:
        metrics["guidance/groups"] = float(collected.guided_groups)
        metrics["guidance/unsolved"] = float(sum(1 for g in groups if not any(t.success for t in g.trajectories)))
    metrics.update(group_health(*without_guidance(groups, collected.advantages)))
    if cfg.health.mutual_information:  # on the policy that sampled: prompt/response MI
        t_mi = time.perf_counter()
        metrics.update(mutual_information_proxy(run.model, groups, pad_token_id=run.pad_id,
                                                max_pairs=cfg.health.mi_max_pairs,
                                                micro_batch_size=cfg.health.mi_max_pairs, temperature=run.temperature))
        metrics["time/health_mi_s"] = time.perf_counter() - t_mi
    for key in sorted({k for m in collected.estimator_metrics for k in m}):  # e.g. GiGPO's step-group size, per round
        values = [m[key] for m in collected.estimator_metrics if key in m]
        metrics[f"advantage/{key}"] = sum(values) / len(values)
    return metrics


def update_policy(run: RLRun, collected: Collected, data: Any, t_train: float) -> dict[str, Any]:
    """Score the batch, take the optimizer step (shrunk to the trust region when ``max_policy_drift``
    is set), measure how far the policy moved, then sync the samplers: the trainer's engine (it
    calls this very model object, so this only drops its caches) and the executor's copies."""
    cfg = run.cfg
    batch = make_batch(data.examples, pad_token_id=run.pad_id, group_ids=data.group_index,
                       trajectory_ids=data.trajectory_ids)
    # where the trainer would re-score every row (bfloat16 autocast or sampling, top-p, stale batches,
    # TIS), one pass takes the old log-probs from the update's own forward instead (train/policy_update.py)
    sampler_differs = bool(getattr(run.sampler, "sample_dtype_differs", False))
    rescore = dict(epochs=cfg.ppo_epochs, top_p=cfg.rollout.top_p, stale=collected.stale,
                   mixed_precision=sampler_differs or training_autocast(run.model) is not None)
    old_from_forward = every_row_needs_rescoring(run.loss_cfg, **rescore) and old_from_forward_is_exact(
        run.model, epochs=cfg.ppo_epochs, train_mode=cfg.model.gradient_checkpointing)
    t_score = time.perf_counter()
    batch = score_batch(run.model, run.reference, batch, run.loss_cfg, micro_batch_size=cfg.micro_batch_size,
                        temperature=run.temperature, epochs=cfg.ppo_epochs, top_p=cfg.rollout.top_p, stale=collected.stale,
                        old_from_forward=old_from_forward, sampler_differs=sampler_differs)
    t_scored = time.perf_counter()
    if cfg.guidance is not None:  # LUFFY's shaped importance weight on the expert's tokens
        batch = shape_guidance(batch, guidance_rows(collected.groups, data.group_index, data.trajectory_index),
                               cfg.guidance.shaping_gamma)
    replay = None
    if run.replay_pool:  # PPO-ptx's mix with the expert: this step's traces, a function of the step
        examples = replay_examples(run.replay_pool, run.step + 1, cfg.expert_replay.per_step)  # type: ignore[union-attr]
        replay = (make_batch(examples, pad_token_id=run.pad_id), cfg.expert_replay.coef)  # type: ignore[union-attr]
    sample = drift_rows(batch, cfg.health.drift_rows)
    if sample is not None and old_from_forward:  # the drift's pi_old: the trainer's, as re-scoring would give
        sample = sample.with_logprobs(old=batch_logprobs(run.model, sample, cfg.micro_batch_size,
                                                         temperature=run.temperature))
    before = trainable_state(run.model) if cfg.max_policy_drift is not None and sample is not None else None
    t_update = time.perf_counter()
    metrics = policy_update(run.model, batch, run.loss_cfg, run.optimizer, run.scheduler, epochs=cfg.ppo_epochs,
                            micro_batch_size=cfg.micro_batch_size, temperature=run.temperature,
                            max_grad_norm=cfg.optim.max_grad_norm, micro_batch_tokens=cfg.micro_batch_tokens,
                            train_mode=cfg.model.gradient_checkpointing, replay=replay,
                            policy_gradient=cfg.expert_replay is None or cfg.expert_replay.policy_gradient,
                            old_from_forward=old_from_forward)
    t_drift = time.perf_counter()
    # how far the update moved the policy; over max_policy_drift, a shorter step or none
    if before is not None:
        metrics.update(cap_drift(run.model, before, sample, max_kl=cfg.max_policy_drift,
                                 micro_batch_size=cfg.micro_batch_size, temperature=run.temperature))
    elif sample is not None:
        metrics["drift/kl"] = measure_drift(run.model, sample, cfg.micro_batch_size, run.temperature)
    if run.probe is not None:
        metrics["drift/probe_nll"] = probe_nll(run.model, run.probe, cfg.micro_batch_size)
    metrics.update({"time/score_s": t_scored - t_score, "time/update_s": t_drift - t_update,
                    "time/drift_s": time.perf_counter() - t_drift})
    run.sampler.update_weights(run.model)
    metrics["train/tokens_per_s"] = float(batch.attention_mask.sum()) * cfg.ppo_epochs / max(time.perf_counter() - t_train, 1e-9)
    return metrics


def end_of_step(run: RLRun, metrics: dict[str, Any], collected: Collected) -> None:
    """Evaluate when due, print the health monitor's warnings, log the row and move the progress bar."""
    cfg = run.cfg
    if run.test_tasks and ((cfg.eval.every and run.step % cfg.eval.every == 0) or run.step == cfg.steps):
        metrics.update(evaluate_policy(cfg, run.sampler, run.renderer, run.test_tasks, run.eval_seed))
    for line in run.health_monitor.update(run.step, metrics):
        log.warning(line)
        print(f"warning: {line}", flush=True)
    if run.step % cfg.logging.log_every == 0 or run.step == cfg.steps:
        run.history.append(run.logger.log(run.step, metrics))
    loss_text = f" loss {metrics['train/loss']:.4f}" if "train/loss" in metrics else ""
    run.progress.update(1, info=f"reward {metrics['reward/mean']:.3f}{loss_text}",
                        tokens=int(sum(t.num_generated_tokens for g in collected.sampled for t in g.trajectories)))


def maybe_checkpoint(run: RLRun) -> None:
    """Every ``checkpoint.every`` steps and at the last: weights, optimizer, scheduler and the state a
    resume needs (task cursor, health monitor, the executor's own state)."""
    cfg = run.cfg
    if (cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0) or run.step == cfg.steps:
        state = {"tasks": {"seed": cfg.tasks.seed, "train": len(run.train_tasks)}, "task_cursor": run.cursor,
                 "health": run.health_monitor.state_dict(),
                 "executor": {"kind": cfg.executor.kind, **run.executor.state_dict()}}
        save_checkpoint(run.run_dir, run.step, run.model, run.optimizer, run.scheduler, state,
                        keep_last=cfg.checkpoint.keep_last)
