"""Bad lines in SFT trajectory files are never silent: skipped with a ``file:line`` warning and
counted, or (``data.on_bad_line: error``) an error naming ``file:line``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pydantic
import pytest

from tracegym.config import SFTConfig, load_config
from tracegym.data.store import BadLineError, TrajectoryWriter, read_trajectories, read_trajectories_checked
from tracegym.recipes.sft import load_sft_examples
from tracegym.types import Message, TrainingExample, Trajectory, Turn, read_json_rows, read_json_rows_numbered


def _trajectory(i: int) -> Trajectory:
    answer = Message(role="assistant", content=f"<answer>{i}</answer>")
    turn = Turn(prompt_ids=(1, 2, 3), completion_ids=(10 + i, 99), message=answer, reward=1.0)
    return Trajectory(env="toy", task_id=f"t{i}", messages=(Message(role="user", content="q"), answer),
                      turns=(turn,), reward=1.0, success=True, policy="expert")


class _Renderer:
    """One example per trajectory: its prompt and completion ids (enough to see which were kept)."""

    def build_examples(self, trajectory: Trajectory, weight: float = 1.0, stats=None) -> list[TrainingExample]:
        turn = trajectory.turns[0]
        ids = (*turn.prompt_ids, *turn.completion_ids)
        mask = (0,) * len(turn.prompt_ids) + (1,) * len(turn.completion_ids)
        return [TrainingExample(input_ids=ids, loss_mask=mask, weights=(1.0,) * len(ids),
                                advantages=(0.0,) * len(ids), logprobs=(0.0,) * len(ids),
                                source=trajectory.task_id)]


@pytest.fixture()
def messy_file(tmp_path: Path) -> Path:
    """Line 1 ok, 2 blank, 3 ok, 4 valid JSON but no Trajectory, 5 ok, 6 a list, 7 torn (crash)."""
    path = tmp_path / "messy.jsonl"
    with TrajectoryWriter(path) as writer:
        writer.write(_trajectory(0))
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n")
        f.write(_trajectory(1).model_dump_json() + "\n")
        f.write(json.dumps({"env": "toy", "reward": "lots"}) + "\n")
        f.write(_trajectory(2).model_dump_json() + "\n")
        f.write("[1, 2]\n")
        f.write(_trajectory(3).model_dump_json()[:57])  # torn mid-write, no newline
    return path


def test_reader_reports_line_numbers_and_keeps_the_old_api(messy_file: Path) -> None:
    rows, problems = read_json_rows_numbered(messy_file)
    assert [n for n, _ in rows] == [1, 3, 4, 5]
    assert [n for n, _ in problems] == [6, 7]
    assert "not a JSON object" in problems[0][1] and "not valid JSON" in problems[1][1]
    plain, bad = read_json_rows(messy_file)
    assert [r.get("task_id") for r in plain] == ["t0", "t1", None, "t2"] and bad == 2

    trajectories, bad_lines = read_trajectories_checked(messy_file)
    assert [t.task_id for t in trajectories] == ["t0", "t1", "t2"]
    assert [p.split(": ")[0] for p in bad_lines] == [f"{messy_file}:{n}" for n in (4, 6, 7)]
    assert "not a Trajectory" in bad_lines[0] and "task_id" in bad_lines[0]

    with pytest.raises(BadLineError, match=f"^{messy_file}:4: not a Trajectory"):
        read_trajectories_checked(messy_file, on_bad_line="error")
    # The plain reader: a wrong row is still fatal, now naming file:line.
    with pytest.raises(BadLineError, match=f"{messy_file}:4"):
        list(read_trajectories(messy_file))


def test_sft_skips_bad_lines_with_file_line_warnings(messy_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        data = load_sft_examples([messy_file], _Renderer(), max_length=100)
    assert [ex.source for ex in data.examples] == ["t0", "t1", "t2"]
    assert data.counts["bad_lines"] == 3 and data.counts["trajectories"] == 3
    text = caplog.text
    for line in (4, 6, 7):
        assert f"{messy_file}:{line}:" in text
    assert "skipped 3 bad line(s)" in text


def test_sft_on_bad_line_error_names_file_and_line(messy_file: Path, tmp_path: Path) -> None:
    cfg = load_config(SFTConfig, data={"data": {"train_files": [str(messy_file)], "on_bad_line": "error"}})
    assert cfg.data.on_bad_line == "error" and SFTConfig().data.on_bad_line == "skip"
    with pytest.raises(BadLineError) as caught:
        load_sft_examples(cfg.data.train_files, _Renderer(), 100, on_bad_line=cfg.data.on_bad_line)
    assert str(caught.value).startswith(f"{messy_file}:4: not a Trajectory")
    assert isinstance(caught.value, ValueError)

    # Only the torn last line left: still an error naming it, not a silent skip.
    torn = tmp_path / "torn.jsonl"
    torn.write_text(_trajectory(0).model_dump_json() + "\n" + '{"env": "to', encoding="utf-8")
    with pytest.raises(BadLineError, match=f"{torn}:2: not valid JSON"):
        load_sft_examples([torn], _Renderer(), 100, on_bad_line="error")

    with pytest.raises((pydantic.ValidationError, ValueError), match="on_bad_line"):
        load_config(SFTConfig, data={"data": {"on_bad_line": "ignore"}})


def test_a_clean_file_gives_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "clean.jsonl"
    with TrajectoryWriter(path) as writer:
        for i in range(3):
            writer.write(_trajectory(i))
    with caplog.at_level(logging.WARNING):
        data = load_sft_examples([path], _Renderer(), 100, on_bad_line="error")
    assert len(data.examples) == 3 and data.counts["bad_lines"] == 0
    assert not caplog.records
