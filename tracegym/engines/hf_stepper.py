"""Continuous batching over a Hugging Face causal LM: requests join and leave a running batch.

``HFEngine.generate`` runs one call to completion: a request that arrives meanwhile waits for the
whole call. A server needs the opposite: every active request advances by one token per step, a
new request joins at the next step, a finished one leaves at once. ``HFStepper`` does that:

- ``submit(StepRequest)`` queues a request (``n`` rows sharing one prompt) from any thread;
- a worker thread (``start()``) loops: admit queued requests (each prompt is prefilled alone, batch
  1, unpadded, its cache rows repeated ``n`` times and merged into the running cache), sample one
  token for every active row, drop the rows that finished, run one forward pass over the rest.

Merging: every row's keys and values live in one ``DynamicCache``; a row's cache is left-padded with
zeros to the common length and the attention mask marks those slots as padding. Position ids are
explicit per row, so a row sees exactly the positions it would see alone (as in ``HFEngine``'s
left padding). Columns that no remaining row attends to are trimmed when rows leave. This needs
plain full-attention cache layers (``DynamicLayer``): sliding-window or recurrent layers are
refused when the stepper is built.

Sampling is the engine's: ``sampling_logprobs`` (temperature, top-p) on the row's logits (plus an
optional logit bias), greedy argmax at temperature 0, ``sample_tokens`` with one generator per
request (seeded from ``seed``), over the request's rows together. Alone in the batch, a request gets
the tokens and log-probs ``HFEngine.generate`` gives for the same prompt and parameters; batched
with others only float rounding differs (padding changes the shapes of the matrix products).

Callbacks run on the worker thread and must be quick: ``on_token(row, token, logprob, top)`` may
return ``True`` to end the row (finish reason ``stop``: stop strings are checked there);
``on_finish(row, reason)`` is called once per row with ``stop``, ``length`` or ``abort``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from tracegym.engines.sampling import sample_tokens, sampling_logprobs

log = logging.getLogger(__name__)

__all__ = ["HFStepper", "StepRequest", "StepperUnsupported"]

TokenCallback = Callable[[int, int, float, "list[tuple[int, float]] | None"], bool]
FinishCallback = Callable[[int, str], None]


class StepperUnsupported(ValueError):
    """The model's cache layers cannot be merged row-wise (sliding window, recurrent state)."""


@dataclass
class StepRequest:
    """One request: ``n`` rows sampled from ``prompt`` with the same parameters.

    ``top_logprobs``: how many of the most likely tokens (under the sampling distribution) to report
    with every sampled token (0: none). ``logit_bias``: token id -> value added to the logits before
    sampling (the log-probs are those of the biased distribution, the one sampled from).
    """

    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    top_logprobs: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    on_token: TokenCallback | None = None
    on_finish: FinishCallback | None = None
    # set by the stepper / by cancel()
    cancelled: bool = False
    generator: torch.Generator | None = None

    def cancel(self) -> None:
        """Ask the stepper to drop this request's rows (finish reason ``abort``)."""
        self.cancelled = True


@dataclass
class _Row:
    request: StepRequest
    index: int  # sample index within the request
    tokens: list[int] = field(default_factory=list)


class HFStepper:
    """Continuous-batching sampler over ``get_model()`` (see the module docstring).

    Args:
        get_model: returns the model to run (read at every step, so an engine's
            ``update_weights`` is seen between steps).
        max_batch_size: rows decoded together; queued requests wait until their ``n`` rows fit.
        pad_token_id: any id; padded slots are masked out.
    """

    def __init__(self, get_model: Callable[[], Any], *, max_batch_size: int = 16, pad_token_id: int = 0):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.get_model = get_model
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self._check_cache_layers()
        self._pending: deque[StepRequest] = deque()
        self._cond = threading.Condition()
        self._gate = threading.Event()  # cleared while paused
        self._gate.set()
        self._stop = False
        self._thread: threading.Thread | None = None
        # running batch
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, K]
        self._pos: torch.Tensor | None = None  # [B, 1] position of each row's next token
        self._logits: torch.Tensor | None = None  # [B, V] logits for each row's next token
        # counters (tests and /health read them)
        self.steps = 0
        self.forward_calls = 0
        self.max_active_rows = 0
        self.error: BaseException | None = None

    # -- public ----------------------------------------------------------------------------------
    @property
    def active_rows(self) -> int:
        return len(self._rows)

    @property
    def pending_requests(self) -> int:
        with self._cond:
            return len(self._pending)

    @property
    def waiting_requests(self) -> int:
        """Queued requests that would not fit in the batch if it were admitted now (in order)."""
        with self._cond:
            free = self.max_batch_size - len(self._rows)
            waiting = 0
            for request in self._pending:
                if waiting == 0 and request.n <= free:
                    free -= request.n
                else:
                    waiting += 1
            return waiting

    def submit(self, request: StepRequest) -> StepRequest:
        if request.n < 1 or request.n > self.max_batch_size:
            raise ValueError(f"n must be in 1..{self.max_batch_size} (the batch size), got {request.n}")
        if not request.prompt:
            raise ValueError("the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        request.generator = torch.Generator(device="cpu")
        if request.seed is not None:
            request.generator.manual_seed(int(request.seed))
        else:
            request.generator.seed()
        with self._cond:
            self._pending.append(request)
            self._cond.notify_all()
        return request

    def start(self) -> "HFStepper":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="tracegym-stepper")
            self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._gate.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No step runs inside this block (queued requests stay queued): for tests and maintenance."""
        self._gate.clear()
        try:
            yield
        finally:
            self._gate.set()
            with self._cond:
                self._cond.notify_all()

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._pending and not self._rows:
                    self._cond.wait()
                if self._stop:
                    break
            self._gate.wait()
            if self._stop:
                break
            try:
                self.step()
            except BaseException as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
                log.exception("stepper: a step failed")
                self.error = exc
                self._abort_all()
        self._abort_all(include_pending=True)

    def step(self) -> None:
        """Admit what fits, sample one token per active row, drop finished rows, run one forward."""
        model = self.get_model()
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                self._admit(model)
                if self._rows:
                    self._sample_and_advance(model)
        finally:
            if was_training:
                model.train()

    # -- internals -------------------------------------------------------------------------------
    def _check_cache_layers(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        model = self.get_model()
        cache = DynamicCache(config=getattr(model, "config", None))
        bad = [type(layer).__name__ for layer in getattr(cache, "layers", ()) if type(layer) is not DynamicLayer]
        if bad:
            raise StepperUnsupported(
                f"continuous batching needs full-attention cache layers; this model has {bad[0]}"
            )

    def _device(self, model: Any) -> torch.device:
        return next(model.parameters()).device

    def _forward(self, model: Any, **kw: Any) -> torch.Tensor:
        self.forward_calls += 1
        return model(use_cache=True, logits_to_keep=1, **kw).logits[:, -1, :]

    def _admit(self, model: Any) -> None:
        from transformers import DynamicCache

        while True:
            with self._cond:
                while self._pending and self._pending[0].cancelled:
                    request = self._pending.popleft()
                    self._finish_all(request, "abort")
                if not self._pending or len(self._rows) + self._pending[0].n > self.max_batch_size:
                    return
                request = self._pending.popleft()
            device = self._device(model)
            ids = torch.tensor([request.prompt], dtype=torch.long, device=device)
            cache = DynamicCache(config=getattr(model, "config", None))
            logits = self._forward(
                model, input_ids=ids, attention_mask=torch.ones_like(ids),
                position_ids=torch.arange(ids.shape[1], device=device)[None], cache=cache,
            )
            n = request.n
            if n > 1:
                cache.batch_repeat_interleave(n)
                logits = logits.repeat_interleave(n, dim=0)
            mask = torch.ones((n, ids.shape[1]), dtype=torch.long, device=device)
            pos = torch.full((n, 1), ids.shape[1], dtype=torch.long, device=device)
            self._merge(cache, mask, pos, logits)
            self._rows.extend(_Row(request, i) for i in range(n))
            self.max_active_rows = max(self.max_active_rows, len(self._rows))

    def _merge(self, cache: Any, mask: torch.Tensor, pos: torch.Tensor, logits: torch.Tensor) -> None:
        if not self._rows:
            self._cache, self._mask, self._pos, self._logits = cache, mask, pos, logits
            return
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        length = max(old_len, new_len)

        def left_pad(t: torch.Tensor, have: int) -> torch.Tensor:
            if have == length:
                return t
            shape = list(t.shape)
            shape[-2 if t.dim() == 4 else -1] = length - have
            return torch.cat([t.new_zeros(shape), t], dim=-2 if t.dim() == 4 else -1)

        for old_layer, new_layer in zip(self._cache.layers, cache.layers):
            old_layer.keys = torch.cat([left_pad(old_layer.keys, old_len), left_pad(new_layer.keys, new_len)], dim=0)
            old_layer.values = torch.cat([left_pad(old_layer.values, old_len), left_pad(new_layer.values, new_len)], dim=0)
        self._mask = torch.cat([left_pad(self._mask, old_len), left_pad(mask, new_len)], dim=0)
        self._pos = torch.cat([self._pos, pos], dim=0)
        self._logits = torch.cat([self._logits, logits], dim=0)

    def _sample_and_advance(self, model: Any) -> None:
        self.steps += 1
        logits = self._logits
        device = logits.device
        chosen = torch.empty(len(self._rows), dtype=torch.long, device=device)
        keep: list[int] = []
        # rows of one request are contiguous: sample them together with the request's generator
        b = 0
        while b < len(self._rows):
            request = self._rows[b].request
            e = b
            while e < len(self._rows) and self._rows[e].request is request:
                e += 1
            group = logits[b:e]
            if request.logit_bias:
                bias = torch.zeros(group.shape[-1], dtype=torch.float32, device=device)
                for token, value in request.logit_bias.items():
                    bias[token] = value
                group = group.float() + bias
            lp_all = sampling_logprobs(group, request.temperature, request.top_p)
            if request.temperature <= 0.0:
                toks = torch.argmax(group, dim=-1)
            else:
                uniforms = torch.rand(e - b, generator=request.generator, dtype=torch.float64)
                toks = sample_tokens(lp_all.exp().cpu(), uniforms).to(device)
            chosen[b:e] = toks
            tok_lp = lp_all.gather(-1, toks[:, None]).squeeze(-1).tolist()
            tops: list[list[tuple[int, float]] | None] = [None] * (e - b)
            if request.top_logprobs > 0:
                values, indices = torch.topk(lp_all, min(request.top_logprobs, lp_all.shape[-1]), dim=-1)
                tops = [list(zip(i_row, v_row)) for i_row, v_row in zip(indices.tolist(), values.tolist())]
            for k, (tok, lp) in enumerate(zip(toks.tolist(), tok_lp)):
                row = self._rows[b + k]
                if request.cancelled:
                    self._finish_row(row, "abort")
                    continue
                row.tokens.append(tok)
                wants_stop = False
                if request.on_token is not None:
                    try:
                        wants_stop = bool(request.on_token(row.index, tok, lp, tops[k]))
                    except Exception:  # noqa: BLE001 - a consumer's bug ends its row, not the batch
                        log.exception("stepper: on_token failed")
                        request.cancelled = True
                        self._finish_row(row, "abort")
                        continue
                if tok in request.stop_token_ids or wants_stop:
                    self._finish_row(row, "stop")
                elif len(row.tokens) >= request.max_tokens:
                    self._finish_row(row, "length")
                else:
                    keep.append(b + k)
            b = e
        if not keep:
            self._reset_batch()
            return
        if len(keep) < len(self._rows):
            keep_t = torch.tensor(keep, dtype=torch.long, device=device)
            self._cache.batch_select_indices(keep_t)
            self._mask, self._pos, chosen = self._mask[keep_t], self._pos[keep_t], chosen[keep_t]
            self._rows = [self._rows[i] for i in keep]
            self._trim()
        self._mask = torch.cat([self._mask, self._mask.new_ones((len(self._rows), 1))], dim=-1)
        self._logits = self._forward(
            model, input_ids=chosen[:, None], attention_mask=self._mask, position_ids=self._pos,
            cache=self._cache,
        )
        self._pos = self._pos + 1

    def _trim(self) -> None:
        """Drop leading cache columns no remaining row attends to (left padding of departed rows)."""
        used = self._mask.any(dim=0).nonzero()
        first = int(used[0]) if used.numel() else self._mask.shape[1]
        if first == 0:
            return
        for layer in self._cache.layers:
            layer.keys = layer.keys[:, :, first:, :]
            layer.values = layer.values[:, :, first:, :]
        self._mask = self._mask[:, first:]

    def _reset_batch(self) -> None:
        self._rows = []
        self._cache = self._mask = self._pos = self._logits = None

    def _finish_row(self, row: _Row, reason: str) -> None:
        if row.request.on_finish is not None:
            try:
                row.request.on_finish(row.index, reason)
            except Exception:  # noqa: BLE001 - a consumer's bug must not stop the batch
                log.exception("stepper: on_finish failed")

    def _finish_all(self, request: StepRequest, reason: str) -> None:
        for i in range(request.n):
            self._finish_row(_Row(request, i), reason)

    def _abort_all(self, include_pending: bool = False) -> None:
        rows, self._rows = self._rows, []
        self._cache = self._mask = self._pos = self._logits = None
        for row in rows:
            self._finish_row(row, "abort")
        if include_pending:
            with self._cond:
                pending, self._pending = list(self._pending), deque()
            for request in pending:
                self._finish_all(request, "abort")
