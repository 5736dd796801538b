"""Proposer / solver self-play (``tracegym rl`` with ``selfplay:``): one base, two LoRA adapters.

The proposer plays ``env`` (an env whose episodes propose tasks, e.g. ``calc_proposer``: "write a new
arithmetic word problem and the expression that answers it"); each valid proposal becomes a task of
``selfplay.solver_env`` (``calculator``) that the solver attempts ``solver_attempts`` times. One step,
top to bottom (``train_selfplay`` reads exactly like this)::

    seeds     = tasks_at(proposer_tasks, seed, cursor, tasks_per_step)
    proposals = run_rollouts(env, seeds, with_adapter(engine, "proposer"), samples=group_size)
    tasks     = [env.solver_task_from(p.messages) for p in proposals]     # None: invalid
    attempts  = run_rollouts(solver_env, valid tasks, with_adapter(engine, "solver"), samples=n)
    p_hat     = each proposal's solver pass rate
    proposer reward = valid * 4 p_hat (1 - p_hat)                           # Tool-R0: learnable problems
    advantages: solver attempts baselined within their proposal, proposals within their seed
                (hierarchical GRPO, prime-rl)
    update the proposer adapter, then the solver adapter, each with its own optimizer
    log(step); maybe_evaluate(solver on held-out solver_env tasks); maybe_checkpoint(step)

The proposer env must implement ``solver_task_from(messages, task_id) -> Task | None``. Both roles
sample through the same engine (each call with its adapter); checkpoints hold both adapters'
weights, optimizers and schedules, so resume is exact; ``final/proposer`` and ``final/solver`` are
portable adapter folders.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from tracegym.algos import has_signal
from tracegym.algos.config import PolicyLossConfig
from tracegym.algos.hierarchical import hierarchical_advantages, learnability_reward
from tracegym.batch import examples_from_groups, make_batch
from tracegym.config import RLConfig, dump_config
from tracegym.executors.base import batch_seed
from tracegym.rollout import RolloutConfig, run_rollouts_sync
from tracegym.rollout_team import with_adapter
from tracegym.train.checkpoint import list_checkpoints, load_latest_intact, save_checkpoint, save_team_final
from tracegym.train.logging import MetricsLogger, ProgressBar, process_rss_mb
from tracegym.train.policy_update import policy_update, score_batch
from tracegym.train.result import TrainResult
from tracegym.train.seed import seed_everything
from tracegym.types import Trajectory, TrajectoryGroup, group_trajectories

__all__ = ["proposer_rewards", "train_selfplay"]


def proposer_rewards(valid: Sequence[bool], pass_rates: Sequence[float | None]) -> list[float]:
    """``valid * 4p(1-p)`` per proposal (an invalid one, with no pass rate, gets 0)."""
    return [learnability_reward(v, p) if v and p is not None else 0.0 for v, p in zip(valid, pass_rates)]


def _with_reward(trajectory: Trajectory, reward: float) -> Trajectory:
    """``trajectory`` with its episode reward replaced by ``reward``, credited on its last turn and the
    earlier turns' rewards zeroed, so the episode reward stays the sum of the turn rewards."""
    if not trajectory.turns:
        return trajectory.model_copy(update={"reward": reward})
    turns = [turn.model_copy(update={"reward": 0.0}) for turn in trajectory.turns[:-1]]
    last = trajectory.turns[-1].model_copy(update={"reward": reward})
    return trajectory.model_copy(update={"turns": (*turns, last), "reward": reward})


def _update(pool: Any, adapter: str, groups: list[TrajectoryGroup], advantages: list[list[list[float]]],
            cfg: RLConfig, loss_cfg: PolicyLossConfig, renderer: Any, pad_id: int, temperature: float) -> dict[str, float]:
    """One policy update of ``adapter`` on ``groups`` (per-turn ``advantages``); groups without signal skipped."""
    skip = [cfg.skip_uniform_groups and not has_signal(a) for a in advantages]
    data = examples_from_groups(groups, renderer, advantages, max_length=cfg.max_length, skip_groups=skip)
    out = {f"adapter/{adapter}/examples": float(len(data.examples))}
    if not data.examples:
        return out
    with pool.training(adapter) as model:
        batch = make_batch(data.examples, pad_token_id=pad_id, group_ids=data.group_index)
        batch = score_batch(model, None, batch, loss_cfg, micro_batch_size=cfg.micro_batch_size, temperature=temperature,
                            epochs=cfg.ppo_epochs, top_p=cfg.rollout.top_p)
        metrics = policy_update(model, batch, loss_cfg, pool.optimizers[adapter], pool.schedulers[adapter],
                                epochs=cfg.ppo_epochs, micro_batch_size=cfg.micro_batch_size, temperature=temperature,
                                max_grad_norm=cfg.optim.max_grad_norm, micro_batch_tokens=cfg.micro_batch_tokens, train_mode=cfg.model.gradient_checkpointing)
    out.update({f"adapter/{adapter}/{k}": v for k, v in metrics.items()})
    return out


def _turn_advantages(groups: list[TrajectoryGroup], values: list[list[float]]) -> list[list[list[float]]]:
    """Each trajectory's advantage on every one of its turns."""
    return [[[a] * len(t.turns) for t, a in zip(g.trajectories, vals)] for g, vals in zip(groups, values)]


def train_selfplay(cfg: RLConfig, resume: bool = False, stop_at_step: int | None = None) -> TrainResult:
    """Self-play as ``cfg`` says (see the module docstring)."""
    from tracegym.envs import make
    from tracegym.eval import summarize
    from tracegym.models import load
    from tracegym.recipes.rl import make_renderer, make_sampler, tasks_at
    from tracegym.recipes.team import build_pool, restore_pool, role_adapters, sync_adapters

    assert cfg.selfplay is not None
    sp = cfg.selfplay
    run_dir = Path(cfg.output_dir)
    if not resume and list_checkpoints(run_dir):
        raise FileExistsError(f"{run_dir} already holds checkpoints: pass --resume to continue, or pick another output_dir")
    loss_cfg = PolicyLossConfig(**cfg.policy_loss)
    proposer_env = make(cfg.env.name, **cfg.env.options)
    if not callable(getattr(proposer_env, "solver_task_from", None)):
        raise ValueError(f"selfplay: env {cfg.env.name!r} proposes no tasks (it has no solver_task_from(messages, task_id))")
    solver_probe = make(sp.solver_env, **sp.solver_env_options)
    seeds = proposer_env.tasks("train", cfg.tasks.train, cfg.tasks.seed)
    test_tasks = solver_probe.tasks("test", cfg.tasks.test, cfg.tasks.seed) if cfg.tasks.test else []
    solver_probe.close()
    dump_config(cfg, run_dir)
    seed_everything(cfg.seed)
    base, tokenizer = load(cfg.model.name, cfg.model.dtype)
    pool = build_pool(cfg, base)
    model = pool.model.to(torch.device("cuda" if torch.cuda.is_available() else "cpu")).eval()
    adapters = role_adapters(cfg)
    renderer = make_renderer(cfg, tokenizer)
    sampler = make_sampler(cfg, model, tokenizer, renderer)
    sampler.update_weights(model)  # vllm: every adapter sent as its first version (hf: nothing to copy)
    proposer, solver = with_adapter(sampler, adapters["proposer"]), with_adapter(sampler, adapters["solver"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0

    def evaluate() -> dict[str, float]:  # the solver on held-out tasks of solver_env
        rc = RolloutConfig(**cfg.rollout.settings(temperature=cfg.eval.temperature, measure_logprob_gap=False),
                           samples_per_task=cfg.eval.samples_per_task, seed=cfg.seed + 1_000_003)
        result = run_rollouts_sync(sp.solver_env, test_tasks, solver, renderer, rc, progress=False,
                                   env_options=sp.solver_env_options, policy_name="solver")
        summary = summarize(result.trajectories + result.failed, ks=[1], turns=[cfg.rollout.max_turns],
                            env=sp.solver_env, n_bootstrap=200)
        return {"eval/pass@1": summary["pass_at"][str(cfg.rollout.max_turns)]["1"],
                "eval/success_rate": summary["success_rate"]}

    step, cursor = 0, 0
    restored = load_latest_intact(run_dir) if resume else None
    if restored is not None:
        step, cursor = restore_pool(restored, pool)
        sampler.update_weights(model)
    logger = MetricsLogger(run_dir, cfg.logging.tensorboard, cfg.logging.wandb, cfg.logging.wandb_project,
                           config=cfg.model_dump(mode="json"), resume_step=step if resume else None)
    history: list[dict[str, Any]] = []
    if step == 0:
        row: dict[str, Any] = {f"memory/{k}": v for k, v in pool.memory_report().items()}
        if test_tasks and cfg.eval.at_start:
            row.update(evaluate())
        history.append(logger.log(0, row))
    progress = ProgressBar(cfg.steps, "self-play", enabled=cfg.logging.progress, completed=step)
    final_dir = None
    mean = lambda values: float(statistics.fmean(values)) if values else 0.0  # noqa: E731
    try:
        while step < cfg.steps:
            t_start = time.perf_counter()
            seed = batch_seed(cfg.seed, step, 0)
            # 1. proposals: group_size per seed task, with the proposer's adapter
            seed_tasks = tasks_at(seeds, cfg.tasks.seed, cursor, cfg.tasks_per_step)
            cursor += len(seed_tasks)
            rc = RolloutConfig(**cfg.rollout.settings(), samples_per_task=cfg.group_size, seed=seed)
            proposed = run_rollouts_sync(cfg.env.name, seed_tasks, proposer, renderer, rc, progress=False,
                                         env_options=cfg.env.options, policy_name="proposer")
            proposals = group_trajectories(proposed.trajectories)
            # 2. each valid proposal is a solver task, attempted solver_attempts times
            solver_tasks: dict[tuple[int, int], Any] = {}
            for g, group in enumerate(proposals):
                for i, t in enumerate(group.trajectories):
                    task = proposer_env.solver_task_from(t.messages, f"sp{step}-{g}-{i}")
                    if task is not None:
                        solver_tasks[(g, i)] = task
            rc_solver = RolloutConfig(**cfg.rollout.settings(), samples_per_task=sp.solver_attempts, seed=seed + 7)
            attempts = run_rollouts_sync(sp.solver_env, list(solver_tasks.values()), solver, renderer, rc_solver,
                                         progress=False, env_options=sp.solver_env_options,
                                         policy_name="solver") if solver_tasks else None
            by_task: dict[str, list[Trajectory]] = {}
            for t in attempts.trajectories if attempts else []:
                by_task.setdefault(t.task_id, []).append(t)
            # 3. rewards and hierarchical advantages
            pass_rate = {key: mean([float(t.success) for t in by_task.get(task.id, [])]) if by_task.get(task.id) else None
                         for key, task in solver_tasks.items()}
            proposer_groups, proposer_values = [], []
            for g, group in enumerate(proposals):
                keys = [(g, i) for i in range(len(group.trajectories))]
                rewards = proposer_rewards([k in solver_tasks for k in keys], [pass_rate.get(k) for k in keys])
                proposer_groups.append(group.model_copy(update={"trajectories": tuple(
                    _with_reward(t, r) for t, r in zip(group.trajectories, rewards))}))
                proposer_values.append(rewards)
            solver_groups = [TrajectoryGroup(env=sp.solver_env, task_id=task.id, trajectories=tuple(by_task[task.id]))
                             for task in solver_tasks.values() if by_task.get(task.id)]
            metrics: dict[str, Any] = {
                "proposer/valid_rate": mean([float(k in solver_tasks) for g, grp in enumerate(proposals)
                                             for k in [(g, i) for i in range(len(grp.trajectories))]]),
                "proposer/reward": mean([r for rs in proposer_values for r in rs]),
                "solver/pass_rate": mean([p for p in pass_rate.values() if p is not None]),
                "solver/learnable_share": mean([float(p is not None and 0 < p < 1) for p in pass_rate.values()]),
                "reward/mean": mean([r for rs in proposer_values for r in rs]),
                "env/errors": float(proposed.stats.failed + (attempts.stats.failed if attempts else 0)),
                "time/rollout_s": time.perf_counter() - t_start,
            }
            # 4. updates: proposals baselined within their seed, attempts within their proposal
            t_train = time.perf_counter()
            for role, groups in (("proposer", proposer_groups), ("solver", solver_groups)):
                if not cfg.roles[role].train or not groups:
                    continue
                values = hierarchical_advantages([g.rewards for g in groups])
                metrics.update(_update(pool, adapters[role], groups, _turn_advantages(groups, values), cfg, loss_cfg,
                                       renderer, pad_id, temperature))
            sync_adapters(sampler, model, [adapters[r] for r in ("proposer", "solver") if cfg.roles[r].train])
            step += 1
            metrics.update({"time/train_s": time.perf_counter() - t_train, "time/step_s": time.perf_counter() - t_start,
                            "rss_mb": process_rss_mb()})
            if test_tasks and ((cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.steps):
                metrics.update(evaluate())
            if step % cfg.logging.log_every == 0 or step == cfg.steps:
                history.append(logger.log(step, metrics))
            progress.update(1, info=f"valid {metrics['proposer/valid_rate']:.2f} solver {metrics['solver/pass_rate']:.2f}")
            if stop_at_step is not None and step >= stop_at_step and step < cfg.steps:
                return TrainResult(run_dir, None, step, history)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.steps:
                state = {"task_cursor": cursor, "pool": pool.state_dict(), "roles": adapters}
                save_checkpoint(run_dir, step, model, None, None, state, keep_last=cfg.checkpoint.keep_last)
        final_dir = save_team_final(pool, tokenizer, run_dir, {
            "base_model": cfg.model.name, "lora": True, "renderer": cfg.model.renderer or cfg.model.name,
            "recipe": "selfplay", "env": cfg.env.name, "solver_env": sp.solver_env, "roles": adapters})
    finally:
        proposer_env.close()
        progress.close()
        logger.close()
    return TrainResult(run_dir, final_dir, step, history)
