"""Sampling metrics: pass@k, pass@(k,T), success rate, bootstrap confidence intervals.

pass@k (Chen et al. 2021) is the probability that at least one of k samples drawn without
replacement from the n samples of a task is correct. With c correct samples it is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

The product form never builds the huge binomials, so it stays exact in floating point for large n.
The estimator is unbiased for the pass@k of the sampling policy when k <= n.

pass@(k,T) adds the interaction budget T: a sample counts as solved at budget T iff it succeeded
and used at most T assistant turns. All T come from one set of n samples per task run at the
largest T. That is exact when the agent's first T turns do not depend on the turn limit (the
prompt does not state it), because a run cut at T is then the prefix of the run at the largest T.

Prompt-injection runs (``tracegym.envs.injection``) mark every episode with ``injected`` and
``attack_success`` in ``Trajectory.metrics``: :func:`injection_figures` gives the attack success
rate (ASR) over the injected episodes and the success rate (utility) of the clean and of the
injected episodes, each a mean over tasks with a bootstrap interval over tasks, as pass@k has.

Everything here is a pure function of counts or per-task outcomes; no file I/O, no plotting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from tracegym.types import Trajectory

__all__ = [
    "TaskOutcomes",
    "assistant_turns",
    "bootstrap_ci",
    "bootstrap_ci_matrix",
    "bootstrap_ci_seeds_tasks",
    "group_by_task",
    "injection_figures",
    "mean_pass_at_k",
    "solved_per_task",
    "paired_bootstrap_diff",
    "paired_seeds_tasks_bootstrap_diff",
    "pass_at_k",
    "pass_at_k_t",
    "pass_at_k_t_per_task",
    "success_rate",
    "valid_ks",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from ``n`` samples of which ``c`` are correct (needs k <= n)."""
    if not (isinstance(n, (int, np.integer)) and isinstance(c, (int, np.integer)) and isinstance(k, (int, np.integer))):
        raise TypeError(f"pass_at_k needs integers, got n={n!r}, c={c!r}, k={k!r}")
    if n < 1:
        raise ValueError(f"pass_at_k needs at least one sample, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        # Every k-subset contains a correct sample.
        return 1.0
    # 1 - C(n-c, k)/C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i); c factors, each in (0, 1).
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k averaged over tasks; ``counts`` holds one ``(n, c)`` pair per task."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("mean_pass_at_k needs at least one task")
    return float(np.mean(values))


def assistant_turns(trajectory: Trajectory) -> int:
    """Number of assistant turns of an episode: its token-exact turns (summaries of its own context
    left out: they are not env steps), or, for trajectories stored without turns (text-level engines,
    imported data), its assistant messages."""
    if trajectory.turns:
        return sum(1 for t in trajectory.turns if t.kind == "action")
    return sum(1 for m in trajectory.messages if m.role == "assistant")


@dataclass(frozen=True)
class TaskOutcomes:
    """The n samples of one task: whether each succeeded and how many assistant turns it used."""

    task_id: str
    success: tuple[bool, ...]
    turns: tuple[int, ...]
    sample_indices: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if len(self.success) != len(self.turns):
            raise ValueError(f"task {self.task_id}: {len(self.success)} success flags but {len(self.turns)} turn counts")
        if not self.success:
            raise ValueError(f"task {self.task_id}: no samples")

    @property
    def n(self) -> int:
        return len(self.success)

    def solved_within(self, max_turns: int | None) -> int:
        """c at budget T: samples that succeeded within ``max_turns`` assistant turns (None: any)."""
        if max_turns is None:
            return sum(self.success)
        return sum(1 for ok, t in zip(self.success, self.turns) if ok and t <= max_turns)


def group_by_task(trajectories: Iterable[Trajectory]) -> list[TaskOutcomes]:
    """One ``TaskOutcomes`` per (env, task_id), in order of first appearance.

    Two trajectories with the same task and the same ``sample_index`` are a duplicate write (a
    resumed rollout), not two samples: that is an error, since it would bias every estimate.
    """
    groups: dict[tuple[str, str], list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault((traj.env, traj.task_id), []).append(traj)
    envs = {env for env, _ in groups}
    outcomes = []
    for (env, task_id), trajs in groups.items():
        indices = [t.sample_index for t in trajs]
        if len(set(indices)) != len(indices):
            dup = sorted({i for i in indices if indices.count(i) > 1})
            raise ValueError(f"task {env}/{task_id} has duplicate sample_index {dup}: the same sample was written twice")
        name = task_id if len(envs) == 1 else f"{env}/{task_id}"
        outcomes.append(
            TaskOutcomes(
                task_id=name,
                success=tuple(bool(t.success) for t in trajs),
                turns=tuple(assistant_turns(t) for t in trajs),
                sample_indices=tuple(indices),
            )
        )
    return outcomes


def valid_ks(ks: Iterable[int], tasks: Sequence[TaskOutcomes]) -> tuple[list[int], list[int]]:
    """Split ``ks`` into those every task supports (k <= its n) and those skipped; sorted, unique."""
    min_n = min(t.n for t in tasks)
    ks_sorted = sorted({int(k) for k in ks})
    bad = [k for k in ks_sorted if k < 1]
    if bad:
        raise ValueError(f"k must be >= 1, got {bad}")
    return [k for k in ks_sorted if k <= min_n], [k for k in ks_sorted if k > min_n]


def pass_at_k_t_per_task(
    tasks: Sequence[TaskOutcomes], ks: Sequence[int], turn_budgets: Sequence[int]
) -> np.ndarray:
    """Per-task pass@(k,T) values, shape (len(turn_budgets), len(ks), n_tasks)."""
    out = np.empty((len(turn_budgets), len(ks), len(tasks)), dtype=np.float64)
    for ti, budget in enumerate(turn_budgets):
        for j, task in enumerate(tasks):
            c = task.solved_within(budget)
            for ki, k in enumerate(ks):
                out[ti, ki, j] = pass_at_k(task.n, c, k)
    return out


def pass_at_k_t(
    tasks: Sequence[TaskOutcomes], ks: Sequence[int], turn_budgets: Sequence[int]
) -> dict[int, dict[int, float]]:
    """pass@(k,T) averaged over tasks: ``{T: {k: value}}``. Every k must be <= every task's n."""
    if not tasks:
        raise ValueError("pass_at_k_t needs at least one task")
    values = pass_at_k_t_per_task(tasks, ks, turn_budgets).mean(axis=2)
    return {int(t): {int(k): float(values[ti, ki]) for ki, k in enumerate(ks)} for ti, t in enumerate(turn_budgets)}


def success_rate(trajectories: Sequence[Trajectory]) -> float:
    """Fraction of all episodes that succeeded (equals pass@1 at the largest T when every task has
    the same number of samples)."""
    if not trajectories:
        raise ValueError("success_rate needs at least one trajectory")
    return float(np.mean([bool(t.success) for t in trajectories]))


def bootstrap_ci_matrix(
    per_task: np.ndarray,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap over tasks for many statistics at once.

    ``per_task`` has shape (..., n_tasks): the last axis is the task axis; each statistic is the
    mean over tasks. Tasks are resampled with replacement; the same resampled task sets are used
    for every statistic, so the intervals of pass@(k,T) for different k and T are coherent (e.g. a
    resample never has pass@2 below pass@1). Returns (low, high), each of shape (...).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    per_task = np.asarray(per_task, dtype=np.float64)
    n_tasks = per_task.shape[-1]
    if n_tasks == 0:
        raise ValueError("bootstrap needs at least one task")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_tasks, size=(n_resamples, n_tasks))  # (B, n_tasks)
    # Counting how often each task is drawn turns the resampled means into one matmul:
    # weights (B, n_tasks) / n_tasks, stats (..., n_tasks) -> (..., B).
    weights = np.zeros((n_resamples, n_tasks), dtype=np.float64)
    np.add.at(weights, (np.arange(n_resamples)[:, None], idx), 1.0)
    means = per_task @ weights.T / n_tasks
    alpha = (1.0 - confidence) / 2.0
    low = np.quantile(means, alpha, axis=-1)
    high = np.quantile(means, 1.0 - alpha, axis=-1)
    return low, high


def bootstrap_ci(
    per_task_values: Sequence[float],
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over tasks of one statistic."""
    low, high = bootstrap_ci_matrix(np.asarray(per_task_values, dtype=np.float64), n_resamples, confidence, seed)
    return float(low), float(high)


def solved_per_task(summary: Mapping[str, Any], turns: int | str) -> dict[str, tuple[int, int]]:
    """task id -> (samples n, samples solved within ``turns``) of an ``eval.json`` summary: the
    input :func:`paired_bootstrap_diff` pairs two evaluations on."""
    return {task: (row["n"], row["solved"][str(turns)]) for task, row in summary["per_task"].items()}


def paired_bootstrap_diff(
    a: Mapping[str, tuple[int, int]],
    b: Mapping[str, tuple[int, int]],
    k: int,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float, int]:
    """pass@k(b) - pass@k(a) on the tasks both evaluated, with a paired bootstrap interval.

    ``a`` and ``b`` map task id -> (n, c). Pairing (resampling the same tasks for both) removes the
    task-difficulty variance that two independent intervals would count twice. Returns
    (difference, low, high, number of shared tasks).
    """
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError("the two evaluations share no task id")
    diffs = np.array([pass_at_k(*b[t], k) - pass_at_k(*a[t], k) for t in shared])
    low, high = bootstrap_ci(diffs, n_resamples, confidence, seed)
    return float(diffs.mean()), low, high, len(shared)



# --- several training seeds evaluated on the same tasks ------------------------------------------
#
# One table per method, rows = training seeds, columns = held-out tasks (the same tasks for every
# seed), cells = a per-task statistic such as pass@1. Both axes are samples: the tasks of the test
# set, and the seeds of the training runs that could have been. The bootstrap below draws rows and
# columns with replacement independently (a crossed two-way bootstrap), so its interval holds the
# spread between seeds as well as the task sampling. With 2 or 3 seeds the seed draw has only a few
# distinct outcomes: the interval is wide and coarse, which is what so few seeds can tell.


def _resample_counts(rng: np.random.Generator, size: int, n_resamples: int) -> np.ndarray:
    """How often each of ``size`` items is drawn in each of ``n_resamples`` draws with replacement: (B, size)."""
    return rng.multinomial(size, np.full(size, 1.0 / size), size=n_resamples).astype(np.float64)


def _resampled_means(table: np.ndarray, seed_counts: np.ndarray, task_counts: np.ndarray) -> np.ndarray:
    """Mean of ``table`` (seeds, tasks) under each resample's row and column counts: (B,)."""
    n_seeds, n_tasks = table.shape
    return np.einsum("bs,st,bt->b", seed_counts, table, task_counts) / (n_seeds * n_tasks)


def _percentile_interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    return float(np.quantile(values, alpha)), float(np.quantile(values, 1.0 - alpha))


def _check_bootstrap_args(n_resamples: int, confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")


def _seeds_by_tasks(table: Any, name: str) -> np.ndarray:
    table = np.asarray(table, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] < 1 or table.shape[1] < 1:
        raise ValueError(f"{name} must be a (seeds, tasks) table with at least one of each, got shape {table.shape}")
    return table


def bootstrap_ci_seeds_tasks(
    per_seed_task: Any, n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of a (seeds, tasks) table, resampling seeds
    (rows) and tasks (columns) with replacement, independently of each other."""
    _check_bootstrap_args(n_resamples, confidence)
    table = _seeds_by_tasks(per_seed_task, "per_seed_task")
    rng = np.random.default_rng(seed)
    seed_counts = _resample_counts(rng, table.shape[0], n_resamples)
    task_counts = _resample_counts(rng, table.shape[1], n_resamples)
    return _percentile_interval(_resampled_means(table, seed_counts, task_counts), confidence)


def paired_seeds_tasks_bootstrap_diff(
    a: Any, b: Any, n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """mean(b) - mean(a) of two (seeds, tasks) tables whose columns are the same tasks, with a
    percentile bootstrap interval; returns (difference, low, high).

    Paired over tasks: each resample draws one set of task columns for both tables, which removes
    the task-difficulty variance both share. Seeds are not paired: seed s of one method and seed s
    of another are unrelated training runs, so each table's rows are resampled on their own (the
    tables may have different numbers of seeds)."""
    _check_bootstrap_args(n_resamples, confidence)
    a = _seeds_by_tasks(a, "a")
    b = _seeds_by_tasks(b, "b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"the tables must have the same task columns, got {a.shape[1]} and {b.shape[1]} tasks")
    rng = np.random.default_rng(seed)
    task_counts = _resample_counts(rng, a.shape[1], n_resamples)
    seed_counts_a = _resample_counts(rng, a.shape[0], n_resamples)
    seed_counts_b = _resample_counts(rng, b.shape[0], n_resamples)
    diffs = _resampled_means(b, seed_counts_b, task_counts) - _resampled_means(a, seed_counts_a, task_counts)
    low, high = _percentile_interval(diffs, confidence)
    return float(b.mean() - a.mean()), low, high



def _rate_over_tasks(
    trajectories: Sequence[Trajectory], value: Callable[[Trajectory], float], n_resamples: int, confidence: float,
    seed: int,
) -> tuple[float | None, list[float] | None]:
    """Mean over tasks of the per-task mean of ``value``, and its bootstrap interval over tasks;
    (None, None) without trajectories."""
    by_task: dict[tuple[str, str], list[float]] = {}
    for t in trajectories:
        by_task.setdefault((t.env, t.task_id), []).append(value(t))
    if not by_task:
        return None, None
    per_task = [float(np.mean(v)) for v in by_task.values()]
    low, high = bootstrap_ci(per_task, n_resamples, confidence, seed)
    return round(float(np.mean(per_task)), 6), [round(low, 6), round(high, 6)]


def injection_figures(
    trajectories: Sequence[Trajectory], n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> dict[str, Any] | None:
    """ASR and utility of a run with prompt-injection episodes, or None when no trajectory carries
    the ``injected`` metric (episodes that failed before their first step carry none and are left out).

    ``asr``: attack success rate over the injected episodes; ``utility_clean`` /
    ``utility_injected``: success rate over the clean / the injected episodes (all of them: also
    those where the agent never reached the injected text, so both are unbiased); each a mean over
    tasks with a ``*_ci`` bootstrap interval over tasks (None where the group is empty). Also:
    ``injected_episodes``, ``clean_episodes``, ``asr_by_attack`` (``{kind: {"episodes", "asr"}}``,
    over episodes), ``injection_seen_rate`` (injected episodes whose agent read the text) and
    ``honeypot_calls`` (calls of the honeypot tool per episode, where it was offered)."""
    marked = [t for t in trajectories if "injected" in t.metrics]
    if not marked:
        return None
    injected = [t for t in marked if t.metrics["injected"] >= 0.5]
    clean = [t for t in marked if t.metrics["injected"] < 0.5]
    args = (n_resamples, confidence, seed)
    asr, asr_ci = _rate_over_tasks(injected, lambda t: float(t.metrics.get("attack_success", 0.0)), *args)
    utility_clean, utility_clean_ci = _rate_over_tasks(clean, lambda t: float(t.success), *args)
    utility_injected, utility_injected_ci = _rate_over_tasks(injected, lambda t: float(t.success), *args)
    by_attack: dict[str, list[float]] = {}
    for t in injected:
        for key in t.metrics:
            if key.startswith("attack/"):
                kind = key.removeprefix("attack/")
                by_attack.setdefault(kind, []).append(float(t.metrics.get("attack_success", 0.0)))
    honeypot = [t.metrics["honeypot_calls"] for t in marked if "honeypot_calls" in t.metrics]
    return {
        "asr": asr,
        "asr_ci": asr_ci,
        "utility_clean": utility_clean,
        "utility_clean_ci": utility_clean_ci,
        "utility_injected": utility_injected,
        "utility_injected_ci": utility_injected_ci,
        "injected_episodes": len(injected),
        "clean_episodes": len(clean),
        "asr_by_attack": {kind: {"episodes": len(v), "asr": round(float(np.mean(v)), 6)}
                          for kind, v in sorted(by_attack.items())},
        "injection_seen_rate": round(float(np.mean([t.metrics.get("injection_seen", 0.0) for t in injected])), 6)
        if injected else None,
        "honeypot_calls": round(float(np.mean(honeypot)), 6) if honeypot else None,
    }
