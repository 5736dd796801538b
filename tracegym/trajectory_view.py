"""Show which tokens of a trajectory are trained on.

``load_records`` reads a JSONL (or Parquet) file of ``Trajectory`` or ``TrainingExample`` rows,
telling which by the keys. Parquet: the columnar schemas of ``tracegym.data.parquet`` (what
``rollout --parquet`` and ``export --examples`` write), and the older files that hold JSON text
(a ``trajectory_json`` column, or JSON in the ``messages``/``turns``/... columns).

``inspect_plain`` returns a plain-text view: a header with counts per record, then every example's
text with newlines shown as ``\\n`` and the trained spans (loss mask 1) wrapped in ``[[...]]``.
``inspect_rich`` is the same view for a terminal, one coloured token at a time (trained tokens on a
green background, the rest dim; shades alternate so token boundaries show).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from tracegym.render.base import BuildStats, Renderer
from tracegym.types import Trajectory, TrainingExample, read_json_rows

RecordKind = Literal["trajectory", "example"]
TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"

# Columns that a Parquet writer may have stored as JSON text instead of nested structs.
_JSON_COLUMNS = ("messages", "turns", "tools", "metrics", "info")
# The column of the first ``rollout --parquet`` files that held each whole trajectory as JSON.
_TRAJECTORY_JSON_COLUMN = "trajectory_json"


@dataclass
class LoadedRecords:
    kind: RecordKind
    records: list[Any]  # Trajectory or TrainingExample
    skipped_lines: int = 0  # lines that were not JSON (e.g. a torn last line)


def _kind_of(row: dict[str, Any]) -> RecordKind:
    if "input_ids" in row and "loss_mask" in row:
        return "example"
    if "turns" in row or "messages" in row:
        return "trajectory"
    raise ValueError(
        f"rows have keys {sorted(row)[:8]}: neither a Trajectory (turns, messages) "
        "nor a TrainingExample (input_ids, loss_mask)"
    )


def _read_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except pa.ArrowException as exc:
            raise ValueError(f"{path} is not a readable Parquet file: {' '.join(str(exc).split())}") from exc
        for number, row in enumerate(rows):
            # tracegym's first Parquet export: summary columns plus the whole trajectory as JSON
            if isinstance(row.get(_TRAJECTORY_JSON_COLUMN), str):
                rows[number] = row = json.loads(row[_TRAJECTORY_JSON_COLUMN])
            for key in _JSON_COLUMNS:
                if isinstance(row.get(key), str):
                    row[key] = json.loads(row[key])
        return rows, 0
    return read_json_rows(path)


def _load_columnar_parquet(path: Path) -> LoadedRecords | None:
    """The records of a file in one of the schemas of ``tracegym.data.parquet``; None for any other
    Parquet file (the older JSON-text ones are read row by row)."""
    from tracegym.data.parquet import parquet_kind, read_examples_parquet, read_trajectories_parquet

    kind = parquet_kind(path)
    if kind is None:
        return None
    records: list[Any] = read_trajectories_parquet(path) if kind == "trajectory" else read_examples_parquet(path)
    if not records:
        raise ValueError(f"{path} holds no records")
    return LoadedRecords(kind=kind, records=records)


def load_records(path: str | Path) -> LoadedRecords:
    """Read Trajectory or TrainingExample rows (JSONL, or Parquet with the same columns)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    if path.suffix == ".parquet":
        columnar = _load_columnar_parquet(path)
        if columnar is not None:
            return columnar
    rows, skipped = _read_rows(path)
    if not rows:
        raise ValueError(f"{path} holds no records")
    kind = _kind_of(rows[0])
    cls = TrainingExample if kind == "example" else Trajectory
    records = []
    for number, row in enumerate(rows):
        try:
            records.append(cls.model_validate(row))
        except ValidationError as exc:
            raise ValueError(f"{path}: record {number} is not a valid {cls.__name__}: {exc}") from exc
    return LoadedRecords(kind=kind, records=records, skipped_lines=skipped)


def tokenizer_name_from(records: Sequence[Any]) -> str | None:
    """A model name stored with the records (``info["tokenizer"]``, ``info["model"]`` or the
    trajectory's ``policy`` when it names a known model or a local folder), else None."""
    from tracegym.models import KNOWN_MODELS

    for record in records:
        if not isinstance(record, Trajectory):
            continue
        for candidate in (record.info.get("tokenizer"), record.info.get("model"), record.policy):
            if isinstance(candidate, str) and (candidate in KNOWN_MODELS or Path(candidate).is_dir()):
                return candidate
    return None


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """One decoded piece per token; joined they give the decoded text. A character split over
    several byte-level tokens is shown on the last of them (the others get "")."""
    pieces: list[str] = []
    pending: list[int] = []
    for token in ids:
        pending.append(token)
        piece = tokenizer.decode(pending, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if piece.endswith("\ufffd") and len(pending) < 4:
            continue  # an incomplete UTF-8 sequence: wait for the rest of its bytes
        pieces.extend([""] * (len(pending) - 1))
        pieces.append(piece)
        pending = []
    if pending:
        pieces.extend([""] * (len(pending) - 1))
        pieces.append(tokenizer.decode(pending, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return pieces


def _escape(piece: str) -> str:
    """Newlines shown as ``\\n`` and kept as line breaks, so the layout stays readable."""
    return piece.replace("\r", "\\r").replace("\t", "\\t").replace("\n", "\\n\n")


def _example_plain(tokenizer: Any, example: TrainingExample, max_tokens: int | None) -> str:
    ids = list(example.input_ids)
    mask = list(example.loss_mask)
    shown = len(ids) if max_tokens is None else min(len(ids), max_tokens)
    pieces = token_pieces(tokenizer, ids[:shown])
    out: list[str] = []
    trained = False
    for piece, flag in zip(pieces, mask[:shown]):
        if flag and not trained:
            out.append(TRAINED_OPEN)
        elif not flag and trained:
            out.append(TRAINED_CLOSE)
        trained = bool(flag)
        out.append(_escape(piece))
    if trained:
        out.append(TRAINED_CLOSE)
    text = "".join(out)
    if shown < len(ids):
        text += f"\n... ({len(ids) - shown} more tokens)"
    return text


def _example_header(number: int, example: TrainingExample) -> str:
    return (
        f"--- example {number} ({example.source or 'no source'}): "
        f"{len(example)} tokens, {sum(example.loss_mask)} trained, logprobs {'yes' if example.has_logprobs else 'no'}"
    )


def _trajectory_header(number: int, trajectory: Trajectory, stats: BuildStats) -> str:
    head = (
        f"=== trajectory {number}: {trajectory.env}/{trajectory.task_id} sample {trajectory.sample_index}"
        f" | policy {trajectory.policy or '?'} | turns {len(trajectory.turns)}"
    )
    counts = (
        f"tokens {stats.total_tokens} | trained {stats.trained_tokens} | examples {stats.examples}"
        f" | splits {stats.splits} | reward {trajectory.reward:g} | success {trajectory.success}"
        f" | end {trajectory.end_reason}"
    )
    if trajectory.error:
        counts += f" | error {trajectory.error}"
    return head + "\n" + counts


def _selected(records: Sequence[Any], index: int | None) -> list[tuple[int, Any]]:
    if index is None:
        return list(enumerate(records))
    if not 0 <= index < len(records):
        raise IndexError(f"--index {index} is out of range: the file holds {len(records)} records")
    return [(index, records[index])]


def _sections(
    loaded: LoadedRecords, renderer: Renderer | None, index: int | None
) -> list[tuple[str, list[tuple[str, TrainingExample]]]]:
    """(header, [(example header, example)]) per selected record."""
    sections = []
    for number, record in _selected(loaded.records, index):
        if isinstance(record, Trajectory):
            if renderer is None:
                raise ValueError("showing trajectories needs a renderer")
            stats = BuildStats()
            examples = renderer.build_examples(record, stats=stats)
            header = _trajectory_header(number, record, stats)
            sections.append((header, [(_example_header(i, ex), ex) for i, ex in enumerate(examples)]))
        else:
            sections.append((f"=== record {number}", [(_example_header(0, record), record)]))
    return sections


def inspect_plain(
    loaded: LoadedRecords,
    tokenizer: Any,
    renderer: Renderer | None = None,
    index: int | None = None,
    max_tokens: int | None = None,
) -> str:
    """The plain-text view of the selected records (all of them when ``index`` is None)."""
    blocks: list[str] = []
    if loaded.skipped_lines:
        blocks.append(f"(skipped {loaded.skipped_lines} unreadable lines)")
    for header, examples in _sections(loaded, renderer, index):
        blocks.append(header)
        for example_header, example in examples:
            blocks.append(example_header)
            blocks.append(_example_plain(tokenizer, example, max_tokens))
    return "\n".join(blocks) + "\n"


# Alternating shades so that neighbouring tokens are told apart.
_TRAINED_STYLES = ("black on green3", "black on dark_sea_green2")
_CONTEXT_STYLES = ("grey62", "grey42")


def inspect_rich(
    loaded: LoadedRecords,
    tokenizer: Any,
    console: Any,
    renderer: Renderer | None = None,
    index: int | None = None,
    max_tokens: int | None = None,
) -> None:
    """Print the coloured view on a ``rich.console.Console``."""
    from rich.text import Text

    if loaded.skipped_lines:
        console.print(f"(skipped {loaded.skipped_lines} unreadable lines)", style="yellow")
    for header, examples in _sections(loaded, renderer, index):
        console.print(Text(header, style="bold"))
        for example_header, example in examples:
            console.print(Text(example_header, style="cyan"))
            ids = list(example.input_ids)
            shown = len(ids) if max_tokens is None else min(len(ids), max_tokens)
            text = Text()
            for position, (piece, flag) in enumerate(zip(token_pieces(tokenizer, ids[:shown]), example.loss_mask)):
                styles = _TRAINED_STYLES if flag else _CONTEXT_STYLES
                text.append(_escape(piece), style=styles[position % 2])
            console.print(text)
            if shown < len(ids):
                console.print(f"... ({len(ids) - shown} more tokens)", style="yellow")
