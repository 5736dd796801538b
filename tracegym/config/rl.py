"""The config of ``tracegym rl`` (single-agent, team and self-play RL) and the sections only it
has: advantages, executors, roles, self-play, health monitors, guidance, and the named presets."""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import Field, model_validator

from tracegym.config._base import _merge_under, _Section
from tracegym.config.shared import (
    CheckpointConfig,
    EnvConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RLEvalConfig,
    RLRolloutConfig,
    TasksConfig,
)


class AdvantageConfig(_Section):
    estimator: str = "grpo"
    """Advantage estimator registered in ``tracegym.algos``: grpo, dr_grpo, rloo, reinforce,
    turn_rloo / turn_grpo (per-turn returns, leave-one-out baseline), gigpo (episode + step groups of
    equal env state), info_gain, mc_continuation (with the scoring step of the same name), tree
    (TreeRL/ARPO advantages and 1/|L(n)| token weights over ``rollout.strategy: tree`` leaves) or a
    plugin's. It returns one advantage per assistant turn of every trajectory."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Options of the estimator, validated by its options model (e.g. ``gamma: 0.9`` for turn_rloo)."""

    intrinsic: str = "none"
    """A scoring pass before the estimator, by its name in ``tracegym.rl.scoring.SCORING_PASSES``
    (``none``: no pass; a plugin module may register its own). The estimator of the same name needs
    its built-in pass: ``info_gain``
    (InfoPO) scores every turn by how much its observation changes the log-prob of the next action
    versus ``placeholder`` (two extra forward passes per turn with a next turn; biased);
    ``mc_continuation`` (VinePPO/C3) branches at decision turns: ``mc_k`` actions (the taken one
    included) x ``mc_m`` continuations each, advantage = Q(taken) - mean Q(others) (unbiased; costly).
    With ``roles:`` it is per-role counterfactual credit (C3): the acting role's message is replaced
    by fresh samples of that role and the rest of the team episode re-run."""

    intrinsic_options: dict[str, Any] = Field(default_factory=dict)
    """Options of a plugin scoring pass, validated by its options model (the built-in passes read
    the keys below)."""

    placeholder: str = "No information found."
    """The neutral observation ``info_gain`` compares each real observation with."""

    mc_k: int = Field(4, ge=2)
    """``mc_continuation``: actions per decision turn, the taken one included."""

    mc_m: int = Field(2, ge=1)
    """``mc_continuation``: continuations played to the end per action."""

    mc_decision_turns: Literal["all", "first"] | list[int] = "all"
    """``mc_continuation``: which turns to branch at (turn indices, 0-based)."""

    mc_reach: Literal["auto", "snapshot", "replay"] = "auto"
    """``mc_continuation``: how a branch reaches its turn: ``Env.snapshot()/restore()`` or replaying
    the recorded actions (checked); ``auto`` uses snapshots where the env supports them."""

    @model_validator(mode="after")
    def _intrinsic_for_its_estimator(self) -> "AdvantageConfig":
        for name in ("info_gain", "mc_continuation"):
            if self.estimator == name and self.intrinsic != name:
                raise ValueError(f"advantage.estimator {name} needs the scores of advantage.intrinsic: {name}")
        return self


class ExecutorConfig(_Section):
    """Where rollouts run relative to the update (docs/scale.md). ``local``: in the trainer's process
    and thread, one after the other (the default; exact resume). ``threads``: a rollout thread with its
    own copy of the policy samples the next batches while the trainer updates. ``ray``: Ray actors
    (``rollout_workers`` of them, each with its own engine and envs) sample; the trainer publishes
    weights to a versioned parameter store. Every trajectory records the policy version that sampled
    it; a batch more than ``max_staleness`` versions behind the trainer is dropped (counted)."""

    kind: Literal["local", "threads", "ray"] = "local"
    """``local``, ``threads`` or ``ray``."""

    max_staleness: int = Field(1, ge=0)
    """Versions a batch may lag the trainer (0: sampled by the weights being updated, i.e. synchronous;
    1: one batch sampled while the previous one trains). Ignored by ``local`` (always 0)."""

    rollout_workers: int = Field(2, gt=0)
    """``ray``: rollout actors (each one CPU, or the share ``worker_cpus`` says)."""

    worker_cpus: float = Field(1.0, gt=0)
    """``ray``: CPUs reserved per rollout actor; its torch/OpenMP threads are set from it (two
    unpinned torch processes on 2 cores were measured to slow each other 10-20x)."""

    trainer_threads: int | None = Field(None, gt=0)
    """Torch threads of the trainer (None: the CPUs not given to rollout workers or the rollout thread)."""

    ray_address: str | None = None
    """``ray``: an existing cluster to connect to (``ray.init(address=...)``); None starts a local one."""

    batch_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for a batch of rollouts: a worker slower than this (a straggler) is restarted and
    its batch sampled again elsewhere; the trainer never waits forever."""

    max_worker_restarts: int = Field(3, ge=0)
    """``ray``: restarts of dead or stalled rollout actors before the run fails."""


class RoleConfig(_Section):
    """One role of a team env (``roles:``): which LoRA adapter plays it and whether it trains."""

    adapter: str | None = None
    """The LoRA adapter that samples and trains this role (None: the role's own name). Roles that
    name the same adapter share its weights and its optimizer (one shared policy)."""

    init: str | None = None
    """A saved adapter folder this role's adapter starts from (e.g. an SFT run's ``final``); None:
    ``model.adapter``, else a fresh adapter."""

    train: bool = True
    """False: the role samples with its adapter but is never updated (a frozen partner)."""


class SelfPlayConfig(_Section):
    """Proposer / solver self-play (``roles: {proposer, solver}``): the proposer plays ``env`` (an env
    whose episodes propose tasks, e.g. ``calc_proposer``), the solver plays ``solver_env`` on them."""

    solver_env: str = "calculator"
    """The env the proposed tasks are played in."""

    solver_env_options: dict[str, Any] = Field(default_factory=dict)
    """Options of ``solver_env``."""

    solver_attempts: int = Field(4, ge=2)
    """Solver episodes per valid proposal: its pass rate p sets the proposer's reward 4p(1-p)."""


class HealthConfig(_Section):
    """RL health monitors (docs/algorithms.md, "Health monitors")."""

    mutual_information: bool = True
    """Compute ``health/mi`` every step: RAGEN-2's prompt/response mutual-information proxy, which
    costs about ``mi_max_pairs`` prompt passes and ``mi_max_pairs``^2 short response passes, no
    gradient. Off: no MI and no MI warning."""

    mi_max_pairs: int = Field(8, ge=2)
    """At most this many groups (one first-turn pair each) enter the MI proxy; the proxy is at most
    log of that many pairs (log 8 = 2.08 nats)."""

    min_reward_std: float | None = Field(0.05, ge=0.0)
    """Warn when ``health/reward_std`` (mean within-group population std of episode rewards) stays
    below this for ``patience`` steps: groups agree on their reward, advantages vanish (RAGEN's
    echo trap). 0.05 suits 0/1 rewards, whose group std is sqrt(p (1 - p)); None: no warning."""

    min_mutual_information: float | None = 0.05
    """Warn when ``health/mi`` (nats) stays below this for ``patience`` steps: responses no longer
    depend on the task (RAGEN-2's template collapse). None: no warning."""

    patience: int = Field(3, ge=1)
    """Consecutive steps below a threshold before the warning; once per streak."""

    drift_rows: int = Field(8, ge=0)
    """Rows of each step's batch on which ``drift/kl`` (KL(pi_old || pi_new) per sampled token, k3
    estimator) is measured after the update: ``ceil(drift_rows / micro_batch_size)`` no-grad
    forward passes. 0: off (``max_policy_drift`` needs it)."""

    probe_tasks: int = Field(8, ge=0)
    """Train tasks whose expert trajectories (the env's scripted expert, recorded once at the start)
    form the fixed probe set of ``drift/probe_nll``: mean NLL per assistant token after every update,
    which rises when RL forgets what SFT taught. 0 (or an env without an expert): off."""


class GuidanceConfig(_Section):
    """Off-policy guidance (LUFFY) for all-failure groups: one expert trajectory joins each group
    whose samples all failed (or every group), before advantages, with LUFFY's shaped importance weight."""

    groups: Literal["all_failed", "every"] = "all_failed"
    """Which groups get the expert trajectory: ``all_failed`` (only groups without a success: they
    carry no signal otherwise) or ``every`` (LUFFY's own mixed-policy setting, one off-policy trace
    in every group: where the policy is unsure, the expert's decision gets a positive advantage in
    its own context, which anchors decisions that an on-policy update would shift everywhere)."""

    source: Literal["expert"] = "expert"
    """Where the guidance trajectory comes from: ``expert`` (the env's scripted ``expert_action``,
    recorded on the policy's token path). An env whose expert cannot solve its tasks is refused at
    the start (one expert episode is played before training)."""

    max_groups_per_step: int | None = Field(None, gt=0)
    """At most this many groups get guidance per step (None: every group that ``groups`` picks)."""

    shaping_gamma: float = Field(0.1, gt=0)
    """LUFFY's policy shaping ``f(x) = x / (x + gamma)``: smaller gamma weighs unlikely tokens more."""


class ExpertReplayConfig(_Section):
    """PPO-ptx's mix (Ouyang et al. 2022) with the env's expert in place of pretraining data: every
    step adds ``coef`` x the mean NLL per assistant token of ``per_step`` expert traces to the policy
    loss, in a fixed rotation through the traces of the first ``tasks`` train tasks. It holds the
    decisions the step's own samples do not reach: a policy-gradient (or KL) term acts only on the
    contexts the batch sampled, while one LoRA update moves a decision in every context that shares
    its features (docs/algorithms.md, "Why RL lost the strong start")."""

    coef: float = Field(0.1, gt=0)
    """Weight of the expert NLL (mean per assistant token) next to the policy loss."""

    tasks: int = Field(64, gt=0)
    """Train tasks whose expert traces (those the expert solves, within ``max_length``) form the pool."""

    per_step: int = Field(8, gt=0)
    """Expert traces per optimizer step, taken in order through the pool and around (step k uses
    traces ``k * per_step ...``: a resumed run replays what an uninterrupted one would)."""

    policy_gradient: bool = True
    """False: the ablation that trains on the replay term alone (continued SFT on the expert under the
    RL stage's optimizer, schedule and steps; the step's groups are still sampled, scored and logged,
    and their loss is not computed). It separates what replay's pull does from what RL adds to it."""


DEFAULT_RUBRIC = (
    "Score how well the agent accomplished the user's task. 1: the task is fully and correctly done, "
    "with tool calls that make sense; 0.5: partly done, or done with clear mistakes along the way; "
    "0: not done, wrong, or the agent gave up or made up results."
)


class JudgeConfig(_Section):
    """``reward.judge``: the judge model and how its score joins the reward."""

    base_url: str
    """The judge's OpenAI-compatible root, ``/v1`` included (e.g. ``http://127.0.0.1:8001/v1``)."""

    model: str
    """The model name sent in each request."""

    api_key_env: str | None = None
    """Environment variable holding the judge's API key (None: no key; it never reaches a log)."""

    mode: Literal["rubric", "ranking"] = "rubric"
    """``rubric``: each episode alone; ``ranking``: a group's episodes together, scored relative to each other."""

    rubric: str = DEFAULT_RUBRIC
    """What a good episode is, in words the judge reads."""

    weight: float = Field(1.0, ge=0.0)
    """Weight of the judge's score in the reward."""

    verifiable_weight: float = Field(1.0, ge=0.0)
    """Weight of the env's (verifiable) reward; 0 trains on the judge alone."""

    position_bias: bool = True
    """``ranking``: judge each group a second time in a shuffled order (twice the cost): averages out,
    and measures, the judge's preference for positions."""

    temperature: float = Field(0.0, ge=0.0)
    """The judge's sampling temperature (0: its most likely verdict, and a cache that holds)."""

    max_tokens: int = Field(512, gt=0)
    """The judge's reply budget (a reply cut off before its JSON is a parse failure)."""

    timeout_s: float = Field(120.0, gt=0)
    """Per-request timeout."""

    max_retries: int = Field(2, ge=0)
    """Retries of a request that failed in transit or with 429/5xx (then it counts in ``judge/errors``)."""

    concurrency: int = Field(8, gt=0)
    """Judge requests in flight at once."""

    max_transcript_chars: int = Field(6_000, gt=200)
    """Characters of one episode's transcript the judge sees (the middle is cut, and says so)."""

    cache: bool = True
    """Reuse the reply to an identical request (in memory and in the run's ``judge_cache.jsonl``)."""

    on_failure: Literal["drop_group", "stop"] = "drop_group"
    """A group the judge could not score (an unparsed reply, a failed request): ``drop_group`` leaves
    it out of the step (counted in ``judge/dropped_groups``), ``stop`` ends the run with the reason."""


class RewardConfig(_Section):
    """``reward``: rewards beyond the env's verifiable one."""

    judge: JudgeConfig | None = None
    """An LLM judge's score joins the env's reward by weight (``tracegym.rl.judge``; docs/algorithms.md,
    "LLM-judge rewards"). None: the env's reward alone."""


class RLConfig(_Section):
    """Reinforcement learning in an environment (``tracegym rl``): sample groups, score, update."""

    plugins: list[str] = Field(default_factory=list)
    """Python modules imported before this config is validated (a module name, or a ``.py`` path
    relative to the config file): they register envs, losses and estimators (``--plugin`` adds more)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model; set ``model.adapter`` to start from an SFT adapter (cold start)."""

    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapter or full fine-tuning."""

    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule."""

    env: EnvConfig = Field(default_factory=EnvConfig)
    """The environment and its options."""

    tasks: TasksConfig = Field(default_factory=TasksConfig)
    """How many train/test tasks are drawn, and with which seed."""

    tasks_per_step: int = Field(8, gt=0)
    """Distinct tasks sampled per optimizer step (prompts per batch)."""

    group_size: int = Field(8, gt=0)
    """Samples per task (the group that group-relative advantages compare)."""

    rollout: RLRolloutConfig = Field(default_factory=RLRolloutConfig)
    """Sampling and episode limits during training."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """How episode rewards become advantages."""

    policy_loss: dict[str, Any] = Field(default_factory=dict)
    """The policy loss, validated by ``tracegym.algos.config.PolicyLossConfig`` before anything loads:
    the common keys ``loss`` (ppo_clip, gspo, policy_gradient, decoupled_ppo or a plugin's), ``aggregation``
    (token_mean, sequence_mean, sequence_sum, fixed_length_sum), ``fixed_length``, ``kl_coef`` (KL to
    the reference policy, the policy at step 0: with ``model.adapter`` the SFT model; 0 skips the
    reference model), ``kl_estimator``, ``kl_penalty``,
    ``entropy_coef``, ``tis_cap``, ``log_ratio_limit``, plus the chosen loss's own options (ppo_clip:
    ``clip_eps_low``, ``clip_eps_high``, ``dual_clip_c``, ``entropy_clip*``; gspo: clip ranges;
    decoupled_ppo: ppo_clip's and ``behav_weight_cap``, ``behav_weight_mode``)."""

    preset: Literal["grpo", "dr_grpo", "dapo", "gspo"] | None = None
    """Named method whose settings differ from the defaults; keys you set yourself win over it.
    ``grpo``: GRPO advantages, PPO-clip, seq-mean-token-mean aggregation (the paper's form).
    ``dr_grpo``: Dr. GRPO advantages (no std) and a constant normaliser (``fixed_length_sum`` with
    the episode token budget). ``dapo``: clip-higher 0.2/0.28, token-mean aggregation, dynamic sampling
    (groups without signal dropped and replaced, ``resample_rounds: 2``). ``gspo``: the sequence-level
    ratio loss with clip ranges 3e-4/4e-4 and sequence-mean aggregation."""

    skip_uniform_groups: bool = True
    """Drop groups whose advantages are all zero (equal rewards: no learning signal, only cost)."""

    resample_rounds: int = Field(0, ge=0)
    """Dynamic sampling (DAPO): while fewer than ``tasks_per_step`` groups carry signal, sample groups
    of further tasks, at most this many extra rounds per step. 0: off."""

    ppo_epochs: int = Field(1, gt=0)
    """Optimizer passes K over each batch of rollouts (K > 1 makes the update off-policy; clipping applies)."""

    micro_batch_size: int = Field(4, gt=0)
    """Sequences per forward/backward pass; gradients accumulate over the whole batch."""

    micro_batch_tokens: int | None = Field(None, gt=0)
    """Cut the update's micro-batches by computed tokens instead of ``micro_batch_size`` rows: a
    prefix the rows share runs once (docs/algorithms.md, "Log-probs"), so a group's samples of one
    prompt pack many to a part at the memory of a few unshared rows. A part costs ``P + rows x
    (longest - P)`` tokens (P: the shared prefix); None: ``micro_batch_size`` rows per part."""

    steps: int = Field(100, gt=0)
    """Optimizer rounds (each: rollouts, advantages, ``ppo_epochs`` updates, weight sync)."""

    max_length: int = Field(4096, gt=0)
    """Longest training sequence in tokens; longer episodes are dropped from the update and counted."""

    eval: RLEvalConfig = Field(default_factory=RLEvalConfig)
    """Periodic evaluation on held-out tasks."""

    seed: int = 0
    """Seed for Python, NumPy and torch RNGs and task order."""

    output_dir: str = "runs/rl"
    """Run directory: config.yaml, metrics.jsonl, rollouts, tensorboard/, checkpoints/, final/."""

    save_rollouts: bool = True
    """Write every training trajectory to ``<output_dir>/rollouts/step_<n>.jsonl``."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Periodic resumable checkpoints."""

    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics sinks and the progress bar."""

    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    """Where rollouts run: in the trainer's loop (``local``), a rollout thread or Ray actors, with
    bounded staleness (docs/scale.md)."""

    roles: dict[str, RoleConfig] = Field(default_factory=dict)
    """Team training (docs/multi_lora.md): role -> its LoRA adapter. With a team env (``logic_grid``,
    ``calc_relay``) every role's turns are sampled in the same batches, each row with its role's
    adapter, and each adapter is updated with its own optimizer; empty: one single-agent policy. Per
    role: ``adapter`` (default the role's name; roles naming one adapter share it), ``init`` (an
    adapter folder to start from; default ``model.adapter``), ``train`` (false: a frozen partner)."""

    selfplay: SelfPlayConfig | None = None
    """Proposer / solver self-play (needs ``roles`` with ``proposer`` and ``solver``)."""

    health: HealthConfig = Field(default_factory=HealthConfig)
    """RL health monitors logged every step (``health/*``, ``drift/*``) and their warnings
    (docs/algorithms.md, "Health monitors")."""

    max_policy_drift: float | None = Field(None, gt=0)
    """Trust region of one update: when ``drift/kl`` (KL(pi_old || pi_new) per sampled token on
    ``health.drift_rows`` rows) exceeds it, the step is shrunk by halves (TRPO's backtracking line
    search) or undone. None: no cap (the drift is still measured)."""

    guidance: GuidanceConfig | None = None
    """Off-policy guidance (LUFFY) for groups whose samples all failed: the env's expert trajectory
    of the task joins the group before advantages, with LUFFY's shaped importance weight. None: off."""

    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Rewards beyond the env's own: ``reward.judge`` (an LLM judge through an OpenAI-compatible endpoint)."""

    expert_replay: ExpertReplayConfig | None = None
    """An NLL term on the env's expert traces in every policy update (PPO-ptx's mix; ``{}`` for the
    defaults): keeps the decisions the step's samples do not reach. It joins the update of the step's
    samples (a step with no examples to train, e.g. every group uniform and skipped, takes no step).
    Single-agent runs; None: off."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("preset"):
            return data
        preset = preset_settings(str(data["preset"]), data)
        return _merge_under(preset, data) if preset is not None else data

    @model_validator(mode="after")
    def _check(self) -> "RLConfig":
        if self.model.adapter and not self.lora.enabled:
            raise ValueError("model.adapter is set but lora.enabled is false: an adapter needs LoRA training")
        if self.rollout.context.policy == "summarize" and (self.rollout.strategy == "tree"
                                                           or self.advantage.intrinsic == "mc_continuation"):
            raise ValueError("rollout.context summarize: tree rollouts and mc_continuation replay prefixes turn by "
                             "turn, which summary turns break; use full, window or observation_masking with them")
        if self.roles or self.selfplay is not None:
            if not self.lora.enabled:
                raise ValueError("roles: a team trains one LoRA adapter per role; set lora.enabled: true")
            if self.executor.kind != "local" or self.rollout.strategy != "chains" or self.resample_rounds \
                    or self.advantage.intrinsic not in ("none", "mc_continuation") or (self.selfplay and self.advantage.intrinsic != "none"):
                raise ValueError("roles: team training runs with executor.kind local, rollout.strategy chains, no "
                                 "resample_rounds, and advantage.intrinsic none or (teams) mc_continuation")
            if self.rollout.engine not in ("hf", "vllm"):
                raise ValueError("roles: rollout.engine must be hf or vllm (engines that sample per-row LoRA adapters)")
            if self.roles and not any(role.train for role in self.roles.values()):
                raise ValueError("roles: at least one role must train (train: true)")
        if self.max_policy_drift is not None and self.health.drift_rows == 0:
            raise ValueError("max_policy_drift measures the drift on health.drift_rows rows; set drift_rows > 0")
        if self.reward.judge is not None and (self.roles or self.selfplay is not None):
            raise ValueError("reward.judge: judged rewards are single-agent RL only; drop it for roles or selfplay")
        if self.expert_replay is not None and (self.roles or self.selfplay is not None):
            raise ValueError("expert_replay: the env's expert plays single-agent episodes; drop it for roles or selfplay")
        if self.guidance is not None and (self.roles or self.selfplay is not None or self.rollout.strategy != "chains"):
            raise ValueError("guidance: an expert trajectory joins a group of independent chains; it needs "
                             "rollout.strategy: chains and a single-agent run (no roles or selfplay)")
        curriculum = self.tasks.curriculum is not None and self.tasks.curriculum.enabled
        if curriculum and self.executor.kind != "local":
            raise ValueError(f"tasks.curriculum needs executor.kind: local (got {self.executor.kind})")
        if curriculum and (self.roles or self.selfplay is not None):
            raise ValueError("tasks.curriculum: team and self-play training keep the seeded task order; drop the section")
        if self.selfplay is not None and set(self.roles) != {"proposer", "solver"}:
            raise ValueError(f"selfplay needs roles: {{proposer, solver}}, got {sorted(self.roles)}")
        if self.executor.kind != "local":
            # These steps sample from the policy inside the trainer's step; a remote or concurrent
            # sampler cannot serve them there.
            if self.resample_rounds:
                raise ValueError(f"resample_rounds needs executor.kind: local (got {self.executor.kind})")
            if self.rollout.strategy != "chains" or self.advantage.intrinsic == "mc_continuation":
                raise ValueError(f"tree rollouts and mc_continuation need executor.kind: local (got {self.executor.kind})")
            if self.rollout.engine != "hf":
                raise ValueError(f"executor.kind {self.executor.kind} builds an hf engine per worker; rollout.engine must be hf")
        return self


def preset_settings(name: str, data: Mapping[str, Any]) -> dict[str, Any] | None:
    """The settings a named preset puts under the user's own (None for an unknown name, which the
    ``preset`` field then reports with the allowed names)."""
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    budget = rollout.get("max_tokens_per_episode") or (
        int(rollout.get("max_tokens_per_turn", 256)) * int(rollout.get("max_turns", 4))
    )
    presets: dict[str, dict[str, Any]] = {
        "grpo": {"advantage": {"estimator": "grpo"}, "policy_loss": {"loss": "ppo_clip", "aggregation": "sequence_mean"}},
        "dr_grpo": {
            "advantage": {"estimator": "dr_grpo"},
            "policy_loss": {"loss": "ppo_clip", "aggregation": "fixed_length_sum", "fixed_length": budget},
        },
        "dapo": {
            "advantage": {"estimator": "grpo"},
            "policy_loss": {"loss": "ppo_clip", "clip_eps_low": 0.2, "clip_eps_high": 0.28, "aggregation": "token_mean"},
            "skip_uniform_groups": True,
            "resample_rounds": 2,
        },
        "gspo": {
            "advantage": {"estimator": "grpo"},
            "policy_loss": {"loss": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "aggregation": "sequence_mean"},
        },
    }
    return presets.get(name)
