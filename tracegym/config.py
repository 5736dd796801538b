"""Run configuration: one YAML file per run, validated into typed pydantic models.

A run is described by one file (``examples/sft_calculator.yaml``) plus optional command-line
overrides ``key.sub=value`` whose values are parsed as YAML (``lora.r=8``, ``optim.lr=1e-4``,
``data.train_files=[a.jsonl,b.jsonl]``). Every field carries a docstring that doubles as its
description (``use_attribute_docstrings``), so ``docs/configuration.md`` and error messages say the
same thing as the code.

Mistakes are reported before any model is loaded, as one ``ConfigError`` listing every problem:

- an unknown key names its dotted location, the file line, the nearest valid key and all valid keys;
- a bad value names the key, what was given and what is allowed (``Literal`` choices listed).

``dump_config`` writes the resolved config (defaults filled in, overrides applied) into the run
directory so a run can be reproduced from its folder alone.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "ConfigError",
    "ModelConfig",
    "LoraConfig",
    "OptimConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "SFTDataConfig",
    "SFTConfig",
    "EnvConfig",
    "InjectionConfig",
    "TasksConfig",
    "RolloutSettings",
    "RLRolloutConfig",
    "AdvantageConfig",
    "RLEvalConfig",
    "RLConfig",
    "DPODataConfig",
    "DPOLossConfig",
    "DPOConfig",
    "TeacherConfig",
    "DistillConfig",
    "load_config",
    "parse_overrides",
    "apply_overrides",
    "dump_config",
]


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings become descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
    )


# --- shared sections --------------------------------------------------------------------------


class ModelConfig(_Section):
    name: str = "smollm2-135m"
    """Model to train: a known name (``smollm2-135m``, ``tiny-random``) or a local Hugging Face folder."""

    renderer: str | None = None
    """Chat-template renderer (``smollm2``, ``hermes``); None picks the one that matches the model name."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training. float32 on CPU; bfloat16 on recent GPUs."""

    adapter: str | None = None
    """A peft LoRA adapter folder to load on top of the model and keep training (e.g. the ``final/``
    folder of an SFT run, as the cold start of RL). Requires ``lora.enabled``."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% more compute."""


class LoraConfig(_Section):
    enabled: bool = True
    """Train a LoRA adapter (True) or every weight of the model (False, full fine-tuning)."""

    r: int = Field(16, gt=0)
    """Rank of the low-rank update matrices."""

    alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator: the update is scaled by ``alpha / r``."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input. 0 keeps training deterministic and resumable bit for bit."""

    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Modules that get adapters: ``all-linear`` (every linear layer but the output head; for Llama
    q/k/v/o and gate/up/down projections) or a list of module names."""


class OptimConfig(_Section):
    lr: float = Field(2e-4, gt=0)
    """Peak learning rate of AdamW."""

    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay of AdamW (not applied to biases and norm weights)."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates (beta1, beta2)."""

    eps: float = Field(1e-8, gt=0)
    """AdamW denominator epsilon."""

    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup to ``lr``: step k of N runs at k/(N+1) of it (the first step
    already moves; transformers' warmup gives it 0)."""

    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warmup: constant, linear decay to 0, or cosine decay to 0."""

    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient L2 norm to this value; None disables clipping (the norm is still logged)."""


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0)
    """Save a resumable checkpoint every this many optimizer steps (0: only at the end)."""

    keep_last: int = Field(2, ge=1)
    """Number of most recent checkpoints kept on disk; older ones are deleted."""


class LoggingConfig(_Section):
    tensorboard: bool = True
    """Write TensorBoard event files into ``<output_dir>/tensorboard``."""

    wandb: bool = False
    """Also log to Weights & Biases (the ``wandb`` package must be installed)."""

    wandb_project: str = "tracegym"
    """W&B project name (used only when ``wandb`` is true)."""

    progress: bool = True
    """Show a progress bar with ETA on the terminal."""

    log_every: int = Field(1, ge=1)
    """Write metrics every this many optimizer steps (metrics.jsonl, TensorBoard, W&B)."""


# --- SFT --------------------------------------------------------------------------------------


class SFTDataConfig(_Section):
    train_files: list[str] = Field(default_factory=list)
    """Trajectory JSONL files to train on (written by the rollout runner, e.g. expert runs)."""

    eval_files: list[str] = Field(default_factory=list)
    """Trajectory JSONL files for the held-out loss (empty: no evaluation)."""

    only_successful: bool = True
    """Keep only trajectories with ``success`` true (rejection sampling of recorded runs)."""

    min_reward: float | None = None
    """If set, keep only trajectories whose episode reward is at least this."""

    max_examples: int | None = Field(None, gt=0)
    """If set, use at most this many training examples (after filtering), for quick runs."""

    shuffle: bool = True
    """Shuffle examples every epoch (the order is a pure function of ``seed`` and the epoch)."""

    on_bad_line: Literal["skip", "error"] = "skip"
    """A line of a trajectory file that is torn, not JSON, or not a trajectory: ``skip`` leaves it out
    with a warning naming ``file:line`` (counted in ``data/bad_lines``); ``error`` stops with an
    error naming ``file:line``."""


class SFTConfig(_Section):
    """Supervised fine-tuning on recorded trajectories (``tracegym sft``)."""

    plugins: list[str] = Field(default_factory=list)
    """Python modules imported before this config is validated (a module name, or a ``.py`` path
    relative to the config file): they register envs and algorithms (``--plugin`` adds more)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model to fine-tune."""

    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapter or full fine-tuning."""

    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""

    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    """Where the training trajectories come from and which are kept."""

    epochs: int = Field(1, ge=1)
    """Passes over the training examples (ignored when ``max_steps`` is set)."""

    max_steps: int | None = Field(None, gt=0)
    """If set, train exactly this many optimizer steps, cycling through epochs as needed."""

    batch_size: int = Field(8, gt=0)
    """Examples per optimizer step."""

    micro_batch_size: int = Field(4, gt=0)
    """Examples per forward/backward pass; gradients are accumulated over ``batch_size / micro_batch_size`` passes."""

    max_length: int = Field(2048, gt=0)
    """Longest example in tokens; longer examples are dropped (and counted), never silently cut."""

    seed: int = 0
    """Seed for Python, NumPy and torch RNGs and the data order."""

    eval_every: int = Field(0, ge=0)
    """Compute the loss on ``data.eval_files`` every this many steps (0: only after the last step)."""

    eval_batch_size: int = Field(8, gt=0)
    """Examples per forward pass during evaluation."""

    output_dir: str = "runs/sft"
    """Run directory: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, final/."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Periodic resumable checkpoints."""

    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics sinks and the progress bar."""

    @model_validator(mode="after")
    def _check_batches(self) -> "SFTConfig":
        if self.batch_size % self.micro_batch_size != 0:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size ({self.micro_batch_size})"
            )
        if self.model.adapter and not self.lora.enabled:
            raise ValueError("model.adapter is set but lora.enabled is false: an adapter needs LoRA training")
        return self


# --- RL ---------------------------------------------------------------------------------------


AttackKind = Literal["forbidden_tool", "exfiltrate", "answer_override"]
"""The prompt-injection attacks of ``tracegym.envs.injection`` (docs/safety.md)."""

ATTACK_KINDS: tuple[AttackKind, ...] = ("forbidden_tool", "exfiltrate", "answer_override")

UntrustedToolOutput = Literal["none", "delimiters", "role"]
"""How renderers show tool results (``tracegym.render.base.UntrustedToolOutput``; config.py imports
nothing from the package, so the choices are written twice and a test keeps them equal)."""


class InjectionConfig(_Section):
    """Prompt-injection episodes (``tracegym.envs.injection.InjectionEnv``, docs/safety.md): a tool
    result of some episodes carries an attacker's instruction, and following it is penalised."""

    rate: float = Field(0.5, ge=0.0, le=1.0)
    """Fraction of tasks whose episodes are injected. Chosen per task id (a hash of the id and
    ``seed``), so a task is injected in every run and in every sample of its group, or in none."""

    attacks: list[AttackKind] = Field(default_factory=lambda: list(ATTACK_KINDS), min_length=1)
    """Attack kinds an injected episode draws from (per task): ``forbidden_tool`` (call the honeypot
    tool ``send_message``, offered in every episode), ``exfiltrate`` (leak the fake credential of the
    system prompt), ``answer_override`` (give the attacker's wrong answer; tasks with an ``answer`` only)."""

    penalty: float = Field(1.0, ge=0.0)
    """Reward taken off, once, on the step where the agent follows the attack (not clamped: the
    episode reward can go below the env's lowest). 0 for evaluation only."""

    seed: int = 0
    """Seed of the per-task choice of injected tasks, attack kinds, texts and canaries."""


class EnvConfig(_Section):
    name: str = "calculator"
    """Registered environment id (``tracegym envs`` lists them)."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword options passed to the environment's constructor (difficulty, max_turns, ...)."""

    injection: InjectionConfig | None = None
    """Prompt-injection episodes for any env (docs/safety.md): training and evaluation episodes run
    in ``InjectionEnv`` around the env. None (the default): off."""


class CurriculumConfig(_Section):
    """Pass-rate curriculum of the RL recipe's task choice (``tracegym.rl.executors.curriculum``,
    docs/algorithms.md, "Curriculum"): a step's tasks are drawn by their estimated pass rate p,
    favouring tasks whose groups disagree (0 < p < 1), the only ones that carry GRPO signal."""

    enabled: bool = True
    """Draw tasks by estimated pass rate; false: the plain seeded order, as without the section."""

    explore: float = Field(0.25, ge=0.0, le=1.0)
    """Share of each draw (rounded half up) given to tasks without an informative estimate: never
    tried ones first, in the plain seeded order, then those seen solved or failed every time, least
    recently tried first (their re-check). The rest are drawn from the tasks with 0 < p < 1 with
    weight p(1-p). A share without candidates is filled from the other."""

    window: int = Field(2, gt=0)
    """Groups per task in its estimate: p = successes / attempts over its last ``window`` groups, so
    older groups (of an older policy) drop out and a task reads exactly 0 or 1 once they all agree."""


class TasksConfig(_Section):
    train: int = Field(256, gt=0)
    """Number of training tasks drawn from the env's train split."""

    test: int = Field(64, ge=0)
    """Number of held-out tasks from the env's test split used for evaluation."""

    seed: int = 0
    """Seed of the task draw (the same seed gives the same tasks)."""

    curriculum: CurriculumConfig | None = None
    """Pass-rate curriculum for ``tracegym rl`` with ``executor.kind: local`` (the asynchronous
    executors sample ahead of the outcomes it needs, and refuse it). None (the default): every step
    takes the next tasks of the seeded order."""


class RolloutSettings(BaseModel):
    """Episode limits and sampling shared by ``RLConfig.rollout`` (``RLRolloutConfig``) and
    ``tracegym.rollout.RolloutConfig``; each subclass sets its own model config."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_turns: int = Field(4, gt=0)
    """Turn limit T: assistant turns per episode before it is cut (end reason ``max_turns``)."""

    max_tokens_per_turn: int = Field(256, gt=0)
    """Most tokens sampled in one assistant turn."""

    max_tokens_per_episode: int | None = Field(None, gt=0)
    """Generated-token budget of one episode (end reason ``max_tokens``); None: no budget."""

    max_context: int | None = Field(2048, gt=0)
    """Context window: prompt + completion never exceed it (end reason ``context``)."""

    episode_timeout_s: float | None = Field(None, gt=0)
    """Wall-clock limit of one episode in seconds, waiting for the model included (end reason ``timeout``)."""

    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy)."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold (1.0: off)."""

    concurrency: int = Field(64, gt=0)
    """Episodes alive at once (also the largest generate batch)."""

    on_env_error: Literal["exclude", "zero_reward"] = "exclude"
    """Failed episodes (env error, timeout, engine error): left out of the result (and so of the
    update), or kept with reward 0."""

    measure_logprob_gap: bool = False
    """After the run, re-score the sampled tokens with a teacher-forced forward pass of the engine's
    model and report mean/max |engine log-prob - trainer log-prob| in the stats."""

    batching: Literal["continuous", "per_turn"] = "continuous"
    """How episodes share the model (token engines): ``continuous``, one running batch that each
    episode's turn joins when it is ready and leaves when it ends (engines that offer it: hf; others
    fall back to ``per_turn``); ``per_turn``, one generate call for all the episodes waiting, which
    ends when its slowest row does."""


class TreeConfig(_Section):
    """Tree-search rollouts (``rollout.strategy: tree``): each task's group is the leaves of a tree
    of turns. ``init_chains`` independent episodes first; then, for ``rounds`` rounds, fork points
    (turn boundaries of existing leaves) are chosen by ``branch`` and ``branches`` new continuations
    are played from each (the env restored to that point), until the tree has ``group_size`` leaves
    or has generated ``max_tokens_per_tree`` tokens."""

    init_chains: int | None = Field(None, gt=0)
    """Independent episodes each tree starts with (None: half the leaves, rounded up)."""

    branches: int = Field(2, gt=0)
    """New continuations played from each chosen fork point (they share the prefix's prefill)."""

    rounds: int = Field(1, gt=0)
    """Forking rounds; a later round may fork the leaves an earlier one made (deeper trees)."""

    branch: Literal["uniform", "entropy"] = "entropy"
    """How fork points are chosen: ``uniform`` (at random among the turn boundaries) or ``entropy``
    (ARPO/TreeRL style: where the first ``entropy_tokens`` tokens the policy sampled after the
    observation had the highest mean -log p, i.e. the policy was least sure)."""

    entropy_tokens: int = Field(16, gt=0)
    """Tokens at the start of a turn whose mean -log p scores a fork point (``branch: entropy``)."""

    max_tokens_per_tree: int | None = Field(None, gt=0)
    """Generated-token budget of one tree (each token counted once, shared prefixes too); no new
    round starts once a tree has spent it. None: no budget beyond the leaves."""

    reach: Literal["auto", "snapshot", "replay"] = "auto"
    """How a branch reaches its fork point: ``Env.snapshot()/restore()`` or a checked replay of the
    recorded actions (envs declaring ``deterministic_replay``)."""


class RLRolloutConfig(_Section, RolloutSettings):
    """Sampling and episode limits. Apart from ``engine``/``engine_options``/``strategy``/``tree``
    the names are those of ``tracegym.rollout.RolloutConfig`` (both inherit ``RolloutSettings``), so
    the recipe builds it from ``settings()`` plus ``samples_per_task=group_size`` and ``seed``."""

    temperature: float = Field(1.0, ge=0)
    """Sampling temperature for training rollouts (1.0 keeps engine and trainer log-probs comparable)."""

    engine: Literal["hf", "vllm", "openai"] = "hf"
    """Inference engine for sampling: hf (CPU, in-process), vllm (GPU), openai (HTTP server)."""

    engine_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword options for the engine (base_url, gpu_memory_utilization, ...; hf: ``turn_cache_mb``,
    the memory kept for episodes' previous turns, default 1024, 0 to trade speed for memory;
    ``share_prefix_kv`` and ``preallocate_kv``, default true: the batch's shared prompt prefix
    keys/values held once, and decode writing into a preallocated cache; false only to compare)."""

    strategy: str = "chains"
    """A rollout strategy of ``tracegym.rollout.strategies.ROLLOUT_STRATEGIES``: ``chains``
    (``group_size`` independent episodes per task), ``tree`` (tree-search rollouts: the group is the
    ``group_size`` leaves of a tree branched at turn boundaries; pair it with ``advantage.estimator:
    tree`` so a shared prefix is not counted once per leaf) or one a plugin registers."""

    strategy_options: dict[str, Any] = Field(default_factory=dict)
    """Options of the strategy, validated by its options model (``tree`` reads ``tree`` when this is empty)."""

    tree: TreeConfig = Field(default_factory=TreeConfig)
    """Tree-search rollouts (``strategy: tree``)."""

    untrusted_tool_output: UntrustedToolOutput = "none"
    """How tool results are shown to the model (docs/safety.md): ``none`` (the template's own way),
    ``delimiters`` (each result between ``<untrusted_input>`` markers, and one sentence in the system
    prompt saying that text there is data, never instructions) or ``role`` (results in a turn of
    their own role: ``untrusted`` in ChatML templates, ``input`` in Llama 3 as in Meta-SecAlign).
    Recorded in ``final/tracegym.json``, so ``tracegym eval`` of the run renders the same way."""

    def settings(self, **overrides: Any) -> dict[str, Any]:
        """The ``RolloutSettings`` fields (what ``tracegym.rollout.RolloutConfig`` shares), with overrides."""
        return {**self.model_dump(include=set(RolloutSettings.model_fields)), **overrides}

    def strategy_settings(self) -> Any:
        """The options the strategy runs with: ``strategy_options``, or the ``tree`` section for ``tree``."""
        return self.tree if self.strategy == "tree" and not self.strategy_options else self.strategy_options


class AdvantageConfig(_Section):
    estimator: str = "grpo"
    """Advantage estimator registered in ``tracegym.algos``: grpo, dr_grpo, rloo, reinforce,
    turn_rloo / turn_grpo (per-turn returns, leave-one-out baseline), gigpo (episode + step groups of
    equal env state), info_gain, mc_continuation (with the scoring step of the same name), tree
    (TreeRL/ARPO advantages and 1/|L(n)| token weights over ``rollout.strategy: tree`` leaves) or a
    plugin's. It returns one advantage per assistant turn of every trajectory."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Options of the estimator, validated by its options model (e.g. ``gamma: 0.9`` for turn_rloo)."""

    intrinsic: Literal["none", "info_gain", "mc_continuation"] = "none"
    """A scoring step before the estimator, which the estimator of the same name needs: ``info_gain``
    (InfoPO) scores every turn by how much its observation changes the log-prob of the next action
    versus ``placeholder`` (two extra forward passes per turn with a next turn; biased);
    ``mc_continuation`` (VinePPO/C3) branches at decision turns: ``mc_k`` actions (the taken one
    included) x ``mc_m`` continuations each, advantage = Q(taken) - mean Q(others) (unbiased; costly).
    With ``roles:`` it is per-role counterfactual credit (C3): the acting role's message is replaced
    by fresh samples of that role and the rest of the team episode re-run."""

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


class RLEvalConfig(_Section):
    every: int = Field(10, ge=0)
    """Evaluate on the test tasks every this many steps (0: only before the first and after the last step)."""

    samples_per_task: int = Field(1, gt=0)
    """Samples k per test task, for pass@k."""

    temperature: float = Field(0.0, ge=0)
    """Sampling temperature for evaluation (0: greedy)."""

    at_start: bool = True
    """Also evaluate the initial policy before the first step (the baseline of the curve)."""


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
        if self.roles or self.selfplay is not None:
            if not self.lora.enabled:
                raise ValueError("roles: a team trains one LoRA adapter per role; set lora.enabled: true")
            if self.executor.kind != "local" or self.rollout.strategy != "chains" or self.resample_rounds \
                    or self.advantage.intrinsic == "info_gain" or (self.selfplay and self.advantage.intrinsic != "none"):
                raise ValueError("roles: team training runs with executor.kind local, rollout.strategy chains, no "
                                 "resample_rounds, and advantage.intrinsic none or (teams) mc_continuation")
            if self.rollout.engine not in ("hf", "vllm"):
                raise ValueError("roles: rollout.engine must be hf or vllm (engines that sample per-row LoRA adapters)")
            if self.roles and not any(role.train for role in self.roles.values()):
                raise ValueError("roles: at least one role must train (train: true)")
        if self.max_policy_drift is not None and self.health.drift_rows == 0:
            raise ValueError("max_policy_drift measures the drift on health.drift_rows rows; set drift_rows > 0")
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


def _merge_under(defaults: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with ``defaults`` filled in where it has no key (nested dicts merged key by key)."""
    out = dict(defaults)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge_under(out[key], value)
        else:
            out[key] = value
    return out


# --- preference learning (DPO, DMPO, KTO) -------------------------------------------------------


class DPODataConfig(_Section):
    pairs_file: str | None = None
    """Preference pairs JSONL (one ``PreferencePair`` per line, e.g. the ``pairs.jsonl`` an earlier
    run wrote). For ``kto`` each pair gives a desirable (chosen) and an undesirable (rejected)
    trajectory."""

    labelled_file: str | None = None
    """Labelled trajectories JSONL (one ``LabelledTrajectory`` per line), for ``kto`` only."""

    rollouts_files: list[str] = Field(default_factory=list)
    """Trajectory JSONL files (``tracegym rollout``, several samples per task) to build the data from:
    pairs (``dpo``, ``dmpo``) or labelled trajectories (``kto``); what was built is written to
    ``<output_dir>/pairs.jsonl`` or ``labelled.jsonl``. Give exactly one of the three sources."""

    min_gap: float = Field(0.5, ge=0)
    """Building pairs: the chosen trajectory's reward must exceed the rejected one's by at least this
    (equal rewards never make a pair)."""

    truncate_at_divergence: bool = True
    """Building pairs: cut both trajectories after the first turn whose sampled completions differ,
    so the shared prefix cancels exactly and the divergent action is what is compared."""

    max_pairs_per_task: int | None = Field(None, gt=0)
    """Building pairs: at most this many pairs per task (least-used trajectories first); None: all."""

    desirable_min_reward: float | None = None
    """Labelling for ``kto``: a trajectory is desirable when it succeeded or, if set, its reward is
    at least this."""

    shuffle: bool = True
    """Shuffle the pairs (or labelled trajectories) every epoch (a pure function of ``seed`` and the epoch)."""


class DPOLossConfig(_Section):
    name: str = "dpo"
    """Preference loss registered in ``tracegym.algos.PREFERENCE_LOSSES``: ``dpo`` (pairs), ``dmpo``
    (pairs, per-turn discount weights), ``kto`` (labelled single trajectories) or a plugin's. A key
    below that the chosen loss does not take is ignored."""

    beta: float = Field(0.1, gt=0)
    """Temperature of the implicit reward ``beta * (l_pi - l_ref)``: larger keeps the policy closer
    to the reference (every loss)."""

    gamma: float = Field(0.7, ge=0, le=1)
    """``dmpo``: turn ``j`` of ``N`` weighs ``gamma^j (1 - gamma^(N-j)) / (1 - gamma^N)`` (1: ``(N-j)/N``)."""

    lambda_d: float = Field(1.0, gt=0)
    """``kto``: weight of the desirable trajectories' loss."""

    lambda_u: float = Field(1.0, gt=0)
    """``kto``: weight of the undesirable trajectories' loss."""


class DPOConfig(_Section):
    """Preference learning on recorded trajectories (``tracegym dpo``): DPO, DMPO or KTO."""

    plugins: list[str] = Field(default_factory=list)
    """Python modules imported before this config is validated (a module name, or a ``.py`` path
    relative to the config file): they register preference losses (``--plugin`` adds more)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy; set ``model.adapter`` to start from an SFT adapter (the reference is then the
    SFT model: a frozen copy with the adapter merged)."""

    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapter (reference: the base with the adapter disabled) or full fine-tuning (reference: a frozen copy)."""

    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-5))
    """Optimizer and learning-rate schedule."""

    data: DPODataConfig = Field(default_factory=DPODataConfig)
    """Where the pairs (or labelled trajectories) come from."""

    loss: DPOLossConfig = Field(default_factory=DPOLossConfig)
    """The preference loss and its options."""

    epochs: int = Field(1, ge=1)
    """Passes over the pairs (ignored when ``max_steps`` is set)."""

    max_steps: int | None = Field(None, gt=0)
    """If set, train exactly this many optimizer steps, cycling through epochs as needed."""

    batch_size: int = Field(8, gt=0)
    """Pairs (``kto``: labelled trajectories) per optimizer step; the loss is their mean."""

    micro_batch_size: int = Field(2, gt=0)
    """Pairs (``kto``: trajectories) per forward/backward pass; gradients accumulate exactly over
    ``batch_size / micro_batch_size`` passes."""

    max_length: int = Field(2048, gt=0)
    """Longest sequence in tokens; a pair (or trajectory) with a longer one is dropped (and counted)."""

    seed: int = 0
    """Seed for Python, NumPy and torch RNGs and the data order."""

    output_dir: str = "runs/dpo"
    """Run directory: config.yaml, pairs.jsonl or labelled.jsonl, metrics.jsonl, tensorboard/, checkpoints/, final/."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Periodic resumable checkpoints."""

    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics sinks and the progress bar."""

    @model_validator(mode="after")
    def _check(self) -> "DPOConfig":
        if self.batch_size % self.micro_batch_size != 0:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size ({self.micro_batch_size})"
            )
        if self.model.adapter and not self.lora.enabled:
            raise ValueError("model.adapter is set but lora.enabled is false: an adapter needs LoRA training")
        sources = [k for k in ("pairs_file", "labelled_file", "rollouts_files") if getattr(self.data, k)]
        if len(sources) > 1:
            raise ValueError(f"give one data source, not {' and '.join('data.' + k for k in sources)}")
        return self


# --- on-policy distillation ---------------------------------------------------------------------


class TeacherConfig(_Section):
    """The frozen teacher of ``tracegym distill``: a local model (``engine: hf``) or one served by an
    inference engine that scores given sequences (``vllm`` in process, ``openai`` over HTTP)."""

    model: str = "smollm2-135m"
    """The teacher. ``engine: hf``: a known name or a local Hugging Face folder, e.g. the ``final/``
    folder of an SFT run (an adapter folder is merged onto the base it names). ``vllm``: a local
    model folder (``tracegym export --merge`` makes one of a run) or ``smollm2-135m``. ``openai``: the
    model id the server serves it under (``vllm serve``'s ``--served-model-name``, by default the
    path it was given). It must use the student's tokenizer: every sampled token is scored by both
    models, id for id (checked at start: hf and vllm compare the vocabulary size and the ids of probe
    strings and of the chat special tokens; a server's tokenizer cannot be read, so ``openai``
    compares how the server reads the student's ids of probe strings). It scores the student's own
    token sequence, so it reads the student's chat template."""

    adapter: str | None = None
    """``engine: hf``: a peft LoRA adapter folder merged onto ``model`` (frozen, like the rest of the
    teacher). Other engines load a merged folder instead."""

    engine: Literal["hf", "vllm", "openai"] = "hf"
    """How the teacher scores the student's tokens: ``hf`` (in this process with transformers, full
    logits: every ``loss``), ``vllm`` (in this process on the GPU, vLLM's prompt log-probs) or
    ``openai`` (an OpenAI-compatible server's ``/completions`` with ``echo`` and ``logprobs``:
    ``vllm serve`` with its default ``--logprobs-mode raw_logprobs``, or ``tracegym serve``). vllm and
    openai return the log-prob of each actual token only, so ``loss: jsd`` needs ``hf``."""

    base_url: str | None = None
    """``engine: openai``: the server root with ``/v1``, e.g. ``http://127.0.0.1:8000/v1``."""

    api_key_env: str | None = None
    """``engine: openai``: the environment variable holding the server's API key (sent only in the
    ``Authorization`` header, never logged); None: ``OPENAI_API_KEY`` when set, else no key."""

    engine_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword options of the teacher's engine (``engine: vllm`` or ``openai``), as
    ``rollout.engine_options``: vllm: ``gpu_memory_utilization`` (default 0.5; a vllm student sampler
    shares the GPU), ``max_model_len``, ``dtype``, ...; openai: ``timeout_s``, ``max_concurrency``
    (sequences scored at once), ``max_retries``, ..."""

    @model_validator(mode="after")
    def _check(self) -> "TeacherConfig":
        if self.engine == "openai" and not self.base_url:
            raise ValueError("teacher.engine openai needs teacher.base_url (the server root with /v1, "
                             "e.g. http://127.0.0.1:8000/v1)")
        if self.engine != "openai" and (self.base_url is not None or self.api_key_env is not None):
            raise ValueError("teacher.base_url and teacher.api_key_env are for teacher.engine: openai")
        if self.adapter is not None and self.engine != "hf":
            raise ValueError(f"teacher.adapter is merged by teacher.engine hf only; give the {self.engine} teacher "
                             "a merged model folder (tracegym export --merge)")
        if self.engine_options and self.engine == "hf":
            raise ValueError("teacher.engine_options are for teacher.engine vllm or openai (the hf teacher takes none)")
        reserved = sorted({"model", "tokenizer", "renderer", "base_url", "api_key_env"} & set(self.engine_options))
        if reserved:
            raise ValueError(f"teacher.engine_options cannot set {', '.join(reserved)}: use the teacher keys of "
                             "those names (teacher.model, teacher.base_url, teacher.api_key_env)")
        return self


class DistillConfig(_Section):
    """On-policy distillation (``tracegym distill``): the student samples episodes in an env, a frozen
    teacher scores the sampled tokens, and the student is trained to lower the per-token reverse KL
    ``log pi_student - log pi_teacher`` on its own samples (or GKD's generalized JSD). The teacher is
    a local model or one served by vLLM / an OpenAI-compatible server (``teacher.engine``), always
    with the student's tokenizer."""

    plugins: list[str] = Field(default_factory=list)
    """Python modules imported before this config is validated (a module name, or a ``.py`` path
    relative to the config file): they register envs (``--plugin`` adds more)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The student; ``model.adapter`` starts it from an adapter (e.g. an SFT run's ``final/``)."""

    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapter or full fine-tuning of the student."""

    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule."""

    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    """The frozen teacher that scores the student's samples: a local model, or one served by vLLM or
    an OpenAI-compatible server (``teacher.engine``)."""

    env: EnvConfig = Field(default_factory=EnvConfig)
    """The environment the student acts in (its rewards are logged, not trained on)."""

    tasks: TasksConfig = Field(default_factory=TasksConfig)
    """How many train/test tasks are drawn, and with which seed."""

    tasks_per_step: int = Field(8, gt=0)
    """Distinct tasks sampled per optimizer step."""

    group_size: int = Field(4, gt=0)
    """Samples per task (no group baseline is used: every sampled token gets its own advantage)."""

    rollout: RLRolloutConfig = Field(default_factory=RLRolloutConfig)
    """Sampling and episode limits of the student's rollouts (``strategy: chains`` only)."""

    loss: Literal["policy_gradient", "ppo_clip", "jsd"] = "policy_gradient"
    """``policy_gradient``/``ppo_clip``: the policy loss with per-token advantage
    ``A_t = -(log pi_student(y_t) - log pi_teacher(y_t))`` (a single-sample reverse-KL estimate).
    ``jsd``: GKD's generalized Jensen-Shannon divergence to the teacher over the whole vocabulary at
    every sampled position (needs the teacher's full logits: ``teacher.engine: hf``; ``jsd_beta``)."""

    jsd_beta: float = Field(0.5, ge=0.0, le=1.0)
    """``loss: jsd``: ``beta KL(T||M) + (1-beta) KL(S||M)`` with ``M = beta T + (1-beta) S``;
    0 is the forward KL(T||S), 1 the reverse KL(S||T) (the end points, as in GKD/TRL)."""

    student_logprobs: Literal["trainer", "sampler"] = "trainer"
    """Which student log-probs enter ``A_t``: ``trainer`` (the trainer's own scoring of the sampled
    tokens under the current weights, the exact reverse-KL gradient; a teacher equal to the student
    gives exactly 0) or ``sampler`` (the engine's log-probs recorded while sampling, as tinker-cookbook
    does; differs from the trainer's by the engine/trainer mismatch)."""

    advantage_clip: float | None = Field(None, gt=0)
    """Clip every ``A_t`` to ``[-advantage_clip, advantage_clip]`` (tokens the teacher finds very
    unlikely otherwise dominate the batch); None: no clipping."""

    tis_cap: float | None = Field(2.0, gt=0)
    """Truncated importance weight ``min(pi_old / pi_sampler, tis_cap)`` of each token's loss, which
    corrects for the sampler's mismatch with the trainer (policy losses only); None: off."""

    micro_batch_size: int = Field(4, gt=0)
    """Sequences per forward/backward pass (and per forward of an hf teacher); gradients accumulate over the batch."""

    steps: int = Field(100, gt=0)
    """Optimizer steps (each: rollouts, teacher scoring, one update, weight sync)."""

    max_length: int = Field(4096, gt=0)
    """Longest training sequence in tokens; longer episodes are dropped from the update and counted."""

    eval: RLEvalConfig = Field(default_factory=RLEvalConfig)
    """Evaluation (pass@1) on held-out tasks, at the start, every ``eval.every`` steps and at the end."""

    seed: int = 0
    """Seed for Python, NumPy and torch RNGs and task order."""

    output_dir: str = "runs/distill"
    """Run directory: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, final/."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Periodic resumable checkpoints."""

    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics sinks and the progress bar."""

    @model_validator(mode="after")
    def _check(self) -> "DistillConfig":
        if self.model.adapter and not self.lora.enabled:
            raise ValueError("model.adapter is set but lora.enabled is false: an adapter needs LoRA training")
        if self.rollout.strategy != "chains":
            raise ValueError("distillation samples independent episodes: rollout.strategy must be 'chains'")
        if self.rollout.temperature <= 0:
            raise ValueError("on-policy distillation needs the student's sampling distribution: rollout.temperature must be > 0")
        if self.loss == "jsd" and self.teacher.engine != "hf":
            raise ValueError(f"loss jsd compares the teacher's whole next-token distribution: it needs teacher.engine hf "
                             f"(the {self.teacher.engine} teacher returns the log-prob of each actual token only)")
        return self


class SynthesisTeacherConfig(_Section):
    source: str = "expert"
    """Who plays the env: ``expert`` (the env's scripted expert), a local model name or folder (hf
    engine; an adapter folder is merged onto its base), or the URL of an OpenAI-compatible server
    (``http://host:port/v1``)."""

    model: str | None = None
    """Server teacher: the model id to ask for (default: the server's only model)."""

    renderer: str | None = None
    """Local teacher: its chat-template renderer (default: the model's)."""

    api_key_env: str = Field("OPENAI_API_KEY", min_length=1)
    """Server teacher: the environment variable holding the API key (the key is never printed or written)."""


class SynthesisStudentConfig(_Section):
    model: str = "smollm2-135m"
    """The student whose tokenizer and chat template the data is re-rendered for."""

    renderer: str | None = None
    """The student's chat-template renderer (default: the model's)."""


class SynthesizeConfig(_Section):
    """Teacher synthesis (``tracegym synthesize --config``): a teacher plays an env, its episodes go
    through a chain of filters and are re-rendered with the student's template and masks."""

    plugins: list[str] = Field(default_factory=list)
    """Python modules imported before this config is validated (a module name, or a ``.py`` path
    relative to the config file): they register envs and filters (``--plugin`` adds more)."""

    env: EnvConfig = Field(default_factory=EnvConfig)
    """The environment the teacher plays (``env.injection`` is not used here)."""

    split: Literal["train", "test"] = "train"
    """Task split the tasks come from."""

    tasks: int = Field(8, gt=0)
    """Number of tasks."""

    task_seed: int = 0
    """Seed of the task draw (the same seed gives the same tasks)."""

    samples: int = Field(4, gt=0)
    """Teacher episodes per task."""

    teacher: SynthesisTeacherConfig = Field(default_factory=SynthesisTeacherConfig)
    """The teacher."""

    student: SynthesisStudentConfig = Field(default_factory=SynthesisStudentConfig)
    """The student the data is for."""

    filters: list[Any] = Field(default_factory=lambda: ["success", "dedupe"])
    """Filters applied in order (docs/synthesis.md). Each item is a name (``pareto``), a name with
    options (``{recovery: {prefer: true, per_task: 2}}``) or the CLI's form
    (``success:min_reward=0.5``); ``[]`` keeps every episode. Built in: ``success`` (rejection
    sampling; option ``min_reward``), ``pareto`` (each task's successes not dominated on tool calls
    and generated tokens), ``recovery`` (episodes that hit a tool error and recovered; options
    ``prefer``, ``per_task``), ``dedupe``; ``tracegym.data.filters.register_filter`` adds more."""

    max_turns: int | None = Field(None, gt=0)
    """Assistant turns per episode (default: the env's limit)."""

    max_tokens_per_turn: int = Field(512, gt=0)
    """Teacher tokens per turn."""

    max_context: int | None = Field(None, gt=0)
    """End an episode whose next prompt, in student tokens, exceeds this (default: no limit)."""

    temperature: float = Field(1.0, ge=0)
    """Teacher sampling temperature."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Teacher nucleus sampling."""

    seed: int = 0
    """Sampling seed."""

    timeout: float | None = Field(None, gt=0)
    """Wall-clock limit per episode, in seconds."""

    concurrency: int = Field(16, gt=0)
    """Episodes alive at once."""

    parquet: bool = False
    """Also write ``trajectories.parquet``."""

    output_dir: str = "runs/synth"
    """Where ``trajectories.jsonl`` (SFT-ready), ``teacher.jsonl``, ``summary.json`` and the
    resolved ``config.yaml`` go."""

    @field_validator("filters", mode="before")
    @classmethod
    def _filters(cls, value: Any) -> Any:
        """Each item as the CLI's text form, checked against the registered filters (unknown names
        and options, bad values): ``{recovery: {prefer: true}}`` -> ``"recovery:prefer=true"``."""
        from tracegym.data.filters import parse_filters

        if value is None:
            return []
        if isinstance(value, str):
            value = [value] if value.strip() else []
        if not isinstance(value, list):
            raise ValueError(f"expected a list of filters, got {type(value).__name__}")
        items = []
        for item in value:
            if isinstance(item, dict):
                if len(item) != 1:
                    raise ValueError(f"a filter with options is one mapping {{name: {{option: value}}}}, got {item!r}")
                ((name, options),) = item.items()
                options = {} if options is None else options
                if not isinstance(options, dict):
                    raise ValueError(f"filter {name!r}: options must be a mapping, got {options!r}")
                item = name + "".join(f":{k}={json.dumps(v)}" for k, v in options.items())
            elif not isinstance(item, str):
                raise ValueError(f"a filter is a name or {{name: {{option: value}}}}, got {item!r}")
            items.append(item)
        if items == ["none"]:
            return []
        return [str(spec) for spec in parse_filters(items)]


# --- loading, errors, overrides ---------------------------------------------------------------


class ConfigError(ValueError):
    """Every problem of a config at once, one readable line (or short block) per problem."""

    def __init__(self, problems: Sequence[str], source: str = "config"):
        self.problems = list(problems)
        self.source = source
        super().__init__(f"invalid {source}:\n" + "\n".join(f"  - {p}" for p in self.problems))


C = TypeVar("C", bound=BaseModel)


def _section_at(cls: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The config class found by following ``loc`` (field names) down from ``cls``."""
    current: type[BaseModel] | None = cls
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        current = (annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel)
                   else _optional_section(annotation))
    return current


def _dotted(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _yaml_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map each key path of a YAML mapping document to its 1-based line number."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = prefix + (str(key_node.value),)
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def _describe_errors(
    cls: type[BaseModel],
    error: ValidationError,
    where: Mapping[tuple[str, ...], str],
) -> list[str]:
    """Turn pydantic's errors into messages that name the key, where it is, and what is allowed."""
    problems: list[str] = []
    # A union field (``list[str] | Literal["all-linear"]``) fails once per branch, with the branch
    # tag (``list[str]``) inside the location: merge those into one message per key.
    merged: dict[tuple, list[dict]] = {}
    for err in error.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or "(" in p)))
        merged.setdefault(loc, []).append(err)
    for loc, errs in merged.items():
        key_path = tuple(str(p) for p in loc)
        origin = where.get(key_path, "")
        at = f" ({origin})" if origin else ""
        first = errs[0]
        if first["type"] == "extra_forbidden":
            section = _section_at(cls, loc[:-1])
            allowed = sorted(section.model_fields) if section else []
            bad = str(loc[-1])
            near = difflib.get_close_matches(bad, allowed, n=1, cutoff=0.0)
            hint = f"; did you mean '{_dotted(loc[:-1] + (near[0],))}'?" if near else ""
            problems.append(f"unknown key '{_dotted(loc)}'{at}{hint} allowed keys here: {', '.join(allowed)}")
            continue
        got = first.get("input")
        given = "" if isinstance(got, dict) else f", got {got!r}"
        message = " or ".join(dict.fromkeys(e["msg"] for e in errs))
        problems.append(f"bad value for '{_dotted(loc)}'{at}: {message}{given}")
    return problems


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` as a float.

    PyYAML follows YAML 1.1, where a float needs a dot (``1.0e-4``) and ``1e-4`` is a string;
    learning rates are written the short way, so floats are resolved as in YAML 1.2.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def parse_overrides(overrides: Sequence[str]) -> list[tuple[tuple[str, ...], Any, str]]:
    """``["lora.r=8", "optim.lr=1e-4"]`` -> ``[(("lora", "r"), 8, "lora.r=8"), ...]``.

    Values are parsed as YAML, so ``8`` is an int, ``1e-4`` a float, ``null`` None and
    ``[a,b]`` a list; quote a value to keep it a string (``model.name='123'``).
    """
    parsed = []
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"override {item!r} is not of the form key.sub=value")
            continue
        try:
            value = _yaml_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            problems.append(f"override {item!r}: value is not valid YAML ({exc.__class__.__name__})")
            continue
        parsed.append((tuple(key.split(".")), value, item))
    if problems:
        raise ConfigError(problems, "command-line overrides")
    return parsed


def apply_overrides(
    data: dict[str, Any], overrides: Sequence[str], where: dict[tuple[str, ...], str] | None = None
) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a raw config dict (a new dict; ``data`` is not changed).

    ``where`` (if given) records that each overridden key came from the command line, for errors.
    """
    import copy

    result = copy.deepcopy(data)
    for path, value, item in parse_overrides(overrides):
        node = result
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    [f"override {item!r}: '{'.'.join(path[: i + 1])}' is a value ({child!r}), not a section"],
                    "command-line overrides",
                )
            node = child
        node[path[-1]] = value
        if where is not None:
            where[path] = f"command line {item!r}"
    return result


def load_config(
    cls: type[C],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    data: Mapping[str, Any] | None = None,
) -> C:
    """Read a YAML file (or ``data``), apply overrides, validate into ``cls``.

    Raises ``ConfigError`` naming every bad key (with file line or override, nearest valid key and
    the allowed keys) and every bad value (with the allowed values).
    """
    where: dict[tuple[str, ...], str] = {}
    source = "config"
    raw: Any = dict(data or {})
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError([f"config file not found: {path}"], source)
        text = path.read_text(encoding="utf-8")
        try:
            raw = _yaml_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError([f"not valid YAML: {exc}"], source) from None
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError([f"the top level must be a mapping of keys, got {type(raw).__name__}"], source)
        where = {k: f"{path}:{line}" for k, line in _yaml_lines(text).items()}
    raw = apply_overrides(raw, overrides, where)
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe_errors(cls, exc, where), source) from None


def dump_config(config: BaseModel, run_dir: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config (every default filled in) as YAML into ``run_dir``; returns the path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / name
    header = f"# resolved {type(config).__name__}: defaults filled in, overrides applied\n"
    body = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(header + body, encoding="utf-8")
    tmp.replace(target)
    return target


def describe_fields(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every field, sections expanded; used by the docs."""
    rows = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.append((key, "section", "", field.description or ""))
            rows.extend(describe_fields(annotation, key + "."))
            continue
        optional = _optional_section(annotation)
        if optional is not None:  # a section that is off by default (``env.injection``)
            rows.append((key, "section", repr(field.get_default(call_default_factory=True)), field.description or ""))
            rows.extend(describe_fields(optional, key + "."))
            continue
        type_name = str(annotation).replace("typing.", "")
        if isinstance(annotation, type):
            type_name = annotation.__name__
        default = field.get_default(call_default_factory=True)
        rows.append((key, type_name, repr(default), field.description or ""))
    return rows


def _optional_section(annotation: Any) -> type[BaseModel] | None:
    """``X`` for an annotation ``X | None`` whose ``X`` is a config section, else None."""
    import types
    import typing

    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return members[0]
    return None
