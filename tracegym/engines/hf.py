"""The default CPU engine: batched sampling with Hugging Face transformers and a KV cache.

Why our own decode loop rather than ``model.generate``: we need the log-prob of every sampled token
under the exact distribution it was drawn from (after temperature and top-p), per-sequence finish
reasons, and we want finished sequences to leave the batch so the remaining ones decode faster.
``generate(output_scores=True)`` returns processed scores but keeps finished rows in the batch until
the longest one ends. The loop here is a plain prefill + one-token decode steps over a
``DynamicCache``; rows that finish are removed from the cache with ``batch_select_indices``.

Preallocated KV (``preallocate_kv=True``, the default): the cache is a ``KVBufferCache``
(``tracegym.engines.kv_buffers``), whose layers write each step's keys and values in place into
buffers reserved once per chunk (the chunk's longest own length after prefill + ``max_tokens``),
where ``DynamicLayer`` concatenates, copying the whole cache and allocating a new one at every
decode step (1.2 GB per step for 64 rows x 400 tokens on SmolLM2, a fragmented heap after a few
calls). Rows that finish are compacted in place. Only the memory layout changes: the attention
reads strided views of the buffers, and the results are those of ``preallocate_kv=False``.

Left padding: prompts of different lengths are left-padded, with an attention mask and explicit
``position_ids`` (cumulative sum of the mask), so a padded row sees exactly the positions it would
see alone. In fp32 the returned log-probs equal a teacher-forced forward pass of the unpadded
sequence to ~1e-6 (tested).

Shared prompts (``prefix_cache=True``, the default): agent prompts in one chunk mostly start with
the same system prompt and tool schemas, and RL groups / pass@k repeat whole prompts n times, so
prefill would recompute the same keys and values many times; and an episode's next turn repeats its
whole previous turn. Three exact savings:

1. identical prompts are prefilled once; their cache rows and last logits are then copied to every
   row that asked for them (``batch_select_indices`` with repeated indices);
2. among the distinct prompts, the longest common prefix (capped so each prompt keeps at least one
   token of its own) is run once with batch 1, its cache repeated to the batch
   (``batch_repeat_interleave``), and only the left-padded suffixes are prefilled. The cache then
   reads ``[prefix | pad | suffix]``: the 2D attention mask ``[1]*P + [0]*pad + [1]*S`` leaves a hole
   that transformers' mask creation turns into a per-key padding mask, and position ids continue
   from ``P`` so every real token sits at the position it has in its own unpadded sequence;
3. across calls, an episode's previous turn (``turn_cache_mb > 0``, on with ``prefix_cache``): when
   a row finishes, the keys and values of its real positions (prompt + sampled tokens but the last,
   which was never fed) are kept, keyed by those tokens. A later prompt that starts with such a key
   (the same episode's next turn: previous prompt + completion + tool result + generation prompt)
   takes them and prefills only its new tokens (a prompt sharing only a part of an entry, e.g. a
   tree branch forking at an earlier turn or another episode's system prompt, takes that part).
   The rows' cached parts are right-aligned in the batch cache: ``[pad | cached c_i | pad | new
   s_i]`` with the mask ``[0]*(C-c_i) + [1]*c_i + [0]*(S-s_i) + [1]*s_i`` and positions continuing
   from ``c_i``. The store is an LRU bounded by ``turn_cache_mb``; an entry extended whole leaves it
   (the new turn's row replaces it), and ``update_weights`` / ``clear_cache`` drop it all: keys
   computed with older weights are never reused. The rollout runner clears it at the start and the
   end of every run, so a run's results never depend on what ran before it.

Shared-prefix KV (``share_prefix_kv=True``, the default): step 2's ``batch_repeat_interleave`` and
the per-row copies of step 3 would hold the common prefix once per row (64 rows x 600 tokens x 46
KB on SmolLM2: 1.8 GB, mostly copies). Instead the chunk's common prefix (capped as in step 2; for
one prompt repeated n times, all but its last token) is a ``SharedPrefix`` held once, batch 1,
outside the ``DynamicCache``; the cache, its 2D mask and its length cover each row's own tokens
only, position ids continue from ``P``, and the forward passes go through the attention function
of ``tracegym.engines.shared_prefix``, which attends to ``[prefix ; own keys]`` in one softmax
(the model is switched to it only during those passes). Kept turns reference their chunk's prefix
(counted once in ``turn_cache_mb``); when a later chunk's common prefix is covered by a kept
prefix, the chunk attends to that same memory, else it is built once from the best kept turn and
a batch-1 pass for what is missing, and each row's cache gets only its kept tokens after it. This
runs for sdpa models whose attention goes through transformers' ``AttentionInterface``, with one
adapter per chunk and at least two rows; mixed-adapter chunks, single rows and other models keep
the layouts of steps 2 and 3.

All of these change only float rounding (the same tokens are computed in other batch shapes): in fp32
the log-probs match the plain path within 1e-4 (tested on tiny-random; 2e-5 worst case measured on
SmolLM2-135M, 32 calculator prompts, with identical sampled tokens). Steps 2 and 3 and the shared
prefix run only when every cache layer is a plain full-attention ``DynamicLayer``; sliding-window
or recurrent layers would see the holes differently.
``prefill_tokens`` and ``prefix_tokens_reused`` count prompt tokens computed and skipped
(``turn_tokens_reused`` the part of the latter that came from the turn cache).

Scoring given sequences (``prompt_logprobs``): one teacher-forced forward pass per batch of
right-padded sequences, ``log_softmax`` at temperature 1 in float32 gathered at each next token
(``tracegym.train.logprobs.token_logprobs``, chunked over positions, a shared prefix run once).
Batches are cut by ``max_batch_size`` rows and by ``prompt_batch_tokens`` (rows x longest row), which
bounds the model's ``[rows, L, V]`` logits; a longer sequence runs alone. Right padding keeps every
real token at its own position and a causal model never lets it see a pad, so each value equals
the unpadded sequence's own forward pass up to float rounding (~1e-6 in fp32, tested).

Weight sync (``update_weights``): the engine holds a *reference* to a module. Passing the trainer's
module (a plain model or a peft/LoRA ``PeftModel``) makes the engine generate with it directly: no
copy, no reload from disk, LoRA adapters applied by peft's forward. Passing a state dict copies the
tensors into the engine's own model in place (``load_state_dict``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from tracegym.engines.base import BASE_ADAPTER, Engine, EngineCapabilities
from tracegym.engines.sampling import sample_tokens, sampling_logprobs, validate_params  # noqa: F401  (re-exported)
from tracegym.engines.kv_buffers import KVBufferCache
from tracegym.engines.shared_prefix import SharedPrefix, prefix_attention, supports_shared_prefix
from tracegym.types import FinishReason, Generation, SamplingParams

log = logging.getLogger(__name__)


_RELEASED = torch.empty(0)  # stands in for a layer's keys/values once copied out of a taken entry


@dataclass
class _TurnKV:
    """One finished row's keys and values for the ``n`` tokens of ``tokens``: the first ``P`` from
    ``prefix`` (its chunk's shared prefix, referenced, not copied; None: ``P = 0``), the other
    ``n - P`` per layer ``[H, n - P, D]`` in ``keys`` / ``values``."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prefix: SharedPrefix | None = None

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix is None else len(self.prefix)

    @property
    def nbytes(self) -> int:
        """The row's own bytes; the store counts a shared prefix once, however many entries hold it."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def head(self, n: int) -> _TurnKV:
        """The first ``n`` positions (views: the entry stays whole)."""
        if n <= self.prefix_len:
            assert self.prefix is not None
            return _TurnKV(self.tokens[:n], [k[:, :0] for k in self.keys], [v[:, :0] for v in self.values],
                           self.prefix.truncated(n))
        own = n - self.prefix_len
        return _TurnKV(self.tokens[:n], [k[:, :own] for k in self.keys], [v[:, :own] for v in self.values], self.prefix)

    def copy_into(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Write ``layer``'s positions ``start .. start + m`` into ``keys`` / ``values`` (each ``[H, m, D]``)."""
        stop = start + keys.shape[1]
        split = min(max(self.prefix_len - start, 0), stop - start)  # how many of them the prefix holds
        if split:
            assert self.prefix is not None
            keys[:, :split] = self.prefix.keys[layer][:, start : start + split]
            values[:, :split] = self.prefix.values[layer][:, start : start + split]
        if split < stop - start:
            own_start, own_stop = max(start - self.prefix_len, 0), stop - self.prefix_len
            keys[:, split:] = self.keys[layer][:, own_start:own_stop]
            values[:, split:] = self.values[layer][:, own_start:own_stop]


@contextmanager
def contiguous_head_input(model: Any) -> Iterator[None]:
    """Hand the output layer a contiguous input while inside.

    ``logits_to_keep=1`` makes transformers call the output layer on ``hidden[:, -1:, :]``, a strided
    view of a prefill's ``[B, L, H]`` hidden states. ``F.linear`` on a strided 3-D input does not fold
    it into one matrix product: it broadcasts the ``[V, H]`` weight to every row and copies it (B x
    49k x 576 values on SmolLM2). Measured on 2 EPYC cores, 16 rows: 83 ms instead of 22 ms in float32
    and 868 ms instead of 8 ms in bfloat16, per prefill. A forward pre-hook copies the ``[B, 1, H]``
    rows instead; ``HFEngine._forward`` sets it for prefills only (a decode step's input is
    contiguous already)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        yield
        return
    handle = head.register_forward_pre_hook(
        lambda _module, args: tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))
    try:
        yield
    finally:
        handle.remove()


class HFEngine(Engine):
    """Batched sampler over a transformers causal LM (CPU or whatever device the model is on).

    Args:
        model: a ``PreTrainedModel`` (or a peft model wrapping one).
        tokenizer: optional; needed only for ``SamplingParams.stop`` strings and for
            ``Generation.text``.
        stop_token_ids: ids that always end a sequence (e.g. the renderer's end-of-turn ids), in
            addition to ``SamplingParams.stop_token_ids``.
        max_batch_size: rows decoded together; larger requests are split into chunks.
        pad_token_id: any id; padded positions are masked out, so the value does not matter.
        prefix_cache: prefill identical prompts once, a chunk's shared prompt prefix once, and reuse
            an episode's previous turn (see the module docstring); ``False`` prefills every row's
            whole prompt.
        min_shared_prefix: shortest common prefix (tokens) worth a separate forward pass.
        share_prefix_kv: keep a chunk's shared prefix keys/values once, attended to by every row,
            instead of a copy per row (see the module docstring); ``False`` copies it, as before
            (a benchmark compares the two).
        turn_cache_mb: memory bound of the previous-turn store (0: off). SmolLM2-135M holds about
            46 KB per token (30 layers x 2 x 3 KV heads x 64 x 4 bytes), so 1024 MB keeps about 22k
            tokens: 45 episodes of 500 tokens waiting for their env.
        prompt_batch_tokens: ``prompt_logprobs`` batches at most this many padded tokens (rows x
            longest row): its logits are ``[rows, L, V]`` (4096 tokens x 49k vocab x 4 bytes = 800 MB).
        preallocate_kv: decode into key/value buffers reserved once per chunk (see the module
            docstring); ``False`` uses transformers' ``DynamicCache``, which copies the cache at
            every step (a benchmark compares the two).
        sample_dtype: ``None`` samples with ``model`` itself (a reference). ``float32`` or
            ``bfloat16`` sample with a plain copy of ``model`` in that dtype, its LoRA adapter
            merged, that ``update_weights`` refreshes from the trainer's module
            (``tracegym.engines.sampling_copy``); a plain model already in that dtype is used as it
            is. ``float32``: the same samples as the peft model, 1.19x faster; ``bfloat16``: faster
            still where the CPU has it, but a merged LoRA loses pass@1 to the rounding, and the
            sampled log-probs carry it (``sample_dtype_differs``).
    """

    name = "hf"
    returns_logprobs = True

    @property
    def capabilities(self) -> EngineCapabilities:
        """Sampled log-probs and token ids come back; the engine holds the trainer's model object."""
        return EngineCapabilities(returns_logprobs=True, exact_token_ids=True, weight_sync="shared_model")

    def __init__(
        self,
        model: Any,
        tokenizer: Any | None = None,
        *,
        stop_token_ids: Sequence[int] = (),
        max_batch_size: int = 64,
        pad_token_id: int = 0,
        prefix_cache: bool = True,
        min_shared_prefix: int = 16,
        share_prefix_kv: bool = True,
        turn_cache_mb: float = 1024.0,
        prompt_batch_tokens: int = 4096,
        preallocate_kv: bool = True,
        sample_dtype: str | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if min_shared_prefix < 1:
            raise ValueError("min_shared_prefix must be >= 1")
        if prompt_batch_tokens < 1:
            raise ValueError("prompt_batch_tokens must be >= 1")
        from tracegym.engines.sampling_copy import resolve_sample_dtype, sampling_copy
        from tracegym.train.lora import is_peft_model

        # the trainer's module (what update_weights follows) and what the engine samples with: that
        # very module, or its merged copy in sample_dtype (then ``self.model is not self.source``)
        self.source = model
        self.sample_dtype = resolve_sample_dtype(sample_dtype)
        copy_needed = self.sample_dtype is not None and (
            is_peft_model(model) or next(model.parameters()).dtype != self.sample_dtype)
        self.model = sampling_copy(model, self.sample_dtype) if copy_needed else model  # type: ignore[arg-type]
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.prefix_cache = prefix_cache
        self.min_shared_prefix = min_shared_prefix
        self.share_prefix_kv = share_prefix_kv
        self.prompt_batch_tokens = prompt_batch_tokens
        self.preallocate_kv = preallocate_kv
        if turn_cache_mb < 0:
            raise ValueError("turn_cache_mb must be >= 0")
        self.turn_cache_bytes = int(turn_cache_mb * 2**20) if prefix_cache else 0
        # LRU (oldest first) keyed by (adapter name or None, tokens): keys/values depend on the adapter
        self._turns: OrderedDict[tuple[str | None, tuple[int, ...]], _TurnKV] = OrderedDict()
        self._turn_bytes = 0  # entries' own bytes + each shared prefix's bytes once
        self._prefix_users: dict[int, list[int]] = {}  # SharedPrefix.storage_id -> [entries holding it, bytes]
        # counters over the engine's life (benchmarks and tests read them):
        self.forward_calls = 0  # model forward passes
        self.prefill_tokens = 0  # prompt tokens run through the model (padding excluded)
        self.prefix_tokens_reused = 0  # prompt tokens whose keys/values were copied, not computed
        self.turn_tokens_reused = 0  # of them, taken from an earlier call's finished row

    def __repr__(self) -> str:
        return (
            f"HFEngine(model={type(self.model).__name__}, max_batch_size={self.max_batch_size}, "
            f"prefix_cache={self.prefix_cache}, share_prefix_kv={self.share_prefix_kv}, "
            f"preallocate_kv={self.preallocate_kv}, turn_cache_mb={self.turn_cache_bytes / 2**20:g}, "
            f"sample_dtype={str(self.sample_dtype).removeprefix('torch.') if self.sample_dtype else None})"
        )

    @property
    def sample_dtype_differs(self) -> bool:
        """Whether the engine samples in another dtype than the trainer's module holds (a bfloat16
        copy of a float32 policy): its log-probs then differ from the trainer's by that rounding, so
        an RL update takes its old log-probs from the trainer (``every_row_needs_rescoring``)."""
        return next(self.model.parameters()).dtype != next(self.source.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- generation ------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, adapters: Sequence[str] | None = None
    ) -> list[list[Generation]]:
        """``params.n`` samples of each prompt. ``adapters``: one LoRA adapter name per prompt (a
        multi-adapter peft model; ``"__base__"`` for no adapter): rows of different adapters decode
        in the same forward passes (peft's ``adapter_names``), each with its own adapter."""
        validate_params(params)
        if not prompts:
            return []
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        if adapters is not None and self.model is not self.source:
            raise ValueError("per-prompt adapters need the multi-adapter model itself; this engine samples with a "
                             "merged copy (sample_dtype): build it with sample_dtype=None")
        if adapters is not None:
            adapters = [str(a) for a in adapters]
            if len(adapters) != len(prompts):
                raise ValueError(f"got {len(adapters)} adapter names for {len(prompts)} prompts")
            known = set(getattr(self.model, "peft_config", {}) or {}) | {BASE_ADAPTER}
            unknown = sorted(set(adapters) - known)
            if unknown:
                raise ValueError(f"unknown adapter(s) {unknown}: the model has {sorted(known)}")
        # one row per (prompt, sample); rows sorted by length so each chunk carries little padding
        rows = [(pi, list(map(int, p))) for pi, p in enumerate(prompts) for _ in range(params.n)]
        row_names = None if adapters is None else [adapters[pi] for pi, _ in rows]
        order = sorted(range(len(rows)), key=lambda r: -len(rows[r][1]))
        generator = torch.Generator(device="cpu")
        if params.seed is not None:
            generator.manual_seed(int(params.seed))
        else:
            generator.seed()
        results: list[Generation | None] = [None] * len(rows)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(order), self.max_batch_size):
                    chunk = order[start : start + self.max_batch_size]
                    names = None if row_names is None else [row_names[r] for r in chunk]
                    outs = self._generate_chunk([rows[r][1] for r in chunk], params, generator, names)
                    for r, g in zip(chunk, outs):
                        results[r] = g
        finally:
            if was_training:
                self.model.train()
        grouped: list[list[Generation]] = [[] for _ in prompts]
        for (pi, _), g in zip(rows, results):
            assert g is not None
            grouped[pi].append(g)
        return grouped

    def continuous_decoder(self, params: SamplingParams, **options: Any) -> Any:
        """A ``ContinuousDecoder`` (``tracegym.engines.hf_continuous``) over this engine's model: one
        running batch that requests join and leave, for the rollout runner (``options``: its
        ``admit_fraction``, ``max_wait_steps``). Sampled with ``params`` (temperature, top-p,
        stops); each request brings its own budget and seed."""
        from tracegym.engines.hf_continuous import ContinuousDecoder

        return ContinuousDecoder(self, params, **options)

    # -- scoring given sequences ---------------------------------------------------------------------
    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """For each sequence, ``log p(seq[i] | seq[:i])`` for ``i >= 1`` (``len(seq) - 1`` floats) under
        the model's raw distribution at temperature 1, from teacher-forced forward passes (see the
        module docstring). The model's active adapter applies, as in ``generate``."""
        from tracegym.engines.base import prompt_sequences
        from tracegym.train.logprobs import token_logprobs

        rows = prompt_sequences(sequences)
        results: list[list[float]] = [[] for _ in rows]
        order = sorted((i for i, row in enumerate(rows) if len(row) >= 2), key=lambda i: -len(rows[i]))
        device = self.device
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for chunk in self._score_chunks(order, rows):
                    width = len(rows[chunk[0]])  # sorted longest first
                    input_ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)  # [b, L]
                    attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [b, L]
                    for b, i in enumerate(chunk):
                        input_ids[b, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
                        attention_mask[b, : len(rows[i])] = 1
                    self.forward_calls += 1
                    # [b, L - 1], target-aligned: column t is log p(token t + 1 | tokens <= t)
                    values = token_logprobs(self.model, input_ids.to(device), attention_mask.to(device), 1.0).cpu()
                    for b, i in enumerate(chunk):
                        results[i] = values[b, : len(rows[i]) - 1].tolist()
        finally:
            if was_training:
                self.model.train()
        return results

    def _score_chunks(self, order: list[int], rows: list[list[int]]) -> list[list[int]]:
        """``order`` (longest first) cut into batches of at most ``max_batch_size`` rows and
        ``prompt_batch_tokens`` padded tokens (a row longer than that alone)."""
        chunks: list[list[int]] = []
        for i in order:
            if chunks:
                chunk = chunks[-1]
                width = len(rows[chunk[0]])
                if len(chunk) < self.max_batch_size and (len(chunk) + 1) * width <= self.prompt_batch_tokens:
                    chunk.append(i)
                    continue
            chunks.append([i])
        return chunks

    def _forward(
        self, names: list[str] | None = None, prefix: SharedPrefix | None = None, **kw: Any
    ) -> torch.Tensor:
        """Last-position logits [B, V]; ``names``: the adapter of each of the B rows (None: the
        model's active adapter for every row); ``prefix``: keys/values every row attends to before
        its cached ones (the cache, mask and positions then describe what follows it)."""
        self.forward_calls += 1
        if names is not None:
            kw["adapter_names"] = list(names)
        prefill = kw["input_ids"].shape[1] > 1  # a decode step's [B, 1, H] input is contiguous already
        with contiguous_head_input(self.model) if prefill else nullcontext():
            if prefix is None:
                out = self.model(use_cache=True, logits_to_keep=1, **kw)
            else:
                with prefix_attention(self.model):
                    out = self.model(use_cache=True, logits_to_keep=1, shared_prefix_kv=prefix, **kw)
        return out.logits[:, -1, :]  # [B, V]

    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator,
        names: list[str] | None = None,
    ) -> list[Generation]:
        from transformers import DynamicCache

        device = self.device
        n_rows = len(prompts)
        stop_ids = set(self.stop_token_ids) | set(params.stop_token_ids)
        tokens: list[list[int]] = [[] for _ in range(n_rows)]
        logps: list[list[float]] = [[] for _ in range(n_rows)]
        finish: list[FinishReason] = ["length"] * n_rows
        if params.max_tokens == 0:
            return [self._make_generation(t, lp, "length") for t, lp in zip(tokens, logps)]

        config = getattr(self.model, "config", None)
        # decode feeds at most max_tokens - 1 tokens: the buffers' headroom beyond the prefill
        cache: DynamicCache = (KVBufferCache(config, headroom=params.max_tokens) if self.preallocate_kv
                               else DynamicCache(config=config))
        logits, attention_mask, next_pos, prefix = self._prefill(prompts, cache, names)
        alive = list(range(n_rows))  # row index of each batch position still decoding
        greedy = params.temperature <= 0.0
        while True:
            lp_all = sampling_logprobs(logits, params.temperature, params.top_p)  # [B, V]
            if greedy:
                chosen = torch.argmax(logits, dim=-1)  # [B]
            else:
                uniforms = torch.rand(lp_all.shape[0], generator=generator, dtype=torch.float64)  # [B]
                chosen = sample_tokens(lp_all.exp().cpu(), uniforms).to(device)
            chosen_lp = lp_all.gather(-1, chosen[:, None]).squeeze(-1)  # [B]
            keep: list[int] = []
            for b, (tok, lp) in enumerate(zip(chosen.tolist(), chosen_lp.tolist())):
                row = alive[b]
                tokens[row].append(tok)
                logps[row].append(lp)
                if tok in stop_ids or (params.stop and self._hits_stop_string(tokens[row], params.stop)):
                    finish[row] = "stop"
                elif len(tokens[row]) >= params.max_tokens:
                    finish[row] = "length"
                else:
                    keep.append(b)
            if self.turn_cache_bytes:
                kept = set(keep)
                done = [b for b in range(len(alive)) if b not in kept]
                self._remember(cache, attention_mask, [(b, prompts[alive[b]] + tokens[alive[b]][:-1]) for b in done],
                               None if names is None else [names[alive[b]] for b in done], prefix)
            if not keep:
                break
            if len(keep) < len(alive):
                # finished rows leave the batch: shrink the cache and the mask to the survivors
                keep_t = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(keep_t)
                attention_mask = attention_mask[keep_t]
                next_pos = next_pos[keep_t]
                chosen = chosen[keep_t]
                alive = [alive[b] for b in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(alive), 1))], dim=-1)
            logits = self._forward(
                None if names is None else [names[row] for row in alive],
                input_ids=chosen[:, None],
                attention_mask=attention_mask,
                position_ids=next_pos,
                cache=cache,
                prefix=prefix,
            )
            next_pos = next_pos + 1
        return [self._make_generation(t, lp, f) for t, lp, f in zip(tokens, logps, finish)]

    def _prefill(
        self, prompts: list[list[int]], cache: Any, names: list[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SharedPrefix | None]:
        """Run the chunk's prompts into ``cache`` (``names``: each row's adapter, or None).

        Returns the last-position logits [B, V], the attention mask over the cache [B, K], the
        position of each row's next token [B, 1], and the shared prefix every row attends to before
        its cache (None: the cache holds whole rows).
        """
        n_rows = len(prompts)
        if not self.prefix_cache:
            self.prefill_tokens += sum(len(p) for p in prompts)
            return (*self._prefill_rows(prompts, cache, prefix_len=0, names=names), None)
        # distinct (adapter, prompt) pairs, in first-seen order; row_source[r] = index of row r's
        # among them (keys and values depend on the adapter, so equal prompts of two adapters differ)
        first_seen: dict[tuple[str | None, tuple[int, ...]], int] = {}
        row_source = [first_seen.setdefault((None if names is None else names[r], tuple(p)), len(first_seen))
                      for r, p in enumerate(prompts)]
        distinct = [list(p) for _, p in first_seen]
        distinct_names = None if names is None else [name for name, _ in first_seen]
        hits = self._take_turns(distinct, cache, distinct_names)
        share_len = 0
        if self.share_prefix_kv and supports_shared_prefix(self.model):
            share_len = self._shared_prefix_len(distinct, cache, distinct_names, repeated=len(distinct) < n_rows)
        prefix = None
        if share_len:
            logits, attention_mask, next_pos, prefix, computed = self._prefill_shared(
                distinct, hits, share_len, cache, distinct_names)
        elif any(hit is not None for hit in hits):
            reused = sum(len(hit.tokens) for hit in hits if hit is not None)
            computed = sum(len(p) for p in distinct) - reused
            self.turn_tokens_reused += reused
            logits, attention_mask, next_pos = self._prefill_after_turns(distinct, hits, cache, distinct_names)
        else:
            prefix_len = self._shared_prefix_len(distinct, cache, distinct_names)
            computed = prefix_len + sum(len(p) - prefix_len for p in distinct)
            logits, attention_mask, next_pos = self._prefill_rows(distinct, cache, prefix_len, distinct_names)
        self.prefill_tokens += computed
        self.prefix_tokens_reused += sum(len(p) for p in prompts) - computed
        if len(distinct) < n_rows:
            # copy each distinct prompt's cache row, mask, position and logits to its rows
            source = torch.tensor(row_source, dtype=torch.long, device=logits.device)
            cache.batch_select_indices(source)
            logits, attention_mask, next_pos = logits[source], attention_mask[source], next_pos[source]
        return logits, attention_mask, next_pos, prefix

    # -- previous-turn store -------------------------------------------------------------------
    def forget_turn(self, tokens: Sequence[int], adapter: str | None = None) -> None:
        """Drop the kept keys/values of exactly ``tokens`` (an episode that ended: no next turn will
        extend its last one, which would otherwise hold its memory until the store's bound evicts it)."""
        entry = self._turns.pop((adapter, tuple(int(t) for t in tokens)), None)
        if entry is not None:
            self._store_forget(entry)

    def clear_cache(self) -> None:
        """Forget every kept turn (after the weights change, or to free the memory)."""
        self._turns.clear()
        self._prefix_users.clear()
        self._turn_bytes = 0

    def _store_put(self, key: tuple[str | None, tuple[int, ...]], entry: _TurnKV) -> None:
        """Keep ``entry`` (replacing an older one of the same key), then drop the least recently
        used entries until the store fits its bound."""
        old = self._turns.pop(key, None)
        if old is not None:
            self._store_forget(old)
        self._turns[key] = entry
        self._turn_bytes += entry.nbytes
        if entry.prefix is not None:
            users = self._prefix_users.setdefault(entry.prefix.storage_id, [0, entry.prefix.storage_nbytes])
            if users[0] == 0:
                self._turn_bytes += users[1]
            users[0] += 1
        while self._turn_bytes > self.turn_cache_bytes:
            _, evicted = self._turns.popitem(last=False)
            self._store_forget(evicted)

    def _store_forget(self, entry: _TurnKV) -> None:
        """Take a removed entry's bytes off the count, and its prefix's with the prefix's last holder."""
        self._turn_bytes -= entry.nbytes
        if entry.prefix is not None:
            users = self._prefix_users[entry.prefix.storage_id]
            users[0] -= 1
            if users[0] == 0:
                self._turn_bytes -= users[1]
                del self._prefix_users[entry.prefix.storage_id]

    @staticmethod
    def _plain_layers(cache: Any) -> bool:
        """Holes in the cache (between parts) are exact only for plain full-attention layers."""
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer or getattr(type(layer), "plain_full_attention", False)
                   for layer in getattr(cache, "layers", ()))

    @staticmethod
    def _reserve(cache: Any, length: int) -> None:
        """Size a ``KVBufferCache`` for ``length`` positions after prefill plus decode, before the
        prefill writes them (a ``DynamicCache`` has nothing to reserve)."""
        if isinstance(cache, KVBufferCache):
            cache.reserve(length)

    def _remember(self, cache: Any, attention_mask: torch.Tensor, rows: list[tuple[int, list[int]]],
                  names: list[str] | None = None, prefix: SharedPrefix | None = None) -> None:
        """Keep the real positions of finished batch rows ``b``, keyed by their adapter (``names``,
        aligned with ``rows``) and the tokens they hold (``prefix``: their first tokens, which the
        entries reference instead of copying)."""
        if not rows or not self._plain_layers(cache):
            return
        prefix_len = 0 if prefix is None else len(prefix)
        for i, (b, tokens) in enumerate(rows):
            where = attention_mask[b].nonzero().flatten().to(cache.layers[0].keys.device)  # [n - P] real positions of row b
            if where.numel() != len(tokens) - prefix_len or len(tokens) == 0:
                continue  # a stored row must match its key token for token
            entry = _TurnKV(
                tuple(int(t) for t in tokens),
                # [H, n - P, D] each: copies out of the cache's views, so no entry keeps a chunk's buffers alive
                [layer.keys[b].index_select(1, where) for layer in cache.layers],
                [layer.values[b].index_select(1, where) for layer in cache.layers],
                prefix,
            )
            new_prefix_bytes = 0 if prefix is None or prefix.storage_id in self._prefix_users else prefix.storage_nbytes
            if entry.nbytes + new_prefix_bytes > self.turn_cache_bytes:
                continue
            self._store_put((None if names is None else names[i], entry.tokens), entry)

    @staticmethod
    def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        """Length of the longest common prefix (binary search over C-speed tuple compares)."""
        low, high = 0, min(len(a), len(b))
        while low < high:
            mid = (low + high + 1) // 2
            if a[:mid] == b[:mid]:
                low = mid
            else:
                high = mid - 1
        return low

    def _take_turns(self, prompts: list[list[int]], cache: Any, names: list[str] | None = None) -> list[_TurnKV | None]:
        """For each prompt, the kept keys/values of its longest prefix held in the store (a whole
        entry, or a part of at least ``min_shared_prefix`` tokens), or None. A prompt keeps at least one token of its own, so its
        last logits are computed. The usual hit is a whole entry (the episode's previous turn); a
        part of one also counts (a tree branch or a continuation forking from an earlier turn, or
        the system prompt another episode already computed). Entries a prompt extends whole are
        superseded by that prompt's own row when it finishes, so they leave the store."""
        if not self._turns or not self._plain_layers(cache):
            return [None] * len(prompts)
        hits: list[_TurnKV | None] = []
        superseded: set[tuple[str | None, tuple[int, ...]]] = set()  # entries handed out whole
        for i, prompt in enumerate(prompts):
            key = tuple(prompt)
            name = None if names is None else names[i]
            best, best_len, best_key = None, 0, None
            for entry_key in self._turns:
                if entry_key[0] != name:
                    continue  # another adapter's keys and values
                tokens = entry_key[1]
                n = self._common_prefix(key, tokens)
                n = min(n, len(key) - 1)
                if n > best_len:
                    best, best_len, best_key = tokens, n, entry_key
            if best is None or (best_len < len(best) and best_len < self.min_shared_prefix):  # short parts: not worth it
                hits.append(None)
                continue
            entry = self._turns[best_key]
            self._turns.move_to_end(best_key)  # recently used
            if best_len == len(best):
                # the first prompt gets the entry itself (``_load_turns`` frees it layer by layer as it
                # copies); another prompt extending it whole gets views taken now, before that: the
                # two may be loaded in separate passes (continuous batching's length buckets)
                hits.append(entry.head(best_len) if best_key in superseded else entry)
                superseded.add(best_key)
            else:  # the first best_len positions only (views; the entry stays whole)
                hits.append(entry.head(best_len))
        for entry_key in superseded:
            self._store_forget(self._turns.pop(entry_key))
        return hits

    def _prefill_after_turns(
        self, prompts: list[list[int]], hits: list[_TurnKV | None], cache: Any, names: list[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Load each row's kept turn into ``cache`` right-aligned, then prefill the new tokens."""
        cached = self._load_turns(hits, 0, cache)
        return self._prefill_suffixes([p[c:] for p, c in zip(prompts, cached)], self._right_aligned_mask(cached),
                                      cached, cache, names)

    def _prefill_shared(
        self, prompts: list[list[int]], hits: list[_TurnKV | None], share_len: int, cache: Any,
        names: list[str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SharedPrefix, int]:
        """Prefill the distinct ``prompts`` keeping their common first ``share_len`` tokens once, as a
        ``SharedPrefix`` outside ``cache``; the rest of each row's kept turn (if any) goes into
        ``cache`` right-aligned, then the new tokens run. Returns ``_prefill_suffixes``'s three, the
        prefix, and how many prompt tokens were computed."""
        prefix, from_store = self._build_prefix(prompts[0][:share_len], hits, names)
        own = self._load_turns(hits, share_len, cache)  # each row's kept tokens after the prefix
        suffixes = [p[share_len + o :] for p, o in zip(prompts, own)]
        logits, attention_mask, next_pos = self._prefill_suffixes(
            suffixes, self._right_aligned_mask(own), [share_len + o for o in own], cache, names, prefix)
        self.turn_tokens_reused += len(prompts) * from_store + sum(own)
        return logits, attention_mask, next_pos, prefix, share_len - from_store + sum(len(s) for s in suffixes)

    def _build_prefix(
        self, tokens: list[int], hits: list[_TurnKV | None], names: list[str] | None = None
    ) -> tuple[SharedPrefix, int]:
        """Keys and values of ``tokens`` (every row's first tokens) once, batch 1, and how many of
        them came from the turn store. A kept turn whose shared prefix covers them gives a view of
        it (the new batch and the old entries then hold one copy); otherwise the hit covering most
        of them gives that part and a batch-1 pass computes the rest."""
        from transformers import DynamicCache

        n = len(tokens)
        covering = next((hit for hit in hits if hit is not None and hit.prefix_len >= n), None)
        if covering is not None:
            assert covering.prefix is not None
            return covering.prefix.truncated(n), n
        best = max((hit for hit in hits if hit is not None), key=lambda hit: len(hit.tokens), default=None)
        have = 0 if best is None else min(len(best.tokens), n)
        part = DynamicCache(config=getattr(self.model, "config", None))
        if best is not None and have:
            for layer in range(len(best.keys)):
                own = best.keys[layer]
                keys = own.new_empty((1, own.shape[0], have, own.shape[-1]))  # [1, H, have, D]
                values = torch.empty_like(keys)
                best.copy_into(layer, keys[0], values[0], 0)
                part.update(keys.to(self.device), values.to(self.device), layer)
        if have < n:
            device = self.device
            self._forward(
                None if names is None else names[:1],
                input_ids=torch.tensor([tokens[have:]], dtype=torch.long, device=device),  # [1, n - have]
                attention_mask=torch.ones((1, n), dtype=torch.long, device=device),
                position_ids=torch.arange(have, n, device=device)[None],
                cache=part,
            )  # the logits are not needed: every row has a token of its own after the prefix
        return SharedPrefix(tuple(tokens), tuple(layer.keys[0] for layer in part.layers),
                            tuple(layer.values[0] for layer in part.layers)), have

    def _load_turns(self, hits: list[_TurnKV | None], start: int | Sequence[int], cache: Any) -> list[int]:
        """Copy each row's kept positions from ``start`` (one for all rows, or one per row) on into
        ``cache``, right-aligned (per layer ``[B, H, C, D]``, zeros before a shorter row's part);
        returns how many each row got."""
        starts = [start] * len(hits) if isinstance(start, int) else list(start)
        counts = [0 if hit is None else max(len(hit.tokens) - s, 0) for hit, s in zip(hits, starts)]
        width = max(counts)
        if width == 0:
            return counts
        ref = next(hit for hit, c in zip(hits, counts) if c and hit is not None)
        for layer in range(len(ref.keys)):
            heads, dim = ref.keys[layer].shape[0], ref.keys[layer].shape[-1]
            keys = ref.keys[layer].new_zeros((len(hits), heads, width, dim))  # [B, H, C, D]
            values = torch.zeros_like(keys)
            for row, (hit, c) in enumerate(zip(hits, counts)):
                if hit is not None and c:
                    hit.copy_into(layer, keys[row, :, width - c :], values[row, :, width - c :], starts[row])
            # drop this layer's references once every row has it (two rows may share an entry): a
            # whole entry, already out of the store, is freed layer by layer, so the store and the
            # batch cache never both hold all of it (a part's tensors stay alive in the store)
            for hit in hits:
                if hit is not None:
                    hit.keys[layer] = hit.values[layer] = _RELEASED
            cache.update(keys.to(self.device), values.to(self.device), layer)
        return counts

    def _right_aligned_mask(self, counts: list[int]) -> torch.Tensor:
        """[B, C] mask of right-aligned cached parts: ``[0]*(C - c_i) + [1]*c_i`` per row."""
        width = max(counts)
        mask = torch.zeros((len(counts), width), dtype=torch.long)
        for i, c in enumerate(counts):
            mask[i, width - c :] = 1
        return mask.to(self.device)

    def _shared_prefix_len(self, prompts: list[list[int]], cache: Any, names: list[str] | None = None,
                           repeated: bool = False) -> int:
        """Tokens of the common prefix worth computing once (0 when not worth it or not safe, or when
        the rows use different adapters: their keys and values differ). ``repeated``: the prompts
        fill more rows than there are prompts, so even a single one has a prefix worth sharing."""
        if (len(prompts) < 2 and not repeated) or not self._plain_layers(cache) or (
                names is not None and len(set(names)) > 1):
            return 0
        first, shortest = prompts[0], min(len(p) for p in prompts)
        common = 0
        # each prompt keeps >= 1 token of its own so the suffix pass yields every row's logits
        while common < shortest - 1 and all(p[common] == first[common] for p in prompts):
            common += 1
        return common if common >= self.min_shared_prefix else 0

    def _prefill_rows(
        self, prompts: list[list[int]], cache: Any, prefix_len: int, names: list[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill ``prompts`` (sharing their first ``prefix_len`` tokens when > 0) into ``cache``."""
        device = self.device
        n_rows = len(prompts)
        # reserved before the prefix pass: its batch-1 buffers, repeated to every row, keep their room
        self._reserve(cache, max(len(p) for p in prompts))
        if prefix_len > 0:
            prefix = torch.tensor([prompts[0][:prefix_len]], dtype=torch.long, device=device)  # [1, P]
            self._forward(
                None if names is None else names[:1],
                input_ids=prefix,
                attention_mask=torch.ones_like(prefix),
                position_ids=torch.arange(prefix_len, device=device)[None],
                cache=cache,
            )  # the logits are not needed: every row has a suffix token after the prefix
            cache.batch_repeat_interleave(n_rows)  # [1, H, P, D] -> [B, H, P, D] per layer
        # the cache holds the shared prefix for every row: [1]*P
        cached_mask = torch.ones((n_rows, prefix_len), dtype=torch.long, device=device)
        return self._prefill_suffixes([p[prefix_len:] for p in prompts], cached_mask, [prefix_len] * n_rows, cache,
                                      names)

    def _prefill_suffixes(
        self, suffixes: list[list[int]], cached_mask: torch.Tensor, cached_len: list[int], cache: Any,
        names: list[str] | None = None, prefix: SharedPrefix | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run each row's new tokens (left-padded) after ``prefix`` (if any) and what ``cache``
        already holds for it.

        ``cached_mask`` [B, C] marks the cache positions that are real for each row, ``cached_len[b]``
        the position of row b's first new token (the prefix's and its cached tokens). Returns the last-position
        logits [B, V], the mask over the whole cache [B, C + S] (``cached | [0]*pad + [1]*new``) and
        each row's next position [B, 1]."""
        device = self.device
        n_rows = len(suffixes)
        max_len = max(len(s) for s in suffixes)
        self._reserve(cache, cached_mask.shape[1] + max_len)  # kept turns already in the cache move once
        input_ids = torch.full((n_rows, max_len), self.pad_token_id, dtype=torch.long)
        suffix_mask = torch.zeros((n_rows, max_len), dtype=torch.long)
        for i, s in enumerate(suffixes):
            input_ids[i, max_len - len(s) :] = torch.tensor(s, dtype=torch.long)
            suffix_mask[i, max_len - len(s) :] = 1
        input_ids, suffix_mask = input_ids.to(device), suffix_mask.to(device)
        start = torch.tensor(cached_len, dtype=torch.long, device=device)[:, None]  # [B, 1]
        # position of each real token in its own sequence; pads get a valid dummy (masked anyway)
        position_ids = start + (suffix_mask.cumsum(-1) - 1).clamp(min=0)  # [B, S]
        attention_mask = torch.cat([cached_mask, suffix_mask], dim=-1)  # [B, C + S]
        logits = self._forward(
            names, prefix, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache
        )
        return logits, attention_mask, position_ids[:, -1:] + 1

    def _hits_stop_string(self, tokens: list[int], stops: Sequence[str]) -> bool:
        if self.tokenizer is None:
            raise ValueError("SamplingParams.stop (strings) needs an HFEngine built with a tokenizer")
        # a stop string can only have been completed by the last token: look at a short tail
        tail = self.tokenizer.decode(tokens[-32:], skip_special_tokens=False)
        return any(s and s in tail for s in stops)

    def _make_generation(self, tokens: list[int], logps: list[float], finish: FinishReason) -> Generation:
        text = self.tokenizer.decode(tokens, skip_special_tokens=False) if self.tokenizer is not None else None
        return Generation(token_ids=tuple(tokens), logprobs=tuple(logps), finish_reason=finish, text=text)

    # -- weight sync -----------------------------------------------------------------------------
    def update_weights(self, model_or_state: Any) -> None:
        """Take the trainer's weights without touching the disk.

        - a ``torch.nn.Module`` (plain or peft/LoRA): the engine generates with that very object
          from now on (a reference, so later in-place optimizer steps are seen too); with
          ``sample_dtype``, its merged weights are written into the engine's copy (so call this
          after every optimizer step);
        - a mapping name -> tensor: copied into the engine's model in place. Keys may carry peft's
          ``base_model.model.`` prefix; LoRA factor tensors are refused (pass the peft model, or
          merge the adapter first), as are names the model does not have.
        """
        self.clear_cache()  # keys and values computed with the old weights must not be reused
        if isinstance(model_or_state, torch.nn.Module):
            if self.model is not self.source:  # the merged copy in sample_dtype takes the module's current weights
                from tracegym.engines.sampling_copy import refresh_sampling_copy

                refresh_sampling_copy(self.model, model_or_state)
            else:
                self.model = model_or_state
            self.source = model_or_state
            return
        if not isinstance(model_or_state, Mapping):
            raise TypeError(f"update_weights takes a torch.nn.Module or a state dict, got {type(model_or_state).__name__}")
        lora_keys = [k for k in model_or_state if "lora_" in k]
        if lora_keys:
            raise ValueError(
                f"state dict holds LoRA factors ({lora_keys[0]}, ...); pass the peft model itself or merge the adapter first"
            )
        own = self.model.state_dict()
        state: dict[str, torch.Tensor] = {}
        for key, value in model_or_state.items():
            name = key
            if name not in own and name.startswith("base_model.model."):
                name = name[len("base_model.model.") :]
            name = name.replace(".base_layer.", ".")
            if name not in own:
                raise KeyError(f"update_weights: the engine's model has no parameter {key!r}")
            state[name] = value
        with torch.no_grad():
            missing = self.model.load_state_dict(state, strict=False).missing_keys
        log.debug("update_weights: %d tensors loaded, %d left unchanged", len(state), len(missing))
