"""``tracegym export --merge``: a checkpoint saved by ``sft`` round-trips through plain transformers + peft.

A short SFT run on tiny-random writes ``final/`` (a LoRA adapter); ``tracegym export --merge``
writes a merged folder. A subprocess that imports only ``transformers`` and ``peft`` (never
tracegym) loads the exported folder, and the adapter on its base model, and computes logits and
``apply_chat_template(..., tools=...)`` ids; they must equal tracegym's loaded model (1e-5) and the
renderer's prompt ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tracegym.cli import main
from tracegym.config import SFTConfig, load_config
from tracegym.data.store import TrajectoryWriter
from tracegym.models import load
from tracegym.recipes.sft import train_sft
from tracegym.render import get_renderer
from tracegym.render.toolcalls import to_openai_messages
from tracegym.types import Message, ToolCall, Trajectory, Turn

TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
SYSTEM = Message(role="system", content="Use the calculate tool, then answer as <answer>N</answer>.")


def _episode(renderer, index: int) -> Trajectory:
    """A two-turn calculator episode (call, result, answer) recorded token in, token out."""
    a, b = 3 + index, 11 * index + 2
    user = Message(role="user", content=f"What is {a} * {b}?")
    call = Message(role="assistant", content="", tool_calls=(ToolCall(name="calculate", arguments={"expression": f"{a} * {b}"}),))
    result = Message(role="tool", content=str(a * b), tool_call_id="call_0", name="calculate")
    answer = Message(role="assistant", content=f"<answer>{a * b}</answer>")
    prompt0 = renderer.render_prompt([SYSTEM, user], [TOOL])
    completion0 = renderer.encode_completion(call)
    prompt1 = renderer.continue_prompt(prompt0, completion0, [result])
    turns = (
        Turn(prompt_ids=tuple(prompt0), completion_ids=tuple(completion0), message=call),
        Turn(prompt_ids=tuple(prompt1), completion_ids=tuple(renderer.encode_completion(answer)), message=answer, reward=1.0),
    )
    return Trajectory(env="toy", task_id=f"mul-{index}", messages=(SYSTEM, user, call, result, answer), turns=turns,
                      reward=1.0, success=True, policy="expert", tools=(TOOL,))


# Conversations whose generation prompts the plain-transformers side renders.
CONVERSATIONS = [
    ([SYSTEM, Message(role="user", content="What is 6 * 7?")], [TOOL]),
    (
        [
            Message(role="user", content="What is 6 * 7?"),
            Message(role="assistant", content="Let me compute.", tool_calls=(ToolCall(name="calculate", arguments={"expression": "6 * 7"}),)),
            Message(role="tool", content="42", tool_call_id="call_0", name="calculate"),
        ],
        [TOOL],
    ),
    ([Message(role="user", content="Hello!"), Message(role="assistant", content="Hi."), Message(role="user", content="Bye.")], None),
]

PLAIN_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = json.load(open(sys.argv[1]))
    ids = torch.tensor([job["ids"]])
    out = {}
    merged = AutoModelForCausalLM.from_pretrained(job["exported"], dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(job["base"], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, job["adapter"]).eval()
    with torch.no_grad():
        torch.save({"merged": merged(ids).logits, "adapter": adapted(ids).logits}, job["logits_file"])
    for name in ("exported", "adapter"):
        tokenizer = AutoTokenizer.from_pretrained(job[name])
        out[name] = [
            tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=True)["input_ids"]
            for messages, tools in job["conversations"]
        ]
    out["imported_tracegym"] = any(m == "tracegym" or m.startswith("tracegym.") for m in sys.modules)
    json.dump(out, open(job["result_file"], "w"))
    """
)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tokenizer) -> Path:
    """A finished 3-step LoRA SFT run on tiny-random (its ``final/`` is the adapter)."""
    folder = tmp_path_factory.mktemp("sft")
    renderer = get_renderer("tiny-random", tokenizer)
    data = folder / "train.jsonl"
    with TrajectoryWriter(data) as writer:
        for i in range(8):
            writer.write(_episode(renderer, i))
    cfg = load_config(SFTConfig, data={
        "model": {"name": "tiny-random"},
        "data": {"train_files": [str(data)]},
        "batch_size": 4, "micro_batch_size": 4, "max_length": 512, "seed": 1, "max_steps": 3,
        "lora": {"enabled": True, "r": 8, "alpha": 16, "dropout": 0.0},
        "optim": {"lr": 2e-2, "warmup_steps": 0},
        "output_dir": str(folder / "run"),
        "logging": {"progress": False, "tensorboard": False},
    })
    result = train_sft(cfg)
    assert result.final_dir is not None and (result.final_dir / "adapter_config.json").is_file()
    return folder / "run"


def test_export_round_trips_through_plain_transformers_and_peft(sft_run, tmp_path, tokenizer):
    out = tmp_path / "merged"
    assert main(["export", "--merge", str(sft_run), "--out", str(out)]) == 0
    adapter = sft_run / "final"
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "tracegym.json"} <= {p.name for p in out.iterdir()}
    assert not list(out.glob("adapter_*"))
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"] == "tiny-random"

    # tiny-random exists only inside tracegym: give plain peft its base as a folder.
    base_model, base_tokenizer = load("tiny-random")
    base_dir = tmp_path / "base"
    base_model.save_pretrained(str(base_dir))
    base_tokenizer.save_pretrained(str(base_dir))

    renderer = get_renderer("tiny-random", tokenizer)
    prompts = [renderer.render_prompt(messages, tools) for messages, tools in CONVERSATIONS]
    ids = prompts[1]
    job = {
        "exported": str(out), "adapter": str(adapter), "base": str(base_dir), "ids": ids,
        "conversations": [[to_openai_messages(messages), tools] for messages, tools in CONVERSATIONS],
        "logits_file": str(tmp_path / "logits.pt"), "result_file": str(tmp_path / "result.json"),
    }
    (tmp_path / "job.json").write_text(json.dumps(job), encoding="utf-8")
    (tmp_path / "plain.py").write_text(PLAIN_SCRIPT, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(tmp_path / "plain.py"), str(tmp_path / "job.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    assert result["imported_tracegym"] is False

    ours, _ = load(adapter)  # tracegym: the adapter merged into its base
    with torch.no_grad():
        expected = ours(torch.tensor([ids])).logits
        untrained = base_model(torch.tensor([ids])).logits
    plain = torch.load(tmp_path / "logits.pt")
    assert (plain["merged"] - expected).abs().max().item() <= 1e-5
    assert (plain["adapter"] - expected).abs().max().item() <= 1e-5
    assert (expected - untrained).abs().max().item() > 1e-3  # SFT moved the weights: the comparison means something
    assert result["exported"] == prompts
    assert result["adapter"] == prompts


def test_export_usage_errors_are_one_line_exit_2(sft_run, tmp_path, capsys):
    assert main(["export", str(sft_run), "--out", str(tmp_path / "a")]) == 2  # no --merge
    assert main(["export", "--merge", str(tmp_path / "missing"), "--out", str(tmp_path / "b")]) == 2
    (tmp_path / "taken").mkdir()
    assert main(["export", "--merge", str(sft_run), "--out", str(tmp_path / "taken")]) == 2
    assert not list((tmp_path / "taken").iterdir()) and not (tmp_path / "a").exists()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 3 and "--merge" in errors[0] and "--force" in errors[2]
    assert not list(tmp_path.glob(".*tmp-*"))
