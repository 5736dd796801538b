"""Inference engines: ``hf`` (CPU default), ``vllm`` (GPU extra), ``openai`` (any compatible HTTP server).

Every command, recipe, server and benchmark builds its engine with :func:`make_engine`:

    from tracegym.engines import make_engine
    engine = make_engine("hf", model="tiny-random")                      # loads model + tokenizer
    engine = make_engine("hf", model=my_model, tokenizer=tok, renderer=r, max_batch_size=32)
    engine = make_engine("openai", model="gpt-4o-mini", base_url="https://...")
    engine = make_engine("vllm", model="/path/to/hf/folder", renderer=r)  # needs ``pip install tracegym[gpu]``

Each engine module is imported only when its name is asked for, and the vllm package itself only
when a vllm engine is built, so the vllm extra is never imported on machines without it.

What an engine can do is in ``engine.capabilities`` (:class:`EngineCapabilities`);
:func:`require_rl_sampler` refuses, with a one-line message, an engine that cannot feed on-policy RL.
"""

from __future__ import annotations

import inspect
from typing import Any

from tracegym.engines.base import Engine, EngineCapabilities, Sampler

ENGINES = ("hf", "openai", "vllm")

__all__ = ["ENGINES", "Engine", "EngineCapabilities", "Sampler", "engine_class", "engine_options",
           "make_engine", "require_rl_sampler"]

# keywords make_engine takes itself: they are never engine options
_FACTORY_KEYWORDS = ("model", "tokenizer", "renderer")


def engine_class(name: str) -> type:
    """The engine class registered under ``name`` (imports its module, never vllm itself)."""
    if name == "hf":
        from tracegym.engines.hf import HFEngine

        return HFEngine
    if name == "openai":
        from tracegym.engines.openai import OpenAIEngine

        return OpenAIEngine
    if name == "vllm":
        from tracegym.engines.vllm import VLLMEngine

        return VLLMEngine
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")


def engine_options(name: str) -> tuple[tuple[str, ...], bool]:
    """The keyword options engine ``name`` takes besides ``model``/``tokenizer``/``renderer``,
    sorted, and whether it passes any other keyword on (vllm hands extra ones to ``vllm.LLM``)."""
    params = inspect.signature(engine_class(name).__init__).parameters.values()
    names = tuple(sorted(
        p.name for p in params
        if p.name != "self" and p.name not in _FACTORY_KEYWORDS
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ))
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return names, open_ended


def make_engine(name: str, *, model: Any, tokenizer: Any = None, renderer: Any = None, **options: Any) -> Engine:
    """Build the engine ``name`` (``hf``, ``openai`` or ``vllm``).

    Args:
        model: ``hf``: a loaded model object (a transformers model, or a peft model wrapping one),
            or a name/folder for :func:`tracegym.models.load` (its tokenizer is loaded with it unless
            ``tokenizer`` is given; the loaded model goes to the GPU when torch sees one). ``openai``: the model id sent to the server. ``vllm``: a local
            HF folder or ``smollm2-135m``.
        tokenizer: ``hf`` (stop strings and ``Generation.text``) and ``openai`` (re-tokenizing the
            text of a server that returns no token ids); ignored by ``vllm``.
        renderer: when given, its ``stop_token_ids`` become the engine's stop ids (``hf``, ``vllm``)
            unless ``stop_token_ids`` is passed explicitly; ``openai`` keeps it for its tool-call
            parser, its stop ids and re-tokenizing.
        **options: keyword arguments of the engine's constructor: ``HFEngine`` (``max_batch_size``,
            ``pad_token_id``, ``prefix_cache``, ``sample_dtype``, ...), ``OpenAIEngine`` (``base_url``,
            ``api_key_env``, ``timeout_s``, ``logprobs``, ``token_ids``, ``allow_retokenized``,
            ``max_tokens_param``, ...), ``VLLMEngine`` (``gpu_memory_utilization``, ``dtype``,
            ``enable_lora``, ... and any other ``vllm.LLM`` argument).

    Unknown engine names and unknown options raise ``ValueError`` naming the engine and what it
    accepts, before any model is loaded or any connection is made.
    """
    cls = engine_class(name)
    allowed, open_ended = engine_options(name)
    unknown = sorted(k for k in options if k not in allowed)
    if unknown and not open_ended:
        raise ValueError(
            f"engine {name!r} has no option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"allowed options: {', '.join(allowed)} (plus model=, tokenizer=, renderer=)"
        )
    if model is None:
        raise ValueError(f"make_engine({name!r}) needs model= (" + (
            "a loaded model, a known name or a folder)" if name == "hf" else "a model name or folder)"))
    if name != "hf" and not isinstance(model, str):
        raise ValueError(f"engine {name!r} takes model= as a name or folder, got a {type(model).__name__} object; "
                         "only the hf engine wraps a model object")
    if renderer is not None and name != "openai" and "stop_token_ids" not in options:
        options["stop_token_ids"] = tuple(renderer.stop_token_ids)

    if name == "hf":
        if isinstance(model, str):
            from tracegym.models import load

            model, loaded_tokenizer = load(model)
            import torch

            if torch.cuda.is_available():  # the recipes train there too: evaluate where they train
                model = model.to("cuda")
            if options.get("sample_dtype") is not None:  # loaded here, so cast in place: no second copy
                from tracegym.engines.sampling_copy import resolve_sample_dtype

                model = model.to(resolve_sample_dtype(options["sample_dtype"]))
            if tokenizer is None:
                tokenizer = loaded_tokenizer
        return cls(model, tokenizer, **options)
    if name == "openai":
        return cls(model, tokenizer=tokenizer, renderer=renderer, **options)
    return cls(model, **options)


def require_rl_sampler(engine: Any) -> None:
    """Raise ``ValueError`` (one line) unless ``engine`` can feed on-policy RL: it must return the
    log-probs of the tokens it samples and the exact token ids it sampled."""
    name = getattr(engine, "name", type(engine).__name__)
    caps = getattr(engine, "capabilities", None)
    if not isinstance(caps, EngineCapabilities):
        raise ValueError(f"engine {name!r} declares no capabilities (an EngineCapabilities), so it cannot be "
                         "checked for on-policy RL; use rollout.engine: hf (CPU) or vllm (GPU)")
    # the openai engine can feed RL once asked for log-probs and server token ids: say how
    hint = ("; or give the openai engine rollout.engine_options logprobs: true and token_ids: server, with a "
            "server that returns token ids (docs/serve.md)") if name == "openai" else ""
    if not caps.returns_logprobs:
        raise ValueError(f"engine {name!r} does not return the log-probs of the tokens it samples, so it cannot "
                         f"feed on-policy RL; use rollout.engine: hf (CPU) or vllm (GPU){hint}")
    if not caps.exact_token_ids:
        raise ValueError(f"engine {name!r} does not return the exact token ids it samples (its text is re-encoded), "
                         f"so it cannot feed on-policy RL; use rollout.engine: hf (CPU) or vllm (GPU){hint}")
