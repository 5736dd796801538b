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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from tracegym.algos import has_signal
from tracegym.algos.config import PolicyLossConfig
from tracegym.algos.hierarchical import hierarchical_advantages, learnability_reward
from tracegym.batch import examples_from_groups, make_batch
from tracegym.config import RLConfig, dump_config
from tracegym.recipes._run import check_run_dir, start_logging, step_times, stops_here
from tracegym.recipes.team import build_pool, restore_pool, role_adapters, sync_adapters
from tracegym.rl.executors.base import batch_seed
from tracegym.rl.policy import make_renderer, make_sampler
from tracegym.rl.tasks import tasks_at
from tracegym.rollout import RolloutConfig, RolloutResult, run_rollouts_sync
from tracegym.rollout.team import with_adapter
from tracegym.train.checkpoint import load_latest_intact, save_checkpoint, save_team_final
from tracegym.train.logging import MetricsLogger, ProgressBar
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


def _mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else 0.0


def _turn_advantages(groups: list[TrajectoryGroup], values: list[list[float]]) -> list[list[list[float]]]:
    """Each trajectory's advantage on every one of its turns."""
    return [[[a] * len(t.turns) for t, a in zip(g.trajectories, vals)] for g, vals in zip(groups, values)]


@dataclass
class SelfPlayRun:
    """What the self-play loop holds from one step to the next (built by ``prepare_run``)."""

    cfg: RLConfig
    loss_cfg: PolicyLossConfig
    run_dir: Path
    proposer_env: Any  # open for the whole run: it turns proposals into solver tasks
    pool: Any
    model: Any  # the pool's model (both adapters on the one base), on the device
    tokenizer: Any
    adapters: dict[str, str]  # role (proposer, solver) -> adapter
    renderer: Any
    sampler: Any
    proposer: Any  # the sampler with the proposer's adapter
    solver: Any  # ... and with the solver's
    pad_id: int
    temperature: float
    seeds: list[Any]  # the proposer env's train tasks
    test_tasks: list[Any]  # held-out tasks of solver_env
    logger: MetricsLogger = None  # type: ignore[assignment]  (set by prepare_run)
    progress: ProgressBar = None  # type: ignore[assignment]
    step: int = 0
    cursor: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Scored:
    """One step's proposals and attempts with their rewards."""

    proposals: list[TrajectoryGroup]  # as sampled, one group per seed task
    solver_tasks: dict[tuple[int, int], Any]  # (group, index) of each valid proposal -> its solver task
    pass_rate: dict[tuple[int, int], float | None]  # each valid proposal's solver pass rate (None: no attempt came back)
    proposer_groups: list[TrajectoryGroup]  # the proposals with their learnability rewards
    proposer_values: list[list[float]]
    solver_groups: list[TrajectoryGroup]  # each solved-at task's attempts


# --- the loop --------------------------------------------------------------------------------------


def train_selfplay(cfg: RLConfig, resume: bool = False, stop_at_step: int | None = None) -> TrainResult:
    """Self-play as ``cfg`` says (see the module docstring)."""
    assert cfg.selfplay is not None
    run = prepare_run(cfg, resume)
    final_dir = None
    try:
        while run.step < cfg.steps:
            t_start = time.perf_counter()
            seed = batch_seed(cfg.seed, run.step, 0)
            proposed = propose(run, seed)                        # 1. group_size proposals per seed task
            proposals = group_trajectories(proposed.trajectories)
            solver_tasks = solver_tasks_of(run, proposals)       # 2. each valid proposal is a solver task,
            attempts = attempt(run, solver_tasks, seed + 7)      #    attempted solver_attempts times
            scored = score_proposals(run, proposals, solver_tasks, attempts)  # 3. rewards
            metrics = step_metrics(scored, proposed, attempts, t_start)
            t_train = time.perf_counter()
            metrics.update(update_roles(run, scored))            # 4. hierarchical advantages, updates, sync
            run.step += 1
            metrics.update(step_times(t_start, t_train))
            end_of_step(run, metrics)                            # 5. evaluate the solver, log
            if stops_here(run.step, stop_at_step, cfg.steps):
                return TrainResult(run.run_dir, None, run.step, run.history)
            maybe_checkpoint(run)
        final_dir = save_team_final(run.pool, run.tokenizer, run.run_dir, {
            "base_model": cfg.model.name, "lora": True, "renderer": cfg.model.renderer or cfg.model.name,
            "recipe": "selfplay", "env": cfg.env.name, "solver_env": cfg.selfplay.solver_env, "roles": run.adapters})
    finally:
        run.proposer_env.close()
        run.progress.close()
        run.logger.close(final_dir)
    return TrainResult(run.run_dir, final_dir, run.step, run.history)


# --- the steps of the loop -------------------------------------------------------------------------


def prepare_run(cfg: RLConfig, resume: bool) -> SelfPlayRun:
    """Check the config, load both envs' tasks, the base and its two adapters, restore a checkpoint,
    log step 0."""
    from tracegym.envs import make
    from tracegym.models import load

    sp = cfg.selfplay
    assert sp is not None
    run_dir = Path(cfg.output_dir)
    check_run_dir(run_dir, resume)
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
    run = SelfPlayRun(cfg, loss_cfg, run_dir, proposer_env, pool, model, tokenizer, adapters, renderer, sampler,
                      proposer=with_adapter(sampler, adapters["proposer"]), solver=with_adapter(sampler, adapters["solver"]),
                      pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                      temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
                      seeds=seeds, test_tasks=test_tasks)
    restored = load_latest_intact(run_dir) if resume else None
    if restored is not None:
        run.step, run.cursor = restore_pool(restored, pool)
        sampler.update_weights(model)
    start_logging(run, resume, cfg.steps, "self-play", lambda: log_start(run))
    return run


def log_start(run: SelfPlayRun) -> None:
    """Row 0: the adapter pool's memory and optionally an evaluation of the solver."""
    row: dict[str, Any] = {f"memory/{k}": v for k, v in run.pool.memory_report().items()}
    if run.test_tasks and run.cfg.eval.at_start:
        row.update(evaluate_solver(run))
    run.history.append(run.logger.log(0, row))


def evaluate_solver(run: SelfPlayRun) -> dict[str, float]:
    """pass@1 and success rate of the solver on held-out tasks of ``solver_env``."""
    from tracegym.eval import summarize

    cfg, sp = run.cfg, run.cfg.selfplay
    assert sp is not None
    rc = RolloutConfig(**cfg.rollout.settings(temperature=cfg.eval.temperature, measure_logprob_gap=False),
                       samples_per_task=cfg.eval.samples_per_task, seed=cfg.seed + 1_000_003)
    result = run_rollouts_sync(sp.solver_env, run.test_tasks, run.solver, run.renderer, rc, progress=False,
                               env_options=sp.solver_env_options, policy_name="solver")
    summary = summarize(result.trajectories + result.failed, ks=[1], turns=[cfg.rollout.max_turns],
                        env=sp.solver_env, n_bootstrap=200)
    return {"eval/pass@1": summary["pass_at"][str(cfg.rollout.max_turns)]["1"],
            "eval/success_rate": summary["success_rate"]}


def propose(run: SelfPlayRun, seed: int) -> RolloutResult:
    """The step's seed tasks (seeded order, resumable cursor), ``group_size`` proposer episodes each."""
    cfg = run.cfg
    seed_tasks = tasks_at(run.seeds, cfg.tasks.seed, run.cursor, cfg.tasks_per_step)
    run.cursor += len(seed_tasks)
    rc = RolloutConfig(**cfg.rollout.settings(), samples_per_task=cfg.group_size, seed=seed)
    return run_rollouts_sync(cfg.env.name, seed_tasks, run.proposer, run.renderer, rc, progress=False,
                             env_options=cfg.env.options, policy_name="proposer")


def solver_tasks_of(run: SelfPlayRun, proposals: list[TrajectoryGroup]) -> dict[tuple[int, int], Any]:
    """(group, index) of each valid proposal -> the solver task the proposer env makes of it."""
    solver_tasks: dict[tuple[int, int], Any] = {}
    for g, group in enumerate(proposals):
        for i, t in enumerate(group.trajectories):
            task = run.proposer_env.solver_task_from(t.messages, f"sp{run.step}-{g}-{i}")
            if task is not None:
                solver_tasks[(g, i)] = task
    return solver_tasks


def attempt(run: SelfPlayRun, solver_tasks: dict[tuple[int, int], Any], seed: int) -> RolloutResult | None:
    """``solver_attempts`` solver episodes of each solver task (None when no proposal was valid)."""
    cfg, sp = run.cfg, run.cfg.selfplay
    assert sp is not None
    if not solver_tasks:
        return None
    rc_solver = RolloutConfig(**cfg.rollout.settings(), samples_per_task=sp.solver_attempts, seed=seed)
    return run_rollouts_sync(sp.solver_env, list(solver_tasks.values()), run.solver, run.renderer, rc_solver,
                             progress=False, env_options=sp.solver_env_options, policy_name="solver")


def score_proposals(run: SelfPlayRun, proposals: list[TrajectoryGroup], solver_tasks: dict[tuple[int, int], Any],
                    attempts: RolloutResult | None) -> Scored:
    """Each valid proposal's solver pass rate ``p``, the proposals' rewards ``valid * 4p(1-p)`` and the
    solver's groups (one per task that got attempts back)."""
    by_task: dict[str, list[Trajectory]] = {}
    for t in attempts.trajectories if attempts else []:
        by_task.setdefault(t.task_id, []).append(t)
    pass_rate = {key: _mean([float(t.success) for t in by_task.get(task.id, [])]) if by_task.get(task.id) else None
                 for key, task in solver_tasks.items()}
    proposer_groups, proposer_values = [], []
    for g, group in enumerate(proposals):
        keys = [(g, i) for i in range(len(group.trajectories))]
        rewards = proposer_rewards([k in solver_tasks for k in keys], [pass_rate.get(k) for k in keys])
        proposer_groups.append(group.model_copy(update={"trajectories": tuple(
            _with_reward(t, r) for t, r in zip(group.trajectories, rewards))}))
        proposer_values.append(rewards)
    solver_env = run.cfg.selfplay.solver_env  # type: ignore[union-attr]
    solver_groups = [TrajectoryGroup(env=solver_env, task_id=task.id, trajectories=tuple(by_task[task.id]))
                     for task in solver_tasks.values() if by_task.get(task.id)]
    return Scored(proposals, solver_tasks, pass_rate, proposer_groups, proposer_values, solver_groups)


def step_metrics(scored: Scored, proposed: RolloutResult, attempts: RolloutResult | None,
                 t_start: float) -> dict[str, Any]:
    """The row's rollout figures: valid proposals, rewards, the solver's pass rate and learnable share."""
    solver_tasks, pass_rate = scored.solver_tasks, scored.pass_rate
    return {
        "proposer/valid_rate": _mean([float(k in solver_tasks) for g, grp in enumerate(scored.proposals)
                                      for k in [(g, i) for i in range(len(grp.trajectories))]]),
        "proposer/reward": _mean([r for rs in scored.proposer_values for r in rs]),
        "solver/pass_rate": _mean([p for p in pass_rate.values() if p is not None]),
        "solver/learnable_share": _mean([float(p is not None and 0 < p < 1) for p in pass_rate.values()]),
        "reward/mean": _mean([r for rs in scored.proposer_values for r in rs]),
        "env/errors": float(proposed.stats.failed + (attempts.stats.failed if attempts else 0)),
        "time/rollout_s": time.perf_counter() - t_start,
    }


def update_roles(run: SelfPlayRun, scored: Scored) -> dict[str, float]:
    """Update the proposer adapter (proposals baselined within their seed), then the solver adapter
    (attempts baselined within their proposal), each with its own optimizer; then sync the sampler."""
    cfg = run.cfg
    metrics: dict[str, float] = {}
    for role, groups in (("proposer", scored.proposer_groups), ("solver", scored.solver_groups)):
        if not cfg.roles[role].train or not groups:
            continue
        values = hierarchical_advantages([g.rewards for g in groups])
        metrics.update(_update(run.pool, run.adapters[role], groups, _turn_advantages(groups, values), cfg,
                               run.loss_cfg, run.renderer, run.pad_id, run.temperature))
    sync_adapters(run.sampler, run.model, [run.adapters[r] for r in ("proposer", "solver") if cfg.roles[r].train])
    return metrics


def end_of_step(run: SelfPlayRun, metrics: dict[str, Any]) -> None:
    """Evaluate the solver when due, log the row and move the progress bar."""
    cfg = run.cfg
    if run.test_tasks and ((cfg.eval.every and run.step % cfg.eval.every == 0) or run.step == cfg.steps):
        metrics.update(evaluate_solver(run))
    if run.step % cfg.logging.log_every == 0 or run.step == cfg.steps:
        run.history.append(run.logger.log(run.step, metrics))
    run.progress.update(1, info=f"valid {metrics['proposer/valid_rate']:.2f} solver {metrics['solver/pass_rate']:.2f}")


def maybe_checkpoint(run: SelfPlayRun) -> None:
    """Every ``checkpoint.every`` steps and at the last: both adapters' weights, optimizers and
    schedules, and the task cursor."""
    cfg = run.cfg
    if (cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0) or run.step == cfg.steps:
        state = {"task_cursor": run.cursor, "pool": run.pool.state_dict(), "roles": run.adapters}
        save_checkpoint(run.run_dir, run.step, run.model, None, None, state, keep_last=cfg.checkpoint.keep_last)
