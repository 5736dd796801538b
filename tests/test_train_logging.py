"""Metrics sinks: metrics.jsonl lines, TensorBoard events, resume truncation, W&B guard."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tracegym.train.logging import MetricsLogger, ProgressBar, process_rss_mb, read_metrics


def _tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_metrics_jsonl_and_tensorboard_are_written(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"loss": 2.5, "lr": torch.tensor(1e-3), "note": "warmup", "ok": True})
        # Flushed per line: readable while the logger is still open.
        assert read_metrics(tmp_path)[0]["loss"] == 2.5
        logger.log(2, {"loss": 1.25, "lr": 2e-3, "grad_norm": float("nan")})
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["note"] == "warmup" and rows[0]["ok"] == 1
    assert rows[0]["lr"] == pytest.approx(1e-3)
    assert rows[1]["grad_norm"] == "nan"  # JSON has no NaN; the line stays valid JSON
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["loss"] == [(1, 2.5), (2, 1.25)]
    assert "note" not in scalars


def test_resume_drops_steps_logged_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
    # The run crashed after step 5; the checkpoint was at step 3.
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=3) as logger:
        logger.log(4, {"loss": 40.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    # A fresh (non-resumed) run in the same folder starts a fresh file.
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"loss": 9.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_torn_last_line_is_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}]


def test_wandb_requested_but_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(RuntimeError, match="wandb package is not installed"):
        MetricsLogger(tmp_path, tensorboard=False, wandb=True)


def test_rss_is_plausible():
    # In a fresh process: in the test session the allocator may hand back pages it already holds,
    # so a new 64 MiB block need not raise the resident size there.
    import subprocess

    code = (
        "import numpy as np\n"
        "from tracegym.train.logging import process_rss_mb\n"
        "before = process_rss_mb()\n"
        "block = np.ones(64 * 2**20 // 4, dtype=np.float32)  # 64 MiB, touched\n"
        "print(before, process_rss_mb())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after = map(float, out.split())
    assert 10 < before < 100_000
    assert after - before > 40


def test_progress_bar_disabled_is_a_no_op():
    with ProgressBar(10, enabled=False) as bar:
        bar.update(1, info="loss 1.0")
