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
- Teams of LoRA adapters on one base model (``enable_lora=True``, ``max_loras`` >= the adapters
  sampled together): ``generate(prompts, params, adapters=[...])`` takes one adapter name per
  prompt (``"__base__"`` or None: the base model, no LoRA), and vLLM samples the mixed batch in one
  call (``LLM.generate(..., lora_request=[one LoRARequest or None per prompt])``).
  ``update_adapter(name, peft_model_or_folder)`` saves that adapter (peft
  ``save_pretrained(folder, selected_adapters=[name])``) to a versioned temporary folder and swaps
  in a new ``LoRARequest`` for it; ``update_weights(peft_model)`` refreshes every adapter of the
  peft model. Hot-swap rule: every version gets a new int id (vLLM caches loaded adapters by id)
  and a new name ``<name>-v<k>`` (recent vLLM keys prefix-cache blocks by the adapter's name,
  vllm-project/vllm#27211, so a reused name could serve KV computed with the old weights,
  vllm-project/vllm#30931); the previous id is removed from vLLM (``llm_engine.remove_lora``)
  and its folder deleted. docs/multi_lora.md has the whole story.

- Scoring given sequences (``prompt_logprobs``, a distillation teacher): each sequence goes in as
  ``TokensPrompt`` with ``SamplingParams(max_tokens=1, temperature=1.0, top_p=1.0,
  prompt_logprobs=0, detokenize=False)``; vLLM's ``RequestOutput.prompt_logprobs`` holds None for the
  first token, then one ``{token_id: Logprob}`` per position that always includes the actual token
  (``prompt_logprobs=0``: only it), whose ``.logprob`` is taken. vLLM computes prompt log-probs from
  the raw logits (its V1 runner; at temperature 1 with no top-p the ``processed_logprobs`` mode of
  this engine is the same distribution), and does not use its prefix cache for such requests.

vLLM is imported only when this engine is built; without it the error names the extra to install.
``bench/gpu_vllm_check.py`` checks log-probs against a teacher-forced HF forward pass on a GPU;
``bench/gpu_multi_lora_check.py`` does the same for a mixed batch of LoRA adapters and a hot swap.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from typing import Any, Mapping, Sequence

from tracegym.engines.base import BASE_ADAPTER, Engine, EngineCapabilities
from tracegym.types import FinishReason, Generation, SamplingParams

log = logging.getLogger(__name__)

INSTALL_HINT = "the vllm engine needs vLLM and a CUDA GPU: pip install tracegym[gpu]"



def is_base_adapter(name: str | None) -> bool:
    """None and ``"__base__"`` mean the base model without any LoRA."""
    return name is None or name == BASE_ADAPTER


def adapter_folder(path: str | os.PathLike[str], name: str | None = None) -> str:
    """The folder holding ``adapter_config.json`` for adapter ``name`` under ``path``.

    peft's ``save_pretrained(path)`` writes the adapter named ``default`` in ``path`` itself and any
    other adapter in ``path/<name>/`` (``PeftModel.save_pretrained``: ``output_dir =
    os.path.join(save_directory, adapter_name) if adapter_name != "default" else save_directory``);
    vLLM wants the folder with ``adapter_config.json`` and the weights. ``path/<name>`` wins when it
    exists, then ``path``."""
    root = os.fspath(path)
    candidates = ([os.path.join(root, name)] if name and not is_base_adapter(name) else []) + [root]
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "adapter_config.json")):
            return folder
    raise FileNotFoundError(
        f"no adapter_config.json in {' or '.join(candidates)}: save the adapter with peft's save_pretrained"
    )


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
        max_loras: adapters vLLM runs in one step (``vllm.LLM(max_loras=...)``; vLLM's default is
            1): set it to the number of adapters a team samples together, or rows of the other
            adapters wait for later steps.
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
        max_loras: int | None = None,
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
            if max_loras is not None:
                kwargs["max_loras"] = max_loras
        self.max_loras = max_loras
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
        self._init_adapters()

    def _init_adapters(self) -> None:
        self._adapters: dict[str, Any] = {}  # adapter name -> its current LoRARequest
        self._versions: dict[str, int] = {}  # adapter name -> versions sent so far
        self._owned: dict[str, str] = {}  # adapter name -> the temporary folder we saved it to
        self._next_lora_id = 1  # vLLM wants ids > 0, unique per adapter version
        self._default_adapter: str | None = None  # what rows get when generate has no adapters
        self._lora_dir: tempfile.TemporaryDirectory | None = None
        self._warned_max_loras = False

    def __repr__(self) -> str:
        adapters = getattr(self, "_adapters", {})
        return f"VLLMEngine(model={self.model_name!r}, lora={'on' if adapters else 'off'}, adapters={sorted(adapters)})"

    @property
    def _lora_request(self) -> Any:
        """The LoRARequest rows get without ``adapters`` (the peft model's active adapter at the
        last ``update_weights(peft_model)``), or None."""
        name = getattr(self, "_default_adapter", None)
        return self._adapters.get(name) if name is not None else None

    @property
    def adapter_requests(self) -> dict[str, Any]:
        """Adapter name -> the ``LoRARequest`` its rows are served with now (a copy)."""
        return dict(getattr(self, "_adapters", {}))

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 adapters: Sequence[str | None] | None = None) -> list[list[Generation]]:
        """``params.n`` generations per prompt. ``adapters``: one adapter name per prompt (``"__base__"``
        or None: no LoRA), each row sampled with that adapter's current weights, all in one vLLM
        call; without it every row gets the default adapter (the last ``update_weights(peft_model)``)
        or none."""
        from vllm.inputs import TokensPrompt

        from tracegym.engines.sampling import validate_params

        validate_params(params)
        lora_request = self.lora_requests_for(len(prompts), adapters)
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
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False, lora_request=lora_request)
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

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """For each token sequence, ``log p(seq[i] | seq[:i])`` for ``i >= 1`` (``len(seq) - 1`` floats)
        at temperature 1, from vLLM's ``prompt_logprobs`` (see the module docstring), all sequences
        in one ``LLM.generate`` call. Rows are scored with the default adapter, as ``generate`` samples."""
        from vllm.inputs import TokensPrompt

        from tracegym.engines.base import prompt_sequences

        rows = prompt_sequences(sequences)
        results: list[list[float]] = [[] for _ in rows]
        todo = [i for i, row in enumerate(rows) if len(row) >= 2]  # one token: nothing to predict
        if not todo:
            return results
        sampling = self._vllm.SamplingParams(
            n=1,
            temperature=1.0,
            top_p=1.0,
            max_tokens=1,  # the one sampled token is not used
            prompt_logprobs=0,  # the actual token's log-prob at every prompt position, no alternatives
            detokenize=False,
        )
        inputs = [TokensPrompt(prompt_token_ids=rows[i]) for i in todo]
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False, lora_request=self._lora_request)
        if len(outputs) != len(todo):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(todo)} sequences")
        for i, out in zip(todo, outputs):
            results[i] = _prompt_values(out, rows[i])
        return results

    @property
    def tokenizer(self) -> Any:
        """The tokenizer vLLM loaded with the model (``LLM.get_tokenizer()``)."""
        return self.llm.get_tokenizer()

    def lora_requests_for(self, count: int, adapters: Sequence[str | None] | None) -> Any:
        """What ``LLM.generate`` gets as ``lora_request`` for ``count`` prompts: None (no LoRA),
        one ``LoRARequest`` for all, or a list with one ``LoRARequest`` or None per prompt (vLLM's
        ``_validate_and_add_requests`` pairs such a list with the prompts one by one)."""
        if adapters is None:
            return self._lora_request
        if isinstance(adapters, str):
            raise TypeError("adapters is one adapter name per prompt (a list), not a single string")
        names = list(adapters)
        if len(names) != count:
            raise ValueError(f"adapters has {len(names)} names for {count} prompts: give one per prompt")
        wanted = sorted({n for n in names if not is_base_adapter(n)})
        if not wanted:
            return None
        if not getattr(self, "enable_lora", False):
            raise ValueError(f"adapters {wanted} need the vllm engine built with enable_lora=True")
        unknown = [n for n in wanted if n not in self._adapters]
        if unknown:
            raise ValueError(f"unknown adapter{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                             f"loaded: {sorted(self._adapters) or 'none'} (send one with update_adapter(name, "
                             f"peft_model_or_folder) or update_weights(peft_model))")
        limit = getattr(self, "max_loras", None) or 1
        if len(wanted) > limit and not self._warned_max_loras:
            self._warned_max_loras = True
            log.warning("%d LoRA adapters in one batch but vLLM runs at most max_loras=%d per step (the other rows "
                        "wait); build the engine with max_loras=%d", len(wanted), limit, len(wanted))
        return [None if is_base_adapter(n) else self._adapters[n] for n in names]

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

    def update_weights(self, model_or_state: Any, adapter: str | None = None) -> None:
        """New weights from the trainer: a state dict or module (copied into vLLM's model), a peft
        model (merged, or with ``enable_lora`` every adapter of it swapped in as a new version), or,
        with ``adapter=``, just that adapter (``update_adapter``)."""
        import torch

        if adapter is not None:
            self.update_adapter(adapter, model_or_state)
            return
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
        from tracegym.engines.sampling_copy import merged_state_dict  # torch and peft: imported on use

        self.load_state_dict(merged_state_dict(model_or_state))  # the trainer's weights stay untouched

    def _set_lora(self, peft_model: Any) -> None:
        """Every adapter of ``peft_model`` as a new version; its active adapter becomes the default
        of rows sampled without ``adapters`` (the single-adapter behaviour: the policy's adapter)."""
        names = list(peft_model.peft_config)
        for name in names:
            self.update_adapter(name, peft_model)
        active = getattr(peft_model, "active_adapter", None)
        if isinstance(active, str) and active in names:
            self._default_adapter = active
        elif len(names) == 1:
            self._default_adapter = names[0]

    def update_adapter(self, name: str, peft_model_or_folder: Any) -> Any:
        """Serve adapter ``name`` with new weights from now on; returns its new ``LoRARequest``.

        ``peft_model_or_folder``: a peft model holding an adapter called ``name`` (saved with
        ``save_pretrained(folder, selected_adapters=[name])`` to a versioned temporary folder), or a
        folder with a saved adapter (``adapter_config.json`` in it or in ``folder/<name>``; it is
        read from there, not copied, and must stay until the next update). The new version gets a
        new int id and name (see the module docstring); vLLM loads it now, so a bad adapter fails
        here and not in the next ``generate``. Then the previous version is removed from vLLM.
        """
        from vllm.lora.request import LoRARequest

        if not getattr(self, "enable_lora", False):
            raise ValueError(f"update_adapter({name!r}) needs the vllm engine built with enable_lora=True")
        if not isinstance(name, str) or not name or is_base_adapter(name):
            raise ValueError(f"adapter name must be a non-empty string other than {BASE_ADAPTER!r}, got {name!r}")
        lora_id = self._next_lora_id
        version = self._versions.get(name, 0) + 1
        owned: str | None = None
        if isinstance(peft_model_or_folder, (str, os.PathLike)):
            folder = adapter_folder(peft_model_or_folder, name)
        elif hasattr(peft_model_or_folder, "peft_config"):
            if name not in peft_model_or_folder.peft_config:
                raise ValueError(f"the peft model has no adapter {name!r} (it has {sorted(peft_model_or_folder.peft_config)})")
            if self._lora_dir is None:
                self._lora_dir = tempfile.TemporaryDirectory(prefix="tracegym-lora-")
            owned = os.path.join(self._lora_dir.name, f"{lora_id}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-v{version}")
            # peft writes a non-default adapter to owned/<name>/, the default one to owned/ itself
            peft_model_or_folder.save_pretrained(owned, selected_adapters=[name])
            folder = adapter_folder(owned, name)
        else:
            raise TypeError(f"update_adapter takes a peft model or a folder, got {type(peft_model_or_folder).__name__}")
        request = LoRARequest(f"{name}-v{version}", lora_id, folder)
        self._next_lora_id += 1
        try:
            self._engine_call("add_lora", request)
        except Exception as exc:
            if owned is not None:
                shutil.rmtree(owned, ignore_errors=True)
            raise RuntimeError(f"vLLM could not load adapter {name!r} from {folder}: {exc}") from exc
        previous, previous_dir = self._adapters.get(name), self._owned.pop(name, None)
        self._adapters[name] = request
        self._versions[name] = version
        if owned is not None:
            self._owned[name] = owned
        if previous is not None:
            self._engine_call("remove_lora", previous.lora_int_id)
        if previous_dir is not None:
            shutil.rmtree(previous_dir, ignore_errors=True)
        return request

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``: removed from vLLM, its folder deleted."""
        request = self._adapters.pop(name, None)
        if request is None:
            raise ValueError(f"unknown adapter {name!r}; loaded: {sorted(self._adapters) or 'none'}")
        self._engine_call("remove_lora", request.lora_int_id)
        folder = self._owned.pop(name, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        if self._default_adapter == name:
            self._default_adapter = None

    def _engine_call(self, method: str, arg: Any) -> Any:
        """``llm.llm_engine.add_lora(request)`` / ``remove_lora(lora_id)`` (V0 and V1 engines both
        have them). Without them an adapter still loads lazily at its first request, and an old
        version stays in vLLM's LRU cache until evicted (never served again: its id is retired)."""
        fn = getattr(getattr(self.llm, "llm_engine", None), method, None)
        if fn is None:
            log.warning("this vLLM has no llm_engine.%s: skipped (adapters load at their first request)", method)
            return None
        return fn(arg)

    def close(self) -> None:
        if getattr(self, "_lora_dir", None) is not None:
            self._lora_dir.cleanup()
            self._lora_dir = None
            self._owned.clear()


def _prompt_values(output: Any, row: list[int]) -> list[float]:
    """The actual tokens' log-probs ``[len(row) - 1]`` of one ``RequestOutput`` asked with
    ``prompt_logprobs``: entry ``i`` maps token ids to ``Logprob`` objects (``.logprob``); entry 0 is None."""
    used = getattr(output, "prompt_token_ids", None)
    if used is not None and [int(t) for t in used] != row:
        raise RuntimeError(f"vLLM scored other prompt ids than the {len(row)} given ({len(used)} used)")
    scores = getattr(output, "prompt_logprobs", None)
    if scores is None or len(scores) < len(row):
        raise RuntimeError(f"vLLM returned {0 if scores is None else len(scores)} prompt log-probs for a sequence of "
                           f"{len(row)} tokens (asked with prompt_logprobs=0)")
    values: list[float] = []
    for i in range(1, len(row)):
        try:  # a dict per position (or, with flat_logprobs, a mapping-like view of one)
            found = scores[i][row[i]]
        except (KeyError, TypeError, IndexError):
            found = None
        if found is None:
            raise RuntimeError(f"vLLM's prompt log-probs at position {i} lack the sequence's token {row[i]}")
        values.append(float(getattr(found, "logprob", found)))
    return values
