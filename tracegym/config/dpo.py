"""The config of ``tracegym dpo``: preference learning (DPO, DMPO, KTO) on recorded trajectories."""

from __future__ import annotations

from pydantic import Field, model_validator

from tracegym.config._base import _Section
from tracegym.config.shared import CheckpointConfig, LoggingConfig, LoraConfig, ModelConfig, OptimConfig


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
