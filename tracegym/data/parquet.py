"""Trajectories and training examples as columnar Parquet, one schema for every environment.

JSONL is how tracegym writes while it runs (one line per episode, flushed). Parquet is for taking
the data elsewhere: ``datasets.load_dataset("parquet", data_files=[...])``, ``pyarrow.dataset``,
pandas, DuckDB, Spark. Those readers concatenate many files in one call only when every file has
the same schema, so the schemas here are fixed and never depend on what an environment puts in its
rows:

- Everything with a fixed shape is a real (nested) column: scalars, messages and tool calls as
  structs, token ids as ``list<int32>``, log-probs as ``list<float32>``.
- Everything free-form (tool arguments, tool schemas, ``metrics``, ``info``) is a JSON string: one
  env's ``info`` keys would otherwise become struct fields that another env's file lacks, and the
  two files would no longer load together.

``TRAJECTORY_SCHEMA`` (one row per ``Trajectory``)::

    env, task_id, split, policy, end_reason: string     sample_index: int64
    reward: float64     success: bool     error: string (null when none)
    messages: list<MESSAGE>
    turns: list<struct{prompt_ids: list<int32>, completion_ids: list<int32>,
                       completion_logprobs: list<float32> (null: none recorded), finish_reason: string,
                       message: MESSAGE, parse_errors: list<string>, env_messages: list<MESSAGE>,
                       reward: float64, metrics_json: string, state_key: string (nullable)}>
    tools_json: list<string>   (one JSON object per tool schema)
    metrics_json, info_json: string (a JSON object)
    num_turns, num_generated_tokens: int64   (derived, for filtering; ignored when read back)

    MESSAGE = struct{role: string, content: string,
                     tool_calls: list<struct{id: string (nullable), name: string,
                                             arguments_json: string, raw: string}>,
                     tool_call_id: string (nullable), name: string (nullable)}

``EXAMPLE_SCHEMA`` (one row per ``TrainingExample``)::

    input_ids: list<int32>   loss_mask: list<int8>
    weights, advantages, logprobs: list<float32>   has_logprobs: bool   source: string

Round trips. A trajectory read back equals the one written (``==``) whenever its JSONL line would
(free-form values are JSON, as in JSONL: a tuple inside ``info`` comes back a list). Token ids must
fit int32 (every tokenizer's vocabulary does; a larger id is an error, never wrapped).
``completion_logprobs`` are float32 because tracegym's engines compute them in float32 (the HF
engine's ``sampling_logprobs``, vLLM): storing them so loses nothing, and a float64 value that is
not a float32 comes back rounded to the nearest one (relative error below 6e-8).

Training examples store ``weights``, ``advantages`` and ``logprobs`` as float32 as well, on purpose:
the trainer turns them into float32 tensors anyway (``tracegym.batch``), so a trainer reading the
file sees exactly what tracegym's own trainer would, at half the size of float64 for the three
per-token columns. What comes back is each value rounded to float32 (an advantage of 0.1 comes back
as 0.10000000149...); every other column comes back exact.

Writes are atomic: the table goes to a hidden temporary file in the target's folder, which is then
renamed over the target, so a reader never sees half a file and a crash leaves the old one intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

import pyarrow as pa
import pyarrow.parquet as pq
import pydantic
import pydantic_core

from tracegym.types import Message, ToolCall, TrainingExample, Trajectory, Turn

__all__ = [
    "EXAMPLE_SCHEMA",
    "MESSAGE_TYPE",
    "SCHEMA_VERSION",
    "TRAJECTORY_SCHEMA",
    "ParquetKind",
    "examples_to_table",
    "parquet_kind",
    "read_examples_parquet",
    "read_trajectories_parquet",
    "table_to_examples",
    "table_to_trajectories",
    "trajectories_to_table",
    "trajectory_from_row",
    "example_from_row",
    "write_examples_parquet",
    "write_parquet_atomic",
    "write_trajectories_parquet",
]

SCHEMA_VERSION = "1"


def _list(item: pa.DataType) -> pa.ListType:
    """A list whose item is named "element", as the Parquet spec names it: a file then reads back
    with exactly the schema it was written with (pyarrow's default item name "item" would not)."""
    return pa.list_(pa.field("element", item))

TOOL_CALL_TYPE = pa.struct(
    [
        pa.field("id", pa.string()),
        pa.field("name", pa.string()),
        pa.field("arguments_json", pa.string()),
        pa.field("raw", pa.string()),
    ]
)

MESSAGE_TYPE = pa.struct(
    [
        pa.field("role", pa.string()),
        pa.field("content", pa.string()),
        pa.field("tool_calls", _list(TOOL_CALL_TYPE)),
        pa.field("tool_call_id", pa.string()),
        pa.field("name", pa.string()),
    ]
)

TURN_TYPE = pa.struct(
    [
        pa.field("prompt_ids", _list(pa.int32())),
        pa.field("completion_ids", _list(pa.int32())),
        pa.field("completion_logprobs", _list(pa.float32())),
        pa.field("finish_reason", pa.string()),
        pa.field("message", MESSAGE_TYPE),
        pa.field("parse_errors", _list(pa.string())),
        pa.field("env_messages", _list(MESSAGE_TYPE)),
        pa.field("reward", pa.float64()),
        pa.field("metrics_json", pa.string()),
        pa.field("state_key", pa.string()),
    ]
)

# The metadata names the schema for humans and for future versions; reading never relies on it
# (a file rewritten by another tool may have lost it), only on the columns.
TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("env", pa.string()),
        pa.field("task_id", pa.string()),
        pa.field("split", pa.string()),
        pa.field("sample_index", pa.int64()),
        pa.field("policy", pa.string()),
        pa.field("reward", pa.float64()),
        pa.field("success", pa.bool_()),
        pa.field("end_reason", pa.string()),
        pa.field("error", pa.string()),
        pa.field("messages", _list(MESSAGE_TYPE)),
        pa.field("turns", _list(TURN_TYPE)),
        pa.field("tools_json", _list(pa.string())),
        pa.field("metrics_json", pa.string()),
        pa.field("info_json", pa.string()),
        pa.field("num_turns", pa.int64()),
        pa.field("num_generated_tokens", pa.int64()),
    ],
    metadata={"tracegym.schema": "trajectory", "tracegym.schema_version": SCHEMA_VERSION},
)

EXAMPLE_SCHEMA = pa.schema(
    [
        pa.field("input_ids", _list(pa.int32())),
        pa.field("loss_mask", _list(pa.int8())),
        pa.field("weights", _list(pa.float32())),
        pa.field("advantages", _list(pa.float32())),
        pa.field("logprobs", _list(pa.float32())),
        pa.field("has_logprobs", pa.bool_()),
        pa.field("source", pa.string()),
    ],
    metadata={"tracegym.schema": "example", "tracegym.schema_version": SCHEMA_VERSION},
)

# Columns derived from the others: written for filtering, not needed to rebuild a Trajectory, so a
# file without them (trimmed by another tool) still reads.
_DERIVED_TRAJECTORY_COLUMNS = ("num_turns", "num_generated_tokens")

ParquetKind = Literal["trajectory", "example"]


# --- JSON for the free-form values ----------------------------------------------------------


def _to_json(value: Any) -> str:
    """JSON text as ``model_dump_json`` writes it (so Parquet and JSONL agree on every value), except
    that NaN and infinities are kept as the JSON extensions ``NaN``/``Infinity`` rather than turned
    into null: a metric of NaN must read back as a float, and null would not validate."""
    return pydantic_core.to_json(value, inf_nan_mode="constants").decode("utf-8")


def _from_json(text: str | None, empty: Any) -> Any:
    return empty if text is None else json.loads(text)


# --- trajectories -> rows -------------------------------------------------------------------


def _tool_call_row(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "name": call.name, "arguments_json": _to_json(call.arguments), "raw": call.raw}


def _message_row(message: Message) -> dict[str, Any]:
    return {
        "role": message.role,
        "content": message.content,
        "tool_calls": [_tool_call_row(c) for c in message.tool_calls],
        "tool_call_id": message.tool_call_id,
        "name": message.name,
    }


def _turn_row(turn: Turn) -> dict[str, Any]:
    return {
        "prompt_ids": turn.prompt_ids,
        "completion_ids": turn.completion_ids,
        "completion_logprobs": turn.completion_logprobs,
        "finish_reason": turn.finish_reason,
        "message": _message_row(turn.message),
        "parse_errors": turn.parse_errors,
        "env_messages": [_message_row(m) for m in turn.env_messages],
        "reward": turn.reward,
        "metrics_json": _to_json(turn.metrics),
        "state_key": turn.state_key,
    }


def _trajectory_row(t: Trajectory) -> dict[str, Any]:
    return {
        "env": t.env,
        "task_id": t.task_id,
        "split": t.split,
        "sample_index": t.sample_index,
        "policy": t.policy,
        "reward": t.reward,
        "success": t.success,
        "end_reason": t.end_reason,
        "error": t.error,
        "messages": [_message_row(m) for m in t.messages],
        "turns": [_turn_row(turn) for turn in t.turns],
        "tools_json": [_to_json(tool) for tool in t.tools],
        "metrics_json": _to_json(t.metrics),
        "info_json": _to_json(t.info),
        "num_turns": len(t.turns),
        "num_generated_tokens": t.num_generated_tokens,
    }


def trajectories_to_table(trajectories: Iterable[Trajectory]) -> pa.Table:
    """One row per trajectory, in ``TRAJECTORY_SCHEMA`` (whatever the envs)."""
    rows = [_trajectory_row(t) for t in trajectories]
    return _table(rows, TRAJECTORY_SCHEMA)


def _table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, OverflowError) as exc:
        # e.g. a token id beyond int32: say which table, never write a wrapped value
        kind = schema.metadata.get(b"tracegym.schema", b"?").decode()
        raise ValueError(f"cannot store these rows as {kind} Parquet: {exc}") from exc


# --- rows -> trajectories -------------------------------------------------------------------


def _tool_call(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": row["name"],
        "arguments": _from_json(row.get("arguments_json"), {}),
        "raw": row.get("raw") or "",
        "id": row.get("id"),
    }


def _message(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": row["role"],
        # OpenAI-style writers leave an assistant's content null when it only calls tools
        "content": row.get("content") or "",
        "tool_calls": [_tool_call(c) for c in row.get("tool_calls") or ()],
        "tool_call_id": row.get("tool_call_id"),
        "name": row.get("name"),
    }


def _turn(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_ids": row["prompt_ids"],
        "completion_ids": row["completion_ids"],
        "completion_logprobs": row.get("completion_logprobs"),
        "finish_reason": row.get("finish_reason") or "stop",
        "message": _message(row["message"]),
        "parse_errors": row.get("parse_errors") or (),
        "env_messages": [_message(m) for m in row.get("env_messages") or ()],
        "reward": 0.0 if row.get("reward") is None else row["reward"],
        "metrics": _from_json(row.get("metrics_json"), {}),
        "state_key": row.get("state_key"),
    }


def trajectory_from_row(row: dict[str, Any]) -> Trajectory:
    """A ``Trajectory`` from one row of a trajectory table as Python values (``table.to_pylist()``,
    a row of ``datasets``, a pandas record)."""
    return Trajectory.model_validate(
        {
            "env": row["env"],
            "task_id": row["task_id"],
            "split": row["split"],
            "sample_index": row["sample_index"],
            "policy": row["policy"],
            "reward": row["reward"],
            "success": row["success"],
            "end_reason": row["end_reason"],
            "error": row.get("error"),
            "messages": [_message(m) for m in row["messages"]],
            "turns": [_turn(t) for t in row.get("turns") or ()],
            "tools": [json.loads(tool) for tool in row.get("tools_json") or ()],
            "metrics": _from_json(row.get("metrics_json"), {}),
            "info": _from_json(row.get("info_json"), {}),
        }
    )


def _conform(table: pa.Table, schema: pa.Schema, optional: tuple[str, ...] = ()) -> pa.Table:
    """``table`` with exactly ``schema``'s columns and types. A file rewritten by another tool may
    have ``large_string``/``large_list`` types, other nullability, extra columns or lost metadata:
    all fine as long as the values convert."""
    missing = [name for name in schema.names if name not in table.column_names and name not in optional]
    if missing:
        raise ValueError(f"not a tracegym {schema.metadata[b'tracegym.schema'].decode()} table: missing columns {missing}")
    wanted = pa.schema([schema.field(name) for name in schema.names if name in table.column_names])
    try:
        return table.select(wanted.names).cast(wanted)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise ValueError(f"columns do not convert to the tracegym schema: {' '.join(str(exc).split())}") from exc


def table_to_trajectories(table: pa.Table) -> list[Trajectory]:
    """Every row of a trajectory table as a ``Trajectory``."""
    table = _conform(table, TRAJECTORY_SCHEMA, optional=_DERIVED_TRAJECTORY_COLUMNS)
    return _validated_rows(table, trajectory_from_row, "Trajectory")


# --- training examples ----------------------------------------------------------------------


def examples_to_table(examples: Iterable[TrainingExample]) -> pa.Table:
    rows = [
        {
            "input_ids": ex.input_ids,
            "loss_mask": ex.loss_mask,
            "weights": ex.weights,
            "advantages": ex.advantages,
            "logprobs": ex.logprobs,
            "has_logprobs": ex.has_logprobs,
            "source": ex.source,
        }
        for ex in examples
    ]
    return _table(rows, EXAMPLE_SCHEMA)


def example_from_row(row: dict[str, Any]) -> TrainingExample:
    return TrainingExample.model_validate({name: row[name] for name in EXAMPLE_SCHEMA.names})


def table_to_examples(table: pa.Table) -> list[TrainingExample]:
    table = _conform(table, EXAMPLE_SCHEMA)
    return _validated_rows(table, example_from_row, "TrainingExample")


def _validated_rows(table: pa.Table, convert: Callable[[dict[str, Any]], Any], what: str) -> list[Any]:
    """``convert`` on every row; a row that does not validate is named in a one-line error."""
    records = []
    for number, row in enumerate(table.to_pylist()):
        try:
            records.append(convert(row))
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ())) or "(row)"
            raise ValueError(f"row {number} is not a valid {what}: {where}: {first.get('msg', 'invalid')}") from exc
    return records


# --- files ----------------------------------------------------------------------------------


def write_parquet_atomic(table: pa.Table, path: str | Path) -> None:
    """Write ``table`` to ``path`` through a temporary sibling and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Hidden (a leading dot) so that a folder scan by pyarrow.dataset or datasets skips it.
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    os.close(descriptor)
    try:
        pq.write_table(table, temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_trajectories_parquet(trajectories: Iterable[Trajectory], path: str | Path) -> int:
    """Write trajectories in ``TRAJECTORY_SCHEMA`` (atomically); returns the number of rows."""
    table = trajectories_to_table(trajectories)
    write_parquet_atomic(table, path)
    return table.num_rows


def write_examples_parquet(examples: Iterable[TrainingExample], path: str | Path) -> int:
    """Write training examples in ``EXAMPLE_SCHEMA`` (atomically); returns the number of rows."""
    table = examples_to_table(examples)
    write_parquet_atomic(table, path)
    return table.num_rows


def _read_table(path: str | Path) -> pa.Table:
    try:
        return pq.read_table(path)
    except pa.ArrowException as exc:
        raise ValueError(f"{path} is not a readable Parquet file: {' '.join(str(exc).split())}") from exc


def read_trajectories_parquet(path: str | Path) -> list[Trajectory]:
    """The trajectories of a file in ``TRAJECTORY_SCHEMA``."""
    try:
        return table_to_trajectories(_read_table(path))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def read_examples_parquet(path: str | Path) -> list[TrainingExample]:
    """The training examples of a file in ``EXAMPLE_SCHEMA``."""
    try:
        return table_to_examples(_read_table(path))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _is_list(schema: pa.Schema, name: str) -> bool:
    return pa.types.is_list(schema.field(name).type) or pa.types.is_large_list(schema.field(name).type)


def parquet_kind(path: str | Path) -> ParquetKind | None:
    """Which of the two schemas a Parquet file has, from its columns alone (reads only the footer);
    None for anything else, such as the older files that hold whole trajectories as JSON text."""
    try:
        schema = pq.read_schema(path)
    except pa.ArrowException as exc:
        raise ValueError(f"{path} is not a readable Parquet file: {' '.join(str(exc).split())}") from exc
    names = set(schema.names)
    required = set(TRAJECTORY_SCHEMA.names) - set(_DERIVED_TRAJECTORY_COLUMNS)
    if required <= names and _is_list(schema, "messages") and _is_list(schema, "turns"):
        return "trajectory"
    if set(EXAMPLE_SCHEMA.names) <= names and _is_list(schema, "input_ids"):
        return "example"
    return None
