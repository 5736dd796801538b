"""Continuous batching for the rollout runner over the hf engine: rows join and leave one running batch.

``HFEngine.generate`` decodes one call to its end. The rollout runner used to put every waiting
episode into one call, so each turn waited for its slowest row, the batch shrank as rows finished,
and an episode whose turn ended early sat idle until the call returned. Here one running batch
lives for the whole rollout (``ContinuousDecoder``; the runner calls its ``step`` between env steps):

- an episode's request (``submit``: its prompt token ids, its token budget, its seed) waits in a
  queue; at a step boundary the queued requests are *admitted* together: their prompts are
  prefilled (the engine's turn store gives each episode's previous turn, so only the tool result and
  the generation prompt are computed; identical prompts once) and their rows join the batch;
- every decode step samples one token for every row (each row with its own generator, seeded per
  request, so a row's tokens do not depend on which rows it shared the batch with), drops the rows
  that finished (their keys and values go to the turn store for the episode's next turn, their
  ``Generation`` back to the episode at once) and runs one forward pass over the rest.

The cache (:class:`SlotKVCache`) keeps each row in a slot of preallocated buffers, its own tokens at
columns ``0 .. len - 1`` (left-aligned). A decode step writes each row's new key at its own column,
so rows of any lengths share a step and a joining row never moves the others (the per-call engine's
layout right-aligns rows, which a joining longer row would shift). The attention reads the buffers'
first ``max(len) + 1`` columns with a 4D mask ``column <= len_b`` per row; columns a row does not
own hold zeros (the buffers start zeroed, and the pages a leaving row wrote are handed back to the
system, reading as zeros again) or keys of an earlier row of that slot, always finite, so the
masked-out products are exact zeros. Rows that leave
move into the freed slots (the kept rows in the lowest ones stay put). The batch's shared prompt prefix (system prompt, tool schemas)
is a ``SharedPrefix`` held once, as in the per-call engine: it is chosen when a batch starts (the
queued prompts' common start), and every later row attends to the part of it its own prompt starts
with (``SharedPrefix.row_lengths``; the rest of its prompt is its own), so any request can join.

Admission costs a prefill forward pass; admitting each request alone would add one per step. Queued
requests are admitted when they are at least ``admit_fraction`` of the rows there would be, when the
oldest has waited ``max_wait_steps`` decode steps, or when nothing is decoding.

Determinism: which rows share a step changes the shapes of the matrix products, so only float
rounding depends on the schedule (tokens and log-probs equal those of each request decoded alone
with the same seed up to ~1e-5, tested). The rollout runner makes the schedule reproducible: after
rows were delivered it lets every live episode queue its next turn (or end) before the next step,
waiting at most ``batch_wait_s`` (``tracegym.rollout``), so with envs that answer within that time
the same run admits the same requests at the same steps.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tracegym.engines.sampling import sample_tokens, sampling_logprobs, validate_params
from tracegym.engines.kv_buffers import KVBufferCache
from tracegym.engines.shared_prefix import SharedPrefix, supports_shared_prefix
from tracegym.types import FinishReason, Generation, SamplingParams

if TYPE_CHECKING:
    from tracegym.engines.hf import HFEngine

log = logging.getLogger(__name__)

__all__ = ["ContinuousDecoder", "SlotKVCache", "SlotKVLayer", "DecodeRequest"]

DoneCallback = Callable[["Generation | None", "BaseException | None"], None]


RESERVED_COLUMNS = 2048
"""Columns a CPU slot buffer holds from the start (address space only until rows touch them)."""


def _untouched_zeros(shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap | None]:
    """Zeros of ``like``'s dtype and device, and the memory map behind them on the CPU.

    On the CPU the buffer is an anonymous memory map: the system hands out a page when it is first
    written (reading an untouched page maps the shared zero page), so reserved columns beyond what
    rows wrote cost address space only (a buffer of ``torch.zeros`` would be resident in full);
    :func:`_release` hands written pages back, and unmapping returns the rest when freed."""
    if like.device.type != "cpu":
        return like.new_zeros(shape), None
    count = math.prod(shape)
    # private: a shared anonymous map (mmap's default) is backed by shared memory, whose pages a read
    # allocates and MADV_DONTNEED does not free
    region = mmap.mmap(-1, max(count * like.element_size(), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=like.dtype, count=count).view(shape), region


def _release(region: mmap.mmap | None, start: int, stop: int) -> None:
    """Hand the whole pages inside bytes ``start .. stop`` of ``region`` back to the system; they
    read as zeros afterwards (``MADV_DONTNEED`` on a private anonymous map), still finite."""
    if region is None:
        return
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # the first whole page inside the range
    last = stop // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        region.madvise(mmap.MADV_DONTNEED, first, last - first)


class SlotKVLayer(DynamicLayer):
    """One layer of a :class:`SlotKVCache`: buffers ``[R, Hkv, C, D]``, row ``b`` in slot ``b`` with its
    own tokens at columns ``0 .. lens[b] - 1``; ``keys`` / ``values`` are the views
    ``buffer[:B, :, :length]`` (``length = max(lens)``)."""

    plain_full_attention = True  # the engine's turn store may read it (HFEngine._plain_layers)

    def __init__(self, owner: SlotKVCache):
        super().__init__()
        self.owner = owner
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._regions: tuple[mmap.mmap | None, ...] = ()  # the memory maps behind _k and _v (CPU)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, columns) the buffers hold."""
        return (0, 0) if self._k is None else (self._k.shape[0], self._k.shape[2])

    def ensure(self, like: torch.Tensor, rows: int, cols: int) -> None:
        """Buffers of at least ``rows`` x ``cols`` (``like``: ``[*, Hkv, *, D]``); growing keeps the
        filled part. Columns start at ``RESERVED_COLUMNS`` and double, so decode reallocates rarely."""
        have_rows, have_cols = self.capacity
        if have_rows >= rows and have_cols >= cols:
            return
        new_rows = max(rows, have_rows)
        # untouched columns cost address space only: reserve generously, so growing (a copy of every
        # row, old and new buffers alive together) is rare
        reserved = RESERVED_COLUMNS if like.device.type == "cpu" else 0  # an accelerator allocates it all
        new_cols = max(cols, 2 * have_cols if have_cols < cols else have_cols, reserved)
        new_cols = -(-new_cols // 64) * 64
        fresh, regions = [], []
        for old in (self._k, self._v):
            buffer, region = _untouched_zeros((new_rows, like.shape[-3], new_cols, like.shape[-1]), like)  # [R, Hkv, C, D]
            if old is not None and self.owner.rows:
                buffer[: self.owner.rows, :, : self.owner.length] = old[: self.owner.rows, :, : self.owner.length]
            fresh.append(buffer)
            regions.append(region)
        self._k, self._v = fresh
        self._regions = tuple(regions)
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        self.refresh()

    def refresh(self) -> None:
        """Re-slice ``keys`` / ``values`` after the rows or the length changed."""
        if self._k is None or self._v is None:
            return
        self.keys = self._k[: self.owner.rows, :, : self.owner.length]  # [B, Hkv, length, D]
        self.values = self._v[: self.owner.rows, :, : self.owner.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: ``key_states`` / ``value_states`` ``[B, Hkv, 1, D]``, row ``b``'s written at
        column ``lens[b]``; returns the views of the first ``length + 1`` columns."""
        owner = self.owner
        rows, length = owner.rows, owner.length
        if key_states.shape[0] != rows or key_states.shape[2] != 1:
            raise ValueError(f"a slot cache takes one new token per row ({rows} rows), got {tuple(key_states.shape)}")
        self.ensure(key_states, rows, length + 1)
        assert self._k is not None and self._v is not None
        self._k[owner.row_ids, :, owner.lens] = key_states[:, :, 0]  # [B, Hkv, D] at (b, :, lens[b])
        self._v[owner.row_ids, :, owner.lens] = value_states[:, :, 0]
        return self._k[:rows, :, : length + 1], self._v[:rows, :, : length + 1]

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def write_row(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Row ``slot``'s own positions (``[Hkv, n, D]`` each) at columns ``0 .. n - 1``."""
        assert self._k is not None and self._v is not None
        n = keys.shape[1]
        self._k[slot, :, :n] = keys
        self._v[slot, :, :n] = values

    def move_row(self, source: int, target: int, length: int) -> None:
        """Row ``source``'s first ``length`` columns (its own tokens) into slot ``target``; the target's
        columns after them (an earlier row's keys) are released."""
        assert self._k is not None and self._v is not None
        self._k[target, :, :length] = self._k[source, :, :length]
        self._v[target, :, :length] = self._v[source, :, :length]
        self.release(target, target + 1, first_column=length)

    def release(self, first_slot: int, stop_slot: int, first_column: int = 0) -> None:
        """Give back the memory of slots ``first_slot .. stop_slot - 1`` from column ``first_column`` on.

        A slot's pages stay resident once written, so without this every slot would hold as many
        columns as the longest row it ever served (measured: 1.85 GB of touched slots for 0.62 GB
        of live rows in an eval at 64 rows). Per slot and head the columns are one contiguous run
        (``[R, Hkv, C, D]``), so a slot's tail is ``Hkv`` ranges, and whole slots are one range."""
        if self._k is None or not self._regions or stop_slot <= first_slot:
            return
        _, heads, cols, dim = self._k.shape
        column_bytes = dim * self._k.element_size()
        for region in self._regions:
            if first_column == 0:
                _release(region, first_slot * heads * cols * column_bytes, stop_slot * heads * cols * column_bytes)
                continue
            for slot in range(first_slot, stop_slot):
                for head in range(heads):
                    run = (slot * heads + head) * cols * column_bytes  # where this slot's head starts
                    _release(region, run + first_column * column_bytes, run + cols * column_bytes)


class SlotKVCache(DynamicCache):
    """The running batch's cache (see the module docstring): ``rows`` rows, ``lens`` [B] own tokens
    per row, ``length`` = max(lens). Invariant: columns ``0 .. length - 1`` of every row hold finite
    values (its own keys, then zeros or keys it no longer attends to)."""

    def __init__(self, config: Any, max_rows: int):
        super().__init__(config=config)
        bad = [type(layer).__name__ for layer in self.layers if type(layer) is not DynamicLayer]
        if bad:
            raise ValueError(f"continuous batching needs full-attention cache layers; this model has {bad[0]}")
        self.max_rows = max_rows
        self.layers = [SlotKVLayer(self) for _ in self.layers]
        self.layer_class_to_replicate = None
        self.rows = 0
        self.length = 0
        self.lens = torch.zeros(0, dtype=torch.long)  # [B]
        self.row_ids = torch.zeros(0, dtype=torch.long)  # [B]: arange(B), for the scatter in update

    def _sync(self) -> None:
        self.length = int(self.lens.max()) if self.rows else 0
        self.row_ids = torch.arange(self.rows, device=self.lens.device)
        for layer in self.layers:
            layer.refresh()

    def add_rows(self, sources: list[list[tuple[torch.Tensor, torch.Tensor]]], cols_needed: int) -> None:
        """Append rows: ``sources[i][layer]`` = (keys, values) ``[Hkv, n_i, D]`` of new row i's own
        positions. ``cols_needed``: columns the buffers should hold (own lengths + decode room)."""
        if not sources:
            return
        rows = self.rows + len(sources)
        lengths = [src[0][0].shape[1] for src in sources]
        new_length = max([self.length, *lengths])
        for layer_idx, layer in enumerate(self.layers):
            like = sources[0][layer_idx][0]
            layer.ensure(like[None], self.max_rows if layer.capacity[0] == 0 else rows, max(cols_needed, new_length))
            for i, src in enumerate(sources):
                keys, values = src[layer_idx]
                layer.write_row(self.rows + i, keys, values)
        self.lens = torch.cat([self.lens, torch.tensor(lengths, dtype=torch.long, device=self.lens.device)])
        self.rows = rows
        self._sync()

    def keep(self, kept: list[int]) -> list[int]:
        """Keep rows ``kept`` (increasing) in slots ``0 .. len(kept) - 1``: a kept row already there
        stays, the others move into the freed slots (at most one copy per row that left). Returns
        the new order: entry ``i`` is the old slot of the row now in slot ``i``."""
        size = len(kept)
        staying = [row for row in kept if row < size]
        holes = sorted(set(range(size)) - set(staying))
        movers = [row for row in kept if row >= size]
        order = list(range(size))
        for target, source in zip(holes, movers):
            for layer in self.layers:
                layer.move_row(source, target, int(self.lens[source]))
            order[target] = source
        for layer in self.layers:  # the slots now free (rows that left, rows that moved down)
            layer.release(size, self.rows)
        self.lens = self.lens[torch.tensor(order, dtype=torch.long)] if order else self.lens[:0]
        self.rows = size
        self._sync()
        return order

    def advance(self) -> None:
        """After a decode step: every row holds one more token."""
        self.lens = self.lens + 1
        self.length += 1
        for layer in self.layers:
            layer.refresh()

    def decode_mask(self) -> torch.Tensor:
        """[B, 1, 1, length + 1] bool: row b attends to its columns ``0 .. lens[b]`` (the new token's included)."""
        columns = torch.arange(self.length + 1, device=self.lens.device)
        return (columns[None, :] <= self.lens[:, None])[:, None, None, :]

    def filled_mask(self) -> torch.Tensor:
        """[B, length] long: 1 where a row holds its own token (the engine's turn store reads it)."""
        columns = torch.arange(self.length, device=self.lens.device)
        return (columns[None, :] < self.lens[:, None]).long()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


PASS_COST_TOKENS = 32
"""What one more forward pass costs, in padded tokens: measured on 2 CPU cores with SmolLM2, a pass
takes about 0.08 s plus 2.3 ms per padded token, so a pass is worth about 35 tokens of padding."""


def _length_buckets(lengths: list[int]) -> list[list[int]]:
    """Indices of ``lengths`` (new tokens per prompt) cut into forward passes of similar lengths.

    One pass pads every row to the longest (39% of a first turn's computed tokens were padding,
    measured); a pass per row pays the fixed cost many times. Rows sorted longest first, the
    partition into consecutive runs minimises ``sum(PASS_COST_TOKENS + rows * longest)`` (an exact
    dynamic program, O(n^2) for n rows)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    sorted_lengths = [lengths[i] for i in order]
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[i]: cost of the first i rows
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i):  # the last pass holds sorted rows j .. i-1, padded to row j's length
            cost = best[j] + PASS_COST_TOKENS + (i - j) * sorted_lengths[j]
            if cost < best[i]:
                best[i], cut[i] = cost, j
    buckets: list[list[int]] = []
    i = n
    while i > 0:
        buckets.append(order[cut[i]:i])
        i = cut[i]
    return buckets[::-1]


@dataclass
class DecodeRequest:
    """One episode turn: ``prompt`` token ids, at most ``max_tokens`` new tokens, sampled with its own
    generator (seeded with ``seed``; None: random). ``done(generation, error)`` is called once, inside
    the decoder's ``step`` (``(None, None)`` for a cancelled request)."""

    prompt: list[int]
    max_tokens: int
    seed: int | None
    done: DoneCallback
    cancelled: bool = False
    waited: int = 0  # decode steps spent queued

    def cancel(self) -> None:
        """The episode stopped waiting (timeout): the row is dropped at the next step."""
        self.cancelled = True


@dataclass
class _Row:
    request: DecodeRequest
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class ContinuousDecoder:
    """One running batch over ``engine``'s model for a whole rollout run (see the module docstring).

    Synchronous and single-threaded: ``submit`` queues a request, ``step`` admits what is due and
    decodes one token for every row; ``done`` callbacks run inside ``step``. The rollout runner
    calls ``step`` from its event loop, between the episodes' env steps (``tracegym.rollout``):
    the model runs on the thread that loaded it (measured on 2 CPU cores: a decode step of SmolLM2
    at 19 rows took 0.14 s on the main thread and 0.20 s from a worker thread; a plain large matmul
    showed no such difference, so the cost is in the many small operations of a decode step).
    """

    def __init__(self, engine: HFEngine, params: SamplingParams, *, admit_fraction: float = 0.25,
                 max_wait_steps: int = 8):
        validate_params(params)
        if params.n != 1:
            raise ValueError("continuous batching takes one row per request (n=1)")
        if not 0.0 <= admit_fraction <= 1.0:
            raise ValueError(f"admit_fraction must be in [0, 1], got {admit_fraction}")
        self.engine = engine
        self.params = params
        self.admit_fraction = admit_fraction
        self.max_wait_steps = max_wait_steps
        self.stop_ids = set(engine.stop_token_ids) | set(params.stop_token_ids)
        self.queue: list[DecodeRequest] = []
        # the running batch
        self.rows: list[_Row] = []
        self.cache: SlotKVCache | None = None
        self.prefix: SharedPrefix | None = None
        self.logits: torch.Tensor | None = None  # [B, V] each row's next-token logits
        self.positions = torch.zeros(0, dtype=torch.long)  # [B] each row's next position
        self.prefix_lens = torch.zeros(0, dtype=torch.long)  # [B] the prefix positions each row attends to
        # counters (stats, benchmarks and tests read them)
        self.admissions = 0  # prefill passes that admitted rows
        self.admitted_rows = 0
        self.decode_steps = 0
        self.row_steps = 0  # sum over decode steps of the rows decoded
        self.delivered = 0  # requests answered (a generation or an error)
        self.prefill_s = 0.0  # admissions (prefill passes and copies into the slots)
        self.decode_s = 0.0  # sampling, delivery, compaction and the decode forward passes
        self.forward_s = 0.0  # of which the decode forward passes

    def submit(self, prompt: list[int], max_tokens: int, seed: int | None, done: DoneCallback) -> DecodeRequest:
        """Queue one request; it joins the batch at a later ``step``."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        request = DecodeRequest([int(t) for t in prompt], int(max_tokens), seed, done)
        self.queue.append(request)
        return request

    @property
    def busy(self) -> bool:
        """Rows decoding or requests queued."""
        return bool(self.rows or self.queue)

    @property
    def mean_batch_size(self) -> float:
        """Rows per decode step, averaged over the run."""
        return self.row_steps / self.decode_steps if self.decode_steps else 0.0

    def step(self) -> None:
        """Admit what is due, then sample one token per row, deliver finished rows and run one forward."""
        model = self.engine.model
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                self._admit()
                if self.rows:
                    self._decode()
        except Exception as exc:  # noqa: BLE001 - the episodes in the batch fail, the run goes on
            log.error("continuous decoding failed for a batch of %d rows: %s", len(self.rows), exc, exc_info=True)
            self._fail_batch(exc)
        finally:
            if was_training:
                model.train()

    def close(self, error: BaseException | None = None) -> None:
        """End every request still queued or decoding with ``error`` (the run is over)."""
        self.fail_all(error or RuntimeError("the rollout ended before this request was served"))

    def _admit(self) -> None:
        self.queue = [r for r in self.queue if not self._dropped(r)]
        queue = self.queue
        room = self.engine.max_batch_size - len(self.rows)
        if not queue or room <= 0:
            return
        if self.rows and not (len(queue) >= self.admit_fraction * (len(self.rows) + len(queue))
                              or queue[0].waited >= self.max_wait_steps):
            return
        if not self.rows:
            self.prefix = None  # a new batch: its own shared prefix
        chosen = queue[:room]
        self.queue = queue[len(chosen):]
        t0 = time.perf_counter()
        rows_before = len(self.rows)
        try:
            self._prefill(chosen)
        except Exception as exc:  # noqa: BLE001 - these requests fail; the running batch goes on
            log.error("continuous decoding: admitting %d requests failed: %s", len(chosen), exc, exc_info=True)
            self._undo_admission(rows_before)  # a pass that joined before the failing one leaves again
            for request in chosen:
                self._deliver(request, None, exc)
        self.prefill_s += time.perf_counter() - t0

    def _prefill(self, requests: list[DecodeRequest]) -> None:
        """Prefill ``requests``' prompts (identical ones once) and add their rows to the batch."""
        engine = self.engine
        first_seen: dict[tuple[int, ...], int] = {}
        source = [first_seen.setdefault(tuple(r.prompt), len(first_seen)) for r in requests]
        distinct = [list(p) for p in first_seen]
        config = getattr(engine.model, "config", None)
        probe = KVBufferCache(config)  # the engine's helpers check its layer types
        hits = engine._take_turns(distinct, probe)
        computed_before = engine.prefill_tokens
        if not self.rows and engine.prefix_cache and engine.share_prefix_kv and supports_shared_prefix(engine.model):
            # a new batch: its queued prompts' common start once (from the turn store when an episode's
            # kept turn covers it); later rows attend to the part of it their prompt starts with
            share = engine._shared_prefix_len(distinct, probe, repeated=True)
            if share:
                self.prefix, from_store = engine._build_prefix(distinct[0][:share], hits)
                engine.prefill_tokens += share - from_store
                engine.turn_tokens_reused += from_store * len(distinct)
        # each prompt's part of the prefix (at least one token of its own left), what the turn store
        # holds of it beyond that, and the tokens it computes
        firsts = [0 if self.prefix is None else min(engine._common_prefix(tuple(p), self.prefix.tokens), len(p) - 1)
                  for p in distinct]
        kept = [0 if hit is None else max(len(hit.tokens) - f, 0) for hit, f in zip(hits, firsts)]
        new = [len(p) - f - k for p, f, k in zip(distinct, firsts, kept)]
        if self.cache is None or not self.rows:
            self.cache = SlotKVCache(config, engine.max_batch_size)
        cols = max(len(distinct[i]) - firsts[i] + r.max_tokens for r, i in zip(requests, source))
        users: dict[int, list[DecodeRequest]] = {}  # distinct prompt -> its requests
        for request, i in zip(requests, source):
            users.setdefault(i, []).append(request)
        for bucket in _length_buckets(new):
            prompts, bucket_hits = [distinct[i] for i in bucket], [hits[i] for i in bucket]
            starts = [firsts[i] for i in bucket]
            tmp = KVBufferCache(config)
            own = engine._load_turns(bucket_hits, starts, tmp)  # each row's kept turn after its prefix part
            suffixes = [p[f + o:] for p, f, o in zip(prompts, starts, own)]
            prefix = None if self.prefix is None else self.prefix.for_rows(torch.tensor(starts, dtype=torch.long))
            logits, mask, next_pos = engine._prefill_suffixes(
                suffixes, engine._right_aligned_mask(own), [f + o for f, o in zip(starts, own)], tmp, None, prefix)
            engine.turn_tokens_reused += sum(own)
            engine.prefill_tokens += sum(len(x) for x in suffixes)
            # this pass's rows join the batch now, so its prefill cache is freed before the next pass
            sources, rows = [], []
            for b, i in enumerate(bucket):
                where = mask[b].nonzero().flatten()  # the row's own positions (after the prefix)
                if where.numel() != len(distinct[i]) - firsts[i]:
                    raise RuntimeError(f"admitted row holds {where.numel()} positions for {len(distinct[i]) - firsts[i]} tokens")
                own_kv = [(layer.keys[b].index_select(1, where), layer.values[b].index_select(1, where))
                          for layer in tmp.layers]  # per layer [Hkv, n, D]
                sources += [own_kv] * len(users[i])
                rows += [b] * len(users[i])
            del tmp
            self.cache.add_rows(sources, cols)
            del sources
            index = torch.tensor(rows, dtype=torch.long)
            self.logits = logits[index] if self.logits is None or len(self.positions) == 0 else torch.cat(
                [self.logits, logits[index]])
            self.positions = torch.cat([self.positions, next_pos[index, 0].cpu()])
            self.prefix_lens = torch.cat([self.prefix_lens, torch.tensor([starts[b] for b in rows], dtype=torch.long)])
            for i in bucket:
                for request in users[i]:
                    generator = torch.Generator(device="cpu")
                    if request.seed is not None:
                        generator.manual_seed(int(request.seed))
                    else:
                        generator.seed()
                    self.rows.append(_Row(request, generator))
        engine.prefix_tokens_reused += sum(len(r.prompt) for r in requests) - (engine.prefill_tokens - computed_before)
        self.admissions += 1
        self.admitted_rows += len(requests)

    def _decode(self) -> None:
        """Sample every row's next token, deliver finished rows, one forward pass for the rest."""
        engine, params = self.engine, self.params
        assert self.logits is not None and self.cache is not None
        t0 = time.perf_counter()
        lp_all = sampling_logprobs(self.logits, params.temperature, params.top_p)  # [B, V]
        if params.temperature <= 0.0:
            chosen = torch.argmax(self.logits, dim=-1)  # [B]
        else:
            # one generator per row: a row's draws do not depend on the others in the batch
            uniforms = torch.cat([torch.rand(1, generator=row.generator, dtype=torch.float64) for row in self.rows])
            chosen = sample_tokens(lp_all.exp().cpu(), uniforms).to(self.logits.device)
        chosen_lp = lp_all.gather(-1, chosen[:, None]).squeeze(-1)  # [B]
        keep: list[int] = []
        finished: list[tuple[int, FinishReason]] = []
        for b, (row, tok, lp) in enumerate(zip(self.rows, chosen.tolist(), chosen_lp.tolist())):
            if row.request.cancelled:
                finished.append((b, "abort"))
                continue
            row.tokens.append(tok)
            row.logprobs.append(lp)
            if tok in self.stop_ids or (params.stop and engine._hits_stop_string(row.tokens, params.stop)):
                finished.append((b, "stop"))
            elif len(row.tokens) >= row.request.max_tokens:
                finished.append((b, "length"))
            else:
                keep.append(b)
        if finished:
            done = [(b, reason) for b, reason in finished if reason != "abort"]
            if engine.turn_cache_bytes and done:
                # kept for the episode's next turn: the part of the prefix the row saw, then its own slot
                by_prefix: dict[int, list[tuple[int, list[int]]]] = {}
                for b, _ in done:
                    by_prefix.setdefault(int(self.prefix_lens[b]), []).append(
                        (b, self.rows[b].request.prompt + self.rows[b].tokens[:-1]))
                mask = self.cache.filled_mask()
                for first, rows in by_prefix.items():
                    prefix = self.prefix.truncated(first) if self.prefix is not None and first else None
                    engine._remember(self.cache, mask, rows, None, prefix)
            for b, reason in finished:
                row = self.rows[b]
                generation = None if reason == "abort" else engine._make_generation(row.tokens, row.logprobs, reason)
                self._deliver(row.request, generation, None)
        if len(keep) < len(self.rows):
            order = self.cache.keep(keep)  # the rows' new slots
            index = torch.tensor(order, dtype=torch.long)
            self.rows = [self.rows[b] for b in order]
            self.positions = self.positions[index]
            self.prefix_lens = self.prefix_lens[index]
            chosen = chosen[index.to(chosen.device)]
        if self.rows:
            device = engine.device
            t_forward = time.perf_counter()
            prefix = None if self.prefix is None else self.prefix.for_rows(self.prefix_lens)
            self.logits = engine._forward(
                None, prefix, input_ids=chosen[:, None], attention_mask=self.cache.decode_mask().to(device),
                position_ids=self.positions[:, None].to(device), cache=self.cache,
            )
            self.forward_s += time.perf_counter() - t_forward
            self.cache.advance()
            self.positions = self.positions + 1
            self.decode_steps += 1
            self.row_steps += len(self.rows)
        else:
            self.logits = None
        for request in self.queue:
            request.waited += 1
        self.decode_s += time.perf_counter() - t0

    # -- delivery and failure -------------------------------------------------------------------
    def _dropped(self, request: DecodeRequest) -> bool:
        if request.cancelled:
            self._deliver(request, None, None)
        return request.cancelled

    def _deliver(self, request: DecodeRequest, generation: Generation | None, error: BaseException | None) -> None:
        self.delivered += 1
        try:
            request.done(generation, error)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the batch
            log.exception("continuous decoding: a done callback failed")

    def _undo_admission(self, rows_before: int) -> None:
        """Take out the rows a failed admission added: each prefill pass appends its rows (cache
        slots, logits, positions, then rows) at the end, so the batch before it is the first
        ``rows_before`` of each, whichever step failed."""
        if self.cache is not None and self.cache.rows > rows_before:
            self.cache.keep(list(range(rows_before)))
        self.rows = self.rows[:rows_before]
        self.positions = self.positions[:rows_before]
        self.prefix_lens = self.prefix_lens[:rows_before]
        if self.logits is not None:
            self.logits = self.logits[:rows_before] if rows_before else None

    def _fail_batch(self, exc: BaseException) -> None:
        rows, self.rows = self.rows, []
        self.cache, self.logits, self.prefix = None, None, None
        self.positions = self.positions[:0]
        self.prefix_lens = self.prefix_lens[:0]
        for row in rows:
            self._deliver(row.request, None, exc)

    def fail_all(self, exc: BaseException) -> None:
        """End every request decoding or queued with ``exc``."""
        self._fail_batch(exc)
        queue, self.queue = self.queue, []
        for request in queue:
            self._deliver(request, None, exc)
