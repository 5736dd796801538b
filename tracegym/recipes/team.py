"""Team RL (``tracegym rl`` with ``roles:``): several LoRA adapters on one base model, trained together.

One step, top to bottom (``train_team`` reads exactly like this)::

    tasks   = tasks_at(train_tasks, seed, cursor, tasks_per_step)
    result  = run_team_rollouts(env, tasks, sampler, adapters=role->adapter)  # every role's turns in the
                                                                              # same batches, each row its adapter
    groups  = group_by_role(result.trajectories)          # one group per (task, role)
    adv     = estimate("magrpo", groups)                   # joint reward - mean over the task's samples, per role
                                                           # (or C3: mc_continuation per role, below)
    for adapter in trained adapters:                       # each with its own AdamW and schedule
        data    = examples_from_groups(its roles' groups, renderer, adv)
        with pool.training(adapter):                       # only this adapter has requires_grad
            batch   = score_batch(model, None, make_batch(data))
            metrics = policy_update(model, batch, loss, pool.optimizers[adapter], pool.schedulers[adapter])
    sync_adapters(sampler, pool.model, trained)            # hf holds this very model; vllm: new adapter versions
    log(step, metrics); maybe_evaluate(step); maybe_checkpoint(step)

Per-role counterfactual credit (C3, ``advantage.intrinsic: mc_continuation`` with ``estimator:
mc_continuation``): at each decision turn the acting role's message is kept (``mc_m``
continuations of the rest of the episode) or replaced by ``mc_k - 1`` fresh samples of that role
(``mc_m`` continuations each); the turn's advantage is Q(taken) - mean Q(replacements) on that
role's reward, so a role is credited for what its own message changed, not for its partner's luck.

``roles:`` maps each role of the env to an adapter (``adapter:``, default the role's name). Two roles
naming one adapter share a policy (one set of weights, one optimizer: the "shared adapter" baseline);
``train: false`` freezes a role's adapter (a fixed partner); ``init:`` starts an adapter from a saved
one (an SFT run's ``final``), else ``model.adapter`` or a fresh LoRA. Checkpoints hold every adapter's
weights, optimizer and schedule (``AdapterPool.state_dict``) plus the RNG states and the task cursor:
a killed run resumes exactly. ``final/<adapter>`` are portable adapter folders (``tracegym eval
--model runs/x/final/solver`` evaluates one on a single-agent env), ``final/team.json`` says which
role each one plays.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from tracegym.algos import estimate, estimator_problems, has_signal
from tracegym.algos.config import PolicyLossConfig
from tracegym.batch import examples_from_groups, make_batch
from tracegym.config import RLConfig, dump_config
from tracegym.data.store import TrajectoryWriter
from tracegym.recipes._run import check_resumed_tasks, check_run_dir, split_tasks, start_logging, step_times, stops_here
from tracegym.rl.executors.base import batch_seed
from tracegym.rl.policy import make_renderer, make_sampler
from tracegym.rl.tasks import tasks_at
from tracegym.rollout import RolloutConfig, RolloutResult
from tracegym.rollout.team import group_by_role, role_of, run_team_rollouts_sync, score_team_counterfactual
from tracegym.train.adapter_pool import AdapterPool
from tracegym.train.checkpoint import load_latest_intact, save_checkpoint, save_team_final
from tracegym.train.logging import MetricsLogger, ProgressBar
from tracegym.train.lora import count_parameters
from tracegym.train.policy_update import policy_update, score_batch
from tracegym.train.result import TrainResult
from tracegym.train.seed import seed_everything
from tracegym.types import Trajectory, TrajectoryGroup

__all__ = ["build_pool", "episode_heads", "evaluate_team", "restore_pool", "role_adapters", "sync_adapters", "team_metrics", "train_team"]


def role_adapters(cfg: RLConfig) -> dict[str, str]:
    """role -> the adapter that plays it (``roles.<role>.adapter``, default the role's name)."""
    return {role: rc.adapter or role for role, rc in cfg.roles.items()}


def build_pool(cfg: RLConfig, base: torch.nn.Module) -> AdapterPool:
    """One adapter per distinct ``roles.*.adapter``, started from the first ``init`` that names it
    (else ``model.adapter``, else fresh), each with its own optimizer over ``steps * ppo_epochs``."""
    adapters = role_adapters(cfg)
    init: dict[str, str | None] = {}
    for role, adapter in adapters.items():
        init.setdefault(adapter, cfg.roles[role].init or cfg.model.adapter)
    names = list(dict.fromkeys(adapters.values()))
    return AdapterPool(base, {name: cfg.lora for name in names}, init=init, optim=cfg.optim,
                       total_steps=cfg.steps * cfg.ppo_epochs)


def episode_heads(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """The first role trajectory of each team episode (one per episode: its success and reward are
    the team's)."""
    seen: set[str] = set()
    out = []
    for t in trajectories:
        key = str(t.info.get("episode_id", id(t)))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def team_metrics(groups: Sequence[TrajectoryGroup], result: RolloutResult) -> dict[str, float]:
    """Team reward and success (per episode), and per role: reward, turns, generated tokens."""
    trajectories = [t for g in groups for t in g.trajectories]
    heads = episode_heads(trajectories)
    mean = lambda values: float(statistics.fmean(values)) if values else 0.0  # noqa: E731
    out = {
        "reward/mean": mean([t.reward for t in heads]),
        "reward/std": float(np.std([t.reward for t in heads])) if heads else 0.0,
        "success_rate": mean([float(t.success) for t in heads]),
        "episode/turns": mean([float(t.info.get("team_turns", len(t.turns))) for t in heads]),
        "episode/generated_tokens": mean([sum(x.num_generated_tokens for x in trajectories
                                              if x.info.get("episode_id") == h.info.get("episode_id")) for h in heads]),
        "env/errors": float(result.stats.failed),
        "rollout/tokens_per_s": result.stats.tokens_per_s,
        "rollout/generated_tokens": float(result.stats.generated_tokens),
        "rollout/mean_batch_size": result.stats.mean_batch_size,
    }
    for reason, count in result.stats.end_reasons.items():
        out[f"end/{reason}"] = float(count)
    by_role: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_role.setdefault(role_of(t) or "agent", []).append(t)
    for role, ts in by_role.items():
        out[f"role/{role}/reward"] = mean([t.reward for t in ts])
        out[f"role/{role}/turns"] = mean([len(t.turns) for t in ts])
        out[f"role/{role}/generated_tokens"] = mean([t.num_generated_tokens for t in ts])
        out[f"role/{role}/parse_errors"] = mean([sum(len(turn.parse_errors) for turn in t.turns) for t in ts])
    return out


def evaluate_team(cfg: RLConfig, sampler: Any, renderer: Any, tasks: Sequence[Any], adapters: Mapping[str, str],
                  seed: int) -> dict[str, float]:
    """pass@1 and success rate of the team on held-out tasks (failed episodes count as unsolved)."""
    from tracegym.eval import summarize

    rollout_cfg = RolloutConfig(**cfg.rollout.settings(temperature=cfg.eval.temperature, measure_logprob_gap=False),
                                samples_per_task=cfg.eval.samples_per_task, seed=seed)
    result = run_team_rollouts_sync(cfg.env.name, tasks, sampler, renderer, rollout_cfg, adapters=adapters,
                                    env_options=cfg.env.options)
    heads = episode_heads(result.trajectories) + episode_heads(result.failed)
    summary = summarize(heads, ks=[1], turns=[cfg.rollout.max_turns], env=cfg.env.name, n_bootstrap=200)
    out = {"eval/pass@1": summary["pass_at"][str(cfg.rollout.max_turns)]["1"],
           "eval/success_rate": summary["success_rate"], "eval/env_errors": float(result.stats.failed)}
    for role in cfg.roles:
        turns = [len(t.turns) for t in result.trajectories if role_of(t) == role]
        out[f"eval/role/{role}/turns"] = float(statistics.fmean(turns)) if turns else 0.0
    return out


def restore_pool(restored: Any, pool: AdapterPool) -> tuple[int, int]:
    """Every adapter's weights, optimizer and schedule from a team (or self-play) checkpoint; returns
    (step, task cursor)."""
    if "pool" not in restored.state:
        raise ValueError(f"{restored.path} is not a team checkpoint (no adapter pool state)")
    pool.load_state_dict(restored.state["pool"])
    return restored.step, int(restored.state["task_cursor"])


def sync_adapters(sampler: Any, model: torch.nn.Module, adapters: Sequence[str]) -> None:
    """Per-role weight sync after an update: an engine that holds the trainer's model (hf) only drops
    its caches; one that copies weights (vllm) gets each updated adapter as a new version, and the
    frozen ones are not re-sent."""
    if getattr(getattr(sampler, "capabilities", None), "weight_sync", "shared_model") == "shared_model":
        sampler.update_weights(model)
        return
    for adapter in adapters:
        sampler.update_weights(model, adapter=adapter)


@dataclass
class TeamRun:
    """What the team loop holds from one step to the next (built by ``prepare_run``)."""

    cfg: RLConfig
    loss_cfg: PolicyLossConfig
    run_dir: Path
    pool: AdapterPool
    model: Any  # the pool's model (every adapter on the one base), on the device
    tokenizer: Any
    adapters: dict[str, str]  # role -> adapter
    trained: list[str]  # the adapters some trained role plays
    renderer: Any
    sampler: Any
    pad_id: int
    temperature: float  # the trainer scores under the distribution the engine sampled from (logits / T)
    train_tasks: list[Any]
    test_tasks: list[Any]
    logger: MetricsLogger = None  # type: ignore[assignment]  (set by prepare_run)
    progress: ProgressBar = None  # type: ignore[assignment]
    step: int = 0
    cursor: int = 0  # task slots consumed so far
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def eval_seed(self) -> int:
        return self.cfg.seed + 1_000_003


# --- the loop --------------------------------------------------------------------------------------


def train_team(cfg: RLConfig, resume: bool = False, stop_at_step: int | None = None) -> TrainResult:
    """Team RL as ``cfg`` says (see the module docstring); ``resume`` continues from the latest intact
    checkpoint; ``stop_at_step`` returns after that step without saving (a simulated kill)."""
    run = prepare_run(cfg, resume)
    final_dir = None
    try:
        while run.step < cfg.steps:
            t_start = time.perf_counter()
            tasks, rollout_cfg, result = collect_step(run)     # 1. every task's group_size team episodes
            trajectories, credit_metrics = counterfactual_credit(run, tasks, rollout_cfg, result)  # 2. optional C3
            groups = group_by_role(trajectories)                # one group per (task, role)
            estimated = estimate(cfg.advantage.estimator, groups, cfg.advantage.options)
            metrics: dict[str, Any] = {**team_metrics(groups, result), **credit_metrics}
            metrics["time/rollout_s"] = time.perf_counter() - t_start
            metrics.update({f"advantage/{k}": v for k, v in estimated.metrics.items()})
            weights = estimated.weights or [[[1.0] * len(a) for a in group] for group in estimated.advantages]
            t_train = time.perf_counter()
            for adapter in run.trained:                         # 3. each trained adapter, its own optimizer
                metrics.update(update_adapter(run, adapter, groups, estimated.advantages, weights))
            sync_adapters(run.sampler, run.model, run.trained)
            run.step += 1
            metrics.update(step_times(t_start, t_train))
            end_of_step(run, metrics, result)                   # 4. evaluate, log
            if stops_here(run.step, stop_at_step, cfg.steps):
                return TrainResult(run.run_dir, None, run.step, run.history)
            maybe_checkpoint(run)
        final_dir = save_team_final(run.pool, run.tokenizer, run.run_dir, {
            "base_model": cfg.model.name, "lora": True, "renderer": cfg.model.renderer or cfg.model.name,
            "recipe": "rl", "env": cfg.env.name, "roles": run.adapters,
            "untrusted_tool_output": cfg.rollout.untrusted_tool_output})
    finally:
        run.progress.close()
        run.logger.close(final_dir)
    return TrainResult(run.run_dir, final_dir, run.step, run.history)


# --- the steps of the loop -------------------------------------------------------------------------


def load_team_tasks(cfg: RLConfig) -> tuple[list[Any], list[Any]]:
    """(train tasks, test tasks) of the team env, after checking that it is one and that the config's
    roles are its roles (a bad env name/option fails before the model loads)."""
    from tracegym.envs import make
    from tracegym.envs.team import TeamEnv

    probe = make(cfg.env.name, **cfg.env.options)
    if not isinstance(probe, TeamEnv):
        raise ValueError(f"roles: env {cfg.env.name!r} is not a team env (a TeamEnv with roles); drop roles: to train "
                         "one agent")
    if set(cfg.roles) != set(probe.roles):
        raise ValueError(f"roles: env {cfg.env.name!r} has roles {list(probe.roles)}, the config names {sorted(cfg.roles)}")
    if cfg.env.injection is not None:
        raise ValueError("env.injection is not supported with roles: yet")
    return split_tasks(cfg, probe)


def prepare_run(cfg: RLConfig, resume: bool) -> TeamRun:
    """Check the config, load tasks, the base and its adapter pool, restore a checkpoint, log step 0."""
    from tracegym.models import load

    run_dir = Path(cfg.output_dir)
    check_run_dir(run_dir, resume)
    loss_cfg = PolicyLossConfig(**cfg.policy_loss)
    problems = estimator_problems(cfg.advantage.estimator, cfg.advantage.options)
    if problems:
        raise ValueError("; ".join(problems))
    train_tasks, test_tasks = load_team_tasks(cfg)
    dump_config(cfg, run_dir)
    seed_everything(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base, tokenizer = load(cfg.model.name, cfg.model.dtype)
    pool = build_pool(cfg, base)
    model = pool.model.to(device).eval()
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    adapters = role_adapters(cfg)
    trained = [a for a in pool.names if any(cfg.roles[r].train for r, ad in adapters.items() if ad == a)]
    renderer = make_renderer(cfg, tokenizer)
    sampler = make_sampler(cfg, model, tokenizer, renderer)
    sampler.update_weights(model)  # vllm: every adapter sent as its first version (hf: nothing to copy)
    run = TeamRun(cfg, loss_cfg, run_dir, pool, model, tokenizer, adapters, trained, renderer, sampler,
                  pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                  temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
                  train_tasks=train_tasks, test_tasks=test_tasks)
    restored = load_latest_intact(run_dir) if resume else None
    if restored is not None:
        check_resumed_tasks(restored, cfg, train_tasks)
        run.step, run.cursor = restore_pool(restored, pool)
        sampler.update_weights(model)
    start_logging(run, resume, cfg.steps, "team rl", lambda: log_start(run))
    if cfg.save_rollouts:
        (run_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    return run


def log_start(run: TeamRun) -> None:
    """Row 0: parameter count, the adapter pool's memory, and optionally an evaluation."""
    cfg = run.cfg
    _, total = count_parameters(run.model)
    memory = run.pool.memory_report()
    row: dict[str, Any] = {"params/total": total, **{f"memory/{k}": v for k, v in memory.items()},
                           "params/adapters": float(len(run.pool.names))}
    if run.test_tasks and cfg.eval.at_start:
        row.update(evaluate_team(cfg, run.sampler, run.renderer, run.test_tasks, run.adapters, run.eval_seed))
    run.history.append(run.logger.log(0, row))


def collect_step(run: TeamRun) -> tuple[list[Any], RolloutConfig, RolloutResult]:
    """The step's tasks (seeded order, resumable cursor) and their ``group_size`` team episodes each;
    all roles' turns share engine batches, each row with its role's adapter."""
    cfg = run.cfg
    tasks = tasks_at(run.train_tasks, cfg.tasks.seed, run.cursor, cfg.tasks_per_step)
    run.cursor += len(tasks)
    rollout_cfg = RolloutConfig(**cfg.rollout.settings(), samples_per_task=cfg.group_size,
                                seed=batch_seed(cfg.seed, run.step, 0))
    path = run.run_dir / "rollouts" / f"step_{run.step + 1:06d}.jsonl"
    writer = TrajectoryWriter(path) if cfg.save_rollouts else None
    try:
        result = run_team_rollouts_sync(cfg.env.name, tasks, run.sampler, run.renderer, rollout_cfg,
                                        adapters=run.adapters, env_options=cfg.env.options, writer=writer,
                                        salt=f"step{run.step}")
    finally:
        if writer is not None:
            writer.close()
    return tasks, rollout_cfg, result


def counterfactual_credit(run: TeamRun, tasks: list[Any], rollout_cfg: RolloutConfig,
                          result: RolloutResult) -> tuple[list[Trajectory], dict[str, float]]:
    """With ``advantage.intrinsic: mc_continuation`` (C3), the episodes with per-role counterfactual
    credit (replace the acting role's message, re-run the rest) and its metrics; else as sampled."""
    cfg = run.cfg
    if cfg.advantage.intrinsic != "mc_continuation":
        return result.trajectories, {}
    trajectories, c3 = asyncio.run(score_team_counterfactual(
        cfg.env.name, result.trajectories, tasks, run.sampler, run.renderer, rollout_cfg, adapters=run.adapters,
        env_options=cfg.env.options, k=cfg.advantage.mc_k, m=cfg.advantage.mc_m,
        decision_turns=cfg.advantage.mc_decision_turns, salt=f"step{run.step}"))
    return trajectories, c3.metrics()


def update_adapter(run: TeamRun, adapter: str, groups: list[TrajectoryGroup], advantages: list[Any],
                   weights: list[Any]) -> dict[str, Any]:
    """One policy update of ``adapter`` on the groups of the trained roles it plays, with its own
    optimizer and schedule (only this adapter has ``requires_grad``); ``adapter/<name>/`` metrics."""
    cfg = run.cfg
    mine = [i for i, g in enumerate(groups) if run.adapters.get(role_of(g.trajectories[0]) or "") == adapter
            and cfg.roles[role_of(g.trajectories[0]) or ""].train]
    skip = [cfg.skip_uniform_groups and not has_signal(advantages[i]) for i in mine]
    data = examples_from_groups([groups[i] for i in mine], run.renderer, [advantages[i] for i in mine],
                                weights=[weights[i] for i in mine], max_length=cfg.max_length, skip_groups=skip)
    metrics: dict[str, Any] = {f"adapter/{adapter}/examples": float(len(data.examples))}
    if not data.examples:
        return metrics
    with run.pool.training(adapter):
        batch = make_batch(data.examples, pad_token_id=run.pad_id, group_ids=data.group_index)
        batch = score_batch(run.model, None, batch, run.loss_cfg, micro_batch_size=cfg.micro_batch_size,
                            temperature=run.temperature, epochs=cfg.ppo_epochs, top_p=cfg.rollout.top_p)
        update = policy_update(run.model, batch, run.loss_cfg, run.pool.optimizers[adapter],
                               run.pool.schedulers[adapter], epochs=cfg.ppo_epochs, micro_batch_size=cfg.micro_batch_size,
                               temperature=run.temperature, max_grad_norm=cfg.optim.max_grad_norm,
                               micro_batch_tokens=cfg.micro_batch_tokens, train_mode=cfg.model.gradient_checkpointing)
    metrics.update({f"adapter/{adapter}/{k}": v for k, v in update.items()})
    return metrics


def end_of_step(run: TeamRun, metrics: dict[str, Any], result: RolloutResult) -> None:
    """Evaluate the team when due, log the row and move the progress bar."""
    cfg = run.cfg
    if run.test_tasks and ((cfg.eval.every and run.step % cfg.eval.every == 0) or run.step == cfg.steps):
        metrics.update(evaluate_team(cfg, run.sampler, run.renderer, run.test_tasks, run.adapters, run.eval_seed))
    if run.step % cfg.logging.log_every == 0 or run.step == cfg.steps:
        run.history.append(run.logger.log(run.step, metrics))
    run.progress.update(1, info=f"team reward {metrics['reward/mean']:.3f}", tokens=int(result.stats.generated_tokens))


def maybe_checkpoint(run: TeamRun) -> None:
    """Every ``checkpoint.every`` steps and at the last: every adapter's weights, optimizer and
    schedule (``AdapterPool.state_dict``), the task cursor and the role -> adapter map."""
    cfg = run.cfg
    if (cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0) or run.step == cfg.steps:
        state = {"tasks": {"seed": cfg.tasks.seed, "train": len(run.train_tasks)}, "task_cursor": run.cursor,
                 "pool": run.pool.state_dict(), "roles": run.adapters}
        save_checkpoint(run.run_dir, run.step, run.model, None, None, state, keep_last=cfg.checkpoint.keep_last)
