"""Plots of evaluations and training runs, drawn with matplotlib's Agg canvas.

Figures are built with ``matplotlib.figure.Figure`` directly (no pyplot): no global figure state,
no GUI backend, safe to call from any thread. Every function returns a Figure; ``save_figure``
writes it atomically and ``figure_png`` gives the PNG bytes (for the HTML report).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tracegym.files import atomic_write_bytes
from tracegym.eval.metrics import assistant_turns
from tracegym.types import Trajectory

__all__ = [
    "compare_figure",
    "figure_png",
    "health_figure",
    "pass_at_k_figure",
    "pass_at_kt_heatmap",
    "save_figure",
    "training_curves_figure",
    "turns_histogram",
]

_DPI = 110


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig: Figure) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return buf.getvalue()


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write the figure as a PNG at ``path`` (atomically); returns the path."""
    path = Path(path)
    atomic_write_bytes(path, figure_png(fig))
    return path


def _series(summary: Mapping[str, Any], turn: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(ks, values, lows, highs) of pass@k at budget ``turn`` from an eval.json dict."""
    row = summary["pass_at"][turn]
    ci = summary.get("pass_at_ci", {}).get(turn, {})
    ks = sorted(int(k) for k in row)
    values = [float(row[str(k)]) for k in ks]
    lows = [float(ci.get(str(k), [v, v])[0]) for k, v in zip(ks, values)]
    highs = [float(ci.get(str(k), [v, v])[1]) for k, v in zip(ks, values)]
    return ks, values, lows, highs


def _k_axis(ax: Any, ks: Sequence[int]) -> None:
    if len(ks) > 1 and max(ks) / max(min(ks), 1) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(ks))
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_xlabel("k (samples)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)


def _title(summary: Mapping[str, Any]) -> str:
    parts = [str(summary.get(key)) for key in ("model", "env", "split") if summary.get(key)]
    return " / ".join(parts)


def _pass_at_k_curve(ax: Any, summary: Mapping[str, Any], turn: str, label: str, alpha: float) -> list[int]:
    """Plot pass@k at budget ``turn`` with its bootstrap interval as a band of opacity ``alpha``; returns its ks."""
    ks, values, lows, highs = _series(summary, turn)
    (line,) = ax.plot(ks, values, marker="o", label=label)
    ax.fill_between(ks, lows, highs, color=line.get_color(), alpha=alpha, linewidth=0)
    return ks


def _finish_pass_at_k_axes(ax: Any, ks: Iterable[int], ylabel: str, title: str) -> None:
    """The k axis over all plotted ``ks``, the y label, the title and the legend of a pass@k plot."""
    _k_axis(ax, sorted(ks))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")


def pass_at_k_figure(summary: Mapping[str, Any], title: str | None = None) -> Figure:
    """pass@k against k, one curve per turn budget T, with the bootstrap interval as a band."""
    fig = _new_figure(6.0, 4.0)
    ax = fig.add_subplot()
    turns = sorted(summary["pass_at"], key=int)
    all_ks: set[int] = set()
    for turn in turns:
        all_ks.update(_pass_at_k_curve(ax, summary, turn, f"T={turn}", alpha=0.18))
    _finish_pass_at_k_axes(ax, all_ks, "pass@(k, T)", title or f"pass@k  {_title(summary)}")
    return fig


def pass_at_kt_heatmap(summary: Mapping[str, Any], title: str | None = None) -> Figure:
    """Heat map of pass@(k, T): rows are turn budgets T, columns sample budgets k."""
    turns = sorted(summary["pass_at"], key=int)
    ks = sorted({int(k) for row in summary["pass_at"].values() for k in row})
    grid = np.full((len(turns), len(ks)), np.nan)  # (n_T, n_k)
    for i, turn in enumerate(turns):
        for j, k in enumerate(ks):
            value = summary["pass_at"][turn].get(str(k))
            if value is not None:
                grid[i, j] = float(value)
    fig = _new_figure(max(4.0, 0.8 * len(ks) + 2.0), max(2.6, 0.5 * len(turns) + 1.8))
    ax = fig.add_subplot()
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_yticks(range(len(turns)), [str(t) for t in turns])
    ax.set_xlabel("k (samples)")
    ax.set_ylabel("T (max assistant turns)")
    for i in range(len(turns)):
        for j in range(len(ks)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="black" if grid[i, j] > 0.6 else "white")
    fig.colorbar(image, ax=ax, label="pass@(k, T)")
    ax.set_title(title or f"pass@(k, T)  {_title(summary)}", fontsize=10)
    return fig


def turns_histogram(trajectories: Sequence[Trajectory]) -> Figure:
    """Assistant turns per episode, solved and unsolved episodes stacked."""
    solved = [assistant_turns(t) for t in trajectories if t.success]
    failed = [assistant_turns(t) for t in trajectories if not t.success]
    top = max(solved + failed + [1])
    bins = np.arange(0, top + 2) - 0.5
    fig = _new_figure(5.0, 3.2)
    ax = fig.add_subplot()
    ax.hist([solved, failed], bins=bins, stacked=True, label=["solved", "not solved"], color=["#2a9d8f", "#e76f51"])
    ax.set_xlabel("assistant turns")
    ax.set_ylabel("episodes")
    ax.legend(fontsize=8)
    ax.set_title("turns per episode", fontsize=10)
    return fig


def compare_figure(
    summaries: Sequence[Mapping[str, Any]], labels: Sequence[str], turn: int | None = None
) -> Figure:
    """pass@k curves of several evaluations overlaid, each at ``turn`` (default: its largest T)."""
    if len(summaries) != len(labels):
        raise ValueError(f"{len(summaries)} evaluations but {len(labels)} labels")
    fig = _new_figure(6.5, 4.2)
    ax = fig.add_subplot()
    all_ks: set[int] = set()
    budgets = set()
    for summary, label in zip(summaries, labels):
        key = str(turn) if turn is not None else str(max(int(t) for t in summary["pass_at"]))
        if key not in summary["pass_at"]:
            raise ValueError(f"evaluation '{label}' has no turn budget T={key} (has {sorted(summary['pass_at'], key=int)})")
        budgets.add(key)
        all_ks.update(_pass_at_k_curve(ax, summary, key, f"{label} (T={key})", alpha=0.15))
    _finish_pass_at_k_axes(ax, all_ks, "pass@k", "pass@k" + (f" at T={budgets.pop()}" if len(budgets) == 1 else ""))
    return fig


def training_curves_figure(
    rows: Sequence[Mapping[str, Any]], keys: Sequence[str], x_key: str | None = None, smooth: int = 0
) -> Figure:
    """One small panel per metric key against ``x_key`` (the row index when None).

    ``smooth``: when > 1, a trailing moving average over that many points is drawn over the raw
    values (which stay visible, faint).
    """
    if not keys:
        raise ValueError("training_curves_figure needs at least one metric key")
    fig, axes, cols, nrows = panel_grid(len(keys), 2.5)
    for idx, key in enumerate(keys):
        ax = axes[idx // cols][idx % cols]
        xs, ys = metric_series(rows, key, x_key)
        ax.plot(xs, ys, linewidth=1.0, alpha=0.35 if smooth > 1 and len(ys) > smooth else 1.0, color="#264653")
        if smooth > 1 and len(ys) > smooth:
            kernel = np.ones(smooth) / smooth
            smoothed = np.convolve(ys, kernel, mode="valid")
            ax.plot(xs[smooth - 1 :], smoothed, linewidth=1.6, color="#e76f51")
        style_panel(ax, key, idx // cols == nrows - 1, x_key)
    hide_unused_panels(axes, len(keys), cols, nrows)
    return fig


def panel_grid(count: int, panel_height: float) -> tuple[Figure, Any, int, int]:
    """A figure of ``count`` small panels, at most 3 per row: (figure, axes [rows][cols], cols, rows)."""
    cols = min(3, count)
    nrows = math.ceil(count / cols)
    fig = _new_figure(3.6 * cols, panel_height * nrows)
    return fig, fig.subplots(nrows, cols, squeeze=False), cols, nrows


def style_panel(ax: Any, title: str, bottom_row: bool, x_key: str | None) -> None:
    """A small panel's title, ticks and grid; the x label on the bottom row only."""
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    if bottom_row:
        ax.set_xlabel(x_key or "record", fontsize=8)


def hide_unused_panels(axes: Any, used: int, cols: int, nrows: int) -> None:
    """Hide the grid cells after the first ``used`` panels."""
    for idx in range(used, nrows * cols):
        axes[idx // cols][idx % cols].set_visible(False)


def metric_series(rows: Sequence[Mapping[str, Any]], key: str, x_key: str | None) -> tuple[list[float], list[float]]:
    """(x, y) of the rows holding a number under ``key`` (x: ``x_key``'s value, or the row index)."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        y = row.get(key)
        x = row.get(x_key, i) if x_key else i
        if _is_number(y) and _is_number(x):
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


def health_figure(
    rows: Sequence[Mapping[str, Any]], panels: Sequence[Mapping[str, Any]], x_key: str | None = None
) -> Figure:
    """The "RL health" figure: one panel per signal against ``x_key`` (the row index when None).

    Each panel is a mapping with ``title``, ``key`` (the metric plotted) and optionally
    ``threshold`` (drawn as a dashed horizontal line) with ``threshold_label`` (its legend text).
    """
    if not panels:
        raise ValueError("health_figure needs at least one panel")
    fig, axes, cols, nrows = panel_grid(len(panels), 2.6)
    for idx, panel in enumerate(panels):
        ax = axes[idx // cols][idx % cols]
        xs, ys = metric_series(rows, panel["key"], x_key)
        ax.plot(xs, ys, linewidth=1.2, marker="o" if len(ys) <= 30 else None, markersize=3, color="#264653")
        threshold = panel.get("threshold")
        if _is_number(threshold):
            ax.axhline(float(threshold), color="#c4320a", linestyle="--", linewidth=1.0,
                       label=panel.get("threshold_label") or f"threshold {threshold:g}")
            ax.legend(fontsize=7, loc="best")
        style_panel(ax, f"{panel['title']}  ({panel['key']})", idx // cols == nrows - 1, x_key)
    hide_unused_panels(axes, len(panels), cols, nrows)
    return fig


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
