"""A self-contained HTML report of a run directory.

``build_report(run_dir)`` gathers what a run left behind and writes ``run_dir/report.html``:

- every ``config.yaml`` (the run's own first, then those of sub-runs such as ``sft/`` and ``rl/``),
- training curves from every ``metrics.jsonl`` (whichever numeric keys exist: reward, loss, KL,
  entropy, ...),
- an "RL health" figure for every ``metrics.jsonl`` that logged health signals (``HEALTH_PANELS``:
  within-group reward std, informative groups, entropy, policy drift, probe NLL, prompt/response
  MI), with the warning thresholds of the run's config as dashed lines,
- evaluation tables and plots from every ``eval.json`` (e.g. ``{base,sft,rl}/eval.json``), with a
  table of why tool calls failed (``call_failures``: count and rate per call attempt of each reason),
- a sample of trajectories from every JSONL file of trajectories: the conversation with tool calls
  and results, reward and end reason, and, given a decode function, the exact tokens of each turn
  with the trained (completion) tokens highlighted.

The page has no script and loads nothing: CSS is inline and plots are base64 PNG data URIs. All
text from the run (messages, configs, errors, file names) is HTML-escaped by jinja2's autoescape.
The file is written atomically (temporary file + rename).
"""

from __future__ import annotations

import base64
import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from markupsafe import Markup

from tracegym.eval.evaluate import EVAL_FILE, load_eval
from tracegym.files import atomic_write_text
from tracegym.eval.metrics import assistant_turns
from tracegym.render.call_errors import CALL_FAILURE_DESCRIPTIONS, failures_in_metrics
from tracegym.types import CALL_FAILURE_REASONS, Message, Trajectory, read_json_rows

__all__ = ["EVAL_COLUMNS", "HEALTH_PANELS", "INJECTION_COLUMNS", "REPORT_FILE", "build_report", "call_failure_rows", "eval_row",
           "decoder_from_tokenizer", "find_run_files", "has_injection", "health_thresholds", "render_report"]

REPORT_FILE = "report.html"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
_MAX_DEPTH = 4  # how deep below the run dir to look for files
_SKIP_DIRS = {"checkpoints", "checkpoint", "__pycache__", "tb", "tensorboard", "wandb", "node_modules"}
_X_KEYS = ("step", "epoch", "time", "timestamp", "wall_time", "elapsed_s")
# Training keys shown first when present (substring match, case-insensitive), in this order.
_PREFERRED = ("reward", "success", "loss", "kl", "entropy", "grad_norm", "clip", "lr", "adv", "len", "token")
_MAX_PANELS = 12
_MAX_TOKENS_SHOWN = 4000  # per trajectory; beyond it the token view says how many were left out

Decode = Callable[[Sequence[int]], str]


def decoder_from_tokenizer(tokenizer: Any) -> Decode:
    """A decode function from a Hugging Face tokenizer (special tokens kept visible)."""
    if not hasattr(tokenizer, "decode"):
        raise TypeError(f"{type(tokenizer).__name__} has no decode method")

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    return decode


# --- finding files ------------------------------------------------------------------------------


@dataclass
class RunFiles:
    configs: list[Path] = field(default_factory=list)
    metrics: list[Path] = field(default_factory=list)
    evals: list[Path] = field(default_factory=list)
    jsonl: list[Path] = field(default_factory=list)  # candidate trajectory files


def _walk(root: Path) -> Iterator[Path]:
    """Files under ``root`` down to _MAX_DEPTH, root first, then sub-folders in name order; hidden
    folders and checkpoint / logger folders are skipped (they can hold thousands of files)."""
    root_depth = len(root.parts)
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and d.lower() not in _SKIP_DIRS and len(here.parts) - root_depth < _MAX_DEPTH
        )
        for name in sorted(filenames):
            yield here / name


def find_run_files(run_dir: str | Path) -> RunFiles:
    """The config, metrics, eval and JSONL files of a run directory (depth-first, sorted)."""
    files = RunFiles()
    for path in _walk(Path(run_dir)):
        if path.name == CONFIG_FILE:
            files.configs.append(path)
        elif path.name == METRICS_FILE:
            files.metrics.append(path)
        elif path.name == EVAL_FILE:
            files.evals.append(path)
        elif path.suffix == ".jsonl" and not path.name.startswith("."):
            files.jsonl.append(path)
    return files


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _label(path: Path, root: Path) -> str:
    """A short name for the run a file belongs to: its folder relative to the run dir."""
    parent = path.parent.relative_to(root).as_posix()
    return root.name if parent == "." else parent


# --- reading ------------------------------------------------------------------------------------


def _read_json_lines(path: Path, limit: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """Rows of a JSONL file and how many lines were unreadable (torn or not JSON objects)."""
    return read_json_rows(path, limit)


def _png_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _figure_uri(fig: Any) -> str:
    from tracegym.eval.plots import figure_png

    return _png_uri(figure_png(fig))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def choose_metric_keys(rows: Sequence[Mapping[str, Any]], limit: int = _MAX_PANELS) -> list[str]:
    """Numeric keys worth a panel: preferred names (reward, loss, kl, entropy...) first, then the
    rest in first-seen order; x-axis keys (step, time) excluded."""
    seen: dict[str, int] = {}
    for row in rows:
        for key, value in row.items():
            if _is_number(value) and key not in _X_KEYS:
                seen[key] = seen.get(key, 0) + 1
    keys = [k for k in seen if seen[k] >= 2 or len(rows) == 1]

    def rank(key: str) -> tuple[int, int]:
        lower = key.lower()
        for i, pattern in enumerate(_PREFERRED):
            if pattern in lower:
                return (i, keys.index(key))
        return (len(_PREFERRED), keys.index(key))

    return sorted(keys, key=rank)[:limit]


# --- sections -----------------------------------------------------------------------------------


def _config_section(files: RunFiles, root: Path) -> list[dict[str, Any]]:
    out = []
    for path in files.configs:
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append({"label": _rel(path, root), "text": text})
    return out


def _training_section(files: RunFiles, root: Path) -> list[dict[str, Any]]:
    from tracegym.eval.plots import training_curves_figure

    out = []
    for path in files.metrics:
        rows, bad = _read_json_lines(path)
        entry: dict[str, Any] = {"label": _label(path, root), "path": _rel(path, root), "rows": len(rows), "bad": bad,
                                 "plot": None, "last": [], "keys": []}
        keys = choose_metric_keys(rows)
        if keys:
            x_key = "step" if any(_is_number(r.get("step")) for r in rows) else None
            smooth = max(1, len(rows) // 25) if len(rows) > 50 else 0
            entry["plot"] = _figure_uri(training_curves_figure(rows, keys, x_key=x_key, smooth=smooth))
            entry["keys"] = keys
            last = rows[-1]
            entry["last"] = [(k, _fmt(last.get(k))) for k in keys]
            entry["last_step"] = last.get("step", len(rows) - 1)
        out.append(entry)
    return out


# The panels of the "RL health" figure (tracegym/train/health.py, docs/algorithms.md "Health
# monitors"): (title, metric keys in order of preference). A panel plots the first key the rows hold
# and is left out when they hold none; entropy and drift are also read under the keys the RL loop
# and tracegym/train/drift.py log them as.
HEALTH_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward std within groups", ("health/reward_std",)),
    ("groups with signal", ("health/informative_groups",)),
    ("entropy", ("health/entropy", "train/entropy")),
    ("policy drift KL", ("health/drift_kl", "drift/kl")),
    ("probe NLL", ("health/probe_nll", "drift/probe_nll")),
    ("MI(prompt; response)", ("health/mi",)),
)
# train/entropy is logged by every RL run: alone it does not make a health section
_HEALTH_TRIGGERS = {key for _, keys in HEALTH_PANELS for key in keys} - {"train/entropy"}


def _find_key(tree: Any, name: str) -> Any:
    """The value of the first ``name`` key anywhere in a nested config mapping (None if absent)."""
    if isinstance(tree, Mapping):
        if name in tree:
            return tree[name]
        for value in tree.values():
            found = _find_key(value, name)
            if found is not None:
                return found
    return None


def health_thresholds(config: Mapping[str, Any] | None) -> dict[str, tuple[float, str]]:
    """Metric key -> (threshold, legend text) for the health figure, from a run's config dict.

    ``health.min_reward_std`` and ``health.min_mutual_information`` (``HealthConfig``); when the
    config has no ``health`` section, ``HealthConfig``'s defaults, labelled as defaults; a threshold
    set to None draws no line. The drift panel gets ``max_policy_drift`` where the config sets one.
    """
    from tracegym.train.health import HealthConfig

    section = (config or {}).get("health")
    source = "default " if not isinstance(section, Mapping) else ""
    section = section if isinstance(section, Mapping) else HealthConfig().model_dump()
    out: dict[str, tuple[float, str]] = {}
    for key, field in (("health/reward_std", "min_reward_std"), ("health/mi", "min_mutual_information")):
        value = section.get(field)
        if _is_number(value):
            out[key] = (float(value), f"{source}{field} {value:g}")
    cap = _find_key(config or {}, "max_policy_drift")
    if _is_number(cap):
        for key in ("health/drift_kl", "drift/kl"):
            out[key] = (float(cap), f"max_policy_drift {cap:g}")
    return out


def _read_config(path: Path) -> dict[str, Any] | None:
    """The YAML mapping in ``path`` (None when missing or unreadable: the report never fails on it)."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _health_section(files: RunFiles, root: Path) -> list[dict[str, Any]]:
    """One "RL health" entry per metrics file that logged a health signal: its figure and, per
    panel, the last value and the threshold. Thresholds come from the config.yaml next to it."""
    from tracegym.eval.plots import health_figure

    out = []
    for path in files.metrics:
        rows, _ = _read_json_lines(path)
        present = {k for row in rows for k, v in row.items() if _is_number(v)}
        if not present & _HEALTH_TRIGGERS:
            continue
        thresholds = health_thresholds(_read_config(path.parent / CONFIG_FILE))
        panels = []
        for title, keys in HEALTH_PANELS:
            key = next((k for k in keys if k in present), None)
            if key is None:
                continue
            threshold, label = thresholds.get(key, (None, ""))
            last = next((row[key] for row in reversed(rows) if _is_number(row.get(key))), None)
            panels.append({"title": title, "key": key, "threshold": threshold, "threshold_label": label,
                           "last": _fmt(last), "threshold_text": label or "–"})
        x_key = "step" if any(_is_number(r.get("step")) for r in rows) else None
        out.append({"label": _label(path, root), "path": _rel(path, root), "panels": panels,
                    "plot": _figure_uri(health_figure(rows, panels, x_key=x_key))})
    return out


def _fmt(value: Any, digits: int = 4) -> str:
    if _is_number(value):
        if isinstance(value, int):
            return str(value)
        return f"{value:.{digits}g}"
    return "" if value is None else str(value)


def _pct(value: Any) -> str:
    return f"{100 * value:.1f}%" if _is_number(value) else "–"


def _ci_text(summary: Mapping[str, Any], turn: str, k: str) -> str:
    value = summary.get("pass_at", {}).get(turn, {}).get(k)
    ci = summary.get("pass_at_ci", {}).get(turn, {}).get(k)
    if value is None:
        return "–"
    if ci:
        return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
    return f"{value:.3f}"


# The cells of one evaluation in the comparison tables, in display order.
EVAL_COLUMNS = ["label", "env", "model", "split", "tasks", "T", "pass@1", "pass@k", "success", "turns", "tokens",
                 "tool calls", "invalid calls", "call P/R", "conv EM"]
# Added to the tables when an evaluation had prompt-injection episodes (docs/safety.md).
INJECTION_COLUMNS = ["asr", "utility clean / injected"]


def _rate_ci_text(summary: Mapping[str, Any], key: str) -> str:
    value, ci = summary.get(key), summary.get(f"{key}_ci")
    if not _is_number(value):
        return "–"
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"


def has_injection(summary: Mapping[str, Any]) -> bool:
    """Whether an evaluation had prompt-injection episodes (its eval.json has ``injected_episodes``)."""
    return "injected_episodes" in summary


def eval_row(summary: Mapping[str, Any], label: str, turn: int | None = None, k: int | None = None) -> dict[str, str]:
    """One evaluation as the cells of the comparison table (shared with ``tracegym compare``).

    pass@1 and pass@k are read at budget ``turn`` (default: the evaluation's largest T) and
    ``k`` (default: its largest k); a cell the evaluation lacks shows "–".
    """
    turn_key = str(turn) if turn is not None else str(max(int(t) for t in summary["pass_at"]))
    row_at_t = summary["pass_at"].get(turn_key, {})
    ks = sorted(int(x) for x in row_at_t)
    k_max = str(k) if k is not None else (str(ks[-1]) if ks else "?")
    turn = turn_key
    cost = summary.get("cost", {})
    tool = summary.get("tool_calls") or {}
    invalid = summary.get("invalid_calls") or {}
    return {
        "label": label,
        "env": str(summary.get("env", "")),
        "model": str(summary.get("model", "")),
        "split": str(summary.get("split", "")),
        "tasks": f"{summary.get('n_tasks', '?')} × {summary.get('samples_per_task', '?')}",
        "T": turn,
        "pass@1": _ci_text(summary, turn, "1"),
        "pass@k": f"k={k_max}: {_ci_text(summary, turn, k_max)}",
        "success": _pct(summary.get("success_rate")),
        "turns": _fmt(cost.get("turns"), 3),
        "tokens": _fmt(cost.get("generated_tokens"), 4),
        "tool calls": _fmt(cost.get("tool_calls"), 3),
        "invalid calls": _pct(invalid.get("invalid_call_rate")),
        "call P/R": f"{tool['call_precision']:.2f} / {tool['call_recall']:.2f}" if tool else "–",
        "conv EM": _pct(tool.get("conversation_exact_match")) if tool else "–",
        "asr": _rate_ci_text(summary, "asr"),
        "utility clean / injected": (f"{_pct(summary.get('utility_clean'))} / {_pct(summary.get('utility_injected'))}"
                                     if has_injection(summary) else "–"),
    }


def call_failure_rows(summary: Mapping[str, Any]) -> list[dict[str, str]]:
    """The "why tool calls failed" table of an evaluation: one row per reason (count, rate per call
    attempt, meaning), then the total; [] when its eval.json has no ``call_failures`` (written before
    they existed) or no call was attempted."""
    failures = summary.get("call_failures") or {}
    by_reason = failures.get("by_reason") or {}
    if not failures.get("attempted_calls"):
        return []
    rows = [{"reason": reason, "count": str(by_reason.get(reason, {}).get("count", 0)),
             "rate": _pct(by_reason.get(reason, {}).get("rate", 0.0)), "meaning": CALL_FAILURE_DESCRIPTIONS[reason]}
            for reason in CALL_FAILURE_REASONS]
    rows.append({"reason": "all", "count": str(failures.get("failed_calls", 0)), "rate": _pct(failures.get("failure_rate")),
                 "meaning": f"of {failures['attempted_calls']} call attempts"})
    return rows


def _eval_section(files: RunFiles, root: Path) -> tuple[list[dict[str, Any]], str | None]:
    from tracegym.eval.plots import compare_figure, pass_at_k_figure, pass_at_kt_heatmap

    evals = []
    for path in files.evals:
        label = _label(path, root)
        try:
            summary = load_eval(path)
            entry: dict[str, Any] = {"label": label, "path": _rel(path, root), "error": None, "row": eval_row(summary, label)}
        except (ValueError, KeyError, TypeError, OSError) as e:
            evals.append({"label": label, "path": _rel(path, root), "error": f"{type(e).__name__}: {e}"})
            continue
        turns = sorted(summary["pass_at"], key=int)
        ks = sorted({int(k) for row in summary["pass_at"].values() for k in row})
        entry["ks"] = ks
        entry["grid"] = [(t, [_ci_text(summary, t, str(k)) for k in ks]) for t in turns]
        entry["curve"] = _figure_uri(pass_at_k_figure(summary, title=f"pass@k  {label}"))
        entry["heatmap"] = _figure_uri(pass_at_kt_heatmap(summary, title=f"pass@(k, T)  {label}"))
        entry["end_reasons"] = sorted((summary.get("end_reasons") or {}).items())
        entry["errors"] = (summary.get("errors") or {}).get("top", [])
        entry["skipped_ks"] = summary.get("skipped_ks", [])
        entry["attacks"] = sorted((summary.get("asr_by_attack") or {}).items())
        entry["call_failures"] = call_failure_rows(summary)
        entry["summary"] = summary
        evals.append(entry)
    good = [e for e in evals if not e.get("error")]
    overlay = None
    if len(good) > 1:
        overlay = _figure_uri(compare_figure([e["summary"] for e in good], [e["label"] for e in good]))
    return evals, overlay


# --- trajectories -------------------------------------------------------------------------------


def _read_trajectories(path: Path, scan_limit: int) -> tuple[list[Trajectory], int, bool]:
    """Up to ``scan_limit`` trajectories of a JSONL file, the count of unreadable lines, and
    whether the file is a trajectory file at all (its first readable line is a Trajectory)."""
    trajectories: list[Trajectory] = []
    bad = 0
    rows, bad_json = _read_json_lines(path, limit=scan_limit)
    for i, row in enumerate(rows):
        try:
            trajectories.append(Trajectory.model_validate(row))
        except Exception:  # pydantic ValidationError and friends: not a trajectory line
            if i == 0:
                return [], 0, False
            bad += 1
    return trajectories, bad + bad_json, bool(trajectories)


def sample_trajectories(trajectories: Sequence[Trajectory], limit: int) -> list[Trajectory]:
    """A deterministic, mixed sample: solved and unsolved episodes alternate (file order within
    each), so a mostly failing run still shows its successes and vice versa."""
    solved = [t for t in trajectories if t.success]
    failed = [t for t in trajectories if not t.success]
    out: list[Trajectory] = []
    while len(out) < limit and (solved or failed):
        for pool in (solved, failed):
            if pool and len(out) < limit:
                out.append(pool.pop(0))
    return out


def _tool_call_text(call: Any) -> str:
    return json.dumps(call.arguments, ensure_ascii=False, sort_keys=True)


def _message_view(message: Message) -> dict[str, Any]:
    return {
        "role": message.role,
        "name": message.name,
        "content": message.content,
        "tool_calls": [{"name": c.name, "arguments": _tool_call_text(c), "id": c.id} for c in message.tool_calls],
        "error": message.role == "tool" and message.content.lstrip().lower().startswith("error:"),
    }


def token_view(trajectory: Trajectory, decode: Decode, max_tokens: int = _MAX_TOKENS_SHOWN) -> tuple[Markup, dict[str, int]]:
    """The episode's tokens, context in grey and sampled (trained) tokens highlighted.

    Turn t's prompt usually extends turn t-1's prompt + completion; only the new part is shown.
    Where it does not (the template rewrote history), the full prompt is shown after a marker.
    Each token is decoded on its own, so token boundaries stay visible.
    """
    parts: list[Markup] = []
    shown = 0
    stats = {"trained": 0, "context": 0, "rewrites": 0, "hidden": 0}
    sequence: tuple[int, ...] = ()

    def emit(ids: Sequence[int], css: str) -> None:
        nonlocal shown
        for token_id in ids:
            if shown >= max_tokens:
                stats["hidden"] += 1
                continue
            text = decode([token_id])
            parts.append(Markup('<span class="tok {}" title="{}">{}</span>').format(css, token_id, text))
            shown += 1

    for turn in trajectory.turns:
        prompt = tuple(turn.prompt_ids)
        if prompt[: len(sequence)] == sequence:
            new_context = prompt[len(sequence):]
        else:
            stats["rewrites"] += 1
            parts.append(Markup('<div class="rewrite">prompt re-rendered: the template changed earlier tokens</div>'))
            new_context = prompt
        emit(new_context, "ctx")
        emit(turn.completion_ids, "gen")
        stats["context"] += len(new_context)
        stats["trained"] += len(turn.completion_ids)
        sequence = prompt + tuple(turn.completion_ids)
    if stats["hidden"]:
        parts.append(Markup('<div class="rewrite">… {} more tokens not shown</div>').format(stats["hidden"]))
    return Markup("").join(parts), stats


_SCREENSHOTS_PER_TRAJECTORY = 12
_MAX_SCREENSHOT_BYTES = 2 * 2**20
_IMAGE_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png"}


def screenshot_views(traj: Trajectory, root: Path) -> tuple[list[tuple[int, str]], int]:
    """``([(turn number, data URI)], missing)``: the screenshots in the episode's ``Turn.artifacts``
    (the web env's ``screenshots`` option), inlined so the page loads nothing; a path is read as
    written, else relative to the run folder. Files gone, too large or not an image are counted in
    ``missing``; at most ``_SCREENSHOTS_PER_TRAJECTORY`` are inlined."""
    shown, missing = [], 0
    actions = [t for t in traj.turns if t.kind == "action"]
    for number, turn in enumerate(actions, start=1):
        written = turn.artifacts.get("screenshot")
        if written is None:
            continue
        path = next((p for p in (Path(written), root / written) if p.is_file()), None)
        kind = _IMAGE_TYPES.get(Path(written).suffix.lower())
        if path is None or kind is None or path.stat().st_size > _MAX_SCREENSHOT_BYTES:
            missing += 1
        elif len(shown) < _SCREENSHOTS_PER_TRAJECTORY:
            shown.append((number, f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"))
    return shown, missing


def _trajectory_view(traj: Trajectory, decode: Decode | None, root: Path | None = None) -> dict[str, Any]:
    view: dict[str, Any] = {
        "task_id": traj.task_id,
        "sample_index": traj.sample_index,
        "env": traj.env,
        "policy": traj.policy,
        "success": traj.success,
        "reward": _fmt(traj.reward),
        "end_reason": traj.end_reason,
        "error": traj.error,
        "turns": assistant_turns(traj),
        "tokens": traj.num_generated_tokens,
        "messages": [_message_view(m) for m in traj.messages],
        "parse_errors": [(i + 1, e) for i, t in enumerate(traj.turns) for e in t.parse_errors],
        "call_failures": [(reason, n) for reason, n in (failures_in_metrics(traj.metrics) or {}).items() if n],
        "reference_calls": json.dumps(traj.info["reference_calls"], ensure_ascii=False)
        if "reference_calls" in traj.info else None,
        "tokens_html": None,
        "token_stats": None,
    }
    view["screenshots"], view["screenshots_missing"] = screenshot_views(traj, root or Path.cwd())
    if decode is not None and traj.turns:
        view["tokens_html"], view["token_stats"] = token_view(traj, decode)
    return view


def _trajectory_section(files: RunFiles, root: Path, per_file: int, decode: Decode | None,
                        scan_limit: int) -> list[dict[str, Any]]:
    out = []
    for path in files.jsonl:
        if path.name == METRICS_FILE:
            continue
        trajectories, bad, is_traj = _read_trajectories(path, scan_limit)
        if not is_traj:
            continue
        sample = sample_trajectories(trajectories, per_file)
        out.append({
            "label": _rel(path, root),
            "read": len(trajectories),
            "solved": sum(t.success for t in trajectories),
            "bad": bad,
            "capped": len(trajectories) >= scan_limit,
            "items": [_trajectory_view(t, decode, root) for t in sample],
        })
    return out


# --- page ---------------------------------------------------------------------------------------


def render_report(
    run_dir: str | Path,
    decode: Decode | None = None,
    max_trajectories: int = 12,
    scan_limit: int = 2000,
) -> str:
    """The report page for ``run_dir`` as an HTML string (nothing written)."""
    import jinja2

    root = Path(run_dir).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    files = find_run_files(root)
    evals, overlay = _eval_section(files, root)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    template = env.get_template("report.html.jinja")
    return template.render(
        title=root.name,
        run_dir=str(root),
        generated=_dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        configs=_config_section(files, root),
        training=_training_section(files, root),
        health=_health_section(files, root),
        evals=evals,
        eval_columns=EVAL_COLUMNS + (INJECTION_COLUMNS if any(has_injection(e.get("summary", {})) for e in evals) else []),
        overlay=overlay,
        trajectory_files=_trajectory_section(files, root, max_trajectories, decode, scan_limit),
        has_decoder=decode is not None,
    )



def build_report(
    run_dir: str | Path,
    decode: Decode | None = None,
    tokenizer: Any = None,
    max_trajectories: int = 12,
    out: str | Path | None = None,
) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``run_dir/report.html``); returns its path.

    ``decode`` (token ids -> text) or ``tokenizer`` (anything with ``decode``) turns on the token
    view; without them the trajectories show message text only. ``max_trajectories`` caps the
    sample per trajectory file.
    """
    if decode is None and tokenizer is not None:
        decode = decoder_from_tokenizer(tokenizer)
    page = render_report(run_dir, decode=decode, max_trajectories=max_trajectories)
    path = Path(out) if out is not None else Path(run_dir) / REPORT_FILE
    atomic_write_text(path, page)
    return path
