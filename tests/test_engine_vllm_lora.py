"""Teams of LoRA adapters on one base model, served by vLLM, tested on CPU without vLLM:

- in process (``VLLMEngine``) against a fake ``vllm`` package put in ``sys.modules``: adapter names
  become one ``LoRARequest`` (or None) per prompt, every update is a new id and name and removes the
  old id, ``"__base__"`` rows get no LoRA, and the folder handed to vLLM holds the right adapter
  (real peft on a tiny Llama);
- over HTTP (``OpenAIEngine``) against a fake vLLM server: each request goes with ``model=<adapter>``,
  and ``load_adapter`` / ``unload_adapter`` / ``update_adapter`` call vLLM's endpoints.

The real thing runs in ``bench/gpu_multi_lora_check.py`` (needs a GPU)."""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tracegym.engines.openai import OpenAIEngine, OpenAIEngineError
from tracegym.engines.vllm import BASE_ADAPTER, VLLMEngine, adapter_folder
from tracegym.serve import ServerThread
from tracegym.types import SamplingParams

SECRET = "sk-lora-test-1f2e3d4c5b6a"
KEY_ENV = "TRACEGYM_TEST_LORA_KEY"


# --- a fake vllm package ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeLoRARequest:
    """``vllm.lora.request.LoRARequest(lora_name, lora_int_id, lora_path)``."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeCompletion:
    token_ids: list
    logprobs: list
    finish_reason: str
    text: str


@dataclass
class FakeRequestOutput:
    outputs: list


class FakeLLMEngine:
    def __init__(self):
        self.calls: list[tuple[str, object]] = []
        self.loaded: set[int] = set()
        self.refuse: str | None = None  # add_lora raises this once when set

    def add_lora(self, request):
        self.calls.append(("add_lora", request))
        if self.refuse is not None:
            message, self.refuse = self.refuse, None
            raise ValueError(message)
        self.loaded.add(request.lora_int_id)
        return True

    def remove_lora(self, lora_id):
        self.calls.append(("remove_lora", lora_id))
        found = lora_id in self.loaded
        self.loaded.discard(lora_id)
        return found


class FakeLLM:
    """Plays ``vllm.LLM``: each row samples ``[1000 + lora_int_id]`` (1000 without LoRA) ``n`` times."""

    instances: list["FakeLLM"] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.llm_engine = FakeLLMEngine()
        self.generate_calls: list[tuple[list, object]] = []
        FakeLLM.instances.append(self)

    def generate(self, inputs, sampling, use_tqdm=True, lora_request=None):
        self.generate_calls.append((list(inputs), lora_request))
        if isinstance(lora_request, list):
            assert len(lora_request) == len(inputs)  # vLLM pairs the list with the prompts one by one
            per_row = lora_request
        else:
            per_row = [lora_request] * len(inputs)
        outs = []
        for req in per_row:
            assert req is None or req.lora_int_id in self.llm_engine.loaded, "a retired or never loaded adapter id"
            tok = 1000 + (req.lora_int_id if req is not None else 0)
            outs.append(FakeRequestOutput([FakeCompletion([tok], [{tok: FakeLogprob(-0.5)}], "length", "x")
                                           for _ in range(sampling.n)]))
        return outs


@pytest.fixture()
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM = FakeLLM
    vllm.SamplingParams = FakeSamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    vllm.inputs, vllm.lora, lora.request = inputs, lora, request
    for name, module in {"vllm": vllm, "vllm.inputs": inputs, "vllm.lora": lora, "vllm.lora.request": request}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # _import_vllm sets it; restored afterwards
    FakeLLM.instances.clear()
    return vllm


def saved_adapter(folder: Path, rank: int = 8) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return folder


GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


# --- in process --------------------------------------------------------------------------------------


def test_adapters_become_one_lora_request_per_prompt(fake_vllm, tmp_path):
    engine = VLLMEngine("/fake/model", enable_lora=True, max_lora_rank=16, max_loras=4)
    llm = engine.llm
    assert llm.kwargs["enable_lora"] is True and llm.kwargs["max_loras"] == 4 and llm.kwargs["max_lora_rank"] == 16
    assert engine.capabilities.weight_sync == "adapter"
    a = engine.update_adapter("planner", saved_adapter(tmp_path / "planner"))
    b = engine.update_adapter("solver", saved_adapter(tmp_path / "solver"))
    assert (a.lora_name, b.lora_name) == ("planner-v1", "solver-v1") and a.lora_int_id != b.lora_int_id
    assert a.lora_path == str(tmp_path / "planner")
    assert [c for c in llm.llm_engine.calls if c[0] == "add_lora"] == [("add_lora", a), ("add_lora", b)]  # loaded now

    adapters = ["planner", BASE_ADAPTER, "solver", None, "planner"]
    out = engine.generate([[1, 2]] * 5, GREEDY.model_copy(update={"n": 2}), adapters=adapters)
    # one vLLM call for the mixed batch, a list aligned with the prompts
    [(inputs, sent)] = llm.generate_calls
    assert len(inputs) == 5 and sent == [a, None, b, None, a]
    ids = {None: 1000, "planner": 1000 + a.lora_int_id, BASE_ADAPTER: 1000, "solver": 1000 + b.lora_int_id}
    assert [[g.token_ids for g in row] for row in out] == [[(ids[n],)] * 2 for n in adapters]
    assert engine.adapter_requests == {"planner": a, "solver": b}
    assert "planner" in repr(engine) and "solver" in repr(engine)


def test_base_rows_get_no_lora(fake_vllm, tmp_path):
    engine = VLLMEngine("/fake/model", enable_lora=True, max_loras=2)
    engine.update_adapter("a", saved_adapter(tmp_path / "a"))
    engine.generate([[1], [2]], GREEDY, adapters=[BASE_ADAPTER, None])
    engine.generate([[1], [2]], GREEDY)  # no adapters and no default adapter: the base model
    assert [sent for _, sent in engine.llm.generate_calls] == [None, None]
    # without enable_lora base rows are fine, adapters are refused before vLLM is called
    plain = VLLMEngine("/fake/model")
    assert "max_loras" not in plain.llm.kwargs and plain.capabilities.weight_sync == "state_dict"
    plain.generate([[1]], GREEDY, adapters=[BASE_ADAPTER])
    with pytest.raises(ValueError, match=r"adapters \['a'\] need the vllm engine built with enable_lora=True"):
        plain.generate([[1]], GREEDY, adapters=["a"])
    with pytest.raises(ValueError, match="needs the vllm engine built with enable_lora=True"):
        plain.update_adapter("a", tmp_path / "a")
    assert [sent for _, sent in plain.llm.generate_calls] == [None]


def test_an_update_gets_a_new_id_and_name_and_removes_the_old(fake_vllm, tmp_path):
    engine = VLLMEngine("/fake/model", enable_lora=True, max_loras=2)
    calls = engine.llm.llm_engine.calls
    a1 = engine.update_adapter("a", saved_adapter(tmp_path / "a1"))
    b1 = engine.update_adapter("b", saved_adapter(tmp_path / "b1"))
    calls.clear()
    a2 = engine.update_adapter("a", saved_adapter(tmp_path / "a2"))
    # vLLM caches adapters by id and (recent vLLM) prefix-cache blocks by name: both are new
    assert a2.lora_int_id not in (a1.lora_int_id, b1.lora_int_id) and a2.lora_name == "a-v2"
    assert a2.lora_path == str(tmp_path / "a2")
    assert calls == [("add_lora", a2), ("remove_lora", a1.lora_int_id)]  # the new one loads before the old goes
    assert engine.adapter_requests == {"a": a2, "b": b1}  # b untouched
    engine.generate([[1], [1]], GREEDY, adapters=["a", "b"])
    assert engine.llm.generate_calls[-1][1] == [a2, b1]
    # ids are never reused, even across adapters
    b2 = engine.update_adapter("b", saved_adapter(tmp_path / "b2"))
    assert len({a1.lora_int_id, b1.lora_int_id, a2.lora_int_id, b2.lora_int_id}) == 4
    engine.remove_adapter("a")
    assert calls[-1] == ("remove_lora", a2.lora_int_id) and list(engine.adapter_requests) == ["b"]


def test_bad_adapters_and_bad_calls_fail_with_one_line(fake_vllm, tmp_path, caplog):
    engine = VLLMEngine("/fake/model", enable_lora=True)  # max_loras: vLLM's default (1)
    a1 = engine.update_adapter("a", saved_adapter(tmp_path / "a1"))
    engine.llm.llm_engine.refuse = "LoRA rank 64 is greater than max_lora_rank 16"
    with pytest.raises(RuntimeError, match=r"vLLM could not load adapter 'a' from .*a2: LoRA rank 64 is greater"):
        engine.update_adapter("a", saved_adapter(tmp_path / "a2", rank=64))
    assert engine.adapter_requests == {"a": a1}  # the old version still serves
    assert ("remove_lora", a1.lora_int_id) not in engine.llm.llm_engine.calls
    with pytest.raises(FileNotFoundError, match="no adapter_config.json in"):
        engine.update_adapter("a", tmp_path / "empty")
    with pytest.raises(ValueError, match=r"unknown adapter 'zzz'; loaded: \['a'\]"):
        engine.generate([[1]], GREEDY, adapters=["zzz"])
    with pytest.raises(ValueError, match="adapters has 1 names for 2 prompts"):
        engine.generate([[1], [2]], GREEDY, adapters=["a"])
    with pytest.raises(TypeError, match="one adapter name per prompt"):
        engine.generate([[1]], GREEDY, adapters="a")
    with pytest.raises(ValueError, match="other than '__base__'"):
        engine.update_adapter(BASE_ADAPTER, tmp_path / "a1")
    assert engine.llm.generate_calls == []
    engine.update_adapter("b", saved_adapter(tmp_path / "b"))
    with caplog.at_level(logging.WARNING, logger="tracegym.engines.vllm"):
        engine.generate([[1], [2]], GREEDY, adapters=["a", "b"])
        engine.generate([[1], [2]], GREEDY, adapters=["a", "b"])
    warned = [r.getMessage() for r in caplog.records if "max_loras" in r.getMessage()]
    assert len(warned) == 1 and "build the engine with max_loras=2" in warned[0]  # once


def test_adapter_folder_follows_peft_layout(tmp_path):
    saved_adapter(tmp_path / "root")
    saved_adapter(tmp_path / "root" / "solver")
    assert adapter_folder(tmp_path / "root", "solver") == str(tmp_path / "root" / "solver")
    assert adapter_folder(tmp_path / "root", "default") == str(tmp_path / "root")
    assert adapter_folder(tmp_path / "root" / "solver", "solver") == str(tmp_path / "root" / "solver")
    with pytest.raises(FileNotFoundError):
        adapter_folder(tmp_path / "nothing", "x")


# --- real peft on a tiny Llama --------------------------------------------------------------------------


def tiny_peft(names=("a", "b"), seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = LlamaForCausalLM(config)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora)
    randomize(model, names)
    return model


def randomize(model, names):
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if any(f".lora_B.{n}." in pname for n in names):
                p.normal_(0.0, 0.1)


def lora_tensors(model, name):
    """The adapter's tensors as peft saves them (HF names without the adapter name)."""
    out = {}
    for key, value in model.state_dict().items():
        if f".{name}." in key and "lora_" in key:
            out[key.replace(f".{name}.", ".")] = value
    return out


def assert_holds(folder, model, name):
    from safetensors.torch import load_file

    assert os.path.isfile(os.path.join(folder, "adapter_config.json"))
    config = json.loads(Path(folder, "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    expected = lora_tensors(model, name)
    assert saved.keys() == expected.keys() and saved
    for key in saved:
        torch.testing.assert_close(saved[key], expected[key], rtol=0, atol=0)


def test_saved_folders_hold_the_right_adapter(fake_vllm):
    model = tiny_peft(("planner", "solver"))
    assert not torch.equal(*[next(iter(lora_tensors(model, n).values())) for n in ("planner", "solver")])
    engine = VLLMEngine("/fake/model", enable_lora=True, max_loras=2)
    engine.update_weights(model)  # a multi-adapter peft model: every adapter refreshed
    a1, b1 = engine.adapter_requests["planner"], engine.adapter_requests["solver"]
    # peft writes a non-default adapter in <folder>/<name>/: vLLM gets that sub-folder
    assert Path(a1.lora_path).name == "planner" and Path(b1.lora_path).name == "solver"
    assert_holds(a1.lora_path, model, "planner")
    assert_holds(b1.lora_path, model, "solver")
    assert os.listdir(Path(a1.lora_path).parent) in (["planner"], ["planner", "README.md"], ["README.md", "planner"])
    # rows without adapters get the peft model's active adapter (the single-adapter behaviour)
    assert model.active_adapter == "planner"
    engine.generate([[1]], GREEDY)
    assert engine.llm.generate_calls[-1][1] is a1

    randomize(model, ["planner"])  # the planner trains on; hot-swap just that one
    engine.update_weights(model, adapter="planner")
    a2 = engine.adapter_requests["planner"]
    assert a2.lora_int_id != a1.lora_int_id and engine.adapter_requests["solver"] is b1
    assert_holds(a2.lora_path, model, "planner")
    assert not os.path.exists(a1.lora_path)  # the old version's folder is gone, b's stays
    assert os.path.exists(b1.lora_path)
    assert ("remove_lora", a1.lora_int_id) in engine.llm.llm_engine.calls
    engine.generate([[1], [1], [1]], GREEDY, adapters=["solver", "planner", BASE_ADAPTER])
    assert engine.llm.generate_calls[-1][1] == [b1, a2, None]
    with pytest.raises(ValueError, match=r"the peft model has no adapter 'c' \(it has \['planner', 'solver'\]\)"):
        engine.update_adapter("c", model)
    root = engine._lora_dir.name
    engine.close()
    assert not os.path.exists(root)
    engine.close()  # twice is fine


def test_a_single_default_adapter_keeps_the_old_behaviour(fake_vllm):
    model = tiny_peft(("default",))
    engine = VLLMEngine("/fake/model", enable_lora=True)
    engine.update_weights(model)
    first = engine.adapter_requests["default"]
    assert_holds(first.lora_path, model, "default")  # the default adapter is saved in the folder itself
    engine.update_weights(model)
    second = engine.adapter_requests["default"]
    assert second.lora_int_id != first.lora_int_id and second.lora_name == "default-v2"
    engine.generate([[1], [2]], GREEDY)
    assert engine.llm.generate_calls[-1][1] is second  # every row, as before
    engine.close()


# --- over HTTP: a fake vLLM server ----------------------------------------------------------------------


def fake_vllm_server(base="base-model"):
    """Plays ``vllm serve BASE --enable-lora`` with runtime LoRA updating: adapter endpoints answer
    like vLLM (plain-text success, JSON error bodies), completions sample ``[len(model)]``."""
    app = FastAPI()
    state = {"loaded": {}, "calls": [], "auth": [], "models": []}

    def error(status, message, kind):
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        body = await request.json()
        state["auth"].append(request.headers.get("authorization"))
        state["calls"].append(("load", body))
        name = body.get("lora_name")
        if name in state["loaded"]:
            return error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                              "in place, set 'load_inplace' to True.", "InvalidUserInput")
        if "missing" in body.get("lora_path", ""):
            return error(404, f"Loading lora {name} failed: No adapter found for {body['lora_path']}\n"
                              f"(auth was {request.headers.get('authorization')})", "NotFoundError")
        state["loaded"][name] = body["lora_path"]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        body = await request.json()
        state["auth"].append(request.headers.get("authorization"))
        state["calls"].append(("unload", body))
        if state["loaded"].pop(body.get("lora_name"), None) is None:
            return error(404, f"The lora adapter '{body.get('lora_name')}' cannot be found.", "NotFoundError")
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        model = body["model"]
        state["models"].append((body["prompt"], model))
        if model != base and model not in state["loaded"]:
            return error(404, f"The model `{model}` does not exist.", "NotFoundError")
        tok = 500 + sorted([base, *state["loaded"]]).index(model)
        choices = [{"index": k, "text": "x", "token_ids": [tok], "finish_reason": "length",
                    "prompt_token_ids": body["prompt"]} for k in range(body.get("n", 1))]
        return {"choices": choices, "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}}

    return app, state


@pytest.fixture()
def lora_server(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    app, state = fake_vllm_server()
    with ServerThread(app) as server:
        engine = OpenAIEngine("base-model", base_url=server.url + "/v1", api_key_env=KEY_ENV, backoff_s=0.01)
        yield engine, state
        engine.close()


def test_http_requests_go_with_model_set_to_the_adapter(lora_server):
    engine, state = lora_server
    assert engine.load_adapter("solver", "/srv/solver") == "Success: LoRA adapter 'solver' added successfully."
    assert engine.update_adapter("planner", "/srv/planner/1") == "planner-v1"
    assert state["calls"] == [("load", {"lora_name": "solver", "lora_path": "/srv/solver"}),
                              ("load", {"lora_name": "planner-v1", "lora_path": "/srv/planner/1"})]
    assert state["auth"] == [f"Bearer {SECRET}"] * 2  # the engine's API key header
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
    out = engine.generate(prompts, SamplingParams(n=2, max_tokens=1),
                          adapters=["planner", BASE_ADAPTER, "solver", None])
    sent = dict((tuple(p), m) for p, m in state["models"])
    assert [sent[tuple(p)] for p in prompts] == ["planner-v1", "base-model", "solver", "base-model"]
    assert [len(row) for row in out] == [2, 2, 2, 2]
    assert out[0][0].token_ids != out[1][0].token_ids != out[2][0].token_ids  # the server told them apart
    # without adapters: the base model, as before
    state["models"].clear()
    engine.generate([[9]], SamplingParams(max_tokens=1))
    assert state["models"] == [([9], "base-model")]
    with pytest.raises(ValueError, match="adapters has 1 names for 2 prompts"):
        engine.generate([[1], [2]], SamplingParams(), adapters=["solver"])


def test_http_hot_swap_loads_a_new_name_then_unloads_the_old(lora_server):
    engine, state = lora_server
    engine.update_adapter("planner", "/srv/planner/1")
    state["calls"].clear()
    # a new served name (a new id on the server, a new prefix-cache namespace), then the old one goes
    assert engine.update_adapter("planner", "/srv/planner/2") == "planner-v2"
    assert state["calls"] == [("load", {"lora_name": "planner-v2", "lora_path": "/srv/planner/2"}),
                              ("unload", {"lora_name": "planner-v1"})]
    assert state["loaded"] == {"planner-v2": "/srv/planner/2"}
    assert engine.served_adapters == {"planner": "planner-v2"} and engine.model_for("planner") == "planner-v2"
    state["models"].clear()
    engine.generate([[1]], SamplingParams(max_tokens=1), adapters=["planner"])
    assert state["models"] == [([1], "planner-v2")]
    # unload by adapter name: its current version goes, and its rows are no longer routed there
    engine.unload_adapter("planner")
    assert state["calls"][-1] == ("unload", {"lora_name": "planner-v2"}) and state["loaded"] == {}
    assert engine.model_for("planner") == "planner"
    assert engine.update_adapter("planner", "/srv/planner/3") == "planner-v3"  # names are never reused


def test_http_adapter_errors_are_one_line_naming_the_adapter(lora_server):
    engine, state = lora_server
    engine.load_adapter("solver", "/srv/solver")
    with pytest.raises(OpenAIEngineError) as info:
        engine.load_adapter("solver", "/srv/solver")
    text = str(info.value)
    assert "loading LoRA adapter 'solver' from '/srv/solver'" in text and "(HTTP 400)" in text
    assert "has already been loaded" in text and "\n" not in text and info.value.status_code == 400
    with pytest.raises(OpenAIEngineError) as info:
        engine.load_adapter("x", "/srv/missing")
    text = str(info.value)
    assert "'x'" in text and "No adapter found for /srv/missing" in text and "\n" not in text
    assert SECRET not in text and "***" in text  # the key is redacted, even when the server echoes it
    with pytest.raises(OpenAIEngineError, match=r"unloading LoRA adapter 'nope' .* failed \(HTTP 404\): "
                                                r"The lora adapter 'nope' cannot be found\."):
        engine.unload_adapter("nope")
    # a failed load of a new version keeps serving the old one
    engine.update_adapter("planner", "/srv/planner/1")
    with pytest.raises(OpenAIEngineError, match="'planner-v2'"):
        engine.update_adapter("planner", "/srv/missing")
    assert engine.model_for("planner") == "planner-v1" and "planner-v1" in state["loaded"]
    with pytest.raises(ValueError, match="other than '__base__'"):
        engine.load_adapter(BASE_ADAPTER, "/srv/x")


def test_http_a_server_without_runtime_lora_updating_says_how_to_start_it():
    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})  # FastAPI's answer for a route not registered

    engine = OpenAIEngine("m", base_url="http://fake.invalid/v1", api_key_env=KEY_ENV,
                          transport=httpx.MockTransport(reply))
    with pytest.raises(OpenAIEngineError, match=r"loading LoRA adapter 'a' from '/x' on http://fake.invalid/v1/"
                                                r"load_lora_adapter failed \(HTTP 404\): Not Found \(no such endpoint: "
                                                r"start vLLM with --enable-lora and .*VLLM_ALLOW_RUNTIME_LORA_UPDATING=True\)"):
        engine.load_adapter("a", "/x")
    assert engine.requests == 1  # not retried: a lost load could have succeeded
