"""Parquet trajectories and training examples: one schema across envs, exact round trips, other
readers (pyarrow.dataset, datasets) loading several envs' files in one call, the CLI
(``rollout --parquet``, ``export --examples``, ``inspect``) and its one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tracegym.cli import main
from tracegym.data import parquet as parquet_module
from tracegym.data.parquet import (
    EXAMPLE_SCHEMA,
    TRAJECTORY_SCHEMA,
    parquet_kind,
    read_examples_parquet,
    read_trajectories_parquet,
    table_to_trajectories,
    trajectories_to_table,
    trajectory_from_row,
    write_examples_parquet,
    write_trajectories_parquet,
)
from tracegym.data.store import TrajectoryWriter, export_parquet, read_trajectories
from tracegym.trajectory_view import load_records
from tracegym.types import Message, ToolCall, TrainingExample, Trajectory, Turn, write_jsonl

BUILTIN_ENVS = ("calculator", "frozenlake", "sokoban", "search", "service")


@pytest.fixture(scope="module")
def renderer():
    from tracegym.models import load_tokenizer
    from tracegym.render import get_renderer

    return get_renderer("tiny-random", load_tokenizer("tiny-random"))


def _expert(env: str, renderer, n: int = 2, seed: int = 1) -> list[Trajectory]:
    from tracegym.envs import make
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    tasks = make(env).tasks("train", n=n, seed=seed)
    result = run_rollouts_sync(env, tasks, "expert", renderer, RolloutConfig(max_turns=8), progress=False)
    assert result.trajectories, f"the {env} expert produced no trajectory"
    return list(result.trajectories)


@pytest.fixture(scope="module")
def by_env(renderer) -> dict[str, list[Trajectory]]:
    return {env: _expert(env, renderer) for env in BUILTIN_ENVS}


def _float32(value: float) -> float:
    return float(np.float32(value))


def _edge_cases() -> list[Trajectory]:
    """What expert runs never produce: parse errors, engine log-probs next to None ones, an episode
    with no turns, unicode, nested and non-finite free-form values, every optional field set."""
    call = ToolCall(name="lookup", arguments={"query": "Zürich 東京 🚀", "filters": {"years": [1999, 2024], "exact": None}},
                    raw='{"name": "lookup", "arguments": {...}}', id="call_1")
    messages = (
        Message(role="system", content="Be brief. ✓"),
        Message(role="user", content="naïve question\nwith\ttabs and \"quotes\""),
        Message(role="assistant", content="", tool_calls=(call, ToolCall(name="noop"))),
        Message(role="tool", content="[]", tool_call_id="call_1", name="lookup"),
        Message(role="assistant", content="<answer>42</answer>"),
    )
    float32_logprobs = tuple(_float32(x) for x in (-0.25, -1.5e-7, -12.375, -0.693147))
    turns = (
        Turn(prompt_ids=(1, 2, 3), completion_ids=(4, 5, 6, 7), completion_logprobs=float32_logprobs,
             finish_reason="length", message=messages[2], parse_errors=("bad JSON in <tool_call>: line 1", "ünïcode"),
             env_messages=(messages[3], Message(role="user", content="go on")), reward=-0.5,
             metrics={"tool_ok": 1.0, "latency": math.inf}, state_key="s:0"),
        Turn(prompt_ids=(1, 2, 3, 4, 5, 6, 7, 8, 49151), completion_ids=(9,), completion_logprobs=None,
             message=messages[4], reward=1.5),
    )
    full = Trajectory(
        env="my-env", task_id="täsk/7", split="test", sample_index=2**40, tools=({"type": "function", "function": {
            "name": "lookup", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},),
        messages=messages, turns=turns, reward=1.0, success=True, metrics={"success": 1.0, "turns": 2.0},
        end_reason="env_error", error="ValueError: boom ☠", policy="smollm2-135m",
        info={"nested": {"a": [1, 2.5, None, "x", {"deep": True}]}, "big": 2**62, "empty": {}, "text": "日本"},
    )
    empty = Trajectory(env="other-env", task_id="t0", messages=(Message(role="user", content="hi"),))
    return [full, empty]


# --- round trips --------------------------------------------------------------------------


def test_expert_trajectories_of_every_builtin_env_round_trip(tmp_path, by_env):
    for env, trajectories in by_env.items():
        assert any(turn.message.tool_calls for t in trajectories for turn in t.turns), env  # the test covers tool calls
        path = tmp_path / f"{env}.parquet"
        assert write_trajectories_parquet(trajectories, path) == len(trajectories)
        assert parquet_kind(path) == "trajectory"
        assert read_trajectories_parquet(path) == trajectories, env


def test_edge_cases_round_trip_exactly(tmp_path):
    trajectories = _edge_cases()
    path = tmp_path / "edge.parquet"
    write_trajectories_parquet(trajectories, path)
    back = read_trajectories_parquet(path)
    assert back == trajectories
    assert back[0].turns[1].completion_logprobs is None and back[0].turns[0].completion_logprobs is not None
    assert back[1].turns == () and back[1].info == {}
    # the derived columns say the same as the trajectories
    table = pq.read_table(path)
    assert table.column("num_turns").to_pylist() == [2, 0]
    assert table.column("num_generated_tokens").to_pylist() == [5, 0]


def test_logprobs_are_float32_in_the_file(tmp_path):
    """Engine log-probs are float32 values and come back exact (above); a value that is not a
    float32 comes back rounded to one, as documented."""
    [full, _] = _edge_cases()
    turn = full.turns[0].model_copy(update={"completion_logprobs": (-0.1, -2.0, -1 / 3, 0.0)})
    path = tmp_path / "f.parquet"
    write_trajectories_parquet([full.model_copy(update={"turns": (turn,)})], path)
    assert pq.read_schema(path).field("turns").type.value_type.field("completion_logprobs").type.value_type == pa.float32()
    [back] = read_trajectories_parquet(path)
    assert back.turns[0].completion_logprobs == tuple(_float32(x) for x in (-0.1, -2.0, -1 / 3, 0.0))
    assert back.turns[0].completion_logprobs != turn.completion_logprobs  # -0.1 is not a float32


def test_non_finite_metrics_survive(tmp_path):
    trajectory = _edge_cases()[1].model_copy(update={"metrics": {"nan": math.nan, "inf": -math.inf}})
    path = tmp_path / "nan.parquet"
    write_trajectories_parquet([trajectory], path)
    [back] = read_trajectories_parquet(path)
    assert math.isnan(back.metrics["nan"]) and back.metrics["inf"] == -math.inf


def test_token_ids_beyond_int32_are_an_error_not_wrapped(tmp_path):
    [full, _] = _edge_cases()
    turn = full.turns[1].model_copy(update={"completion_ids": (2**31,)})
    with pytest.raises(ValueError, match="trajectory Parquet"):
        write_trajectories_parquet([full.model_copy(update={"turns": (turn,)})], tmp_path / "x.parquet")
    assert not list(tmp_path.iterdir())


def test_training_examples_round_trip_with_float32_values(tmp_path, by_env, renderer):
    examples = [ex for t in by_env["calculator"] for ex in renderer.build_examples(t, weight=0.3, advantage=-0.7)]
    examples.append(TrainingExample(input_ids=(5, 6, 7), loss_mask=(0, 1, 1), weights=(0.0, 1.0, 1.0),
                                    advantages=(0.0, 0.1, 0.1), logprobs=(0.0, -0.5, -1e-3), has_logprobs=True,
                                    source="x/ü/0#1"))
    path = tmp_path / "examples.parquet"
    assert write_examples_parquet(examples, path) == len(examples)
    assert pq.read_schema(path).equals(EXAMPLE_SCHEMA, check_metadata=True)
    assert parquet_kind(path) == "example"
    expected = [
        ex.model_copy(update={name: tuple(_float32(v) for v in getattr(ex, name)) for name in ("weights", "advantages", "logprobs")})
        for ex in examples
    ]
    back = read_examples_parquet(path)
    assert back == expected
    assert back[-1].advantages[1] != 0.1  # float32 storage is real: 0.1 is not a float32
    assert [ex.input_ids for ex in back] == [ex.input_ids for ex in examples]


# --- one schema, several envs ---------------------------------------------------------------


def test_every_env_gets_the_same_schema(by_env):
    tables = [trajectories_to_table(ts) for ts in by_env.values()] + [trajectories_to_table(_edge_cases())]
    for table in tables:
        assert table.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True)
    # free-form values really differ across these tables (tools, info), and still no schema differs
    assert len({len(table.column("tools_json")[0].as_py()) for table in tables}) > 1


def test_pyarrow_dataset_reads_two_envs_files_at_once(tmp_path, by_env):
    import pyarrow.dataset as ds

    a, b = tmp_path / "calculator.parquet", tmp_path / "frozenlake.parquet"
    write_trajectories_parquet(by_env["calculator"], a)
    write_trajectories_parquet(by_env["frozenlake"], b)
    table = ds.dataset([str(a), str(b)], format="parquet").to_table()
    assert table.num_rows == len(by_env["calculator"]) + len(by_env["frozenlake"])
    assert table_to_trajectories(table) == by_env["calculator"] + by_env["frozenlake"]


def test_datasets_load_dataset_reads_all_five_envs_files_in_one_call(tmp_path, by_env):
    import datasets

    files = []
    for env in BUILTIN_ENVS:  # one file per built-in env, each with its own tools, info and metrics
        files.append(tmp_path / f"{env}.parquet")
        write_trajectories_parquet(by_env[env], files[-1])
    loaded = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                                   cache_dir=str(tmp_path / "hf"))
    everything = [t for env in BUILTIN_ENVS for t in by_env[env]]
    assert len(loaded) == len(everything)
    assert [trajectory_from_row(row) for row in loaded] == everything  # every row back, equal
    assert sorted(set(loaded["env"])) == sorted(BUILTIN_ENVS)


# --- files written by tracegym before, and by others ---------------------------------------


def _old_blob_file(trajectories: list[Trajectory], path: Path) -> None:
    """The format of ``export_parquet`` before the columnar schema: summary columns + JSON."""
    rows = [{"env": t.env, "task_id": t.task_id, "reward": t.reward, "num_turns": len(t.turns),
             "trajectory_json": t.model_dump_json()} for t in trajectories]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_load_records_reads_old_json_blob_and_new_files(tmp_path, by_env):
    trajectories = by_env["search"]
    old, new = tmp_path / "old.parquet", tmp_path / "new.parquet"
    _old_blob_file(trajectories, old)
    write_trajectories_parquet(trajectories, new)
    assert parquet_kind(old) is None
    for path in (old, new):
        loaded = load_records(path)
        assert loaded.kind == "trajectory" and loaded.records == trajectories


def test_a_file_rewritten_by_another_tool_still_reads(tmp_path, by_env):
    """large_string/large_list types, lost metadata, no derived columns, an extra column."""
    table = trajectories_to_table(by_env["sokoban"]).drop_columns(["num_turns", "num_generated_tokens"])
    large = pa.schema([pa.field(f.name, pa.large_string()) if f.type == pa.string() else
                       pa.field(f.name, pa.large_list(f.type.value_type)) if pa.types.is_list(f.type) else f
                       for f in table.schema])
    rewritten = table.cast(large).replace_schema_metadata(None).append_column("note", pa.array(["x"] * table.num_rows))
    path = tmp_path / "rewritten.parquet"
    pq.write_table(rewritten, path)
    assert parquet_kind(path) == "trajectory"
    assert read_trajectories_parquet(path) == by_env["sokoban"]


def test_export_parquet_writes_the_columnar_schema(tmp_path, by_env):
    jsonl = tmp_path / "t.jsonl"
    with TrajectoryWriter(jsonl) as writer:
        writer.write_all(by_env["service"])
    out = tmp_path / "sub" / "t.parquet"
    assert export_parquet(jsonl, out) == len(by_env["service"])
    assert pq.read_schema(out).equals(TRAJECTORY_SCHEMA)
    assert read_trajectories_parquet(out) == list(read_trajectories(jsonl))


# --- atomic writes ----------------------------------------------------------------------------


def _temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if ".tmp-" in p.name]


def test_atomic_write_leaves_no_temporary_and_a_failure_keeps_the_old_file(tmp_path, by_env, monkeypatch):
    path = tmp_path / "t.parquet"
    write_trajectories_parquet(by_env["calculator"], path)
    write_trajectories_parquet(by_env["frozenlake"], path)  # replaces
    assert read_trajectories_parquet(path) == by_env["frozenlake"]
    assert _temporaries(tmp_path) == []

    real_write = pq.write_table

    def torn_write(table, where, **kw):  # a crash after half the rows reached the disk
        real_write(table.slice(0, 1), where, **kw)
        raise OSError("disk full")

    monkeypatch.setattr(parquet_module.pq, "write_table", torn_write)
    with pytest.raises(OSError, match="disk full"):
        write_trajectories_parquet(by_env["calculator"], path)
    assert read_trajectories_parquet(path) == by_env["frozenlake"]
    assert _temporaries(tmp_path) == []


# --- the CLI ------------------------------------------------------------------------------------


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_rollout_parquet_is_read_by_inspect(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["rollout", "--env", "calculator", "--policy", "expert", "--model", "tiny-random", "--tasks", "2",
                 "--out", str(out), "--parquet"]) == 0
    parquet = out / "trajectories.parquet"
    assert parquet_kind(parquet) == "trajectory"
    from_jsonl = list(read_trajectories(out / "trajectories.jsonl"))
    assert len(from_jsonl) == 2 and read_trajectories_parquet(parquet) == from_jsonl
    capsys.readouterr()
    assert main(["inspect", str(out / "trajectories.jsonl"), "--plain", "--model", "tiny-random"]) == 0
    jsonl_view = capsys.readouterr().out
    assert main(["inspect", str(parquet), "--plain", "--model", "tiny-random"]) == 0
    assert capsys.readouterr().out == jsonl_view
    assert "=== trajectory 1: calculator/" in jsonl_view


def _expected_examples(renderer, trajectories: list[Trajectory]) -> list[TrainingExample]:
    examples = [ex for t in trajectories for ex in renderer.build_examples(t, weight=1.0, advantage=t.reward)]
    return [ex.model_copy(update={name: tuple(_float32(v) for v in getattr(ex, name))
                                  for name in ("weights", "advantages", "logprobs")}) for ex in examples]


def test_export_examples_rows_equal_build_examples(tmp_path, by_env, renderer, capsys):
    # rewards that are not all 1.0, so the advantage column shows it is the episode reward
    trajectories = [t.model_copy(update={"reward": r}) for t, r in zip(by_env["calculator"] + by_env["frozenlake"],
                                                                        (1.0, 0.25, -0.1, 0.0))]
    jsonl = tmp_path / "t.jsonl"
    write_jsonl(jsonl, trajectories)
    out = tmp_path / "examples.parquet"
    assert main(["export", "--examples", str(jsonl), "--out", str(out), "--model", "tiny-random"]) == 0
    assert "wrote 4 examples" in capsys.readouterr().out
    expected = _expected_examples(renderer, trajectories)
    assert read_examples_parquet(out) == expected
    # on trained tokens the advantage is the episode reward (rounded to float32)
    for ex, t in zip(read_examples_parquet(out), trajectories):
        assert {a for a, m in zip(ex.advantages, ex.loss_mask) if m} == {_float32(t.reward)}
    assert _temporaries(tmp_path) == []

    # a Parquet trajectory file gives the same examples; --force replaces the output
    parquet = tmp_path / "t.parquet"
    write_trajectories_parquet(trajectories, parquet)
    assert main(["export", "--examples", str(parquet), "--out", str(out), "--model", "tiny-random", "--force"]) == 0
    assert read_examples_parquet(out) == expected

    # inspect reads the example file
    capsys.readouterr()
    assert main(["inspect", str(out), "--plain", "--model", "tiny-random", "--index", "1"]) == 0
    shown = capsys.readouterr().out
    assert "=== record 1" in shown and f"({expected[1].source})" in shown and "[[" in shown


def test_export_examples_of_an_rl_run_folder(tmp_path, by_env, renderer):
    run = tmp_path / "runs" / "rl"
    (run / "rollouts").mkdir(parents=True)
    write_jsonl(run / "rollouts" / "step_000002.jsonl", by_env["frozenlake"])
    write_jsonl(run / "rollouts" / "step_000001.jsonl", by_env["calculator"])
    (run / "rollouts" / "step_000003.jsonl").write_text("")  # a step that wrote nothing yet
    out = tmp_path / "rl.parquet"
    assert main(["export", "--examples", str(run), "--out", str(out), "--model", "tiny-random"]) == 0
    assert read_examples_parquet(out) == _expected_examples(renderer, by_env["calculator"] + by_env["frozenlake"])


def test_export_and_inspect_errors_are_one_line_exit_2(tmp_path, by_env, capsys):
    jsonl = tmp_path / "t.jsonl"
    write_jsonl(jsonl, by_env["calculator"])
    out = tmp_path / "out.parquet"

    assert main(["export", "--examples", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "no such file" in _one_error_line(capsys)
    assert main(["export", "--merge", "--examples", str(jsonl), "--out", str(out)]) == 2
    assert "mutually exclusive" in _one_error_line(capsys)

    neither = tmp_path / "neither.parquet"
    pq.write_table(pa.table({"hello": [1, 2], "world": ["a", "b"]}), neither)
    assert main(["export", "--examples", str(neither), "--out", str(out)]) == 2
    assert "neither a Trajectory" in _one_error_line(capsys)
    assert main(["inspect", str(neither)]) == 2
    assert "neither a Trajectory" in _one_error_line(capsys)

    not_parquet = tmp_path / "garbage.parquet"
    not_parquet.write_text("not parquet at all\n")
    assert main(["export", "--examples", str(not_parquet), "--out", str(out)]) == 2
    assert "not a readable Parquet file" in _one_error_line(capsys)
    assert main(["inspect", str(not_parquet)]) == 2
    assert "not a readable Parquet file" in _one_error_line(capsys)

    examples = tmp_path / "examples.parquet"
    write_examples_parquet([TrainingExample(input_ids=(1,), loss_mask=(1,), weights=(1.0,), advantages=(0.0,),
                                            logprobs=(0.0,))], examples)
    assert main(["export", "--examples", str(examples), "--out", str(out)]) == 2
    assert "not trajectories" in _one_error_line(capsys)

    assert main(["export", "--examples", str(jsonl), "--out", str(tmp_path / "out.jsonl")]) == 2
    assert ".parquet" in _one_error_line(capsys)
    out.write_bytes(b"keep me")
    assert main(["export", "--examples", str(jsonl), "--out", str(out)]) == 2
    assert "--force" in _one_error_line(capsys)
    assert out.read_bytes() == b"keep me"
    assert main(["export", "--merge", "--out", str(tmp_path / "folder")]) == 2
    assert "--merge needs" in _one_error_line(capsys)
    assert main(["export", "--out", str(out)]) == 2
    assert "--merge" in _one_error_line(capsys) and not (tmp_path / "folder").exists()
    assert _temporaries(tmp_path) == []


def test_a_trajectory_table_with_a_bad_row_names_it_in_one_line(tmp_path, by_env, capsys):
    table = trajectories_to_table(by_env["calculator"])
    rows = table.to_pylist()
    rows[1]["end_reason"] = "exploded"  # not an EndReason
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA), path)
    with pytest.raises(ValueError, match=r"row 1 is not a valid Trajectory: end_reason"):
        read_trajectories_parquet(path)
    assert main(["inspect", str(path)]) == 2
    assert "row 1" in _one_error_line(capsys)


def test_info_with_different_keys_per_env_keeps_one_schema(tmp_path):
    base = _edge_cases()[1]
    a = base.model_copy(update={"info": {"grid": [[0, 1], [1, 0]]}})
    b = base.model_copy(update={"env": "x", "info": {"score": {"by_tool": {"add": 3}}, "tags": ["q"]}})
    pa_path, pb_path = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_trajectories_parquet([a], pa_path)
    write_trajectories_parquet([b], pb_path)
    assert pq.read_schema(pa_path).equals(pq.read_schema(pb_path), check_metadata=True)
    assert json.loads(pq.read_table(pb_path).column("info_json")[0].as_py()) == b.info
