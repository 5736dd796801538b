"""The config of ``tracegym sft``: supervised fine-tuning on recorded trajectories."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tracegym.config._base import _Section
from tracegym.config.shared import CheckpointConfig, LoggingConfig, LoraConfig, ModelConfig, OptimConfig


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
