"""``TrainResult``: what a training recipe returns (``train_sft``, ``train_rl``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TrainResult"]


@dataclass
class TrainResult:
    """The run folder, the final model folder, the last step and the metric rows of one training run."""

    run_dir: Path
    final_dir: Path | None  # None when the run stopped early (``stop_at_step``)
    step: int
    history: list[dict[str, Any]] = field(default_factory=list)  # rows logged by this invocation
