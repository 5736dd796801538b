"""The config of ``tracegym distill``: on-policy distillation from a frozen teacher."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tracegym.config._base import _Section
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
