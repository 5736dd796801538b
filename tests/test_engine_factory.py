"""``make_engine`` (the one engine factory), engine capabilities and ``require_rl_sampler``."""

from __future__ import annotations

import pytest
import torch

import tracegym.models
from tracegym.engines import (
    EngineCapabilities,
    Sampler,
    engine_options,
    make_engine,
    require_rl_sampler,
)
from tracegym.engines.hf import HFEngine
from tracegym.engines.openai import OpenAIEngine
from tracegym.engines.vllm import VLLMEngine
from tracegym.types import SamplingParams

PROMPT = [1, 4093, 198, 6004, 28]


@pytest.fixture(scope="module")
def tiny():
    from tracegym.render import get_renderer

    model, tokenizer = tracegym.models.load("tiny-random")
    return model, tokenizer, get_renderer("tiny-random", tokenizer)


@pytest.fixture()
def openai_engine():
    # the constructor only builds an httpx client: no request is sent
    engine = make_engine("openai", model="m", base_url="http://127.0.0.1:9/v1", api_key_env="TRACEGYM_NO_SUCH_KEY")
    yield engine
    engine.close()


def test_hf_from_a_model_name(tiny):
    _, _, renderer = tiny
    engine = make_engine("hf", model="tiny-random", renderer=renderer, max_batch_size=3)
    assert isinstance(engine, HFEngine)
    assert engine.tokenizer is not None  # loaded with the model
    assert engine.stop_token_ids == tuple(renderer.stop_token_ids) and engine.stop_token_ids
    assert engine.max_batch_size == 3
    [[g]] = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(g.token_ids) == len(g.logprobs) >= 1


def test_hf_from_a_loaded_model_object(tiny):
    model, tokenizer, renderer = tiny
    engine = make_engine("hf", model=model, tokenizer=tokenizer, renderer=renderer, pad_token_id=7,
                         prefix_cache=False)
    assert engine.model is model and engine.tokenizer is tokenizer
    assert engine.pad_token_id == 7 and engine.prefix_cache is False
    assert engine.stop_token_ids == tuple(renderer.stop_token_ids)
    # explicit stop ids win over the renderer's; no renderer means no stop ids
    assert make_engine("hf", model=model, renderer=renderer, stop_token_ids=[5]).stop_token_ids == (5,)
    assert make_engine("hf", model=model).stop_token_ids == ()
    # same model, same greedy tokens as a direct construction
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    assert engine.generate([PROMPT], greedy) == HFEngine(model, tokenizer, prefix_cache=False).generate([PROMPT], greedy)


def test_unknown_engine_name():
    with pytest.raises(ValueError, match=r"unknown engine 'tgi'; choose one of hf, openai, vllm"):
        make_engine("tgi", model="tiny-random")


def test_unknown_option_is_refused_before_loading(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(tracegym.models, "load", no_load)
    with pytest.raises(ValueError) as err:
        make_engine("hf", model="tiny-random", max_batch=4)
    text = str(err.value)
    assert "engine 'hf' has no option 'max_batch'" in text
    assert "allowed options:" in text and "max_batch_size" in text and "stop_token_ids" in text
    assert "\n" not in text
    with pytest.raises(ValueError, match=r"engine 'openai' has no options 'max_batch_size', 'seed'; allowed options: .*base_url"):
        make_engine("openai", model="m", max_batch_size=4, seed=1)


def test_options_follow_the_constructors():
    hf, hf_open = engine_options("hf")
    assert "max_batch_size" in hf and "pad_token_id" in hf and not hf_open
    assert "model" not in hf and "tokenizer" not in hf  # the factory's own keywords
    oa, _ = engine_options("openai")
    assert {"base_url", "api_key_env", "timeout_s"} <= set(oa)
    vl, vl_open = engine_options("vllm")
    assert "gpu_memory_utilization" in vl and vl_open  # other keywords go on to vllm.LLM


def test_model_objects_only_for_hf_and_model_is_needed():
    with pytest.raises(ValueError, match="only the hf engine wraps a model object"):
        make_engine("vllm", model=torch.nn.Linear(2, 2))  # refused before vllm is imported
    with pytest.raises(ValueError, match=r"make_engine\('hf'\) needs model="):
        make_engine("hf", model=None)


def test_capabilities(tiny, openai_engine):
    model, tokenizer, _ = tiny
    hf = make_engine("hf", model=model, tokenizer=tokenizer)
    assert hf.capabilities == EngineCapabilities(returns_logprobs=True, exact_token_ids=True, weight_sync="shared_model")
    assert isinstance(openai_engine, OpenAIEngine)
    assert openai_engine.capabilities == EngineCapabilities(returns_logprobs=False, exact_token_ids=False,
                                                            weight_sync="none")
    # the class attribute the rollout runner reads today
    assert HFEngine.returns_logprobs is True and OpenAIEngine.returns_logprobs is False
    assert isinstance(hf, Sampler) and isinstance(openai_engine, Sampler)
    # vllm: without a GPU, check the property on an unbuilt instance
    vllm = VLLMEngine.__new__(VLLMEngine)
    vllm.enable_lora = False
    assert vllm.capabilities == EngineCapabilities(True, True, "state_dict")
    vllm.enable_lora = True
    assert vllm.capabilities.weight_sync == "adapter"


def test_hf_shared_model_sync_swaps_the_object(tiny):
    model, tokenizer, _ = tiny
    engine = make_engine("hf", model=model, tokenizer=tokenizer)
    other, _ = tracegym.models.load("tiny-random")
    engine.update_weights(other)
    assert engine.model is other


def test_require_rl_sampler(tiny, openai_engine):
    model, tokenizer, _ = tiny
    assert require_rl_sampler(make_engine("hf", model=model, tokenizer=tokenizer)) is None
    with pytest.raises(ValueError) as err:
        require_rl_sampler(openai_engine)
    text = str(err.value)
    assert text.startswith("engine 'openai' does not return the log-probs of the tokens it samples")
    assert "rollout.engine: hf (CPU) or vllm (GPU)" in text and "\n" not in text

    class TextLevel:
        name = "texty"
        capabilities = EngineCapabilities(returns_logprobs=True, exact_token_ids=False)

    with pytest.raises(ValueError, match="engine 'texty' does not return the exact token ids"):
        require_rl_sampler(TextLevel())

    class Bare:
        name = "bare"

    with pytest.raises(ValueError, match="engine 'bare' declares no capabilities"):
        require_rl_sampler(Bare())
