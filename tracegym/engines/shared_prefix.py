"""Attention over a prompt prefix held once for a whole batch (the hf engine's shared-prefix KV).

Agent prompts in one batch start with the same system prompt and tool schemas. Replicating that
prefix's keys and values into every batch row costs rows x prefix x (46 KB per token on SmolLM2)
and is read again, row by row, at every decode step. Here the batch's ``DynamicCache`` holds only
each row's own tokens, and the prefix is a :class:`SharedPrefix` (batch 1, per layer ``[Hkv, P, D]``)
passed to the model as the forward keyword ``shared_prefix_kv``; transformers hands unknown forward
keywords down to the attention function, and :func:`shared_prefix_attention_forward` (registered in
``AttentionInterface`` as ``tracegym_shared_prefix``, with sdpa's mask function) attends to
``[prefix ; row's own keys]`` in one softmax: every row sees the whole prefix, its own keys are
masked by the usual 4D mask. The mask, ``cache_position`` and the cache length therefore describe
the own part only; the caller's ``position_ids`` continue from ``P``.

The model's attention implementation is switched to this one only inside :func:`prefix_attention`
(the engine may hold the trainer's model): a call without ``shared_prefix_kv`` that runs meanwhile
(another thread) gets sdpa's mask and sdpa's attention, exactly as before.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch

ATTENTION_NAME = "tracegym_shared_prefix"
PREFIX_KWARG = "shared_prefix_kv"


@dataclass(frozen=True, eq=False)
class SharedPrefix:
    """Keys and values of ``tokens`` computed once (batch 1), attended to by every row of a batch.

    ``keys`` / ``values``: per layer ``[Hkv, P, D]``. Rows, kept turns and later batches may all
    reference one prefix; ``truncated`` gives views, so they share its memory too."""

    tokens: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    row_lengths: torch.Tensor | None = None
    """[B] long: row b attends to the first ``row_lengths[b]`` positions only (None: all of them).
    Continuous batching gives each row the part of the batch's prefix its prompt starts with."""

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> SharedPrefix:
        """The first ``n`` positions (views of the same memory)."""
        if n == len(self) and self.row_lengths is None:
            return self
        return SharedPrefix(self.tokens[:n], tuple(k[:, :n] for k in self.keys), tuple(v[:, :n] for v in self.values))

    def for_rows(self, lengths: torch.Tensor) -> SharedPrefix:
        """This prefix, row ``b`` attending to its first ``lengths[b]`` positions (the same memory)."""
        return SharedPrefix(self.tokens, self.keys, self.values, lengths)

    @property
    def storage_id(self) -> int:
        """Identifies the memory behind this prefix: a prefix and its truncations share it."""
        return self.keys[0].untyped_storage().data_ptr()

    @property
    def storage_nbytes(self) -> int:
        """Bytes this prefix keeps alive (the whole memory it views, not just its ``P`` positions)."""
        return sum(t.untyped_storage().nbytes() for t in (*self.keys, *self.values))


def shared_prefix_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    shared_prefix_kv: SharedPrefix | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` over ``[shared prefix ; key]`` (an ``AttentionInterface`` function).

    query [B, H, q, D]; key / value [B, Hkv, S, D] (the rows' own cached + new tokens);
    attention_mask: sdpa's mask over the own part, bool [B, 1, q, S] (True: attend), or None (causal
    when ``q > 1``, which transformers only returns when ``S == q``; everything when ``q == 1``).
    Returns [B, q, H, D] like sdpa. Without a prefix this is sdpa itself.

    The two score blocks are merged with one max and one sum (the softmax of their concatenation,
    in fp32) rather than concatenated, in place: the prefix block (``B x H x q x P`` floats, the
    largest tensor here in a prefill) is never copied. Grouped-query heads are folded into the
    query rows (head ``h`` reads kv head ``h // (H / Hkv)``, as ``repeat_kv``), and the prefix
    products fold the batch in as well: one ``[Hkv, B*g*q, D] x [Hkv, D, P]`` product reads the
    prefix once for all rows.
    """
    if shared_prefix_kv is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError("shared-prefix attention is for inference: dropout must be 0")
    prefix_keys = shared_prefix_kv.keys[module.layer_idx]  # [Hkv, P, D]
    prefix_values = shared_prefix_kv.values[module.layer_idx]  # [Hkv, P, D]
    batch, heads, q_len, dim = query.shape
    kv_heads, own_len, prefix_len = key.shape[1], key.shape[2], prefix_keys.shape[1]
    group = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    rows = group * q_len
    grouped = query.reshape(batch, kv_heads, rows, dim)  # [B, Hkv, g*q, D]
    folded = grouped.transpose(0, 1).reshape(kv_heads, batch * rows, dim)  # [Hkv, B*g*q, D]

    # the prefix block stays in its product's layout [Hkv, B, g*q, P]: no copy of it is made
    prefix_scores = torch.bmm(folded, prefix_keys.transpose(1, 2)).float().mul_(scale)  # [Hkv, B*g*q, P]
    prefix_scores = prefix_scores.view(kv_heads, batch, rows, prefix_len)  # [Hkv, B, g*q, P]
    if shared_prefix_kv.row_lengths is not None:  # row b sees the first row_lengths[b] positions only
        columns = torch.arange(prefix_len, device=query.device)
        hidden = columns[None, :] >= shared_prefix_kv.row_lengths.to(query.device)[:, None]  # [B, P]
        prefix_scores.masked_fill_(hidden[None, :, None, :], float("-inf"))
    own_scores = torch.matmul(grouped, key.transpose(2, 3)).float().mul_(scale)  # [B, Hkv, g*q, S]
    if attention_mask is None and q_len > 1:
        causal = torch.ones(q_len, own_len, dtype=torch.bool, device=query.device).tril(own_len - q_len)
        attention_mask = causal[None, None]  # [1, 1, q, S]
    if attention_mask is not None:
        # [B|1, 1, q, S] -> [B|1, 1, g*q, S]: every query head of a group shares its row's mask
        mask = attention_mask.expand(-1, -1, q_len, own_len)[:, :, None].expand(-1, -1, group, -1, -1)
        mask = mask.reshape(mask.shape[0], 1, rows, own_len)
        if mask.dtype == torch.bool:
            own_scores.masked_fill_(~mask, float("-inf"))
        else:  # an additive float mask
            own_scores.add_(mask)

    # softmax over [prefix | own], in place. A real query sees at least itself, so its max is finite;
    # a padding query with no visible key gets a finite stand-in and, below, an output of zeros
    peak = torch.maximum(prefix_scores.amax(-1, keepdim=True).transpose(0, 1),
                         own_scores.amax(-1, keepdim=True)).clamp_(min=-1e30)  # [B, Hkv, g*q, 1]
    prefix_probs = prefix_scores.sub_(peak.transpose(0, 1)).exp_()  # [Hkv, B, g*q, P], unnormalised
    own_probs = own_scores.sub_(peak).exp_()  # [B, Hkv, g*q, S], unnormalised
    total = prefix_probs.sum(-1, keepdim=True).transpose(0, 1) + own_probs.sum(-1, keepdim=True)  # [B, Hkv, g*q, 1]
    total.clamp_(min=torch.finfo(total.dtype).tiny)

    folded_probs = prefix_probs.view(kv_heads, batch * rows, prefix_len).to(value.dtype)  # [Hkv, B*g*q, P]
    out = torch.bmm(folded_probs, prefix_values).view(kv_heads, batch, rows, dim).transpose(0, 1)  # [B, Hkv, g*q, D]
    out = out.float() + torch.matmul(own_probs.to(value.dtype), value).float()
    out = (out / total).to(query.dtype)  # [B, Hkv, g*q, D]
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None  # [B, q, H, D]


_registered = False
_switch_lock = threading.Lock()
_switched: dict[int, list[Any]] = {}  # id(config) -> [implementation to restore, callers inside]


def _register() -> None:
    """Make ``ATTENTION_NAME`` known to transformers (attention function, and sdpa's mask maker)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _registered = True


def _base_model(model: Any) -> Any:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def supports_shared_prefix(model: Any) -> bool:
    """Whether ``model`` can attend to a shared prefix: its attention goes through transformers'
    ``AttentionInterface`` (so the forward keyword reaches it) and is sdpa, the implementation this
    one falls back to and whose masks it reads."""
    base = _base_model(model)
    implementation = getattr(getattr(base, "config", None), "_attn_implementation", None)
    return bool(getattr(base, "_supports_attention_backend", False)) and implementation in ("sdpa", ATTENTION_NAME)


@contextlib.contextmanager
def prefix_attention(model: Any) -> Iterator[None]:
    """Inside, ``model`` attends with :func:`shared_prefix_attention_forward`; on leaving, the last
    caller out restores the model's own implementation (callers may overlap in threads)."""
    _register()
    config = _base_model(model).config
    with _switch_lock:
        state = _switched.setdefault(id(config), [config._attn_implementation, 0])
        state[1] += 1
        config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        with _switch_lock:
            state[1] -= 1
            if state[1] == 0:
                config._attn_implementation = state[0]
                del _switched[id(config)]
