"""``tracegym eval`` end to end (expert and tiny-random), failed episodes as unsolved samples,
argument errors, and the shared policy setup (``--adapter``) of ``tracegym/commands/_policy.py``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import pytest
import torch

from tracegym.cli import main
from tracegym.data.store import read_trajectories
from tracegym.envs.base import Env, Task
from tracegym.types import Message, StepResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("pass_at_k.png", "pass_at_kt.png", "turns.png")


def _load(out: Path) -> dict:
    return json.loads((out / "eval.json").read_text())


def _assert_plots(out: Path) -> None:
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, name


def test_expert_on_calculator(tmp_path: Path, capsys):
    out = tmp_path / "expert"
    rc = main(["eval", "--env", "calculator", "--env-option", "num_calls=2", "--policy", "expert", "--tasks", "3",
               "--samples", "2", "--k", "1,2,4", "--turns", "1,2,4,8", "--no-progress", "--out", str(out)])
    assert rc == 0
    s = _load(out)
    assert (s["env"], s["model"], s["split"]) == ("calculator", "expert", "test")
    assert (s["n_tasks"], s["samples_per_task"], s["n_trajectories"]) == (3, 2, 6)
    assert s["ks"] == [1, 2] and s["skipped_ks"] == [4]
    assert any("k = 4 skipped" in note for note in s["notes"])
    # two calls then the answer: exactly 3 assistant turns, so solved at T >= 3 only
    assert s["pass_at"] == {"1": {"1": 0.0, "2": 0.0}, "2": {"1": 0.0, "2": 0.0},
                            "4": {"1": 1.0, "2": 1.0}, "8": {"1": 1.0, "2": 1.0}}
    assert s["pass_at_ci"]["8"]["1"] == [1.0, 1.0]
    assert s["success_rate"] == 1.0 and s["max_turns"] == 8
    assert s["cost"]["turns"] == 3.0 and s["cost"]["tool_calls"] == 2.0 and s["cost"]["generated_tokens"] > 0
    assert s["tool_calls"]["call_precision"] == 1.0 and s["tool_calls"]["call_recall"] == 1.0
    assert s["tool_calls"]["reference_calls"] == 12
    # the sampling settings and the policy are recorded; n > 1 -> temperature 1.0 by default
    assert s["sampling"]["temperature"] == 1.0 and s["sampling"]["seed"] == 0
    assert s["adapter"] is None and s["engine"] is None and s["env_options"] == {"num_calls": 2}
    trajectories = list(read_trajectories(out / "trajectories.jsonl"))
    from tracegym.envs import make

    task_ids = [task.id for task in make("calculator", num_calls=2).tasks("test", n=3, seed=0)]
    assert [(t.task_id, t.sample_index) for t in trajectories] == [(i, k) for i in task_ids for k in (0, 1)]
    assert len(trajectories) == 6 and {t.split for t in trajectories} == {"test"}
    _assert_plots(out)
    printed = capsys.readouterr().out
    assert "pass@1" in printed and "1.000 [1.000, 1.000]" in printed


def test_tiny_random_hf_engine(tmp_path: Path):
    out = tmp_path / "tiny"
    rc = main(["eval", "--env", "calculator", "--model", "tiny-random", "--tasks", "2", "--samples", "2",
               "--k", "1,2", "--turns", "1,2", "--max-tokens-per-turn", "4", "--seed", "5", "--no-progress",
               "--out", str(out)])
    s = _load(out)
    assert rc == 0
    assert (s["model"], s["base_model"], s["engine"]) == ("tiny-random", "tiny-random", "hf")
    assert s["n_trajectories"] == 4 and s["success_rate"] == 0.0
    assert s["pass_at"] == {"1": {"1": 0.0, "2": 0.0}, "2": {"1": 0.0, "2": 0.0}}
    assert 0 < s["cost"]["generated_tokens"] <= 2 * 4 and 1 <= s["cost"]["turns"] <= 2
    assert s["tool_calls"] is not None and s["tool_calls"]["matched_calls"] == 0  # calculator has references
    assert s["sampling"]["temperature"] == 1.0 and s["sampling"]["seed"] == 5
    assert s["sampling"]["max_context"] == 2048  # tiny-random's max_position_embeddings
    _assert_plots(out)


def test_one_sample_defaults_to_greedy_and_is_reproducible(tmp_path: Path):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert main(["eval", "--env", "calculator", "--model", "tiny-random", "--tasks", "2", "--samples", "1",
                     "--k", "1", "--turns", "1", "--max-tokens-per-turn", "6", "--no-progress", "--out", str(out)]) == 0
        assert _load(out)["sampling"]["temperature"] == 0.0
        runs.append([t.turns[0].completion_ids for t in read_trajectories(out / "trajectories.jsonl")])
    assert runs[0] == runs[1] and len(runs[0]) == 2


# --- failed episodes are unsolved samples -----------------------------------------------------------


class FlakyEnv(Env):
    """One step per episode, solved by any answer; the first episode of task t1 raises in ``step``."""

    name = "flaky-eval-test"
    t1_resets = 0

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return [Task(id=f"t{i}", split=split, data={}) for i in range(n)]

    def tool_schemas(self) -> list[dict]:
        return []

    async def reset(self, task: Task) -> list[Message]:
        self.task = task
        if task.id == "t1":
            FlakyEnv.t1_resets += 1
            self.fail = FlakyEnv.t1_resets == 1
        else:
            self.fail = False
        return [Message(role="user", content=f"solve {task.id}")]

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        if self.fail:
            raise RuntimeError("tool backend unreachable")
        return StepResult(messages=(), reward=1.0, terminated=True, truncated=False, info={"success": True})

    def expert_action(self) -> Message:
        return Message(role="assistant", content="<answer>1</answer>")


@pytest.fixture()
def flaky_env():
    from tracegym.envs.registry import register, unregister

    FlakyEnv.t1_resets = 0
    register(FlakyEnv.name, FlakyEnv, overwrite=True)
    yield FlakyEnv.name
    unregister(FlakyEnv.name)


def test_failed_episodes_count_as_unsolved(tmp_path: Path, flaky_env: str):
    out = tmp_path / "flaky"
    rc = main(["eval", "--env", flaky_env, "--policy", "expert", "--tasks", "2", "--samples", "2", "--k", "1,2",
               "--turns", "1", "--no-progress", "--out", str(out)])
    assert rc == 0
    s = _load(out)
    # t0: 2 of 2 solved; t1: 1 of 2 (the failed episode is a miss, not dropped).
    # pass@1 = (1 + 1/2) / 2 = 0.75 (dropping the failure would give 1.0); pass@2 = (1 + 1) / 2 = 1.0
    assert s["n_trajectories"] == 4 and s["per_task"]["t1"] == {"n": 2, "solved": {"1": 1}}
    assert s["pass_at"]["1"] == {"1": 0.75, "2": 1.0}
    assert s["success_rate"] == 0.75
    assert s["errors"]["env_error"] == 1 and "tool backend unreachable" in s["errors"]["top"][0]["error"]
    assert any("1 of 4 episodes failed" in note for note in s["notes"])
    kept = list(read_trajectories(out / "trajectories.jsonl"))
    assert sorted(t.end_reason for t in kept) == ["env_error", "terminated", "terminated", "terminated"]


# --- argument errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value, message", [
    ("--k", "1,x,4", "'x' is not an integer"),
    ("--turns", "0,2", "0 < 1"),
    ("--samples", "0", "expected an integer >= 1"),
])
def test_malformed_arguments_exit_2(tmp_path: Path, capsys, flag: str, value: str, message: str):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--env", "calculator", "--policy", "expert", flag, value, "--out", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("extra, message", [
    (["--env", "no-such-env"], "cannot make env 'no-such-env'"),
    (["--env", "calculator", "--env-option", "num_calls=0"], "cannot make env 'calculator'"),
    (["--env", "calculator", "--samples", "2", "--k", "4,8"], "exceeds --samples 2"),
    (["--env", "calculator", "--adapter", "no/such/folder"], "not a LoRA adapter folder"),
    (["--env", "calculator", "--model", "no-such-model", "--engine", "hf", "--policy", "model"], "unknown model"),
])
def test_bad_arguments_are_clear_errors(tmp_path: Path, capsys, extra: list[str], message: str):
    argv = ["eval", "--policy", "expert", "--tasks", "1", "--samples", "1", "--k", "1", "--no-progress",
            "--out", str(tmp_path / "x"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not (tmp_path / "x" / "eval.json").exists()


# --- --adapter: the LoRA adapter is merged into the model that samples ---------------------------------


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """A LoRA adapter on tiny-random with non-zero B (a fresh adapter would be the identity)."""
    from tracegym.config import LoraConfig
    from tracegym.models import load
    from tracegym.train.lora import prepare_model, save_weights

    model, _ = load("tiny-random")
    peft_model = prepare_model(model, LoraConfig(r=4, alpha=8.0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    folder = tmp_path_factory.mktemp("adapter") / "final"
    save_weights(peft_model, folder)
    (folder / "tracegym.json").write_text(json.dumps({"base_model": "tiny-random", "renderer": "smollm2"}))
    return folder


def _policy_args(argv: list[str]) -> argparse.Namespace:
    from tracegym.commands import _policy

    parser = argparse.ArgumentParser()
    _policy.add_policy_arguments(parser)
    _policy.add_run_arguments(parser, default_tasks=1, default_samples=1)
    return parser.parse_args([*argv, "--out", "unused"])


def test_adapter_is_merged_into_the_model(adapter_dir: Path):
    from peft import PeftModel

    from tracegym.commands._policy import build_policy
    from tracegym.models import load

    base, _ = load("tiny-random")
    reference = PeftModel.from_pretrained(load("tiny-random")[0], str(adapter_dir)).merge_and_unload()
    key = "model.layers.0.self_attn.q_proj.weight"
    expected = reference.state_dict()[key]
    assert not torch.allclose(expected, base.state_dict()[key])  # the adapter changes this weight

    # --adapter alone: the base model comes from tracegym.json
    setup = build_policy(_policy_args(["--adapter", str(adapter_dir)]))
    assert (setup.model_name, setup.adapter, setup.policy_name) == ("tiny-random", str(adapter_dir), str(adapter_dir))
    assert torch.equal(setup.model.state_dict()[key], expected)
    assert setup.policy.model is setup.model and setup.gap_model is setup.model
    assert not any("lora_" in name for name in setup.model.state_dict())
    # the adapter folder given as --model means the same
    same = build_policy(_policy_args(["--model", str(adapter_dir)]))
    assert (same.model_name, same.adapter) == ("tiny-random", str(adapter_dir))
    assert torch.equal(same.model.state_dict()[key], expected)
    # and --model + --adapter too
    both = build_policy(_policy_args(["--model", "tiny-random", "--adapter", str(adapter_dir)]))
    assert torch.equal(both.model.state_dict()[key], expected)


def test_adapter_misuse_is_refused(adapter_dir: Path):
    from tracegym.commands._policy import UsageError, build_policy

    with pytest.raises(UsageError, match="no effect with --policy expert"):
        build_policy(_policy_args(["--adapter", str(adapter_dir), "--policy", "expert"]))
    with pytest.raises(UsageError, match="needs a local model"):
        build_policy(_policy_args(["--adapter", str(adapter_dir), "--engine", "openai"]))
    with pytest.raises(UsageError, match="is itself an adapter folder"):
        build_policy(_policy_args(["--model", str(adapter_dir), "--adapter", str(adapter_dir)]))


def test_eval_with_adapter_records_it(tmp_path: Path, adapter_dir: Path):
    out = tmp_path / "lora"
    rc = main(["eval", "--env", "calculator", "--adapter", str(adapter_dir), "--tasks", "1", "--samples", "2",
               "--k", "1,2", "--turns", "1", "--max-tokens-per-turn", "3", "--no-progress", "--out", str(out)])
    assert rc == 0
    s = _load(out)
    assert (s["model"], s["base_model"], s["adapter"]) == (str(adapter_dir), "tiny-random", str(adapter_dir))
    assert {t.policy for t in read_trajectories(out / "trajectories.jsonl")} == {str(adapter_dir)}


def test_rollout_command_takes_the_adapter(tmp_path: Path, adapter_dir: Path):
    out = tmp_path / "rollout"
    rc = main(["rollout", "--env", "calculator", "--adapter", str(adapter_dir), "--tasks", "1", "--samples", "2",
               "--max-turns", "1", "--max-tokens-per-turn", "3", "--no-progress", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["model"], summary["adapter"], summary["policy"]) == ("tiny-random", str(adapter_dir), str(adapter_dir))
    # the log-prob gap is measured against the merged model the engine sampled from
    assert summary["logprob_gap"]["max"] < 1e-4 and summary["logprob_gap"]["tokens"] == summary["generated_tokens"]
