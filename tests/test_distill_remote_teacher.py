"""A distillation teacher served by an engine that scores given sequences (``prompt_logprobs``), on the
tiny random model, no GPU and no network:

- ``HFEngine.prompt_logprobs`` equals a hand teacher-forced ``log_softmax`` gather (the reference);
- ``tracegym serve`` implements ``echo`` on ``/v1/completions`` (the prompt's tokens and log-probs
  first, None for the first one; ``max_tokens: 0`` only with echo), and the ``openai`` engine's
  ``prompt_logprobs`` through it equals the hf engine's; vLLM's reply shapes (``prompt_logprobs``,
  ``token_id:123`` tokens) are read from a fake vLLM server, and a server without echo is named;
- ``VLLMEngine.prompt_logprobs`` against a fake ``vllm`` package returning vLLM-shaped outputs;
- distillation: the advantages with a served (or vLLM) teacher equal those with the same teacher
  loaded locally, a served copy of the student gives ~0, two CLI steps run against a loopback
  server, ``jsd`` with a remote teacher and other config mistakes are refused in one line, and a
  server with another vocabulary is refused by the tokenizer probe.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tracegym.config import ConfigError, DistillConfig, TeacherConfig, load_config
from tracegym.engines.hf import HFEngine
from tracegym.engines.openai import OpenAIEngine, OpenAIEngineError
from tracegym.recipes import distill as distill_recipe
from tracegym.recipes.distill import (
    EngineTeacher,
    LocalTeacher,
    check_remote_tokenizer,
    engine_teacher_logprobs,
    make_teacher,
    remote_tokenizer_mismatch,
    teacher_sequences,
)
from tracegym.serve import ServerThread, create_app
from tracegym.train.logging import read_metrics
from tracegym.types import Generation, TrainingExample

KEY = "sk-teacher-test-7c4e1a9b"
KEY_ENV = "TRACEGYM_TEST_TEACHER_KEY"
SEQUENCES = [list(range(100, 131)), [5, 6, 7], [9], list(range(300, 310)), list(range(100, 120)) + [7, 7]]


def _hand(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """``log p(ids[i] | ids[:i])`` for i >= 1 from one unpadded forward pass, fp32 log-softmax gathered."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)  # [L, V]
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _assert_close(got: list[list[float]], expected: list[list[float]], atol: float) -> None:
    assert [len(row) for row in got] == [len(row) for row in expected]
    for a, b in zip(got, expected):
        assert a == pytest.approx(b, abs=atol)


@pytest.fixture(scope="module")
def tiny():
    from tracegym.models import load
    from tracegym.render import get_renderer

    model, tokenizer = load("tiny-random")
    return model, tokenizer, get_renderer("tiny-random", tokenizer)


@pytest.fixture(scope="module")
def teacher_model():
    from tracegym.models import load

    return load("tiny-random", seed=1)[0].requires_grad_(False)  # other weights, the same tokenizer


@pytest.fixture(scope="module")
def served_teacher(tiny, teacher_model):
    """``tracegym serve`` of the teacher on loopback, with an API key: (server, its hf engine)."""
    _, tokenizer, renderer = tiny
    engine = HFEngine(teacher_model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    app = create_app(engine, renderer, "tiny-teacher", max_context=512, api_key=KEY)
    with ServerThread(app) as server:
        yield server, engine


@pytest.fixture()
def remote(served_teacher, monkeypatch):
    """The openai engine pointed at the served teacher (the key read from ``KEY_ENV``)."""
    monkeypatch.setenv(KEY_ENV, KEY)
    engine = OpenAIEngine("tiny-teacher", base_url=served_teacher[0].url + "/v1", api_key_env=KEY_ENV, max_retries=0)
    yield engine
    engine.close()


# --- the hf engine: the reference ------------------------------------------------------------------


def test_hf_prompt_logprobs_equal_a_hand_teacher_forced_gather(tiny):
    model = tiny[0]
    engine = HFEngine(model, tiny[1], prompt_batch_tokens=64)  # several batches: 31 + 22 tokens, then the rest
    values = engine.prompt_logprobs(SEQUENCES)
    assert [len(v) for v in values] == [len(s) - 1 for s in SEQUENCES]  # [9] has nothing to predict: []
    for seq, got in zip(SEQUENCES, values):
        assert got == pytest.approx(_hand(model, seq), abs=1e-5)
    assert engine.forward_calls >= 2
    _assert_close(HFEngine(model, tiny[1]).prompt_logprobs(SEQUENCES), values, 1e-5)  # one batch
    assert engine.prompt_logprobs([]) == []
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        engine.prompt_logprobs([[1, 2], []])
    with pytest.raises(TypeError, match="a list of token sequences"):
        engine.prompt_logprobs([1, 2, 3])  # type: ignore[list-item]


# --- tracegym serve: echo ----------------------------------------------------------------------------


def test_served_prompt_logprobs_equal_the_hf_engines(served_teacher, remote):
    _, local = served_teacher
    _assert_close(remote.prompt_logprobs(SEQUENCES), local.prompt_logprobs(SEQUENCES), 1e-4)
    assert remote.prompt_logprobs([[42]]) == [[]]


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_echo_replies_start_with_the_prompt(served_teacher, tiny):
    server, local = served_teacher
    tokenizer = tiny[1]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    prompt = SEQUENCES[3]
    expected = local.prompt_logprobs([prompt])[0]
    reply = client.completions.create(model="tiny-teacher", prompt=prompt, echo=True, logprobs=0, max_tokens=2,
                                      temperature=0.0, extra_body={"return_tokens_as_token_ids": True})
    choice = reply.choices[0]
    lp = choice.logprobs
    sampled = choice.model_extra["token_ids"]
    assert len(sampled) == 2  # token_ids stay the sampled ids
    assert lp.tokens == [f"token_id:{t}" for t in prompt + sampled]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-5)
    assert all(isinstance(v, float) for v in lp.token_logprobs[len(prompt):])  # then the sampled tokens'
    assert choice.text.startswith(_decode(tokenizer, prompt)) and len(lp.text_offset) == len(prompt) + 2
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 2

    # max_tokens 0 with echo: the prompt's scores alone; the tokens' text as the server's tokenizer reads them
    only = client.completions.create(model="tiny-teacher", prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    choice = only.choices[0]
    assert choice.logprobs.tokens == [_decode(tokenizer, [t]) for t in prompt]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert choice.text == _decode(tokenizer, prompt) and choice.model_extra["token_ids"] == []
    assert choice.finish_reason == "length" and only.usage.completion_tokens == 0
    # a text prompt is echoed as it was sent; no logprobs: no scores
    text = client.completions.create(model="tiny-teacher", prompt="Hello there", echo=True, max_tokens=1)
    assert text.choices[0].text.startswith("Hello there") and text.choices[0].logprobs is None

    cases = [
        (dict(prompt=prompt, max_tokens=0), "max_tokens", "only with echo"),
        (dict(prompt=prompt, echo=True, logprobs=2), "logprobs", "with echo, logprobs must be 0"),
        (dict(prompt=prompt, echo=True, max_tokens=0, model="other"), "model", "does not exist"),
    ]
    for kwargs, param, words in cases:
        kwargs.setdefault("model", "tiny-teacher")
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as info:
            client.completions.create(**kwargs)
        err = info.value.body
        assert err["param"] == param and words in err["message"], (kwargs, err)


class ScriptedTokens:
    """A token engine without ``prompt_logprobs`` (``scores`` adds one returning fixed values)."""

    name = "scripted"
    returns_logprobs = True

    def __init__(self, scores: bool = False):
        if scores:
            self.prompt_logprobs = lambda seqs: [[-0.5 - i for i in range(len(s) - 1)] for s in seqs]

    def generate(self, prompts, params):
        return [[Generation(token_ids=(5,), logprobs=(-0.25,))] * params.n for _ in prompts]


def test_echo_needs_an_engine_that_scores_prompts(tiny):
    renderer = tiny[2]
    with ServerThread(create_app(ScriptedTokens(), renderer, "scripted")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="scripted", prompt=[1, 2, 3], echo=True, logprobs=0, max_tokens=1)
        assert info.value.body["param"] == "echo" and "prompt_logprobs" in info.value.body["message"]
        plain = client.completions.create(model="scripted", prompt=[1, 2, 3], echo=True, max_tokens=1)
        assert plain.choices[0].model_extra["token_ids"] == [5]  # echo without log-probs needs no scoring
        engine = OpenAIEngine("scripted", base_url=server.url + "/v1", max_retries=0)
        with pytest.raises(OpenAIEngineError, match=r"does not score prompts \(echo with logprobs\).*vllm serve"):
            engine.prompt_logprobs([[1, 2, 3]])
    with ServerThread(create_app(ScriptedTokens(scores=True), renderer, "scripted")) as server:  # served one call at a time
        engine = OpenAIEngine("scripted", base_url=server.url + "/v1", max_retries=0)
        assert engine.prompt_logprobs([[1, 2, 3, 4], [7, 8]]) == [[-0.5, -1.5, -2.5], [-0.5]]


# --- the openai engine against vLLM's reply shapes --------------------------------------------------


def _fake_score(token: int, position: int) -> float:
    return -((token % 7) + 0.25 * position) - 0.125


def fake_vllm_server(mode: str, seen: list[dict[str, Any]]) -> FastAPI:
    """``/v1/completions`` with echo as vLLM answers it: ``prompt_logprobs`` keyed by id strings (plus
    ``token_logprobs`` that differ, to show which one is read), ``legacy`` (token_logprobs only, text
    tokens), ``wrong_ids`` (the tokens name other ids), ``no_echo`` (a 400 naming echo), ``flaky`` (a
    503 before each answer)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if mode == "no_echo":
            return JSONResponse(status_code=400, content={"error": {"message": "echo is not supported here",
                                                                    "type": "BadRequestError", "param": "echo"}})
        if mode == "flaky" and len(seen) % 2 == 1:
            return JSONResponse(status_code=503, content={"error": {"message": "busy"}})
        prompt = body["prompt"]
        scores = [_fake_score(t, i) for i, t in enumerate(prompt)]
        ids = [t + 1 for t in prompt] if mode == "wrong_ids" else prompt
        choice: dict[str, Any] = {
            "index": 0, "text": "x", "finish_reason": "length", "stop_reason": None,
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids] + ["token_id:5"],
                         "token_logprobs": [None] + [s - (1.0 if mode == "vllm" else 0.0) for s in scores[1:]] + [-0.5],
                         "top_logprobs": [None] * (len(prompt) + 1), "text_offset": [0] * (len(prompt) + 1)},
        }
        if mode == "legacy":
            choice["logprobs"]["tokens"] = [f"t{t}" for t in prompt] + ["x"]
        if mode == "vllm":
            choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": s, "rank": 1, "decoded_token": "?"},
                                                   "3": {"logprob": -9.0, "rank": 2, "decoded_token": "?"}}
                                                  for t, s in zip(prompt[1:], scores[1:])]
            choice["prompt_token_ids"] = prompt
        return {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1}}

    return app


@pytest.mark.parametrize("mode", ["vllm", "legacy", "flaky"])
def test_openai_engine_reads_vllms_prompt_logprobs(mode, monkeypatch):
    seen: list[dict[str, Any]] = []
    monkeypatch.setenv(KEY_ENV, KEY)
    with ServerThread(fake_vllm_server(mode, seen)) as server:
        engine = OpenAIEngine("teacher", base_url=server.url + "/v1", api_key_env=KEY_ENV, max_retries=2,
                              backoff_s=0.01)
        values = engine.prompt_logprobs([[11, 12, 13, 14], [20, 21]])
    # prompt_logprobs (by id) wins over token_logprobs, which the vllm mode shifts by -1
    assert values == [[pytest.approx(_fake_score(t, i)) for i, t in enumerate([11, 12, 13, 14]) if i],
                      [pytest.approx(_fake_score(21, 1))]]
    body = seen[-1]
    assert body["echo"] is True and body["logprobs"] == 0 and body["max_tokens"] == 1 and body["temperature"] == 1.0
    assert isinstance(body["prompt"], list) and body["return_tokens_as_token_ids"] is True


@pytest.mark.parametrize("mode, words", [("wrong_ids", "not the prompt's"), ("no_echo", "does not score prompts")])
def test_openai_engine_names_a_server_that_scores_something_else(mode, words, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    with ServerThread(fake_vllm_server(mode, [])) as server:
        engine = OpenAIEngine("teacher", base_url=server.url + "/v1", api_key_env=KEY_ENV, max_retries=0)
        with pytest.raises(OpenAIEngineError, match=words) as info:
            engine.prompt_logprobs([[11, 12, 13]])
    assert KEY not in str(info.value) and "\n" not in str(info.value)


# --- the vllm engine against a fake vllm package ------------------------------------------------------


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@dataclass
class FakeLogprob:
    logprob: float
    rank: int = 1
    decoded_token: str | None = None


@dataclass
class FakeOutput:
    prompt_token_ids: list
    prompt_logprobs: list
    outputs: list


class FakeLLM:
    """Plays ``vllm.LLM``: prompt log-probs of a real hf model (``scorer``), shaped as vLLM returns
    them (None first, then ``{token_id: Logprob}`` holding the actual token; with ``prompt_logprobs``
    above 0, one more alternative)."""

    scorer: Any = None
    tokenizer: Any = None
    instances: list["FakeLLM"] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple[list, Any, Any]] = []
        FakeLLM.instances.append(self)

    def get_tokenizer(self):
        return FakeLLM.tokenizer

    def generate(self, inputs, sampling, use_tqdm=True, lora_request=None):
        self.calls.append((list(inputs), sampling, lora_request))
        rows = [list(i["prompt_token_ids"]) for i in inputs]
        values = FakeLLM.scorer.prompt_logprobs(rows)
        outs = []
        for row, lps in zip(rows, values):
            entries: list[Any] = [None]
            for token, value in zip(row[1:], lps):
                entry = {token: FakeLogprob(value)}
                if sampling.prompt_logprobs:
                    entry[(token + 1) % 49152] = FakeLogprob(-20.0, rank=2)
                entries.append(entry)
            outs.append(FakeOutput(row, entries, []))
        return outs


@pytest.fixture()
def fake_vllm(monkeypatch, tiny, teacher_model):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = FakeSamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # _import_vllm sets it; restored afterwards
    FakeLLM.scorer = HFEngine(teacher_model, tiny[1])
    FakeLLM.tokenizer = tiny[1]
    FakeLLM.instances.clear()
    return vllm


def test_vllm_prompt_logprobs_take_each_actual_tokens_entry(fake_vllm, tmp_path):
    from tracegym.engines import make_engine

    engine = make_engine("vllm", model=str(tmp_path))
    values = engine.prompt_logprobs(SEQUENCES)
    assert values == FakeLLM.scorer.prompt_logprobs(SEQUENCES)
    [llm] = FakeLLM.instances
    [(inputs, sampling, lora)] = llm.calls  # one call; the one-token sequence is not sent
    assert [i["prompt_token_ids"] for i in inputs] == [s for s in SEQUENCES if len(s) > 1] and lora is None
    assert (sampling.prompt_logprobs, sampling.max_tokens, sampling.temperature, sampling.top_p) == (0, 1, 1.0, 1.0)
    assert engine.tokenizer is FakeLLM.tokenizer

    def missing(inputs, sampling, use_tqdm=True, lora_request=None):  # a position without the actual token
        return [FakeOutput(list(i["prompt_token_ids"]), [None, {3: FakeLogprob(-1.0)}], []) for i in inputs]

    llm.generate = missing
    with pytest.raises(RuntimeError, match="position 1 lack the sequence's token 6"):
        engine.prompt_logprobs([[5, 6]])


# --- distillation ---------------------------------------------------------------------------------


def _data(out: Path, teacher: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {"name": "tiny-random"},
        "lora": {"enabled": True, "r": 8},
        "optim": {"lr": 1e-2},
        "teacher": teacher,
        "env": {"name": "calculator", "options": {"num_calls": 1}},
        "tasks": {"train": 8, "test": 2, "seed": 0},
        "tasks_per_step": 2,
        "group_size": 4,
        "rollout": {"max_turns": 1, "max_tokens_per_turn": 8, "concurrency": 8},
        "micro_batch_size": 4,
        "steps": 2,
        "eval": {"every": 0, "at_start": False},
        "output_dir": str(out),
        "logging": {"progress": False, "tensorboard": False},
    }


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """One step's student, batch and loss config, as ``train_distill`` builds them (tiny-random, LoRA)."""
    from tracegym.batch import examples_from_groups, make_batch
    from tracegym.envs import make
    from tracegym.rl.collect import collect_groups
    from tracegym.rl.policy import load_policy, make_sampler
    from tracegym.rl.tasks import tasks_at
    from tracegym.render import get_renderer

    cfg = load_config(DistillConfig, data=_data(tmp_path_factory.mktemp("d") / "run", {"model": "tiny-random"}))
    loss_cfg = distill_recipe.policy_loss_config(cfg)
    torch.manual_seed(cfg.seed)
    model, tokenizer, _ = load_policy(cfg, loss_cfg, torch.device("cpu"))  # type: ignore[arg-type]
    renderer = get_renderer("tiny-random", tokenizer)
    sampler = make_sampler(cfg, model, tokenizer, renderer)  # type: ignore[arg-type]
    tasks = tasks_at(make("calculator", num_calls=1).tasks("train", cfg.tasks.train), cfg.seed, 0, cfg.tasks_per_step)
    groups, _ = collect_groups(sampler, cfg, tasks, renderer, seed=0)  # type: ignore[arg-type]
    data = examples_from_groups(groups, renderer)
    batch = make_batch(data.examples, pad_token_id=tokenizer.pad_token_id)
    assert batch.loss_mask.sum() > 10
    return model, batch, loss_cfg


def _advantages(sampled, teacher) -> tuple[torch.Tensor, dict[str, float]]:
    model, batch, loss_cfg = sampled
    scored, metrics = distill_recipe.score_with_teacher(model, teacher, batch, loss_cfg, micro_batch_size=4,
                                                        temperature=1.0)
    return scored.advantages, metrics


def test_served_teacher_gives_the_local_teachers_advantages(sampled, teacher_model, remote):
    local, local_metrics = _advantages(sampled, teacher_model)
    served, served_metrics = _advantages(sampled, EngineTeacher(remote, "tiny-teacher"))
    mask = sampled[1].loss_mask.bool()
    assert local[mask].abs().mean() > 1e-2  # a real signal
    assert torch.allclose(served, local, atol=1e-4)
    assert not served[~mask].any()  # 0 off the sampled tokens
    assert served_metrics["distill/reverse_kl"] == pytest.approx(local_metrics["distill/reverse_kl"], abs=1e-4)


def test_a_served_copy_of_the_student_gives_zero_advantages(sampled, tiny):
    from tracegym.models import load

    model, tokenizer, renderer = tiny
    student_copy = load("tiny-random")[0]  # the student's base weights; its LoRA B is 0
    with ServerThread(create_app(HFEngine(student_copy, tokenizer), renderer, "student", max_context=512)) as server:
        engine = OpenAIEngine("student", base_url=server.url + "/v1", max_retries=0)
        advantages, metrics = _advantages(sampled, EngineTeacher(engine))
    assert advantages.abs().max() < 1e-4 and abs(metrics["distill/reverse_kl"]) < 1e-5


def test_scattered_teacher_logprobs_are_target_aligned(tiny, teacher_model):
    """Column t holds log p(token t + 1 | tokens <= t) of each row, up to its last trained token."""
    from tracegym.batch import make_batch

    rows = [list(range(100, 112)), list(range(200, 207)), list(range(300, 305))]
    masks = [[0] * 5 + [1] * 5 + [0] * 2, [0] * 4 + [1] * 3, [0] * 5]  # row 0: trailing untrained; row 2: none
    examples = [TrainingExample(input_ids=ids, loss_mask=m, weights=[1.0] * len(ids), advantages=[0.0] * len(ids),
                                logprobs=[0.0] * len(ids), source=f"e/t{i}/0") for i, (ids, m) in enumerate(zip(rows, masks))]
    batch = make_batch(examples, pad_token_id=0)
    assert teacher_sequences(batch) == [rows[0][:10], rows[1], []]
    values = engine_teacher_logprobs(HFEngine(teacher_model), batch)
    local = LocalTeacher(teacher_model).score(batch, 2)
    mask = batch.loss_mask.bool()
    assert values.shape == batch.loss_mask.shape and values.dtype == torch.float32
    assert torch.allclose(values[mask], local[mask], atol=1e-5)
    for row, ids in enumerate(rows[:2]):
        hand = _hand(teacher_model, ids)
        for column in range(batch.loss_mask.shape[1]):
            if batch.loss_mask[row, column]:
                assert float(values[row, column]) == pytest.approx(hand[column], abs=1e-5)
    assert not values[2].any()


def test_vllm_teacher_gives_the_local_teachers_advantages(sampled, teacher_model, fake_vllm, tmp_path, tiny):
    teacher = make_teacher(TeacherConfig(engine="vllm", model=str(tmp_path), engine_options={"gpu_memory_utilization": 0.3}),
                           "float32", torch.device("cpu"), tiny[1])
    assert FakeLLM.instances[0].kwargs["gpu_memory_utilization"] == 0.3
    served, _ = _advantages(sampled, teacher)
    local, _ = _advantages(sampled, teacher_model)
    assert torch.allclose(served, local, atol=1e-4)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="is a LoRA adapter folder.*tracegym export --merge"):
        make_teacher(TeacherConfig(engine="vllm", model=str(tmp_path)), "float32", torch.device("cpu"), tiny[1])


def _write_config(tmp_path: Path, teacher: str, out: Path, extra: str = "") -> Path:
    config = tmp_path / "distill.yaml"
    config.write_text(
        "model: {name: tiny-random}\nlora: {r: 8}\noptim: {lr: 0.01}\n"
        f"teacher: {teacher}\n"
        "env: {name: calculator, options: {num_calls: 1}}\ntasks: {train: 8, test: 2}\n"
        "tasks_per_step: 2\ngroup_size: 4\nrollout: {max_turns: 1, max_tokens_per_turn: 8, concurrency: 8}\n"
        "eval: {every: 0, at_start: false}\nsteps: 2\n"
        f"output_dir: '{out}'\nlogging: {{progress: false, tensorboard: false}}\n{extra}"
    )
    return config


def test_cli_distill_from_a_served_teacher(tmp_path, capsys, served_teacher, monkeypatch):
    from tracegym.cli import main

    monkeypatch.setenv(KEY_ENV, KEY)
    out = tmp_path / "run"
    teacher = (f"{{engine: openai, model: tiny-teacher, base_url: '{served_teacher[0].url}/v1', "
               f"api_key_env: {KEY_ENV}, engine_options: {{max_concurrency: 4}}}}")
    assert main(["distill", "--config", str(_write_config(tmp_path, teacher, out))]) == 0
    printed = capsys.readouterr()
    assert "distill done: 2 steps" in printed.out and KEY not in printed.out + printed.err
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        for key in ("distill/reverse_kl", "distill/teacher_logprob", "train/loss", "train/grad_norm"):
            assert key in row and math.isfinite(row[key]), key
        assert abs(row["distill/reverse_kl"]) > 1e-3  # another model: a real (single-sample, noisy) signal
    assert (out / "final").is_dir()


@pytest.mark.parametrize(
    "teacher, extra, words",
    [
        ("{engine: openai, base_url: 'http://127.0.0.1:9/v1'}", "loss: jsd\n", "loss jsd compares the teacher's whole"),
        ("{engine: openai}", "", "teacher.engine openai needs teacher.base_url"),
        ("{engine: openai, base_url: 'http://x/v1', adapter: a}", "", "teacher.adapter is merged by teacher.engine hf"),
        ("{engine: hf, base_url: 'http://x/v1'}", "", "are for teacher.engine: openai"),
        ("{engine: hf, engine_options: {timeout_s: 3}}", "", "are for teacher.engine vllm or openai"),
        ("{engine: openai, base_url: 'http://x/v1', engine_options: {base_url: y}}", "", "cannot set base_url"),
        ("{engine: openai, base_url: 'http://x/v1', engine_options: {gpu_memory_utilization: 0.5}}", "",
         "teacher.engine_options: engine 'openai' has no option 'gpu_memory_utilization'"),
    ],
)
def test_remote_teacher_config_mistakes_are_one_line_errors(tmp_path, capsys, teacher, extra, words):
    from tracegym.cli import main

    out = tmp_path / "run"
    assert main(["distill", "--config", str(_write_config(tmp_path, teacher, out, extra))]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert not out.exists()  # refused before anything is written
    if "jsd" in extra:
        with pytest.raises(ConfigError, match="needs teacher.engine hf"):
            load_config(DistillConfig, data=_data(out, {"engine": "vllm", "model": "x"}), overrides=["loss=jsd"])


def test_unreachable_server_is_one_line(tmp_path, capsys):
    from tracegym.cli import main

    out = tmp_path / "run"
    teacher = "{engine: openai, model: t, base_url: 'http://127.0.0.1:9/v1', engine_options: {max_retries: 0}}"
    assert main(["distill", "--config", str(_write_config(tmp_path, teacher, out))]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: teacher 't' at http://127.0.0.1:9/v1:") and "Traceback" not in "\n".join(err)


class _TextEngine:
    """Answers ``prompt_token_texts`` with a fixed function of the ids (or None, or an error)."""

    name = "texts"
    base_url = "http://fake/v1"

    def __init__(self, read):
        self.read = read

    def prompt_token_texts(self, ids):
        if isinstance(self.read, Exception):
            raise self.read
        return None if self.read is None else [self.read(t) for t in ids]


def test_a_server_with_another_vocabulary_is_refused(tokenizer, caplog):
    ids = tokenizer.encode("Hello world! What is 12 * 7 + 3?", add_special_tokens=False)
    same = [tokenizer.decode([t]) for t in ids]
    assert remote_tokenizer_mismatch(tokenizer, ids, same) is None
    assert remote_tokenizer_mismatch(tokenizer, ids, tokenizer.convert_ids_to_tokens(ids)) is None  # raw pieces
    shifted = [tokenizer.decode([t + 1]) for t in ids]  # another vocabulary: other text for the same ids
    assert "probe token ids as other text" in remote_tokenizer_mismatch(tokenizer, ids, shifted)

    check_remote_tokenizer(_TextEngine(lambda t: tokenizer.decode([t])), tokenizer, "t")  # agrees
    with pytest.raises(ValueError, match=r"^teacher 't' at http://fake/v1 does not share the student's tokenizer"):
        check_remote_tokenizer(_TextEngine(lambda t: tokenizer.decode([(t * 7 + 3) % 49152])), tokenizer, "t")
    with pytest.raises(ValueError, match="at http://fake/v1: refused"):
        check_remote_tokenizer(_TextEngine(OpenAIEngineError("refused")), tokenizer, "t")
    check_remote_tokenizer(_TextEngine(None), tokenizer, "t")  # no text: cannot be checked, only logged
    assert "cannot be checked" in caplog.text


def test_the_served_teacher_passes_the_tokenizer_probe(remote, tiny):
    texts = remote.prompt_token_texts([1, 100, 101])
    assert texts == [tiny[1].decode([t]) for t in (1, 100, 101)]
    check_remote_tokenizer(remote, tiny[1], "tiny-teacher")
    assert httpx.get(remote.base_url.rsplit("/v1", 1)[0] + "/health").json()["status"] == "ok"
