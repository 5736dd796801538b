"""tracegym.models: tiny-random, name resolution, local folders, and the atomic SmolLM2 cache.

Cache tests that only exercise the cache machinery swap the ~15 s GGUF de-quantisation for a
tiny-random model (``stub_gguf``). The two ``slow`` tests use the real GGUF and together
de-quantise exactly once: to build a cache in a tmp folder (module fixture); the rebuild of a
truncated copy of it is handed a copy of that same de-quantised model.
"""

from __future__ import annotations

import copy
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from tracegym import models
from tracegym.cli import main as cli_main

PROMPT = [{"role": "user", "content": "What is 12 * 7 + 3?"}]


def _prompt_logits(model, tokenizer) -> torch.Tensor:
    """Logits [1, prompt_len, vocab] of the chat-templated PROMPT."""
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        return model(**ids).logits


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _leftover_temporaries(cache_root: Path) -> list[Path]:
    return list((cache_root / "models").glob(".smollm2-135m.tmp-*"))


# --------------------------------------------------------------------------------------------
# tiny-random


def test_tiny_random_architecture_and_generation_config(tiny_model):
    model, tokenizer = tiny_model
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert (config.num_key_value_heads, config.intermediate_size) == (2, 128)
    assert config.vocab_size == len(tokenizer) == 49152
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn == 2
    assert model.generation_config.eos_token_id == end_of_turn
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == end_of_turn
    assert not model.training
    assert model.dtype == torch.float32
    # 49152*64 tied embedding + 2 layers of attention (64x64 q,o; 64x32 k,v) and MLP (3 x 64x128) + norms
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert sum(p.numel() for p in model.parameters()) == 49152 * 64 + 2 * per_layer + 64


def test_tiny_random_is_a_function_of_the_seed_only_and_keeps_the_callers_rng():
    torch.manual_seed(123)
    expected_next_draw = torch.rand(4)
    torch.manual_seed(123)
    first, _ = models.load("tiny-random")
    assert torch.equal(torch.rand(4), expected_next_draw), "loading advanced the caller's RNG"
    torch.manual_seed(999)  # a different caller state must not change the weights
    second, _ = models.load("tiny-random")
    other_seed, _ = models.load("tiny-random", seed=1)
    assert _same_weights(first, second)
    assert not torch.equal(first.model.embed_tokens.weight, other_seed.model.embed_tokens.weight)


def test_dtype_is_applied_and_validated():
    model, _ = models.load("tiny-random", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, _ = models.load("tiny-random", dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    with pytest.raises(ValueError, match="floating torch dtype"):
        models.load("tiny-random", dtype="int8")
    with pytest.raises(ValueError, match="floating torch dtype"):
        models.load("tiny-random", dtype="float33")


def test_padding_with_pad_equal_eos_is_harmless_given_the_attention_mask(tiny_model):
    """pad id == <|im_end|> id, so only the attention mask tells padding apart: a left-padded batch
    must give each row the logits it has alone."""
    model, shared_tokenizer = tiny_model
    tokenizer = models.load_tokenizer("tiny-random")
    tokenizer.padding_side = "left"
    texts = ["<|im_start|>user\nhi<|im_end|>\n", "<|im_start|>user\na longer question here<|im_end|>\n"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    short_len = len(tokenizer(texts[0]).input_ids)
    padding = batch.input_ids.shape[1] - short_len
    assert padding > 0
    assert batch.input_ids[0, :padding].tolist() == [tokenizer.pad_token_id] * padding
    assert batch.attention_mask[0].tolist() == [0] * padding + [1] * short_len
    # The padded row ends with a real <|im_end|> too: ids alone cannot find the padding.
    assert batch.input_ids[0, -2].item() == tokenizer.pad_token_id
    with torch.no_grad():
        batched = model(**batch).logits  # [2, padded_len, vocab]
        for row, text in enumerate(texts):
            alone = model(**tokenizer(text, return_tensors="pt")).logits  # [1, len, vocab]
            torch.testing.assert_close(batched[row, -alone.shape[1]:], alone[0], atol=1e-5, rtol=1e-5)
    assert shared_tokenizer.padding_side == "right", "load_tokenizer must not hand out a shared object"


# --------------------------------------------------------------------------------------------
# Names, tokenizers, local folders


def test_unknown_name_lists_known_names_and_accepts_paths(tmp_path):
    with pytest.raises(models.UnknownModelError) as info:
        models.load("gpt-17")
    message = str(info.value)
    assert "'gpt-17'" in message and "smollm2-135m" in message and "tiny-random" in message
    assert "local folder" in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(models.UnknownModelError, match="offline"):
        models.resolve_model_name("SomeOrg/some-model")
    with pytest.raises(models.UnknownModelError, match="neither a Hugging Face model folder"):
        models.resolve_model_name(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(models.UnknownModelError, match="neither a model folder nor a .gguf"):
        models.resolve_model_name(tmp_path / "notes.txt")
    with pytest.raises(models.UnknownModelError, match="empty"):
        models.resolve_model_name("  ")


def test_resolve_model_name_canonicalises(tmp_path):
    assert models.resolve_model_name("smollm2-135m") == "smollm2-135m"
    assert models.resolve_model_name(" SmolLM2 ") == "smollm2-135m"
    assert models.resolve_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m"
    assert models.resolve_model_name("TINY-RANDOM") == "tiny-random"
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve_model_name(tmp_path) == str(tmp_path.resolve())
    gguf = models.smollm2_gguf_path()
    assert models.resolve_model_name(str(gguf)) == str(gguf.resolve())


def test_load_tokenizer_gives_independent_objects_with_masks():
    first = models.load_tokenizer("smollm2-135m")
    second = models.load_tokenizer()
    assert first is not second
    first.padding_side = "left"
    first.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    assert second.padding_side == "right" and len(second) == 49152
    assert second.pad_token == second.eos_token == "<|im_end|>"
    assert second.pad_token_id == second.eos_token_id == 2
    assert second("hi").attention_mask == [1]


def test_gguf_tokenizer_equals_the_default_one():
    """load_tokenizer("smollm2-135m") may come from the cache folder; it must equal the GGUF's own."""
    from_gguf = models.load_tokenizer(models.smollm2_gguf_path())
    default = models.load_tokenizer("smollm2-135m")
    chat = [{"role": "system", "content": "Be brief."}, *PROMPT, {"role": "assistant", "content": "87"}]
    assert from_gguf.apply_chat_template(chat, tokenize=False) == default.apply_chat_template(chat, tokenize=False)
    text = default.apply_chat_template(chat, tokenize=False) + " é\t<|endoftext|>"
    assert from_gguf(text).input_ids == default(text).input_ids
    assert (from_gguf.pad_token_id, from_gguf.eos_token_id, len(from_gguf)) == (2, 2, 49152)


def test_gguf_read_once_shares_one_reader_per_file_inside_the_block_only(tmp_path):
    """transformers opens a GGUF file three times per model load; inside ``_gguf_read_once`` the
    opens of one file share one parsed reader (and one tensor-name map per architecture), whose
    fields and tensors are those of a plain open; outside it, and after an error, gguf is itself."""
    import gguf
    import numpy as np

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("blk.0.ffn_down.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    plain_reader, plain_map = gguf.GGUFReader, gguf.get_tensor_name_map
    plain = plain_reader(str(path))

    with models._gguf_read_once():
        first, again = gguf.GGUFReader(str(path)), gguf.GGUFReader(path)
        assert first is again and isinstance(first, plain_reader)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert list(first.fields) == list(plain.fields)
    assert [bytes(first.fields["tokenizer.ggml.tokens"].parts[i]) for i in first.fields["tokenizer.ggml.tokens"].data] == [b"a", b"b", b"c"]
    assert [t.name for t in first.tensors] == [t.name for t in plain.tensors] == ["blk.0.ffn_down.weight"]
    np.testing.assert_array_equal(first.tensors[0].data, plain.tensors[0].data)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (plain_reader, plain_map)
    assert gguf.GGUFReader(str(path)) is not gguf.GGUFReader(str(path))

    with pytest.raises(RuntimeError, match="load failed"), models._gguf_read_once():
        raise RuntimeError("load failed")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (plain_reader, plain_map)


def test_local_hf_folder_round_trip(tiny_model, tmp_path):
    model, tokenizer = tiny_model
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = models.load(str(tmp_path))
    assert _same_weights(model, loaded)
    torch.testing.assert_close(_prompt_logits(loaded, loaded_tokenizer), _prompt_logits(model, tokenizer), atol=0, rtol=0)
    assert loaded_tokenizer("a <|im_end|> b").input_ids == tokenizer("a <|im_end|> b").input_ids
    assert loaded.generation_config.eos_token_id == 2 and loaded.generation_config.pad_token_id == 2
    assert not loaded.training
    half, _ = models.load(tmp_path, dtype="bfloat16")
    assert half.dtype == torch.bfloat16
    assert models.load_tokenizer(str(tmp_path))("x y").input_ids == tokenizer("x y").input_ids


def test_local_folder_without_pad_token_pads_with_eos(tiny_model, tmp_path):
    model, tokenizer = tiny_model
    tokenizer = models.load_tokenizer("tiny-random")
    tokenizer.pad_token = None
    model.generation_config.save_pretrained(tmp_path)
    model.config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    import transformers

    assert transformers.AutoTokenizer.from_pretrained(tmp_path).pad_token is None  # the premise
    loaded = models.load_tokenizer(tmp_path)
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"


# --------------------------------------------------------------------------------------------
# The cache machinery, with a fast stand-in for the GGUF de-quantisation


class _StubDequantizer:
    """Stands in for ``_dequantize_gguf``: returns tiny-random (seed 7) and counts calls."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls = 0
        self.delay_s = delay_s
        self._lock = threading.Lock()

    def __call__(self, path: Path):
        assert path == models.smollm2_gguf_path()
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_s)
        return models.load("tiny-random", seed=7)


@pytest.fixture
def stub_gguf(monkeypatch, tmp_path) -> _StubDequantizer:
    monkeypatch.setenv("TRACEGYM_CACHE", str(tmp_path / "cache"))
    stub = _StubDequantizer()
    monkeypatch.setattr(models, "_dequantize_gguf", stub)
    return stub


@pytest.fixture
def reference_stub_model():
    return models.load("tiny-random", seed=7)[0]


def test_first_load_builds_cache_and_later_loads_read_it(stub_gguf, reference_stub_model, tmp_path):
    assert models.cache_status().problem == "not built"
    model, tokenizer = models.load("smollm2-135m")
    assert stub_gguf.calls == 1
    folder = tmp_path / "cache" / "models" / "smollm2-135m"
    assert models.cache_status().built and models.verify_cache() is None
    assert model.name_or_path == str(folder)
    manifest = json.loads((folder / models.MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {p.name for p in folder.iterdir()} - {models.MANIFEST_NAME}
    assert manifest["files"]["model.safetensors"]["size"] == (folder / "model.safetensors").stat().st_size
    assert manifest["check"]["max_abs_logit_diff"] == 0.0
    assert _leftover_temporaries(tmp_path / "cache") == []
    again, again_tokenizer = models.load("smollm2-135m", dtype="bfloat16")
    assert stub_gguf.calls == 1, "a trusted cache must not be rebuilt"
    assert _same_weights(model, reference_stub_model)
    assert again.dtype == torch.bfloat16
    assert again_tokenizer is not tokenizer and again_tokenizer.pad_token_id == 2


@pytest.mark.parametrize("interruption", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_interrupted_write_leaves_no_trusted_cache(stub_gguf, reference_stub_model, monkeypatch, tmp_path, interruption):
    real_save = models._save_hf_folder

    def save_half_then_fail(model, tokenizer, folder):
        real_save(model, tokenizer, folder)
        weights = folder / "model.safetensors"
        with open(weights, "r+b") as handle:
            handle.truncate(weights.stat().st_size // 2)
        raise interruption

    monkeypatch.setattr(models, "_save_hf_folder", save_half_then_fail)
    if isinstance(interruption, OSError):
        # a failed cache write still gives the caller the (uncached) model
        model, _ = models.load("smollm2-135m")
        assert _same_weights(model, reference_stub_model)
    else:
        with pytest.raises(KeyboardInterrupt):
            models.load("smollm2-135m")
    assert not (tmp_path / "cache" / "models" / "smollm2-135m").exists()
    assert _leftover_temporaries(tmp_path / "cache") == []
    assert not models.cache_status().built

    monkeypatch.setattr(models, "_save_hf_folder", real_save)
    model, _ = models.load("smollm2-135m")
    assert stub_gguf.calls == 2
    assert models.cache_status().built and _same_weights(model, reference_stub_model)


def test_killed_build_leftovers_are_not_trusted(stub_gguf, tmp_path):
    """A build killed before its manifest leaves files but no marker (or a stray temporary)."""
    models.load("smollm2-135m")
    folder = tmp_path / "cache" / "models" / "smollm2-135m"
    (folder / models.MANIFEST_NAME).unlink()
    stray = folder.parent / ".smollm2-135m.tmp-12345-deadbeef"
    shutil.copytree(folder, stray)
    assert "no completion manifest" in models.cache_status().problem
    models.load("smollm2-135m")
    assert stub_gguf.calls == 2
    assert models.cache_status().built and not stray.exists()


def test_cache_whose_weights_fail_to_load_is_rebuilt(stub_gguf, reference_stub_model, tmp_path):
    models.load("smollm2-135m")
    weights = tmp_path / "cache" / "models" / "smollm2-135m" / "model.safetensors"
    with open(weights, "r+b") as handle:  # same size, garbage header length: passes the size check
        handle.write(b"\xff" * 8)
    assert models.cache_status().built, "the quick check only compares sizes"
    assert "SHA-256" in models.verify_cache()
    model, _ = models.load("smollm2-135m")
    assert stub_gguf.calls == 2
    assert models.verify_cache() is None and _same_weights(model, reference_stub_model)


def test_cache_of_another_gguf_is_rebuilt(stub_gguf, tmp_path):
    models.load("smollm2-135m")
    manifest_path = tmp_path / "cache" / "models" / "smollm2-135m" / models.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["source"]["size"] += 1
    manifest_path.write_text(json.dumps(manifest))
    assert "different GGUF" in models.cache_status().problem
    models.load("smollm2-135m")
    assert stub_gguf.calls == 2 and models.cache_status().built


def test_a_reload_that_differs_is_never_cached(stub_gguf, monkeypatch, tmp_path):
    real_load_folder = models._load_hf_folder

    def perturbed_reload(folder, dtype):
        model, tokenizer = real_load_folder(folder, dtype)
        with torch.no_grad():
            model.model.norm.weight.mul_(1.01)
        return model, tokenizer

    monkeypatch.setattr(models, "_load_hf_folder", perturbed_reload)
    with pytest.raises(models.CacheBuildError, match="logits differ"):
        models.load("smollm2-135m")
    assert not (tmp_path / "cache" / "models" / "smollm2-135m").exists()
    assert _leftover_temporaries(tmp_path / "cache") == []


def test_concurrent_first_loads_build_once(stub_gguf, reference_stub_model):
    """Two loaders at once (threads with their own lock-file handles contend like processes)."""
    stub_gguf.delay_s = 0.5
    results: list = [None, None]
    errors: list[BaseException] = []

    def loader(index: int) -> None:
        try:
            results[index] = models.load("smollm2-135m")[0]
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=loader, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert stub_gguf.calls == 1
    assert all(_same_weights(result, reference_stub_model) for result in results)


def test_models_command_lists_builds_and_verifies(stub_gguf, capsys):
    assert cli_main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "smollm2-135m" in listing and "tiny-random" in listing and "not built" in listing
    assert str(models.cache_dir() / "models") in listing
    assert cli_main(["models", "build"]) == 0
    assert stub_gguf.calls == 1
    assert cli_main(["models", "verify"]) == 0
    capsys.readouterr()
    assert cli_main(["models"]) == 0
    assert "smollm2-135m cache: built" in capsys.readouterr().out
    assert cli_main(["models", "build"]) == 0 and stub_gguf.calls == 1
    assert cli_main(["models", "build", "--force"]) == 0 and stub_gguf.calls == 2


# --------------------------------------------------------------------------------------------
# The real SmolLM2 (slow: de-quantises twice in this file, no more)


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    """Build the real cache in a tmp folder, recording the GGUF-loaded model's prompt logits, and a
    copy of the de-quantised model and tokenizer as the GGUF gave them (before the cache saw them)."""
    root = tmp_path_factory.mktemp("real-cache")
    real_dequantize = models._dequantize_gguf
    gguf_logits: list[torch.Tensor] = []
    dequantized: list[tuple] = []

    def recording_dequantize(path):
        model, tokenizer = real_dequantize(path)
        dequantized.append((path, copy.deepcopy(model), copy.deepcopy(tokenizer)))
        gguf_logits.append(_prompt_logits(model, tokenizer))
        return model, tokenizer

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRACEGYM_CACHE", str(root))
        patch.setattr(models, "_dequantize_gguf", recording_dequantize)
        model, tokenizer = models.load("smollm2-135m")
        first_load_logits = _prompt_logits(model, tokenizer)
    assert len(gguf_logits) == 1
    return root, gguf_logits[0], first_load_logits, dequantized[0]


def _refuse_dequantize(path):
    raise AssertionError("a trusted cache must be read, not rebuilt")


@pytest.mark.slow
def test_smollm2_cache_round_trip_matches_the_gguf(real_cache, monkeypatch):
    root, gguf_logits, first_load_logits, _ = real_cache
    monkeypatch.setenv("TRACEGYM_CACHE", str(root))
    monkeypatch.setattr(models, "_dequantize_gguf", _refuse_dequantize)
    assert models.cache_status().built and models.verify_cache() is None
    model, tokenizer = models.load("smollm2-135m")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    logits = _prompt_logits(model, tokenizer)
    assert logits.shape == gguf_logits.shape and logits.shape[-1] == 49152
    torch.testing.assert_close(logits, gguf_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(first_load_logits, gguf_logits, atol=1e-5, rtol=0)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


@pytest.mark.slow
def test_truncated_smollm2_cache_is_rebuilt(real_cache, monkeypatch, tmp_path):
    root, gguf_logits, _, (gguf_path, dequantized_model, dequantized_tokenizer) = real_cache
    copy_root = tmp_path / "copy"
    shutil.copytree(root, copy_root)  # new files: models loaded from `root` keep their mmaps intact
    weights = copy_root / "models" / "smollm2-135m" / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 3)
    monkeypatch.setenv("TRACEGYM_CACHE", str(copy_root))
    assert "model.safetensors has" in models.cache_status().problem
    calls: list[Path] = []

    def counting_dequantize(path):
        # The same GGUF gives the same model (the fixture's load checked it against the GGUF's
        # logits): hand the rebuild a copy of that one instead of de-quantising it again (~15 s).
        calls.append(path)
        assert path == gguf_path
        return copy.deepcopy(dequantized_model), copy.deepcopy(dequantized_tokenizer)

    monkeypatch.setattr(models, "_dequantize_gguf", counting_dequantize)
    model, tokenizer = models.load("smollm2-135m")  # rebuilt from the GGUF's model
    assert len(calls) == 1
    assert models.verify_cache() is None
    torch.testing.assert_close(_prompt_logits(model, tokenizer), gguf_logits, atol=1e-5, rtol=0)
