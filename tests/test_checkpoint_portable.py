"""Saved model folders other tools can use as trained (issue 15, part 2).

- the saved tokenizer's own chat template (``chat_template.jinja``) gives, through
  ``apply_chat_template(messages, tools=..., add_generation_prompt=True)``, exactly the prompt ids
  the renderer trained on (golden test, both renderers, with and without tools);
- ``adapter_config.json`` names the base model portably (``smollm2-135m``, never the cache folder)
  and ``tracegym.models.load`` still puts the adapter back on it;
- files 0644 / folders 0755 under the usual umask (the umask respected);
- config.json carries ``rope_theta`` at the top level, as transformers 4.x reads it.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from tracegym.config import LoraConfig
from tracegym.models import load, model_cache_path, portable_model_name, tiny_random_config
from tracegym.render import get_renderer, renderer_name_for
from tracegym.render.toolcalls import to_openai_messages
from tracegym.train.checkpoint import legacy_config_fields, save_checkpoint, save_final
from tracegym.train.lora import prepare_model
from tracegym.types import Message, ToolCall

CALC = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression (+, -, *, /, «parentheses»).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}, "lang": {"type": "string", "enum": ["en", "fr"]}}},
    },
}


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


CONVERSATIONS = {
    # system prompt, two calls in one turn, tool results, a second round, a final answer
    "tools": (
        [
            Message(role="system", content="Use the tools. Answer as <answer>N</answer>."),
            Message(role="user", content="What is 37 * 24 + 5? Then look up 'café'."),
            Message(role="assistant", content="Two steps.", tool_calls=(_call("calculate", expression="37 * 24"), _call("lookup", word="café", lang="fr"))),
            Message(role="tool", content="888", tool_call_id="call_0", name="calculate"),
            Message(role="tool", content='{"word": "café", "en": "coffee"}', tool_call_id="call_1", name="lookup"),
            Message(role="assistant", content="", tool_calls=(_call("calculate", expression="888 + 5"),)),
            Message(role="tool", content="Error: the service is busy\n(retry)", tool_call_id="call_0", name="calculate"),
            Message(role="user", content="Try again."),
            Message(role="assistant", content="", tool_calls=(_call("calculate", expression="888 + 5"),)),
            Message(role="tool", content="893", tool_call_id="call_0", name="calculate"),
            Message(role="assistant", content="<answer>893</answer>"),
        ],
        [CALC, LOOKUP],
    ),
    # no system message: smollm2 adds its default one, with the tools block after it
    "no_system": (
        [
            Message(role="user", content="12 * 7 + 3?"),
            Message(role="assistant", content="", tool_calls=(_call("calculate", expression="12 * 7 + 3"),)),
            Message(role="tool", content="87", tool_call_id="call_0", name="calculate"),
            Message(role="assistant", content="<answer>87</answer>"),
        ],
        [CALC],
    ),
    # no tools at all, with and without a system message
    "chat": (
        [
            Message(role="user", content="Say hello in French. 👋"),
            Message(role="assistant", content="Bonjour !"),
            Message(role="user", content="And in German?"),
            Message(role="assistant", content="Hallo!"),
        ],
        None,
    ),
    "chat_system": (
        [
            Message(role="system", content="Be brief."),
            Message(role="user", content="Name a prime."),
            Message(role="assistant", content="7"),
        ],
        None,
    ),
}


def _lora_model(seed: int = 0) -> torch.nn.Module:
    """tiny-random with a LoRA adapter whose B factors are random (so the adapter changes logits)."""
    model, _ = load("tiny-random")
    peft_model = prepare_model(model, LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return peft_model.eval()


@pytest.fixture(scope="module")
def lora_model():
    return _lora_model()


@pytest.fixture(scope="module", params=["smollm2", "hermes"])
def saved(request, tmp_path_factory, lora_model, tokenizer):
    """(renderer name, final folder) of a LoRA run saved with that renderer."""
    run_dir = tmp_path_factory.mktemp(f"run_{request.param}")
    renderer = "tiny-random" if request.param == "smollm2" else "hermes"  # as the recipes record it
    info = {"base_model": "tiny-random", "lora": True, "renderer": renderer, "recipe": "sft"}
    return request.param, save_final(lora_model, tokenizer, run_dir, info)


def _prompt_cuts(messages):
    """Every prefix a generation prompt is rendered for: up to each assistant turn, and the whole."""
    return [messages[:i] for i, m in enumerate(messages) if m.role == "assistant"] + [messages]


@pytest.mark.parametrize("arguments_as_string", [False, True])
def test_saved_chat_template_reproduces_the_training_prompt_ids(saved, tokenizer, arguments_as_string):
    from transformers import AutoTokenizer

    renderer_name, folder = saved
    renderer = get_renderer(renderer_name, tokenizer)
    loaded = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert (folder / "chat_template.jinja").read_text(encoding="utf-8") == renderer.chat_template == loaded.chat_template
    checked = 0
    for name, (conversation, tools) in CONVERSATIONS.items():
        for messages in _prompt_cuts(conversation):
            expected = renderer.render_prompt(messages, tools)
            got = loaded.apply_chat_template(
                to_openai_messages(messages, arguments_as_string=arguments_as_string),
                tools=tools, add_generation_prompt=True, return_dict=True,
            )["input_ids"]
            assert got == expected, f"{renderer_name} / {name} / {len(messages)} messages"
            checked += 1
    assert checked >= 12
    # The tool parts are really rendered (not an empty template): the call JSON and the schemas.
    text = loaded.apply_chat_template(to_openai_messages(CONVERSATIONS["tools"][0]), tools=[CALC], tokenize=False)
    assert '"name": "calculate", "arguments": {"expression": "37 * 24"}' in text and '"description": "Evaluate' in text


def test_saved_template_keeps_the_renderer_guessable(saved, tokenizer):
    """A folder without tracegym.json is given the renderer its template belongs to (full models
    saved by save_final and exported folders are read that way)."""
    from transformers import AutoTokenizer

    renderer_name, folder = saved
    loaded = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert renderer_name_for(str(folder), loaded) == renderer_name


def test_tokenizer_config_is_readable_by_older_transformers(saved):
    _, folder = saved
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == (folder / "chat_template.jinja").read_text(encoding="utf-8")
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # transformers 4.x has no TokenizersBackend
    assert "local_files_only" not in config and "is_local" not in config


def test_adapter_names_a_portable_base_and_loads(tmp_path, lora_model, tokenizer):
    from peft import PeftModel

    # Peft records the base's name_or_path, which for SmolLM2 is this machine's cache folder.
    lora_model.peft_config["default"].base_model_name_or_path = str(model_cache_path("smollm2-135m"))
    try:
        ckpt = save_checkpoint(tmp_path / "run", 1, lora_model)
        final = save_final(lora_model, tokenizer, tmp_path / "run", {"base_model": "tiny-random", "lora": True, "renderer": "tiny-random"})
    finally:
        lora_model.peft_config["default"].base_model_name_or_path = "tiny-random"
    for folder, expected in ((final, "tiny-random"), (ckpt / "model", "smollm2-135m")):
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        assert config["base_model_name_or_path"] == expected
        assert str(model_cache_path("smollm2-135m")) not in (folder / "README.md").read_text(encoding="utf-8")
    assert portable_model_name(model_cache_path("smollm2-135m")) == "smollm2-135m"
    assert portable_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m"
    assert portable_model_name("/models/Qwen2.5") == "/models/Qwen2.5"

    ids = torch.tensor([get_renderer("smollm2", tokenizer).render_prompt(CONVERSATIONS["no_system"][0][:1], [CALC])])
    with torch.no_grad():
        expected = lora_model(ids).logits
        merged, _ = load(final)  # through tracegym.json
        assert (merged(ids).logits - expected).abs().max().item() <= 1e-5
        (final / "tracegym.json").unlink()  # through adapter_config.json alone
        merged, _ = load(final)
        assert (merged(ids).logits - expected).abs().max().item() <= 1e-5
        # plain peft, the base given explicitly (as the docs say)
        base, _ = load("tiny-random")
        plain = PeftModel.from_pretrained(base, str(final)).eval()
        assert (plain(ids).logits - expected).abs().max().item() <= 1e-5
        unadapted, _ = load("tiny-random")
        assert (unadapted(ids).logits - expected).abs().max().item() > 1e-3  # the adapter matters


def _modes(folder: Path) -> tuple[set[int], set[int]]:
    files = {stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}
    dirs = {stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")] if p.is_dir()}
    return files, dirs


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_saved_files_get_the_modes_the_umask_gives(tmp_path, lora_model, tokenizer, umask, file_mode, dir_mode):
    old = os.umask(umask)
    try:
        final = save_final(lora_model, tokenizer, tmp_path / "run", {"base_model": "tiny-random", "renderer": "tiny-random"})
        ckpt = save_checkpoint(tmp_path / "run", 3, lora_model)
    finally:
        os.umask(old)
    assert (final / "adapter_model.safetensors").is_file() and (ckpt / "model" / "adapter_model.safetensors").is_file()
    for folder in (final, ckpt):
        assert _modes(folder) == ({file_mode}, {dir_mode}), folder


def _tiny_full_model(rope_theta: float) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    config = tiny_random_config()
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_full_model_config_has_top_level_rope_theta(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = _tiny_full_model(100000.0)
    final = save_final(model, tokenizer, tmp_path / "run", {"base_model": "tiny-random", "lora": False, "renderer": "tiny-random"})
    config = json.loads((final / "config.json").read_text(encoding="utf-8"))
    # What transformers 4.x reads (it ignores rope_parameters and would default to 10000):
    assert config["rope_theta"] == 100000.0
    assert "rope_scaling" not in config or config["rope_scaling"] is None
    assert config["torch_dtype"] == "float32"
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    # transformers 5 reads the folder as before: same RoPE, same logits.
    reloaded = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True).eval()
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    ids = torch.tensor([[1, 2, 3, 400, 5000, 17]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_legacy_fields_of_a_scaled_rope_read_back_the_same():
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, rope_parameters=dict(rope))
    legacy = legacy_config_fields(config.to_dict())
    assert legacy["rope_theta"] == 500000.0
    assert legacy["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert LlamaConfig.from_dict(legacy).rope_parameters == config.rope_parameters
    # nested per-layer-type RoPE has no transformers 4.x form: left alone
    nested = {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}}
    assert legacy_config_fields(nested) == nested
