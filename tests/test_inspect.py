"""``tracegym inspect``: the plain view of a small trajectory (golden text), example rows, the CLI."""

from __future__ import annotations

import io
import json
import re

import pytest

from tracegym.cli import main
from tracegym.trajectory_view import inspect_plain, inspect_rich, load_records, token_pieces
from tracegym.render import get_renderer
from tracegym.types import Message, ToolCall, Trajectory, Turn, write_jsonl

MESSAGES = (
    Message(role="system", content="S"),
    Message(role="user", content="2+3?"),
    Message(role="assistant", tool_calls=(ToolCall(name="add", arguments={"a": 2, "b": 3}),)),
    Message(role="tool", content="5"),
    Message(role="assistant", content="<answer>5</answer>"),
)

GOLDEN = """=== trajectory 0: arith/t1 sample 0 | policy expert | turns 2
tokens 72 | trained 42 | examples 1 | splits 0 | reward 1 | success True | end terminated
--- example 0 (arith/t1/0#0): 72 tokens, 42 trained, logprobs no
<|im_start|>system\\n
S<|im_end|>\\n
<|im_start|>user\\n
2+3?<|im_end|>\\n
<|im_start|>assistant\\n
[[<tool_call>\\n
{"name": "add", "arguments": {"a": 2, "b": 3}}\\n
</tool_call><|im_end|>]]\\n
<|im_start|>tool\\n
5<|im_end|>\\n
<|im_start|>assistant\\n
[[<answer>5</answer><|im_end|>]]
"""


def _trajectory(renderer, cut_first: bool = False) -> Trajectory:
    p0 = renderer.render_prompt(MESSAGES[:2])
    c0 = renderer.encode_completion(MESSAGES[2])
    if cut_first:
        c0 = c0[:-1]  # cut before <|im_end|>: continue_prompt appends it, untrained
    p1 = renderer.continue_prompt(p0, c0, MESSAGES[3:4])
    c1 = renderer.encode_completion(MESSAGES[4])
    return Trajectory(
        env="arith",
        task_id="t1",
        messages=MESSAGES,
        turns=(
            Turn(prompt_ids=p0, completion_ids=c0, message=MESSAGES[2]),
            Turn(prompt_ids=p1, completion_ids=c1, message=MESSAGES[4]),
        ),
        reward=1.0,
        success=True,
        policy="expert",
    )


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return get_renderer("smollm2", tokenizer)


def test_plain_view_golden(tmp_path, tokenizer, renderer):
    path = tmp_path / "traj.jsonl"
    write_jsonl(path, [_trajectory(renderer)])
    loaded = load_records(path)
    assert loaded.kind == "trajectory"
    assert inspect_plain(loaded, tokenizer, renderer) == GOLDEN


def test_plain_view_shows_an_appended_end_of_turn_untrained(tmp_path, tokenizer, renderer):
    path = tmp_path / "traj.jsonl"
    write_jsonl(path, [_trajectory(renderer, cut_first=True)])
    text = inspect_plain(load_records(path), tokenizer, renderer)
    assert '</tool_call>]]<|im_end|>\\n\n<|im_start|>tool' in text
    assert "tokens 72 | trained 41 |" in text


def test_max_tokens_and_index(tmp_path, tokenizer, renderer):
    path = tmp_path / "traj.jsonl"
    write_jsonl(path, [_trajectory(renderer), _trajectory(renderer, cut_first=True)])
    prompt_length = len(renderer.render_prompt(MESSAGES[:2]))
    assert prompt_length == 19  # 6 system + 9 user ("2", "+", "3", "?") + 4 ("<|im_start|>", "ass", "istant", "\n")
    text = inspect_plain(load_records(path), tokenizer, renderer, index=1, max_tokens=prompt_length + 1)
    assert text.startswith("=== trajectory 1: ")
    # the whole prompt, then the first trained token, closed at the cut
    assert text.endswith("<|im_start|>assistant\\n\n[[<]]\n... (52 more tokens)\n")
    with pytest.raises(IndexError, match="holds 2 records"):
        inspect_plain(load_records(path), tokenizer, renderer, index=2)


def test_training_example_rows_and_torn_line(tmp_path, tokenizer, renderer):
    examples = renderer.build_examples(_trajectory(renderer))
    path = tmp_path / "examples.jsonl"
    write_jsonl(path, examples)
    with open(path, "a") as f:
        f.write('{"input_ids": [1, 2')  # a torn last line
    loaded = load_records(path)
    assert loaded.kind == "example" and loaded.skipped_lines == 1
    text = inspect_plain(loaded, tokenizer)
    assert text.splitlines()[:3] == [
        "(skipped 1 unreadable lines)",
        "=== record 0",
        "--- example 0 (arith/t1/0#0): 72 tokens, 42 trained, logprobs no",
    ]
    assert text.endswith(GOLDEN.split("logprobs no\n", 1)[1])


def test_token_pieces_join_to_the_decoded_text(tokenizer, renderer):
    ids = renderer.encode_text("naïve café 👋 日本語 done")
    pieces = token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == "naïve café 👋 日本語 done"
    assert "\ufffd" not in "".join(pieces)


def test_rich_view_colours_trained_tokens(tmp_path, tokenizer, renderer):
    from rich.console import Console

    path = tmp_path / "traj.jsonl"
    write_jsonl(path, [_trajectory(renderer)])
    console = Console(file=io.StringIO(), record=True, force_terminal=True, width=200, color_system="256")
    inspect_rich(load_records(path), tokenizer, console, renderer)
    assert console.export_text(styles=False, clear=False) == GOLDEN.replace("[[", "").replace("]]", "")
    styled = console.export_text(styles=True)
    runs = re.findall(r"\x1b\[([0-9;]*)m(.*?)\x1b\[0m", styled, flags=re.S)
    trained_runs = [text for codes, text in runs if ";48;" in f";{codes};"]  # a background colour
    assert "".join(trained_runs) == (
        '<tool_call>\\n{"name": "add", "arguments": {"a": 2, "b": 3}}\\n</tool_call><|im_end|>'
        "<answer>5</answer><|im_end|>"
    )
    assert len(trained_runs) == 42  # one styled run per trained token


def test_cli_plain_output_and_errors(tmp_path, renderer, capsys):
    path = tmp_path / "traj.jsonl"
    write_jsonl(path, [_trajectory(renderer)])
    assert main(["inspect", str(path), "--plain"]) == 0
    assert capsys.readouterr().out == GOLDEN
    assert main(["inspect", str(path), "--index", "5"]) == 2
    assert "out of range" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"hello": 1}) + "\n")
    assert main(["inspect", str(bad)]) == 2
    assert "neither a Trajectory" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_parquet_rows(tmp_path, tokenizer, renderer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    trajectory = _trajectory(renderer)
    row = json.loads(trajectory.model_dump_json())
    for key in ("messages", "turns", "tools", "metrics", "info"):
        row[key] = json.dumps(row[key])  # nested columns stored as JSON text
    path = tmp_path / "traj.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    assert inspect_plain(load_records(path), tokenizer, renderer) == GOLDEN
