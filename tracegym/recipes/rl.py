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
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from tracegym.algos import EstimatorResult, estimate, estimator_problems, has_signal
from tracegym.algos.config import PolicyLossConfig
from tracegym.algos.kl import kl_per_token
from tracegym.batch import examples_from_groups, make_batch
from tracegym.config import RLConfig, dump_config
from tracegym.data.store import TrajectoryWriter
from tracegym.envs.injection import InjectionEnv, env_source
from tracegym.executors.base import batch_seed
from tracegym.executors.factory import make_executor
from tracegym.eval.metrics import injection_figures
from tracegym.render import get_renderer
from tracegym.rollout import RolloutConfig, RolloutResult, run_rollouts_sync
from tracegym.rollout_branches import score_mc_continuation
from tracegym.rollout_tree import run_tree_rollouts_sync
from tracegym.train.checkpoint import list_checkpoints, load_latest_intact, save_checkpoint, save_final
from tracegym.train.drift import build_probe, cap_drift, drift_rows, measure_drift, probe_nll, trainable_state
from tracegym.train.guidance import (add_guidance, guidance_rows, is_guidance, needs_guidance, shape_guidance,
                                     without_guidance)
from tracegym.train.health import HealthMonitor, group_health, mutual_information_proxy
from tracegym.train.info_gain import score_info_gain
from tracegym.train.logging import MetricsLogger, ProgressBar, process_rss_mb
from tracegym.train.lora import count_parameters, is_peft_model, prepare_model, starting_reference
from tracegym.train.optim import build_optimizer, build_scheduler
from tracegym.train.policy_update import batch_logprobs, policy_update, reference_logprobs, score_batch
from tracegym.train.result import TrainResult
from tracegym.train.seed import seed_everything
from tracegym.types import Trajectory, TrajectoryGroup, group_trajectories

log = logging.getLogger(__name__)


class RLResult(TrainResult):
    """What ``train_rl`` returns: the run folder, the final model folder (None when stopped early),
    the last step and the rows this invocation logged."""


# --- tasks -----------------------------------------------------------------------------------------


def task_order(num_tasks: int, seed: int, epoch: int) -> np.ndarray:
    """Train-task order of one epoch: a pure function of (seed, epoch), so resume needs no RNG state."""
    return np.random.default_rng([seed, 7919, epoch]).permutation(num_tasks)


def tasks_at(tasks: Sequence[Any], seed: int, start: int, count: int) -> list[Any]:
    """The tasks of slots ``start .. start+count-1`` of the endless seeded order (epochs wrap)."""
    out = []
    for slot in range(start, start + count):
        epoch, position = divmod(slot, len(tasks))
        out.append(tasks[int(task_order(len(tasks), seed, epoch)[position])])
    return out


def tasks_for_step(tasks: Sequence[Any], per_step: int, seed: int, step: int) -> list[Any]:
    """The ``per_step`` tasks of (0-based) ``step`` when no step draws extra tasks."""
    return tasks_at(tasks, seed, step * per_step, per_step)


# --- the pieces of one step ------------------------------------------------------------------------


def collect_groups(
    sampler: Any, cfg: RLConfig, tasks: Sequence[Any], renderer: Any, *, seed: int, writer: Any | None = None,
    gap_model: Any | None = None,
) -> tuple[list[TrajectoryGroup], RolloutResult]:
    """``group_size`` episodes of every task with the current policy -> one group per task: independent
    chains, or with ``rollout.strategy: tree`` the ``group_size`` leaves of one tree per task."""
    rollout_cfg = RolloutConfig(**cfg.rollout.settings(), samples_per_task=cfg.group_size, seed=seed)
    env, env_options = env_source(cfg.env.name, cfg.env.options, cfg.env.injection)
    if cfg.rollout.strategy == "tree":
        result, tree_stats = run_tree_rollouts_sync(
            env, tasks, sampler, renderer, rollout_cfg, cfg.rollout.tree, cfg.group_size,
            env_options=env_options, writer=writer, policy_name="policy")
        result.stats.extra = tree_stats.metrics()
        return group_trajectories(result.trajectories), result
    result = run_rollouts_sync(env, tasks, sampler, renderer, rollout_cfg, writer=writer, progress=False,
                               env_options=env_options, policy_name="policy", gap_model=gap_model)
    return group_trajectories(result.trajectories), result


def make_renderer(cfg: RLConfig, tokenizer: Any) -> Any:
    """The renderer of ``model.renderer`` (or the model's), showing tool results as
    ``rollout.untrusted_tool_output`` says."""
    return get_renderer(cfg.model.renderer or cfg.model.name, tokenizer,
                        untrusted_tool_output=cfg.rollout.untrusted_tool_output)


def injection_metrics(trajectories: Sequence[Trajectory], prefix: str) -> dict[str, float]:
    """``{prefix}asr`` (attack success rate of the injected episodes), ``{prefix}utility_clean`` /
    ``{prefix}utility_injected`` (their success rates) and ``{prefix}injected`` (the injected share);
    {} for episodes without injections."""
    figures = injection_figures(trajectories, n_resamples=1)  # rows log the rates, not intervals
    if figures is None:
        return {}
    total = figures["injected_episodes"] + figures["clean_episodes"]
    out = {f"{prefix}injected": figures["injected_episodes"] / max(total, 1)}
    for key in ("asr", "utility_clean", "utility_injected"):
        if figures[key] is not None:
            out[f"{prefix}{key}"] = float(figures[key])
    return out


def rollout_metrics(groups: Sequence[TrajectoryGroup], results: Sequence[RolloutResult]) -> dict[str, float]:
    """Rewards, episode shape, env failures and sampling speed of this step's rollouts (the policy's
    own episodes: guidance trajectories are counted in ``guidance/groups``, not here)."""
    episodes: list[Trajectory] = [t for g in groups for t in g.trajectories if not is_guidance(t)]
    rewards = [t.reward for t in episodes]
    mean = lambda values: float(statistics.fmean(values)) if values else 0.0  # noqa: E731
    metrics = {
        "reward/mean": mean(rewards),
        "reward/std": float(np.std(rewards)) if rewards else 0.0,
        "success_rate": mean([float(t.success) for t in episodes]),
        "episode/turns": mean([len(t.turns) for t in episodes]),
        "episode/generated_tokens": mean([t.num_generated_tokens for t in episodes]),
        "env/errors": float(sum(r.stats.failed for r in results)),
        **reward_part_metrics(episodes),
        "rollout/tokens_per_s": mean([r.stats.tokens_per_s for r in results]),
        "rollout/generated_tokens": float(sum(r.stats.generated_tokens for r in results)),  # what the engine sampled
        **injection_metrics(episodes, "attack/"),
    }
    for r in results:
        for reason, count in r.stats.end_reasons.items():
            metrics[f"end/{reason}"] = metrics.get(f"end/{reason}", 0.0) + float(count)
        for key, value in r.stats.extra.items():  # e.g. the tree rollouts' tree/leaves, tree/generated_tokens
            metrics[key] = metrics.get(key, 0.0) + value
        if r.stats.logprob_gap is not None:
            metrics["logprob_gap/mean"] = r.stats.logprob_gap.mean
            metrics["logprob_gap/max"] = max(metrics.get("logprob_gap/max", 0.0), r.stats.logprob_gap.max)
    return metrics


def drop_overlong(
    groups: Sequence[TrajectoryGroup], tasks: Sequence[Any], renderer: Any, max_length: int,
) -> tuple[list[TrajectoryGroup], list[Any], int]:
    """Leave out, before any advantage exists, every episode with a training example longer than
    ``max_length`` tokens; returns the kept groups, their tasks and the number of episodes left out.

    Why before: dropped after estimation, a group's kept advantages no longer sum to 0, and the
    episodes that run long are mostly failures, so the kept rows would be biased upwards. A group
    left with no episode goes, with its task."""
    kept_groups, dropped = [], 0
    for group in groups:
        kept = tuple(t for t in group.trajectories
                     if all(len(e) <= max_length for e in renderer.build_examples(t)))
        dropped += len(group.trajectories) - len(kept)
        if kept:
            kept_groups.append(group if len(kept) == len(group.trajectories)
                               else group.model_copy(update={"trajectories": kept}))
    present = {g.task_id for g in kept_groups}
    return kept_groups, [t for t in tasks if t.id in present], dropped


def reward_part_metrics(episodes: Sequence[Trajectory]) -> dict[str, float]:
    """Mean of every named reward part (``reward/<part>`` in ``Trajectory.metrics``, unweighted,
    summed over the episode; docs/environments.md, "Reward parts") over the episodes that have it."""
    sums: dict[str, list[float]] = {}
    for t in episodes:
        for key, value in t.reward_parts.items():
            sums.setdefault(f"reward/{key}", []).append(float(value))
    return {key: float(statistics.fmean(values)) for key, values in sorted(sums.items())}


def guide_groups(
    groups: Sequence[TrajectoryGroup], tasks: Sequence[Any], cfg: RLConfig, renderer: Any, seed: int,
) -> tuple[list[TrajectoryGroup], int]:
    """With ``guidance``: the env's expert trajectory joins each group whose samples all failed
    (before advantages: the group then carries signal and still sums to 0). Returns the groups and
    the number guided. A group whose expert episode failed too (or an env without an expert) stays
    unguided and is counted in ``guidance/unsolved`` (the groups needing guidance minus those guided)."""
    if cfg.guidance is None:
        return list(groups), 0
    chosen = needs_guidance(groups, cfg.guidance)
    if not chosen:
        return list(groups), 0
    wanted = {groups[g].task_id for g in chosen}
    guides = expert_episodes(cfg, [t for t in tasks if t.id in wanted], renderer, seed=seed, injection=True)
    return add_guidance(groups, guides, chosen)


def expert_episodes(cfg: RLConfig, tasks: Sequence[Any], renderer: Any, *, seed: int,
                    injection: bool = False) -> dict[str, Trajectory]:
    """The env's expert on ``tasks`` (greedy, on the policy's token path): ``{task_id: trajectory}`` of
    the episodes it solved whose examples fit ``max_length`` (a guide dropped for length after
    advantages would leave its group's failures with negative advantages alone). The runner records
    an expert that raises as a failed episode, so an env without one gives {}."""
    if not tasks:
        return {}
    env, env_options = env_source(cfg.env.name, cfg.env.options, cfg.env.injection if injection else None)
    config = RolloutConfig(**cfg.rollout.settings(temperature=0.0), samples_per_task=1, seed=seed)
    result = run_rollouts_sync(env, list(tasks), "expert", renderer, config, progress=False, env_options=env_options,
                               policy_name="expert")
    return {t.task_id: t for t in result.trajectories
            if t.success and all(len(e) <= cfg.max_length for e in renderer.build_examples(t))}


def starting_probe(cfg: RLConfig, train_tasks: Sequence[Any], renderer: Any) -> list[Any]:
    """Before training, one expert pass over the first train tasks serves two ends: the fixed probe
    set of ``drift/probe_nll`` (``health.probe_tasks`` tasks, as training examples; [] when off or
    when the expert solves none), and with ``guidance`` the check that the env's expert solves a
    task at all, so an env without a working expert fails here instead of never guiding."""
    wanted = max(cfg.health.probe_tasks, 1 if cfg.guidance is not None else 0)
    solved = expert_episodes(cfg, list(train_tasks)[:wanted], renderer, seed=cfg.seed + 31)
    if cfg.guidance is not None and not solved:
        raise ValueError(f"guidance: the expert of env {cfg.env.name!r} did not solve a train task within the rollout "
                         "limits (rollout.max_turns, max_tokens_per_turn); guidance needs an env with a working "
                         "expert_action, or drop the guidance section")
    probe_ids = [t.id for t in list(train_tasks)[: cfg.health.probe_tasks]]
    examples = [e for task_id in probe_ids if task_id in solved for e in renderer.build_examples(solved[task_id])]
    if cfg.health.probe_tasks and not examples:
        log.info("no probe set: the expert of env %r solved none of %d train tasks (drift/probe_nll off)",
                 cfg.env.name, cfg.health.probe_tasks)
    return examples


def kl_in_reward(
    groups: Sequence[TrajectoryGroup], model: torch.nn.Module, reference: torch.nn.Module | None, renderer: Any,
    loss_cfg: PolicyLossConfig, *, pad_token_id: int, micro_batch_size: int, temperature: float,
) -> tuple[list[TrajectoryGroup], float]:
    """Each episode's reward minus ``beta * sum_t kl_t`` over its sampled tokens (PPO-RLHF style),
    taken off its last turn's reward; returns the new groups and the mean penalty per episode."""
    scored = examples_from_groups(groups, renderer)
    if not scored.examples:
        return list(groups), 0.0
    guide = [is_guidance(groups[g].trajectories[i]) for g, i in zip(scored.group_index, scored.trajectory_index)]
    batch = make_batch(scored.examples, pad_token_id=pad_token_id)
    kl = kl_per_token(batch_logprobs(model, batch, micro_batch_size, temperature=temperature),
                      reference_logprobs(model, reference, batch, micro_batch_size, temperature), loss_cfg.kl_estimator)
    per_example = (kl * batch.loss_mask).sum(-1) * loss_cfg.kl_coef  # [E]
    penalty: dict[tuple[int, int], float] = {}
    for e, (g, i) in enumerate(zip(scored.group_index, scored.trajectory_index)):
        if not guide[e]:  # the expert's tokens were not sampled by the policy: no KL estimate on them
            penalty[(g, i)] = penalty.get((g, i), 0.0) + float(per_example[e])
    out = [
        group.model_copy(update={"trajectories": tuple(
            with_reward_offset(t, -penalty.get((g, i), 0.0)) for i, t in enumerate(group.trajectories))})
        for g, group in enumerate(groups)
    ]
    return out, sum(penalty.values()) / max(sum(len(g) for g in groups), 1)


def score_and_estimate(
    groups: Sequence[TrajectoryGroup], tasks: Sequence[Any], cfg: RLConfig, loss_cfg: PolicyLossConfig, *,
    sampler: Any, model: torch.nn.Module, reference: torch.nn.Module | None, renderer: Any, pad_token_id: int,
    temperature: float, seed: int,
) -> tuple[list[TrajectoryGroup], EstimatorResult, float]:
    """The scoring steps the config asks for, in order, then the estimator: ``mc_continuation``
    branches at decision turns (Q(taken) - mean Q(others) in ``Turn.metrics``), KL in the reward
    takes ``beta * KL`` off each episode's last turn, ``info_gain`` scores turns (InfoPO). Returns the
    scored groups, one advantage per turn (with the estimator's and the branching step's metrics) and
    the mean KL penalty per episode (0 without KL in the reward)."""
    groups = list(groups)
    extra: dict[str, float] = {}
    if cfg.advantage.intrinsic == "mc_continuation":
        env, env_options = env_source(cfg.env.name, cfg.env.options, cfg.env.injection)
        groups, mc_stats = score_mc_continuation(
            groups, sampler, renderer, env, env_options, tasks,
            decision_turns=cfg.advantage.mc_decision_turns, k=cfg.advantage.mc_k, m=cfg.advantage.mc_m,
            config=RolloutConfig(**cfg.rollout.settings()), seed=seed,
            reach=cfg.advantage.mc_reach)
        extra = mc_stats.metrics(prefix="mc_")
    kl_penalty = 0.0
    if loss_cfg.kl_coef > 0 and loss_cfg.kl_penalty == "reward":
        groups, kl_penalty = kl_in_reward(groups, model, reference, renderer, loss_cfg, pad_token_id=pad_token_id,
                                          micro_batch_size=cfg.micro_batch_size, temperature=temperature)
    if cfg.advantage.intrinsic == "info_gain":
        groups = score_info_gain(groups, model, renderer, placeholder=cfg.advantage.placeholder, temperature=temperature,
                                 micro_batch_size=cfg.micro_batch_size, pad_token_id=pad_token_id)
    estimated = estimate(cfg.advantage.estimator, groups, cfg.advantage.options)
    return groups, EstimatorResult(estimated.advantages, {**extra, **estimated.metrics}, estimated.weights), kl_penalty


def with_reward_offset(trajectory: Trajectory, offset: float) -> Trajectory:
    """``trajectory`` with ``offset`` added to its last turn's reward and to its episode reward."""
    if not trajectory.turns or offset == 0.0:
        return trajectory
    last = trajectory.turns[-1].model_copy(update={"reward": trajectory.turns[-1].reward + offset})
    return trajectory.model_copy(update={"turns": (*trajectory.turns[:-1], last), "reward": trajectory.reward + offset})


def load_policy(cfg: RLConfig, loss_cfg: PolicyLossConfig, device: torch.device) -> tuple[Any, Any, Any]:
    """(trainable model in eval mode, tokenizer, frozen reference or None)."""
    from tracegym.models import load

    model, tokenizer = load(cfg.model.name, cfg.model.dtype)
    # the policy at step 0: a frozen copy (full fine-tuning, or the SFT adapter merged when RL starts
    # from one); None for a fresh adapter (the base, adapter disabled) or without a KL term
    reference = starting_reference(model, cfg.lora, cfg.model.adapter, device) if loss_cfg.kl_coef > 0 else None
    model = prepare_model(model, cfg.lora, cfg.model.adapter)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if cfg.lora.enabled:
            model.enable_input_require_grads()
    model.to(device).eval()
    if reference is None and loss_cfg.kl_coef > 0 and not is_peft_model(model):
        raise ValueError("kl_coef > 0 needs a reference policy: LoRA (adapter disabled) or full fine-tuning")
    return model, tokenizer, reference


def make_sampler(cfg: RLConfig, model: Any, tokenizer: Any, renderer: Any) -> Any:
    """The rollout engine; one that cannot return the log-probs of its samples is refused."""
    from tracegym.engines import make_engine, require_rl_sampler

    options = dict(cfg.rollout.engine_options)
    if cfg.rollout.engine == "hf":  # holds the trainer's model object: weight sync is free and exact
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        options.setdefault("max_batch_size", cfg.rollout.concurrency)
        options.setdefault("pad_token_id", pad_id)
        sampler = make_engine("hf", model=model, tokenizer=tokenizer, renderer=renderer, **options)
    else:
        sampler = make_engine(cfg.rollout.engine, model=options.pop("model", cfg.model.name), tokenizer=tokenizer,
                              renderer=renderer, **options)
    require_rl_sampler(sampler)
    if sampler.capabilities.weight_sync == "none":
        # a server the recipe cannot update would sample every step after the first from a stale policy
        raise ValueError(f"engine {cfg.rollout.engine!r} cannot take the trainer's weights (weight_sync: none): every "
                         "step after the first would sample from a stale policy; use rollout.engine: hf or vllm")
    return sampler


def evaluate_policy(cfg: RLConfig, sampler: Any, renderer: Any, tasks: Sequence[Any], seed: int) -> dict[str, float]:
    """pass@1 and success rate of the current policy on held-out tasks (as many samples as configured)."""
    from tracegym.eval import summarize

    rollout_cfg = RolloutConfig(
        **cfg.rollout.settings(temperature=cfg.eval.temperature, measure_logprob_gap=False),
        samples_per_task=cfg.eval.samples_per_task, seed=seed,
    )
    env, env_options = env_source(cfg.env.name, cfg.env.options, cfg.env.injection)
    result = run_rollouts_sync(env, tasks, sampler, renderer, rollout_cfg, progress=False,
                               env_options=env_options, policy_name="policy")
    summary = summarize(result.trajectories + result.failed, ks=[1], turns=[cfg.rollout.max_turns], env=cfg.env.name,
                        n_bootstrap=200)  # failed episodes count as unsolved
    return {"eval/pass@1": summary["pass_at"][str(cfg.rollout.max_turns)]["1"], "eval/success_rate": summary["success_rate"],
            "eval/turns": summary["cost"]["turns"], "eval/env_errors": float(result.stats.failed),
            **injection_metrics(result.trajectories + result.failed, "eval/")}


# --- the loop --------------------------------------------------------------------------------------


def train_rl(cfg: RLConfig, resume: bool = False, stop_at_step: int | None = None) -> RLResult:
    """Run RL as ``cfg`` says; ``resume`` continues from the latest intact checkpoint in ``cfg.output_dir``.

    ``stop_at_step`` returns right after that step without saving, as if the process had been killed
    there (tests use it to check that resume reproduces an uninterrupted run exactly).
    """
    from tracegym.envs import make

    if cfg.selfplay is not None:  # proposer / solver self-play: its own flat loop (recipes/selfplay.py)
        from tracegym.recipes.selfplay import train_selfplay

        done = train_selfplay(cfg, resume=resume, stop_at_step=stop_at_step)
        return RLResult(done.run_dir, done.final_dir, done.step, done.history)
    if cfg.roles:  # a team: one LoRA adapter per role on one base (recipes/team.py)
        from tracegym.recipes.team import train_team

        done = train_team(cfg, resume=resume, stop_at_step=stop_at_step)
        return RLResult(done.run_dir, done.final_dir, done.step, done.history)
    run_dir = Path(cfg.output_dir)
    if not resume and list_checkpoints(run_dir):
        raise FileExistsError(f"{run_dir} already holds checkpoints: pass --resume to continue, or pick another output_dir")
    loss_cfg = PolicyLossConfig(**cfg.policy_loss)
    problems = estimator_problems(cfg.advantage.estimator, cfg.advantage.options)
    if problems:  # a bad estimator name or option fails before anything loads
        raise ValueError("; ".join(problems))
    probe = make(cfg.env.name, **cfg.env.options)  # a bad env name/option fails before the model loads
    if cfg.env.injection is not None:  # so does a tool that clashes with the injection's honeypot
        InjectionEnv.from_config(probe, cfg.env.injection).tool_schemas()
    train_tasks = probe.tasks("train", cfg.tasks.train, cfg.tasks.seed)
    test_tasks = probe.tasks("test", cfg.tasks.test, cfg.tasks.seed) if cfg.tasks.test else []
    probe.close()
    dump_config(cfg, run_dir)
    seed_everything(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, reference = load_policy(cfg, loss_cfg, device)
    renderer = make_renderer(cfg, tokenizer)
    sampler = make_sampler(cfg, model, tokenizer, renderer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # the trainer scores under the distribution the engine sampled from (logits / T): ratio 1 at any T
    temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps * cfg.ppo_epochs)

    step, cursor = 0, 0  # cursor: task slots consumed so far (more than steps x tasks_per_step with resampling)
    health_monitor = HealthMonitor.from_config(cfg.health)
    probe = build_probe(starting_probe(cfg, train_tasks, renderer), pad_id)
    # the newest intact checkpoint: a corrupt one is named in a warning and skipped, never silently ignored
    restored = load_latest_intact(run_dir, model, optimizer, scheduler) if resume else None
    if restored is not None:
        saved = restored.state.get("tasks", {})
        if saved.get("seed") != cfg.tasks.seed or saved.get("train") != len(train_tasks):
            raise ValueError(f"{restored.path} was trained on other tasks (seed or count differ); cannot resume on this config")
        step = restored.step
        cursor = int(restored.state.get("task_cursor", step * cfg.tasks_per_step))
        health_monitor.load_state_dict(restored.state.get("health", {}))
        sampler.update_weights(model)
    trainable, total = count_parameters(model)
    logger = MetricsLogger(run_dir, cfg.logging.tensorboard, cfg.logging.wandb, cfg.logging.wandb_project,
                           config=cfg.model_dump(mode="json"), resume_step=step if resume else None)
    history: list[dict[str, Any]] = []
    eval_seed = cfg.seed + 1_000_003
    if step == 0:
        row = {"params/trainable": trainable, "params/total": total, "rollout/temperature": cfg.rollout.temperature,
               "eval/temperature": cfg.eval.temperature}
        if probe is not None:
            row["drift/probe_nll"] = probe_nll(model, probe, cfg.micro_batch_size)
        if test_tasks and cfg.eval.at_start:
            row.update(evaluate_policy(cfg, sampler, renderer, test_tasks, eval_seed))
        history.append(logger.log(0, row))
    progress = ProgressBar(cfg.steps, "rl", enabled=cfg.logging.progress, completed=step)
    gap_model = model if cfg.rollout.measure_logprob_gap else None
    if cfg.save_rollouts:
        (run_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    # where rollouts come from: this loop (local), a rollout thread or Ray actors (docs/scale.md);
    # the policy version is the number of updates applied, so it starts at the step resumed at
    executor = make_executor(cfg, model, tokenizer, renderer, sampler, train_tasks, version=step, gap_model=gap_model)
    if restored is not None:  # the executor's own state (the curriculum's pass-rate estimates)
        executor.load_state_dict(restored.state.get("executor", {}))
    final_dir = None
    try:
        while step < cfg.steps:
            t_start = time.perf_counter()
            # 1. collect: the step's groups from the executor (sampled now, or ahead by a recent policy
            #    version); with resampling, more tasks until enough carry signal
            writer = TrajectoryWriter(run_dir / "rollouts" / f"step_{step + 1:06d}.jsonl") if cfg.save_rollouts else None
            groups, results, advantages, weights, rounds, estimator_metrics = [], [], [], [], 0, []
            sampled: list[TrajectoryGroup] = []  # every episode as sampled (the rows' reward figures)
            dropped_too_long, guided_groups = 0, 0
            stale = False  # sampled by an older policy version (an asynchronous executor ran ahead)
            try:
                while True:
                    batch = executor.next_batch(step, cursor, rounds)
                    tasks, new, result = batch.tasks, batch.groups, batch.result
                    stale = stale or batch.version != step
                    cursor += len(tasks)
                    if writer is not None:
                        writer.write_all(result.trajectories)
                    seed = batch_seed(cfg.seed, step, rounds)
                    # over-long episodes leave their groups before the estimator sees them (their
                    # advantages would not sum to 0 over the rows that train)
                    sampled += new
                    new, tasks, overlong = drop_overlong(new, tasks, renderer, cfg.max_length)
                    dropped_too_long += overlong
                    # groups whose samples all failed get the env's expert trajectory (LUFFY guidance)
                    new, guided = guide_groups(new, tasks, cfg, renderer, seed + 7_919)
                    guided_groups += guided
                    # 2. optional scoring steps (branching, KL in the reward, InfoPO), then one advantage per turn
                    new, estimated, kl_penalty = score_and_estimate(
                        new, tasks, cfg, loss_cfg, sampler=sampler, model=model, reference=reference, renderer=renderer,
                        pad_token_id=pad_id, temperature=temperature, seed=seed + 104_729)
                    groups, results = groups + new, results + [result]
                    advantages += estimated.advantages
                    # per-turn token weights (a tree's 1/|L(n)|), 1 where the estimator gives none
                    weights += estimated.weights or [[[1.0] * len(a) for a in group] for group in estimated.advantages]
                    estimator_metrics.append(estimated.metrics)
                    with_signal = sum(has_signal(a) for a in advantages)
                    if rounds >= cfg.resample_rounds or with_signal >= cfg.tasks_per_step:
                        break
                    rounds += 1
            finally:
                if writer is not None:
                    writer.close()
            metrics: dict[str, Any] = rollout_metrics(sampled, results)
            metrics.update({"time/rollout_s": time.perf_counter() - t_start, "groups/no_signal": float(len(groups) - with_signal),
                            "groups/resample_rounds": float(rounds), **executor.metrics()})
            if loss_cfg.kl_coef > 0 and loss_cfg.kl_penalty == "reward":
                metrics["reward/kl_penalty"] = kl_penalty
            if cfg.guidance is not None:
                metrics["guidance/groups"] = float(guided_groups)
                metrics["guidance/unsolved"] = float(sum(
                    1 for g in groups if not any(t.success for t in g.trajectories)))
            # health: reward spread, groups with signal (of the policy's own episodes: a guide would
            # hide the echo trap), and (on the policy that sampled) prompt/response MI
            metrics.update(group_health(*without_guidance(groups, advantages)))
            if cfg.health.mutual_information:
                t_mi = time.perf_counter()
                metrics.update(mutual_information_proxy(model, groups, pad_token_id=pad_id, max_pairs=cfg.health.mi_max_pairs,
                                                        micro_batch_size=cfg.health.mi_max_pairs, temperature=temperature))
                metrics["time/health_mi_s"] = time.perf_counter() - t_mi
            for key in sorted({k for m in estimator_metrics for k in m}):  # e.g. GiGPO's step-group size, per round
                values = [m[key] for m in estimator_metrics if key in m]
                metrics[f"advantage/{key}"] = sum(values) / len(values)

            # 3. examples: each turn's advantage on the tokens sampled in that turn (mask 0 elsewhere)
            skip = [cfg.skip_uniform_groups and not has_signal(a) for a in advantages]
            data = examples_from_groups(groups, renderer, advantages, weights=weights, max_length=cfg.max_length,
                                        skip_groups=skip)
            metrics.update({"examples/count": float(len(data.examples)), "examples/template_splits": float(data.template_splits),
                            "examples/dropped_too_long": float(data.dropped_too_long),
                            "episodes/dropped_too_long": float(dropped_too_long)})

            # 4. update, then weight sync: the trainer's engine (it calls this very model object, so
            #    this only drops its caches) and the executor's samplers (they copy the new weights)
            t_train = time.perf_counter()
            if data.examples:
                batch = make_batch(data.examples, pad_token_id=pad_id, group_ids=data.group_index,
                                   trajectory_ids=data.trajectory_ids)
                batch = score_batch(model, reference, batch, loss_cfg, micro_batch_size=cfg.micro_batch_size,
                                    temperature=temperature, epochs=cfg.ppo_epochs, top_p=cfg.rollout.top_p, stale=stale)
                if cfg.guidance is not None:  # LUFFY's shaped importance weight on the expert's tokens
                    batch = shape_guidance(batch, guidance_rows(groups, data.group_index, data.trajectory_index),
                                           cfg.guidance.shaping_gamma)
                sample = drift_rows(batch, cfg.health.drift_rows)
                before = trainable_state(model) if cfg.max_policy_drift is not None and sample is not None else None
                metrics.update(policy_update(model, batch, loss_cfg, optimizer, scheduler, epochs=cfg.ppo_epochs,
                                             micro_batch_size=cfg.micro_batch_size, temperature=temperature,
                                             max_grad_norm=cfg.optim.max_grad_norm, micro_batch_tokens=cfg.micro_batch_tokens,
                                             train_mode=cfg.model.gradient_checkpointing))
                # how far the update moved the policy; over max_policy_drift, a shorter step or none
                if before is not None:
                    metrics.update(cap_drift(model, before, sample, max_kl=cfg.max_policy_drift,
                                             micro_batch_size=cfg.micro_batch_size, temperature=temperature))
                elif sample is not None:
                    metrics["drift/kl"] = measure_drift(model, sample, cfg.micro_batch_size, temperature)
                if probe is not None:
                    metrics["drift/probe_nll"] = probe_nll(model, probe, cfg.micro_batch_size)
                sampler.update_weights(model)
                metrics["train/tokens_per_s"] = float(batch.attention_mask.sum()) * cfg.ppo_epochs / max(time.perf_counter() - t_train, 1e-9)
            step += 1
            executor.publish(model, step)  # version = updates so far (a step without examples changes nothing)
            metrics.update({"time/train_s": time.perf_counter() - t_train, "time/step_s": time.perf_counter() - t_start,
                            "rss_mb": process_rss_mb()})

            # 5. evaluate, log, checkpoint
            if test_tasks and ((cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.steps):
                metrics.update(evaluate_policy(cfg, sampler, renderer, test_tasks, eval_seed))
            for line in health_monitor.update(step, metrics):
                log.warning(line)
                print(f"warning: {line}", flush=True)
            if step % cfg.logging.log_every == 0 or step == cfg.steps:
                history.append(logger.log(step, metrics))
            loss_text = f" loss {metrics['train/loss']:.4f}" if "train/loss" in metrics else ""
            progress.update(1, info=f"reward {metrics['reward/mean']:.3f}{loss_text}",
                            tokens=int(sum(t.num_generated_tokens for g in sampled for t in g.trajectories)))
            if stop_at_step is not None and step >= stop_at_step and step < cfg.steps:
                return RLResult(run_dir, None, step, history)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.steps:
                state = {"tasks": {"seed": cfg.tasks.seed, "train": len(train_tasks)}, "task_cursor": cursor,
                         "health": health_monitor.state_dict(),
                         "executor": {"kind": cfg.executor.kind, **executor.state_dict()}}
                save_checkpoint(run_dir, step, model, optimizer, scheduler, state, keep_last=cfg.checkpoint.keep_last)
        final_dir = save_final(model, tokenizer, run_dir, {"base_model": cfg.model.name, "lora": cfg.lora.enabled,
                                                             "renderer": cfg.model.renderer or cfg.model.name,
                                                             "recipe": "rl", "env": cfg.env.name,
                                                             "untrusted_tool_output": cfg.rollout.untrusted_tool_output})
    finally:
        executor.close()
        progress.close()
        logger.close()
    return RLResult(run_dir, final_dir, step, history)
