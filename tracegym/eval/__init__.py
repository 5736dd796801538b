"""Evaluation: pass@k, pass@(k,T), tool-call scores, cost; eval.json, plots and the HTML report.

The entry points other parts use:

- ``summarize(trajectories, ks, turns, env, model, split) -> dict``: the content of eval.json.
- ``write_eval(directory, summary, trajectories)``: eval.json + PNG plots (+ trajectories.jsonl).
- ``load_eval(path)``: read an eval.json back (or the one in a directory).
- ``build_report(run_dir, decode=None)``: RUN_DIR/report.html (see ``tracegym.eval.report``).

Plotting and the report import matplotlib / jinja2 lazily, so importing this package is cheap.
"""

from __future__ import annotations

from typing import Any

from tracegym.eval.evaluate import DEFAULT_KS, EVAL_FILE, load_eval, summarize, write_eval
from tracegym.eval.metrics import bootstrap_ci, mean_pass_at_k, pass_at_k, pass_at_k_t
from tracegym.eval.toolcalls import call_failure_stats, invalid_call_stats, reference_call_stats

__all__ = [
    "DEFAULT_KS",
    "EVAL_FILE",
    "bootstrap_ci",
    "build_report",
    "call_failure_stats",
    "invalid_call_stats",
    "load_eval",
    "mean_pass_at_k",
    "pass_at_k",
    "pass_at_k_t",
    "reference_call_stats",
    "summarize",
    "write_eval",
]


def build_report(*args: Any, **kwargs: Any):  # noqa: ANN201 - re-exported, see report.build_report
    from tracegym.eval.report import build_report as _build_report

    return _build_report(*args, **kwargs)
