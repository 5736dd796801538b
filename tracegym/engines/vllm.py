"""The GPU engine: vLLM over token-id prompts (optional extra: ``pip install tracegym[gpu]``).

- Prompts go in as ``TokensPrompt(prompt_token_ids=...)`` (token-in, token-out: no re-tokenising).
- ``logprobs=0`` asks vLLM for the log-prob of the sampled token only. The engine is built with
  ``logprobs_mode="processed_logprobs"`` so that log-prob is taken under the distribution the token
  was drawn from (after temperature and top-p), the same convention as the hf engine; vLLM's default
  (``raw_logprobs``) would report the unscaled softmax. For greedy requests both are the unscaled
  softmax.
- Weight sync from the trainer, in process: ``update_weights(state_dict | module)`` calls
  ``load_weights`` on the driver worker's model (vLLM's engine core must run in this process, so
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before vLLM is imported) and resets the prefix cache
  (cached KV blocks were computed with the old weights). A peft (LoRA) model is either merged on the
  fly (default: adapter deltas are added to a copy of the base weights sent to vLLM) or, with
  ``enable_lora=True``, saved as an adapter and served with a ``LoRARequest``.

vLLM is imported only when this engine is built; without it the error names the extra to install.
``bench/gpu_vllm_check.py`` checks log-probs against a teacher-forced HF forward pass on a GPU.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any, Mapping, Sequence

from tracegym.engines.base import Engine, EngineCapabilities
from tracegym.types import FinishReason, Generation, SamplingParams

log = logging.getLogger(__name__)

INSTALL_HINT = "the vllm engine needs vLLM and a CUDA GPU: pip install tracegym[gpu]"


def _import_vllm() -> Any:
    # load_weights must reach the model object, so the engine core runs in this process
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return vllm


def resolve_model_path(model: str) -> str:
    """A folder vLLM can load: known tracegym names are built into the local cache first."""
    from tracegym.models import KNOWN_MODELS

    if model == "smollm2-135m":
        from tracegym.models import build_smollm2_cache

        return str(build_smollm2_cache())
    if model in KNOWN_MODELS:
        raise ValueError(f"model {model!r} has no folder on disk for vLLM; save it with save_pretrained and pass the folder")
    return model


class VLLMEngine(Engine):
    """Batched sampling with vLLM.

    Args:
        model: a local HF folder or ``smollm2-135m``.
        stop_token_ids: ids that always end a sequence (the renderer's end-of-turn ids).
        enable_lora / max_lora_rank: serve peft adapters with ``LoRARequest`` instead of merging.
        gpu_memory_utilization, dtype, max_model_len, seed, enforce_eager: passed to ``vllm.LLM``.
        **llm_kwargs: any other ``vllm.LLM`` argument.
    """

    name = "vllm"
    returns_logprobs = True

    @property
    def capabilities(self) -> EngineCapabilities:
        """Sampled log-probs and token ids come back; ``update_weights`` copies weights into vLLM
        (``state_dict``; a peft model is merged first) or, with ``enable_lora``, serves the peft
        model's adapter (``adapter``)."""
        sync = "adapter" if getattr(self, "enable_lora", False) else "state_dict"
        return EngineCapabilities(returns_logprobs=True, exact_token_ids=True, weight_sync=sync)

    def __init__(
        self,
        model: str,
        *,
        stop_token_ids: Sequence[int] = (),
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = False,
        **llm_kwargs: Any,
    ):
        self._vllm = _import_vllm()
        self.model_path = resolve_model_path(model)
        self.model_name = model
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.enable_lora = enable_lora
        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            enforce_eager=enforce_eager,
            enable_lora=enable_lora,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        if enable_lora:
            kwargs["max_lora_rank"] = max_lora_rank
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        try:
            self.llm = self._vllm.LLM(**kwargs)
        except TypeError as exc:
            if "logprobs_mode" not in str(exc):
                raise
            # older vLLM: no processed log-probs; the gap check will show the difference
            log.warning("this vLLM has no logprobs_mode: log-probs are the unscaled softmax, not the sampling distribution")
            kwargs.pop("logprobs_mode")
            self.llm = self._vllm.LLM(**kwargs)
        self._lora_request: Any = None
        self._lora_version = 0
        self._lora_dir: tempfile.TemporaryDirectory | None = None

    def __repr__(self) -> str:
        return f"VLLMEngine(model={self.model_name!r}, lora={'on' if self._lora_request else 'off'})"

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        from vllm.inputs import TokensPrompt

        from tracegym.engines.hf import validate_params

        validate_params(params)
        if not prompts:
            return []
        sampling = self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            seed=params.seed,
            stop=list(params.stop) or None,
            stop_token_ids=sorted(set(self.stop_token_ids) | set(params.stop_token_ids)) or None,
            logprobs=0,  # the sampled token's log-prob only
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        )
        inputs = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False, lora_request=self._lora_request)
        results: list[list[Generation]] = []
        for out in outputs:
            gens = []
            for c in out.outputs:
                token_ids = tuple(int(t) for t in c.token_ids)
                # c.logprobs: one {token_id: Logprob} per generated position, holding the sampled one
                logprobs = tuple(float(c.logprobs[i][tok].logprob) for i, tok in enumerate(token_ids)) if c.logprobs else None
                finish: FinishReason = "stop" if c.finish_reason == "stop" else "length" if c.finish_reason == "length" else "abort"
                gens.append(Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=finish, text=c.text))
            results.append(gens)
        return results

    # -- weight sync -----------------------------------------------------------------------------
    def _driver_model(self) -> Any:
        engine = self.llm.llm_engine
        for path in (
            "model_executor.driver_worker.worker.model_runner.model",  # V1, in-process engine core
            "model_executor.driver_worker.model_runner.model",  # V0
            "engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
        ):
            obj: Any = engine
            try:
                for attr in path.split("."):
                    obj = getattr(obj, attr)
            except AttributeError:
                continue
            return obj
        raise RuntimeError(
            "cannot reach vLLM's model object for load_weights; run with VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "(set before vllm is imported) and tensor_parallel_size=1"
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> int:
        """Send HF-named tensors to vLLM's model (it maps them onto its fused layers)."""
        model = self._driver_model()
        weights = [(name, tensor.detach()) for name, tensor in state.items()]
        model.load_weights(weights=weights)
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        return len(weights)

    def update_weights(self, model_or_state: Any) -> None:
        import torch

        if isinstance(model_or_state, Mapping):
            if any("lora_" in k for k in model_or_state):
                raise ValueError("state dict holds LoRA factors: pass the peft model itself")
            self.load_state_dict(model_or_state)
            return
        if not isinstance(model_or_state, torch.nn.Module):
            raise TypeError(f"update_weights takes a torch.nn.Module or a state dict, got {type(model_or_state).__name__}")
        is_peft = hasattr(model_or_state, "peft_config")
        if not is_peft:
            self.load_state_dict(model_or_state.state_dict())
            return
        if self.enable_lora:
            self._set_lora(model_or_state)
            return
        self.load_state_dict(merged_state_dict(model_or_state))

    def _set_lora(self, peft_model: Any) -> None:
        from vllm.lora.request import LoRARequest

        if self._lora_dir is None:
            self._lora_dir = tempfile.TemporaryDirectory(prefix="tracegym-lora-")
        self._lora_version += 1
        folder = os.path.join(self._lora_dir.name, f"v{self._lora_version}")
        peft_model.save_pretrained(folder)
        # a new id per version: vLLM caches adapters by id
        self._lora_request = LoRARequest(f"policy-v{self._lora_version}", self._lora_version, folder)

    def close(self) -> None:
        if self._lora_dir is not None:
            self._lora_dir.cleanup()
            self._lora_dir = None


def merged_state_dict(peft_model: Any) -> dict[str, Any]:
    """The base model's weights with the LoRA deltas added, HF-named, without modifying the model.

    peft's ``merge_adapter`` adds the deltas in place and ``unmerge_adapter`` subtracts them again,
    so the trainer's model is unchanged afterwards (up to float rounding of the add/subtract).
    """
    import torch

    with torch.no_grad():
        peft_model.merge_adapter()
        try:
            state: dict[str, Any] = {}
            for key, value in peft_model.get_base_model().state_dict().items():
                if "lora_" in key:
                    continue
                state[key.replace(".base_layer.", ".")] = value.detach().clone()
        finally:
            peft_model.unmerge_adapter()
    return state
