"""Config sections shared by more than one recipe: the model, LoRA, optimizer, checkpoints and
logging (every training recipe), the environment with its prompt-injection and task sections (RL,
distillation, synthesis) and the rollout, tree and evaluation sections (RL and distillation).
``RolloutSettings`` is also the base of ``tracegym.rollout.RolloutConfig``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tracegym.config._base import _Section


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

    autocast: Literal["none", "bfloat16", "auto"] = "none"
    """Mixed precision for the training forward passes: ``bfloat16`` runs their matmuls in bfloat16
    (weights, gradients, optimizer and losses stay in ``dtype``); ``auto`` does so only where the
    device computes bfloat16 natively (AMX / AVX512-BF16 CPUs, CUDA). Rollouts are not affected; RL
    re-scores the old policy with the trainer so the PPO ratio starts at 1 (tracegym/train/precision.py)."""


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


TrackingBackend = Literal["tensorboard", "mlflow", "wandb"]
"""The experiment trackers ``logging.backends`` can list (``tracegym.train.tracking``, docs/tracking.md)."""

class MlflowConfig(_Section):
    """MLflow tracking (``mlflow`` in ``logging.backends``)."""

    tracking_uri: str | None = None
    """Where runs are recorded: a server (``http://host:5000``), a database (``sqlite:///path/mlflow.db``)
    or a folder (``file:///path``: MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE=true`` for it). None:
    ``MLFLOW_TRACKING_URI`` when set, else a SQLite store in ``<output_dir>/mlflow/mlflow.db``."""

    experiment: str = "tracegym"
    """MLflow experiment the run is recorded in (created when missing)."""


class WandbConfig(_Section):
    """Weights & Biases tracking (``wandb`` in ``logging.backends``)."""

    project: str = "tracegym"
    """W&B project name."""

    entity: str | None = None
    """W&B team or user the project belongs to; None: the account's default."""

    mode: Literal["auto", "offline", "online"] = "auto"
    """``auto``: what ``WANDB_MODE`` says when it is ``offline`` or ``online``, else online exactly when
    ``WANDB_API_KEY`` is set. Offline runs are files under ``<output_dir>/wandb``, uploaded later with
    ``wandb sync``; ``offline`` never uses the network."""


def _backends_from_old_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``logging`` with the keys of before ``backends`` turned into it: ``tensorboard: bool`` and
    ``wandb: bool`` add or remove that backend, ``wandb_project`` is ``wandb.project``."""
    out = dict(data)
    switches: dict[str, bool] = {}
    for name in ("tensorboard", "wandb"):
        value = out.get(name)
        if isinstance(value, bool):
            switches[name] = out.pop(name)
        elif name == "tensorboard" and name in out:
            raise ValueError(f"logging.tensorboard must be true or false, got {value!r} (or list tensorboard in logging.backends)")
        elif name == "wandb" and value is not None and not isinstance(value, (dict, BaseModel)):
            raise ValueError(f"logging.wandb is a section (project, entity, mode), got {value!r}: "
                             "list wandb in logging.backends to turn it on")
    if "wandb_project" in out:
        wandb = out.get("wandb")
        wandb = wandb.model_dump() if isinstance(wandb, BaseModel) else dict(wandb or {})
        wandb.setdefault("project", out.pop("wandb_project"))
        out["wandb"] = wandb
    if switches:
        backends = list(out.get("backends") or ["tensorboard"])
        for name, on in switches.items():
            backends = [b for b in backends if b != name] + ([name] if on else [])
        out["backends"] = backends
    return out


class LoggingConfig(_Section):
    backends: list[TrackingBackend] = Field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers that get the run's config, metrics per logged step and, at the end, the final
    model and report (docs/tracking.md): ``tensorboard`` (``<output_dir>/tensorboard``), ``mlflow``,
    ``wandb``. ``metrics.jsonl`` is always written. The old ``tensorboard: false``, ``wandb: true`` and
    ``wandb_project`` keys still work: they edit this list (and ``wandb.project``)."""

    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    """MLflow settings, used when ``backends`` lists ``mlflow``."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """W&B settings, used when ``backends`` lists ``wandb``."""

    artifacts: bool = True
    """At the end of a run, give the trackers that keep files (mlflow, wandb) the final model folder and
    the run's ``report.html`` when it has one. The folder of a full fine-tune holds the whole model."""

    timeout_s: float = Field(120.0, gt=0)
    """Longest a tracker may take over one call (opening, a step's metrics, an artifact, closing); one
    that takes longer, or fails, is reported once and switched off for the rest of the run. Training
    never stops for a tracker."""

    progress: bool = True
    """Show a progress bar with ETA on the terminal."""

    log_every: int = Field(1, ge=1)
    """Write metrics every this many optimizer steps (metrics.jsonl and every backend)."""

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        return _backends_from_old_keys(data) if isinstance(data, dict) else data

    @field_validator("backends")
    @classmethod
    def _once_each(cls, backends: list[str]) -> list[str]:
        twice = sorted({b for b in backends if backends.count(b) > 1})
        if twice:
            raise ValueError(f"logging.backends lists {', '.join(twice)} more than once")
        return backends


AttackKind = Literal["forbidden_tool", "exfiltrate", "answer_override"]
"""The prompt-injection attacks of ``tracegym.envs.injection`` (docs/safety.md)."""

ATTACK_KINDS: tuple[AttackKind, ...] = ("forbidden_tool", "exfiltrate", "answer_override")

UntrustedToolOutput = Literal["none", "delimiters", "role"]
"""How renderers show tool results (``tracegym.render.base.UntrustedToolOutput``; tracegym.config imports
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


class ContextConfig(BaseModel):
    """How an episode's history is shown to the model once it grows (``rollout.context``).
    ``full``: everything, every turn extends the last prompt. ``window``: the opening messages (system
    prompt, task) and the last ``keep_turns`` turns (each an assistant message and what answered it).
    ``observation_masking``: every message, but the tool results of turns older than the last
    ``keep_turns`` replaced by ``placeholder``. ``summarize``: once the prompt passes ``summarize_at``
    tokens, the model first writes a summary (a sampled turn, trained like any other, never sent to
    the env); from then on the prompt shows the opening messages, that summary and the turns since
    (with the last ``keep_turns`` before it). A rewritten history is rendered afresh, so the episode's
    trajectory becomes segments, each trained on exactly the prompt the model saw and the tokens it
    sampled (docs/rollouts.md, "Context policies")."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    policy: Literal["full", "window", "observation_masking", "summarize"] = "full"
    """``full``, ``window``, ``observation_masking`` or ``summarize``."""

    keep_turns: int = Field(2, ge=1)
    """Turns kept whole (``window``), with their tool results (``observation_masking``), or shown
    after a summary next to it (``summarize``)."""

    placeholder: str = "[earlier tool output omitted]"
    """What a masked tool result reads (``observation_masking``)."""

    summarize_at: int = Field(1024, gt=0)
    """``summarize``: prompt tokens above which the model summarizes before its next action (set it
    below ``max_context`` by at least ``max_summary_tokens``)."""

    max_summary_tokens: int = Field(256, gt=0)
    """``summarize``: most tokens of one summary turn."""

    summary_request: str = ("Your context is nearly full. Summarize the task and everything you have learned and "
                            "done so far that you still need, in a few lines, without calling a tool.")
    """``summarize``: the user message that asks for the summary (the summary turn's prompt ends with it)."""

    summary_header: str = "Summary of your earlier turns (written by you):"
    """``summarize``: what precedes the summary in the prompts after it."""


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

    context: ContextConfig = Field(default_factory=ContextConfig)
    """How long histories are shown to the model: ``full`` (default), ``window``,
    ``observation_masking`` or ``summarize`` (``ContextConfig``)."""

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

    harness: str | None = None
    """Your own agent plays the episodes (docs/harness.md): ``path/file.py:function`` or
    ``module:function``, an ``async def run(task, client)``. Short for ``strategy: harness`` with
    ``strategy_options.agent`` set to it."""

    tree: TreeConfig = Field(default_factory=TreeConfig)
    """Tree-search rollouts (``strategy: tree``)."""

    @model_validator(mode="before")
    @classmethod
    def _harness_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("harness") is not None:
            if data.get("strategy", "harness") not in ("harness", "chains"):
                raise ValueError(f"rollout.harness: an agent plays through strategy harness, not {data['strategy']!r}")
            options = dict(data.get("strategy_options") or {})
            if options.get("agent", data["harness"]) != data["harness"]:
                raise ValueError("rollout.harness and rollout.strategy_options.agent name different agents")
            data = {**data, "strategy": "harness", "strategy_options": {**options, "agent": data["harness"]}}
        return data

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


class RLEvalConfig(_Section):
    every: int = Field(10, ge=0)
    """Evaluate on the test tasks every this many steps (0: only before the first and after the last step)."""

    samples_per_task: int = Field(1, gt=0)
    """Samples k per test task, for pass@k."""

    temperature: float = Field(0.0, ge=0)
    """Sampling temperature for evaluation (0: greedy)."""

    at_start: bool = True
    """Also evaluate the initial policy before the first step (the baseline of the curve)."""
