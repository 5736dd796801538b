"""Turn a set of evaluation trajectories into ``eval.json`` (and plots beside it).

``summarize`` is pure: trajectories in, a JSON-ready dict out. ``write_eval`` writes that dict as
``eval.json`` plus PNG plots (and, by default, the trajectories) into a directory. The
``tracegym eval`` command runs rollouts and calls both; ``tracegym compare`` and ``tracegym
report`` only read what ``write_eval`` wrote.

eval.json fields (version 1; keys of ``pass_at`` are strings because JSON keys are):

- ``env``, ``model``, ``split``: what was evaluated.
- ``n_tasks``, ``samples_per_task`` (the smallest n of any task; ``samples_per_task_max`` too),
  ``n_trajectories``.
- ``ks``: the k values reported; ``skipped_ks``: requested k larger than samples_per_task, which
  the unbiased estimator cannot give. ``turns``: the budgets T reported; ``max_turns``: the largest.
- ``success_rate``: fraction of episodes that succeeded. ``reward_mean``: mean episode reward.
- ``pass_at[T][k]``: mean over tasks of the unbiased pass@k, a sample counting as solved at T iff
  it succeeded within T assistant turns. ``pass_at_ci[T][k]``: [low, high] percentile bootstrap
  interval over tasks (``bootstrap``: resamples, confidence, seed).
- ``cost``: per-episode means of generated tokens, prompt tokens (summed over turns: prefill
  work), assistant turns, tool calls, and wall time when the runner recorded ``info["wall_time_s"]``.
- ``tool_calls``: strict call / turn / conversation scores against ``info["reference_calls"]``,
  or null when no trajectory has references. ``invalid_calls``: invalid-call counts and rate,
  from every trajectory. ``call_failures``: why calls failed: ``attempted_calls``,
  ``failed_calls``, ``failure_rate`` and ``by_reason[reason] = {"count", "rate"}`` for ``bad_json``,
  ``unknown_tool``, ``bad_args``, ``truncated`` and ``other``, rates per call attempt
  (``toolcalls.call_failure_stats``; the episodes' ``parse_errors/<reason>`` metrics summed).
- ``end_reasons``: episode count per end reason. ``errors``: env / engine errors and timeouts,
  with the most frequent error texts.
- ``per_task``: ``{task_id: {"n": n, "solved": {T: c_T}}}`` so later tools (paired comparisons)
  can recompute any pass@(k,T) without the trajectories.
- ``metrics``: means of the numeric ``trajectory.metrics`` keys (env-specific scores).
- Only for runs with prompt-injection episodes (``tracegym.envs.injection``): ``asr`` (attack
  success rate over the injected episodes) and ``asr_ci``, ``utility_clean`` / ``utility_injected``
  (success rate of the clean / injected episodes) with ``*_ci``, ``injected_episodes``,
  ``clean_episodes``, ``asr_by_attack``, ``injection_seen_rate``, ``honeypot_calls``
  (``metrics.injection_figures``); ``per_task`` entries of injected tasks add ``injected`` (their
  injected samples) and ``attack_successes``, for paired ASR comparisons.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from tracegym.eval.metrics import (
    assistant_turns,
    bootstrap_ci_matrix,
    group_by_task,
    injection_figures,
    pass_at_k_t_per_task,
    success_rate,
    valid_ks,
)
from tracegym.eval.toolcalls import call_failure_stats, invalid_call_stats, reference_call_stats
from tracegym.files import atomic_write_bytes, atomic_write_text  # noqa: F401  (re-exported)
from tracegym.types import Trajectory, write_jsonl

__all__ = [
    "DEFAULT_KS",
    "EVAL_FILE",
    "EVAL_SCHEMA_VERSION",
    "atomic_write_bytes",
    "atomic_write_text",
    "load_eval",
    "summarize",
    "write_eval",
]

EVAL_FILE = "eval.json"
EVAL_SCHEMA_VERSION = 1
DEFAULT_KS = (1, 2, 4, 8, 16, 32, 64)
_ERROR_END_REASONS = ("env_error", "engine_error", "timeout")


def summarize(
    trajectories: Sequence[Trajectory],
    ks: Iterable[int] = DEFAULT_KS,
    turns: Iterable[int] | None = None,
    env: str | None = None,
    model: str | None = None,
    split: str | None = None,
    *,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """The content of ``eval.json`` for ``trajectories`` (all samples of all tasks of one run).

    ``ks``: sample budgets; those larger than the fewest samples any task has are skipped and
    listed in ``skipped_ks``. ``turns``: turn budgets T; None means the single budget "largest
    number of assistant turns any episode used". ``env``/``model``/``split`` default to the values
    the trajectories carry when they all agree.
    """
    trajectories = list(trajectories)
    if not trajectories:
        raise ValueError("summarize needs at least one trajectory; the evaluation produced none")
    tasks = group_by_task(trajectories)
    turn_counts = [assistant_turns(t) for t in trajectories]
    budgets = sorted({int(t) for t in turns}) if turns is not None else [max(max(turn_counts), 1)]
    if not budgets or budgets[0] < 1:
        raise ValueError(f"turn budgets must be >= 1, got {budgets}")
    kept_ks, skipped_ks = valid_ks(ks, tasks)
    if not kept_ks:
        raise ValueError(f"no k in {sorted(set(ks))} is <= the {min(t.n for t in tasks)} samples per task")

    per_task = pass_at_k_t_per_task(tasks, kept_ks, budgets)  # (n_T, n_k, n_tasks)
    means = per_task.mean(axis=2)
    low, high = bootstrap_ci_matrix(per_task, n_resamples=n_bootstrap, confidence=confidence, seed=seed)

    pass_at = {
        str(t): {str(k): round(float(means[ti, ki]), 6) for ki, k in enumerate(kept_ks)} for ti, t in enumerate(budgets)
    }
    ci = np.stack([low, high], axis=-1)  # (n_T, n_k, 2)
    pass_at_ci = {
        str(t): {str(k): [round(float(ci[ti, ki, 0]), 6), round(float(ci[ti, ki, 1]), 6)] for ki, k in enumerate(kept_ks)}
        for ti, t in enumerate(budgets)
    }

    ref_stats = reference_call_stats(trajectories)
    end_reasons = Counter(t.end_reason for t in trajectories)
    error_texts = Counter((t.error or "").strip().splitlines()[0][:200] for t in trajectories if t.error)

    traj_metrics: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in t.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
                traj_metrics.setdefault(key, []).append(float(value))

    summary: dict[str, Any] = {
        "schema_version": EVAL_SCHEMA_VERSION,
        "env": env if env is not None else _agreed(t.env for t in trajectories),
        "model": model if model is not None else _agreed(t.policy for t in trajectories),
        "split": split if split is not None else _agreed(t.split for t in trajectories),
        "n_tasks": len(tasks),
        "samples_per_task": min(t.n for t in tasks),
        "samples_per_task_max": max(t.n for t in tasks),
        "n_trajectories": len(trajectories),
        "ks": kept_ks,
        "skipped_ks": skipped_ks,
        "turns": budgets,
        "max_turns": budgets[-1],
        "success_rate": round(success_rate(trajectories), 6),
        "reward_mean": round(float(np.mean([t.reward for t in trajectories])), 6),
        "pass_at": pass_at,
        "pass_at_ci": pass_at_ci,
        "bootstrap": {"resamples": n_bootstrap, "confidence": confidence, "seed": seed, "unit": "task"},
        "cost": {
            "generated_tokens": round(float(np.mean([t.num_generated_tokens for t in trajectories])), 3),
            "prompt_tokens": round(float(np.mean([sum(len(u.prompt_ids) for u in t.turns) for t in trajectories])), 3),
            "turns": round(float(np.mean(turn_counts)), 3),
            "tool_calls": round(float(np.mean([_num_tool_calls(t) for t in trajectories])), 3),
            **_mean_wall_time(trajectories),
        },
        "tool_calls": ref_stats.to_dict() if ref_stats is not None else None,
        "invalid_calls": invalid_call_stats(trajectories).to_dict(),
        "call_failures": call_failure_stats(trajectories).to_dict(),
        "end_reasons": dict(sorted(end_reasons.items())),
        "errors": {
            **{reason: end_reasons.get(reason, 0) for reason in _ERROR_END_REASONS},
            "with_error_text": sum(1 for t in trajectories if t.error),
            "top": [{"error": text, "count": n} for text, n in error_texts.most_common(10)],
        },
        "per_task": {
            task.task_id: {"n": task.n, "solved": {str(b): task.solved_within(b) for b in budgets}} for task in tasks
        },
        "metrics": {k: round(float(np.mean(v)), 6) for k, v in sorted(traj_metrics.items())},
    }
    injection = injection_figures(trajectories, n_resamples=n_bootstrap, confidence=confidence, seed=seed)
    if injection is not None:
        summary.update(injection)
        _add_attack_counts(summary["per_task"], trajectories, single_env=len({t.env for t in trajectories}) == 1)
    return summary


def _add_attack_counts(per_task: dict[str, Any], trajectories: Sequence[Trajectory], single_env: bool) -> None:
    """``injected`` (samples) and ``attack_successes`` in the ``per_task`` entry of each injected
    task (keyed as ``group_by_task`` names tasks), for paired ASR comparisons."""
    for t in trajectories:
        if t.metrics.get("injected", 0.0) < 0.5:
            continue
        entry = per_task[t.task_id if single_env else f"{t.env}/{t.task_id}"]
        entry["injected"] = entry.get("injected", 0) + 1
        entry["attack_successes"] = entry.get("attack_successes", 0) + int(t.metrics.get("attack_success", 0.0) >= 0.5)


def _agreed(values: Iterable[str]) -> str:
    distinct = sorted({v for v in values if v})
    return distinct[0] if len(distinct) == 1 else ",".join(distinct)


def _mean_wall_time(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``{"wall_time_s": mean}`` over the episodes whose ``info`` records their wall time."""
    times = [t.info["wall_time_s"] for t in trajectories if isinstance(t.info.get("wall_time_s"), (int, float))]
    return {"wall_time_s": round(float(np.mean(times)), 4)} if times else {}


def _num_tool_calls(trajectory: Trajectory) -> int:
    return sum(len(m.tool_calls) for m in trajectory.messages if m.role == "assistant")


def load_eval(path: str | Path) -> dict[str, Any]:
    """Read an ``eval.json`` (or the one inside a directory), with a clear error when it is not one."""
    path = Path(path)
    if path.is_dir():
        path = path / EVAL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {EVAL_FILE} at {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    missing = [k for k in ("pass_at", "pass_at_ci", "ks", "turns", "success_rate") if k not in data]
    if missing:
        raise ValueError(f"{path} is not a tracegym eval.json (missing {', '.join(missing)})")
    return data


def write_eval(
    directory: str | Path,
    summary: dict[str, Any],
    trajectories: Sequence[Trajectory] | None = None,
    *,
    plots: bool = True,
    save_trajectories: bool = True,
) -> dict[str, Path]:
    """Write ``eval.json`` and the plots into ``directory``; returns the paths written by name.

    Plots: ``pass_at_k.png`` (pass@k per T with bootstrap bands), ``pass_at_kt.png`` (k x T heat
    map) and, given trajectories, ``turns.png`` (assistant turns per episode, solved vs not).
    With ``save_trajectories`` and trajectories given, they are written to ``trajectories.jsonl``
    (one ``Trajectory`` per line), which ``tracegym report`` browses.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    eval_path = directory / EVAL_FILE
    atomic_write_text(eval_path, json.dumps(summary, indent=2, sort_keys=False) + "\n")
    written["eval"] = eval_path
    if trajectories is not None and save_trajectories:
        traj_path = directory / "trajectories.jsonl"
        tmp = directory / ".trajectories.jsonl.tmp"
        write_jsonl(tmp, trajectories)
        os.replace(tmp, traj_path)
        written["trajectories"] = traj_path
    if plots:
        from tracegym.eval import plots as _plots

        written["pass_at_k"] = _plots.save_figure(_plots.pass_at_k_figure(summary), directory / "pass_at_k.png")
        written["pass_at_kt"] = _plots.save_figure(_plots.pass_at_kt_heatmap(summary), directory / "pass_at_kt.png")
        if trajectories:
            written["turns"] = _plots.save_figure(_plots.turns_histogram(trajectories), directory / "turns.png")
    return written
