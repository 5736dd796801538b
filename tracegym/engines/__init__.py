"""Inference engines: ``hf`` (CPU default), ``vllm`` (GPU extra), ``openai`` (any compatible HTTP server).

    from tracegym.engines import make_engine
    engine = make_engine("hf", model="tiny-random")           # loads model + tokenizer
    engine = make_engine("hf", model=my_model, tokenizer=tok)  # wraps an in-memory model
    engine = make_engine("openai", model="gpt-4o-mini", base_url="https://...")
    engine = make_engine("vllm", model="/path/to/hf/folder")   # needs ``pip install tracegym[gpu]``

Each engine module is imported only when its name is asked for, so the vllm extra is never imported
on machines without it.
"""

from __future__ import annotations

from typing import Any

from tracegym.engines.base import Engine

ENGINES = ("hf", "openai", "vllm")

__all__ = ["ENGINES", "Engine", "make_engine"]


def make_engine(name: str, **kw: Any) -> Any:
    """Build an engine by name.

    - ``hf``: ``model`` is a loaded model or a name/path for ``tracegym.models.load``; other keywords
      go to :class:`~tracegym.engines.hf.HFEngine` (``tokenizer``, ``stop_token_ids``,
      ``max_batch_size``). When ``model`` is a name the tokenizer is loaded with it.
    - ``openai``: keywords of :class:`~tracegym.engines.openai.OpenAIEngine` (``model``,
      ``base_url``, ``api_key_env``, ``timeout_s``, ``max_retries``...).
    - ``vllm``: keywords of :class:`~tracegym.engines.vllm.VLLMEngine`.
    """
    if name == "hf":
        from tracegym.engines.hf import HFEngine

        model = kw.pop("model", None)
        if model is None:
            raise ValueError("make_engine('hf') needs model= (a loaded model, a known name or a folder)")
        if isinstance(model, str):
            from tracegym.models import load

            model, tokenizer = load(model)
            kw.setdefault("tokenizer", tokenizer)
        return HFEngine(model, **kw)
    if name == "openai":
        from tracegym.engines.openai import OpenAIEngine

        return OpenAIEngine(**kw)
    if name == "vllm":
        from tracegym.engines.vllm import VLLMEngine

        return VLLMEngine(**kw)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
