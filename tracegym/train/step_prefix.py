"""A prompt prefix shared by every micro-batch of one step, run once for all of them.

Every row an env renders starts with the same system prompt and tool schemas (288 of the ~500 tokens
of a 3-call calculator trace). ``forward_logits`` already runs a micro-batch's common prefix once;
with several micro-batches a step still ran it once per micro-batch, forward and backward. Here it
runs once per step:

1. ``step_prefix(model, sources)`` finds the prefix every row of every source shares (real tokens,
   before the first column that needs a logit), runs it at batch 1 and keeps each layer's keys and
   values as float32 leaf tensors ``[1, H_kv, P, D]`` (detached from the prefix's graph, which it keeps);
2. each micro-batch's forward starts from those leaves (``cache(rows)``: a ``DynamicCache`` holding
   them expanded to its rows), runs whatever more its own rows share at batch 1, then its suffixes;
   its ``backward`` adds the gradient of its loss w.r.t. the prefix states into the leaves' ``.grad``
   (float32, so micro-batches sum without bfloat16 rounding);
3. ``backward()`` after the last micro-batch sends the summed gradient through the prefix's graph once.

Exact: a causal prefix never sees what follows it, and the chain rule is linear, so the weight
gradient is the sum of what each micro-batch's own prefix pass would have given (float rounding
aside: other matmul shapes). The weights must not change between ``step_prefix`` and the last
micro-batch (one optimizer step's gradient accumulation, or scoring without gradients).

Not in train mode (gradient checkpointing drops the cache; dropout would draw one mask for all rows)
and only for models whose cache is plain full attention (``DynamicLayer``): elsewhere ``step_prefix``
returns None and every micro-batch runs as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from tracegym.train.precision import training_forward_context

MIN_SHARED_PREFIX = 16  # tokens: a shorter common prefix is not worth a separate forward pass


def plain_cache_layers(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a plain full-attention ``DynamicLayer`` (rows can be
    repeated and extended exactly; a sliding window or a linear-attention state cannot)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def common_prefix_length(sources: Sequence[tuple[Tensor, Tensor, int]]) -> int:
    """Tokens at the start that every row of every ``(input_ids [B, L], attention_mask [B, L],
    first_column)`` source holds alike (real tokens, not padding), at most each source's
    ``first_column`` (no logit is needed inside the prefix) and one short of its shortest row.
    0 when below ``MIN_SHARED_PREFIX`` or with fewer than two rows in all."""
    sources = [s for s in sources if s[0].shape[0] > 0]
    if sum(int(ids.shape[0]) for ids, _, _ in sources) < 2:
        return 0
    limit = min(min(first, int(mask.sum(-1).min()) - 1) for ids, mask, first in sources)
    if limit < MIN_SHARED_PREFIX:
        return 0
    reference = sources[0][0][:1, :limit]  # [1, limit]
    same = torch.ones(limit, dtype=torch.bool)
    for ids, mask, _ in sources:
        same &= ((ids[:, :limit] == reference.to(ids.device)).all(0) & (mask[:, :limit] == 1).all(0)).cpu()
    differs = (~same).nonzero()
    length = int(differs[0]) if differs.numel() else limit
    return length if length >= MIN_SHARED_PREFIX else 0


class StepPrefix:
    """The keys and values of a prefix every row of a step starts with (module doc).

    ``ids``: the prefix's token ids [P]; ``keys`` / ``values``: per layer, float32 leaves
    [1, H_kv, P, D] (requiring grad when built with grad enabled); ``dtype``: the dtype the model
    produced them in, which each micro-batch's cache gets back."""

    def __init__(self, ids: Tensor, keys: list[Tensor], values: list[Tensor], dtype: torch.dtype,
                 graph: list[Tensor] | None) -> None:
        self.ids = ids
        self.keys = keys
        self.values = values
        self.dtype = dtype
        self._graph = graph  # the prefix's own key/value tensors, still attached to its forward graph

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])

    def covers(self, input_ids: Tensor, attention_mask: Tensor, first_column: int) -> bool:
        """Whether every row of this micro-batch starts with the prefix as real tokens, and needs no
        logit inside it."""
        size = self.length
        if first_column < size or input_ids.shape[1] <= size:
            return False
        head = input_ids[:, :size]
        return bool((head == self.ids.to(head.device)).all() and (attention_mask[:, :size] == 1).all())

    def cache(self, model: Any, rows: int) -> Any:
        """A fresh ``DynamicCache`` holding the prefix for ``rows`` rows (``expand``: the micro-batch's
        backward sums its rows' gradients into the leaves)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=getattr(model, "config", None))
        for index, (keys, values) in enumerate(zip(self.keys, self.values)):
            cache.layers[index].update(keys.to(self.dtype).expand(rows, -1, -1, -1),
                                       values.to(self.dtype).expand(rows, -1, -1, -1))
        return cache

    def backward(self) -> None:
        """Send the gradients the micro-batches left on the leaves through the prefix's forward graph
        once (a no-op without grad or when no micro-batch used the prefix)."""
        if self._graph is None:
            return
        leaves = self.keys + self.values
        pairs = [(tensor, leaf.grad.to(tensor.dtype)) for tensor, leaf in zip(self._graph, leaves) if leaf.grad is not None]
        self._graph = None  # the graph is freed by the backward (or here, if nothing used it)
        if pairs:
            torch.autograd.backward([tensor for tensor, _ in pairs], [grad for _, grad in pairs])
        for leaf in leaves:
            leaf.grad = None


def step_prefix(model: Any, sources: Sequence[tuple[Tensor, Tensor, int]]) -> StepPrefix | None:
    """Run the prefix every row of ``sources`` (``(input_ids [B, L], attention_mask [B, L],
    first_column)``, e.g. a step's whole batch and its replay batch) shares, once, at batch 1, with
    gradients when grad is enabled. None when there is no such prefix of ``MIN_SHARED_PREFIX``
    tokens, in train mode, or for a model whose cache is not plain full attention."""
    if getattr(model, "training", False):
        return None
    length = common_prefix_length(sources)
    if not length:
        return None
    from transformers import DynamicCache

    device = next(iter(model.parameters())).device
    ids = sources[0][0][0, :length].to(device)  # [P]
    cache = DynamicCache(config=getattr(model, "config", None))
    with training_forward_context(model, device):
        model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], cache=cache, use_cache=True,
              logits_to_keep=1)
    if not plain_cache_layers(cache):
        return None
    grad = torch.is_grad_enabled()
    keys = [layer.keys.detach().float().requires_grad_(grad) for layer in cache.layers]  # [1, H_kv, P, D] each
    values = [layer.values.detach().float().requires_grad_(grad) for layer in cache.layers]
    graph = [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers] if grad else None
    return StepPrefix(ids, keys, values, cache.layers[0].keys.dtype, graph)


__all__ = ["MIN_SHARED_PREFIX", "StepPrefix", "common_prefix_length", "plain_cache_layers", "step_prefix"]
