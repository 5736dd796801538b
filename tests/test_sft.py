"""SFT recipe on the tiny random model: it learns, it resumes exactly, micro-batching is exact."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tracegym.config import SFTConfig, load_config
from tracegym.data.store import TrajectoryWriter
from tracegym.recipes._run import epoch_order
from tracegym.recipes.sft import load_sft_examples, train_sft
from tracegym.render import get_renderer
from tracegym.train.checkpoint import list_checkpoints
from tracegym.train.logging import read_metrics
from tracegym.types import Message, Trajectory, Turn

SYSTEM = Message(role="system", content="Answer with the sum inside <answer></answer>.")
DETERMINISTIC_KEYS = ("loss", "grad_norm", "lr", "epoch", "loss_tokens", "tokens")


def _toy_trajectory(renderer, index: int, success: bool = True) -> Trajectory:
    rng = random.Random(index)
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    messages = [SYSTEM, Message(role="user", content=f"What is {a} + {b}?")]
    answer = Message(role="assistant", content=f"<answer>{a + b if success else a - b}</answer>")
    turn = Turn(
        prompt_ids=tuple(renderer.render_prompt(messages)),
        completion_ids=tuple(renderer.encode_completion(answer)),
        message=answer,
        reward=1.0 if success else 0.0,
    )
    return Trajectory(
        env="toy", task_id=f"add-{index}", messages=(*messages, answer), turns=(turn,),
        reward=turn.reward, success=success, policy="expert",
    )


@pytest.fixture(scope="module")
def toy_files(tmp_path_factory, tokenizer) -> tuple[Path, Path]:
    renderer = get_renderer("tiny-random", tokenizer)
    folder = tmp_path_factory.mktemp("toy")
    train, test = folder / "train.jsonl", folder / "test.jsonl"
    with TrajectoryWriter(train) as writer:
        for i in range(20):
            writer.write(_toy_trajectory(renderer, i))
        for i in range(100, 104):  # failed episodes: filtered out by only_successful
            writer.write(_toy_trajectory(renderer, i, success=False))
    with TrajectoryWriter(test) as writer:
        for i in range(200, 204):
            writer.write(_toy_trajectory(renderer, i))
    return train, test


def _config(tmp_path: Path, train: Path, *overrides: str, eval_file: Path | None = None) -> SFTConfig:
    data = {
        "model": {"name": "tiny-random"},
        "data": {"train_files": [str(train)], "eval_files": [str(eval_file)] if eval_file else []},
        "batch_size": 4, "micro_batch_size": 2, "max_length": 512, "seed": 3,
        "optim": {"lr": 5e-3, "warmup_steps": 2, "schedule": "cosine"},
        "output_dir": str(tmp_path / "run"),
        "logging": {"progress": False, "tensorboard": False},
    }
    return load_config(SFTConfig, data=data, overrides=list(overrides))


def test_examples_are_filtered_and_masked(toy_files, tokenizer):
    renderer = get_renderer("tiny-random", tokenizer)
    data = load_sft_examples([toy_files[0]], renderer, max_length=512)
    assert data.counts["trajectories"] == 24 and data.counts["kept_trajectories"] == 20
    assert len(data.examples) == 20
    ex = data.examples[0]
    # Loss only on the generated answer: "<answer>N</answer>" plus the end-of-turn token.
    generated = [t for t, m in zip(ex.input_ids, ex.loss_mask) if m]
    assert tokenizer.decode(generated).startswith("<answer>") and generated[-1] == tokenizer.eos_token_id
    unfiltered = load_sft_examples([toy_files[0]], renderer, max_length=512, only_successful=False)
    assert len(unfiltered.examples) == 24
    short = load_sft_examples([toy_files[0]], renderer, max_length=10)
    assert short.examples == [] and short.counts["dropped_too_long"] == 20


def test_epoch_order_is_a_pure_function_of_seed_and_epoch():
    assert list(epoch_order(10, 1, 0, True)) == list(epoch_order(10, 1, 0, True))
    assert list(epoch_order(10, 1, 0, True)) != list(epoch_order(10, 1, 1, True))
    assert sorted(epoch_order(10, 1, 0, True)) == list(range(10))
    assert list(epoch_order(5, 1, 0, False)) == [0, 1, 2, 3, 4]


def test_sft_decreases_loss_and_writes_run_files(tmp_path, toy_files):
    cfg = _config(tmp_path, toy_files[0], "max_steps=15", "lora.enabled=false", "logging.tensorboard=true", "optim.lr=3e-2",
                  "eval_every=5", eval_file=toy_files[1])
    result = train_sft(cfg)
    rows = [r for r in read_metrics(result.run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, 16))
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < 0.5 * first, (first, last)
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0]
    assert rows[0]["lr"] == pytest.approx(3e-2 / 3) and rows[1]["lr"] == pytest.approx(2 * 3e-2 / 3)  # warmup over 2 steps
    assert all(r["rss_mb"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    run = result.run_dir
    assert (run / "config.yaml").is_file() and list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (result.final_dir / "model.safetensors").is_file() and (result.final_dir / "tokenizer.json").is_file()
    assert [s for s, _ in list_checkpoints(run)] == [15]
    with pytest.raises(FileExistsError, match="--resume"):
        train_sft(cfg)


def _final_tensors(final_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(final_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    assert tensors
    return tensors


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_resume_matches_straight_run_exactly(tmp_path, toy_files, lora):
    # 20 examples, batch 4: 5 steps per epoch, so 7 steps cross an epoch boundary (a new shuffle).
    common = ("max_steps=7", f"lora.enabled={str(lora).lower()}", "lora.r=4")
    straight = train_sft(_config(tmp_path / "a", toy_files[0], *common))

    cfg = _config(tmp_path / "b", toy_files[0], *common, "checkpoint.every=2")
    # Killed after step 5: the last checkpoint is step 4, so step 5 is trained (and logged) twice.
    interrupted = train_sft(cfg, stop_at_step=5)
    assert interrupted.final_dir is None and [s for s, _ in list_checkpoints(cfg.output_dir)] == [2, 4]
    resumed = train_sft(cfg, resume=True)
    assert resumed.step == 7 and [r["step"] for r in resumed.history] == [5, 6, 7]

    def table(run_dir: Path) -> list[tuple]:
        return [tuple(r[k] for k in ("step", *DETERMINISTIC_KEYS)) for r in read_metrics(run_dir) if r["step"] > 0]

    assert table(straight.run_dir) == table(resumed.run_dir)  # every step once, identical numbers
    assert len(table(resumed.run_dir)) == 7
    a, b = _final_tensors(straight.final_dir), _final_tensors(resumed.final_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    if lora:
        assert (resumed.final_dir / "adapter_config.json").is_file()
        assert not (resumed.final_dir / "model.safetensors").exists()
        # The data cursor is meaningless for another data order: resuming with another seed is refused.
        with pytest.raises(ValueError, match="cannot resume"):
            train_sft(cfg.model_copy(update={"seed": 4}), resume=True)


def test_micro_batch_size_does_not_change_the_step(tmp_path, toy_files):
    one = train_sft(_config(tmp_path / "m1", toy_files[0], "max_steps=2", "micro_batch_size=1"))
    four = train_sft(_config(tmp_path / "m4", toy_files[0], "max_steps=2", "micro_batch_size=4"))
    for r1, r4 in zip(one.history, four.history):
        assert r1["loss"] == pytest.approx(r4["loss"], rel=1e-5)
        assert r1["grad_norm"] == pytest.approx(r4["grad_norm"], rel=1e-4)
        assert r1["micro_batches"] == 4 and r4["micro_batches"] == 1


def test_too_few_examples_is_a_clear_error(tmp_path, toy_files):
    with pytest.raises(ValueError, match="fewer than batch_size"):
        train_sft(_config(tmp_path, toy_files[0], "batch_size=32", "micro_batch_size=4"))


def test_cli_runs_sft_and_reports_config_errors(tmp_path, toy_files, capsys):
    from tracegym.cli import main

    config = tmp_path / "sft.yaml"
    config.write_text(
        f"model: {{name: tiny-random}}\ndata: {{train_files: ['{toy_files[0]}']}}\nbatch_size: 4\n"
        f"micro_batch_size: 4\noutput_dir: '{tmp_path / 'run'}'\nlogging: {{progress: false, tensorboard: false}}\n"
    )
    assert main(["sft", "--config", str(config), "lora.rr=4"]) == 2
    assert "did you mean 'lora.r'?" in capsys.readouterr().err
    assert main(["sft", "--config", str(config), "max_steps=2", "lora.r=4"]) == 0
    assert "sft done: 2 steps" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]
    assert load_config(SFTConfig, tmp_path / "run" / "config.yaml").lora.r == 4  # the resolved config
    # A second run into the same folder without --resume is refused with a clear message.
    assert main(["sft", "--config", str(config), "max_steps=2"]) == 1
    assert "--resume" in capsys.readouterr().err


def test_bad_lines_are_counted_in_the_run_or_stop_it(tmp_path, toy_files, caplog):
    from tracegym.data.store import BadLineError

    messy = tmp_path / "messy.jsonl"
    lines = toy_files[0].read_text(encoding="utf-8").splitlines(keepends=True)
    # line 3: valid JSON but not a trajectory; last line: torn by a crash mid-write
    messy.write_text("".join(lines[:2]) + '{"env": "toy"}\n' + "".join(lines[2:]) + lines[0][:40], encoding="utf-8")
    bad_at = (3, len(lines) + 2)

    with caplog.at_level("WARNING", logger="tracegym.recipes.sft"):
        result = train_sft(_config(tmp_path / "skip", messy, "max_steps=1", "lora.r=4"))
    assert all(f"{messy}:{n}:" in caplog.text for n in bad_at)
    step0 = next(r for r in read_metrics(result.run_dir) if r["step"] == 0)
    assert step0["data/bad_lines"] == 2 and step0["data/kept_trajectories"] == 20

    with pytest.raises(BadLineError, match=f"{messy}:3: not a Trajectory"):
        train_sft(_config(tmp_path / "error", messy, "max_steps=1", "data.on_bad_line=error"))


def test_resume_skips_a_truncated_latest_checkpoint(tmp_path, toy_files, caplog):
    cfg = _config(tmp_path, toy_files[0], "max_steps=6", "lora.r=4", "checkpoint.every=2")
    train_sft(cfg, stop_at_step=5)  # killed after step 5: checkpoints of steps 2 and 4
    assert [s for s, _ in list_checkpoints(cfg.output_dir)] == [2, 4]
    newer = list_checkpoints(cfg.output_dir)[-1][1]
    state = newer / "training_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # torn by a full disk or an interrupted copy
    with caplog.at_level("WARNING", logger="tracegym.train.checkpoint"):
        resumed = train_sft(cfg, resume=True)
    assert str(state) in caplog.text
    assert [r["step"] for r in resumed.history] == [3, 4, 5, 6] and resumed.final_dir is not None
