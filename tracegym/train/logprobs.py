"""Per-token log-probs and entropies of a causal LM, without extra ``[B, L, V]`` float copies.

``log_softmax(logits).gather(target)`` materialises a second ``[B, L, V]`` tensor (49k vocab x
4k tokens x 4 bytes = 800 MB per sequence), plus one more for a temperature division, a float32
upcast or an entropy. Here one autograd function computes, chunk by chunk of positions,

    log p(target) = z[target] - logsumexp(z)          H = logsumexp(z) - sum softmax(z) * z
    (z = logits / temperature, in float32)

and saves nothing but the logits (and the small per-position results). Its backward recomputes
each chunk's softmax and writes the gradient straight into one ``[..., V]`` buffer:

    d log p(target) / dz = onehot(target) - p          dH / dz = -p * (log p + H)

so the temporaries never exceed ``chunk_rows x V`` floats. The output of ``token_logprobs`` is
target-aligned: column ``t`` is ``log p(input_ids[:, t+1] | input_ids[:, :t+1])``, shape
``[B, L-1]``, matching ``tracegym.batch.Batch``.

The temperature must be the engine's sampling temperature, or trainer and engine log-probs differ
by construction (logits are divided by it before the softmax, as in vLLM).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tracegym.train.precision import training_forward_context
from tracegym.train.step_prefix import MIN_SHARED_PREFIX, StepPrefix, common_prefix_length, plain_cache_layers

DEFAULT_CHUNK_ROWS = 32  # positions per chunk: 32 x 49k x 4 bytes = 6 MB temporaries (cache-sized: 4x faster than 1024 on a 2-core CPU)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs (greedy has no distribution), got {temperature}")


def _chunk_values(z: Tensor, targets: Tensor | None, with_entropy: bool) -> tuple[Tensor | None, Tensor | None]:
    """Scaled logits z [n_c, V] (float32) -> (log p(target) [n_c] or None, entropy [n_c] or None)."""
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse if targets is not None else None
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    return logp, entropy


def _chunk_grad(z: Tensor, targets: Tensor | None, grad_logp: Tensor | None, grad_entropy: Tensor | None,
                entropy: Tensor | None, temperature: float) -> Tensor:
    """dL/dlogits [n_c, V] of one chunk from its scaled logits z (float32, consumed), the upstream
    gradients [n_c] (None: that output unused) and the saved entropies:
    d log p(target) / dz = onehot(target) - p, dH / dz = -p (log p + H), dz / dlogits = 1 / T."""
    log_p = torch.log_softmax(z, dim=-1)
    g = log_p.exp()  # p, turned into -dL/dz in place below
    if grad_entropy is not None:
        scale = log_p.add_(entropy[:, None]).mul_(grad_entropy[:, None].float())  # (log p + H) g_H
        if grad_logp is not None:
            scale.add_(grad_logp[:, None].float())
        g.mul_(scale)
    else:
        g.mul_(grad_logp[:, None].float())
    g.neg_()
    if grad_logp is not None:
        g.scatter_add_(-1, targets[:, None], grad_logp[:, None].float())
    return g.div_(temperature)


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """(flat logits [N, V], targets [N] or None) -> (log-probs [N], entropies [N] or empty), float32."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor | None, temperature: float, chunk_rows: int, with_entropy: bool):
        ctx.set_materialize_grads(False)  # an output the loss does not use (the logged entropy) gets None, not zeros
        n = logits.shape[0]
        logp = torch.zeros(n if targets is not None else 0, dtype=torch.float32, device=logits.device)
        entropy = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk_rows):
            stop = start + chunk_rows
            z = logits[start:stop].float() / temperature  # [n_c, V], the one temporary
            values = _chunk_values(z, targets[start:stop] if targets is not None else None, with_entropy)
            if values[0] is not None:
                logp[start:stop] = values[0]
            if values[1] is not None:
                entropy[start:stop] = values[1]
        ctx.save_for_backward(logits, targets if targets is not None else torch.empty(0), entropy)
        ctx.temperature, ctx.chunk_rows, ctx.has_targets, ctx.with_entropy = temperature, chunk_rows, targets is not None, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        logits, targets, entropy = ctx.saved_tensors
        use_logp = ctx.has_targets and grad_logp is not None
        use_entropy = ctx.with_entropy and grad_entropy is not None
        if not (use_logp or use_entropy):
            return None, None, None, None, None
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            stop = start + ctx.chunk_rows
            z = logits[start:stop].float() / ctx.temperature
            g = _chunk_grad(z, targets[start:stop] if use_logp else None, grad_logp[start:stop] if use_logp else None,
                            grad_entropy[start:stop] if use_entropy else None,
                            entropy[start:stop] if use_entropy else None, ctx.temperature)
            grad_logits[start:stop] = g.to(logits.dtype)
        return grad_logits, None, None, None, None


def _run(logits: Tensor, targets: Tensor | None, temperature: float, chunk_rows: int, with_entropy: bool) -> tuple[Tensor, Tensor]:
    _check_temperature(temperature)
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    if targets is not None and logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    flat = logits.reshape(-1, logits.shape[-1])  # a view for contiguous logits (pass the model's output whole)
    flat_targets = targets.reshape(-1).long() if targets is not None else None
    logp, entropy = _ChunkedLogprobEntropy.apply(flat, flat_targets, float(temperature), int(chunk_rows), with_entropy)
    lead = logits.shape[:-1]
    return (logp.reshape(lead) if targets is not None else logp), (entropy.reshape(lead) if with_entropy else entropy)


# --- the fused output layer ------------------------------------------------------------------------
#
# Why: the [B, L, V] logits of an agent episode are the largest tensors of a training step (6 rows x
# 172 kept positions x 49k vocab x 4 bytes = 200 MB, and as much again for their gradient), all for
# a few kilobytes of log-probs. Without them the demo's RL update peaks 0.5 GB lower
# (bench/rl_update.py; its time within the measurements' scatter). Why by hand: the libraries that fuse the output layer with the loss
# (Liger-Kernel, Apple's Cut Cross-Entropy) are Triton kernels for GPUs. Here the output layer runs
# chunk by chunk of positions inside one autograd function:
#
#     z_c = (h_c @ W^T + b) / T        [chunk, V]   (never the whole [N, V])
#     log p(target) = z_c[target] - logsumexp(z_c),  H = logsumexp(z_c) - sum softmax(z_c) * z_c
#
# and its backward recomputes z_c, forms dL/dz_c as ``_ChunkedLogprobEntropy`` does, and returns
# dL/dh_c = dL/dz_c @ W (and dL/dW += dL/dz_c^T @ h_c when the output layer trains).

FUSED_CHUNK_ROWS = 32  # positions per chunk: 32 x 49k x 4 bytes = 6 MB (bench/rl_update.py: 0.45 GB lower peak than 128, same time)
FUSED_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3"})
"""Model types whose causal LM is ``lm_head(body(...).last_hidden_state)`` with nothing after the
output layer (no logit soft-capping or scaling): the fused path computes exactly their logits.
Others take the plain path (full logits, then ``_ChunkedLogprobEntropy``)."""


def output_head(model: Any) -> tuple[Any, torch.nn.Linear] | None:
    """``(body, output layer)`` of a causal LM whose logits are ``output_layer(body(...).last_hidden_state)``
    (``FUSED_HEAD_MODEL_TYPES``, a plain ``nn.Linear`` head, LoRA or no adapter); None otherwise."""
    peft_config = getattr(model, "peft_config", None) or {}
    if any(str(getattr(c, "peft_type", "")).split(".")[-1] != "LORA" or getattr(c, "alora_invocation_tokens", None)
           for c in peft_config.values()):
        return None  # prompt tuning & co. change the inputs, aLoRA its offsets, in PeftModel.forward
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(base, "config", None), "model_type", None) not in FUSED_HEAD_MODEL_TYPES:
        return None
    body = getattr(base, getattr(base, "base_model_prefix", "") or "model", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if body is None or type(head) is not torch.nn.Linear:  # e.g. LoRA on the output layer
        return None
    if head._forward_hooks or head._forward_pre_hooks or hasattr(head, "_hf_hook"):
        return None  # something (offloading, a user's hook) expects the layer to be called
    return body, head


def _head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype | None) -> Tensor:
    """``hidden @ weight^T + bias`` in ``dtype`` (the autocast dtype of the caller, else as given;
    ``weight`` and ``bias`` come already cast, once per pass)."""
    return torch.nn.functional.linear(hidden.to(dtype) if dtype is not None else hidden, weight, bias)


def _cast_head(weight: Tensor, bias: Tensor | None, dtype: torch.dtype | None) -> tuple[Tensor, Tensor | None]:
    if dtype is None:
        return weight, bias
    return weight.to(dtype), (bias.to(dtype) if bias is not None else None)


class _FusedHeadLogprobEntropy(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] or None, targets [N]) -> (log-probs [N], entropies [N]
    or empty), float32, with the output layer applied chunk by chunk (see the section comment)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                chunk_rows: int, with_entropy: bool):
        ctx.set_materialize_grads(False)
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        with torch.autocast(device_type, enabled=False):  # the casts are explicit, alike in forward and backward
            head_weight, head_bias = _cast_head(weight, bias, dtype)
            for start in range(0, n, chunk_rows):
                stop = start + chunk_rows
                z = _head_logits(hidden[start:stop], head_weight, head_bias, dtype).float().div_(temperature)  # [n_c, V]
                chunk_logp, chunk_entropy = _chunk_values(z, targets[start:stop], with_entropy)
                logp[start:stop] = chunk_logp
                if chunk_entropy is not None:
                    entropy[start:stop] = chunk_entropy
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature, ctx.chunk_rows, ctx.with_entropy, ctx.dtype = temperature, chunk_rows, with_entropy, dtype
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        use_entropy = ctx.with_entropy and grad_entropy is not None
        if grad_logp is None and not use_entropy:
            return None, None, None, None, None, None, None
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_bias else None
        head_weight, head_bias = _cast_head(weight, bias, ctx.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk_rows):
                stop = start + ctx.chunk_rows
                z = _head_logits(hidden[start:stop], head_weight, head_bias, ctx.dtype).float().div_(ctx.temperature)
                g = _chunk_grad(z, targets[start:stop], grad_logp[start:stop] if grad_logp is not None else None,
                                grad_entropy[start:stop] if use_entropy else None,
                                entropy[start:stop] if use_entropy else None, ctx.temperature)  # dL/dlogits [n_c, V]
                if want_hidden:
                    grad_hidden[start:stop] = (g.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
                if want_weight:
                    grad_weight.addmm_(g.t(), hidden[start:stop].float())
                if want_bias:
                    grad_bias.add_(g.sum(0))
        return (grad_hidden, grad_weight.to(weight.dtype) if want_weight else None,
                grad_bias.to(bias.dtype) if want_bias else None, None, None, None, None)


def _run_fused(hidden: Tensor, head: torch.nn.Linear, targets: Tensor, temperature: float, chunk_rows: int,
               with_entropy: bool) -> tuple[Tensor, Tensor]:
    """hidden [B, n, H], targets [B, n] -> (log-probs [B, n], entropies [B, n] or empty)."""
    _check_temperature(temperature)
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match targets {tuple(targets.shape)}")
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy = _FusedHeadLogprobEntropy.apply(flat, head.weight, head.bias, targets.reshape(-1).long(),
                                                   float(temperature), int(chunk_rows), with_entropy)
    return logp.reshape(lead), (entropy.reshape(lead) if with_entropy else entropy)


def logprobs_from_logits(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> Tensor:
    """``log softmax(logits / temperature)[target]``: logits [..., V], targets [...] -> [...] float32.

    Differentiable. Pass contiguous logits (a slice such as ``logits[:, :-1]`` is copied whole by
    the reshape); ``token_logprobs`` passes the full logits and drops the last position instead.
    """
    return _run(logits, targets, temperature, chunk_rows, with_entropy=False)[0]


def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position: logits [..., V] -> [...] float32.

    Differentiable, chunked like ``logprobs_from_logits``."""
    return _run(logits, None, temperature, chunk_rows, with_entropy=True)[1]


def shared_prefix_length(input_ids: Tensor, attention_mask: Tensor, first_column: int) -> int:
    """Tokens at the start that every row holds alike (real tokens, not padding), at most
    ``first_column`` (no logit is needed inside the prefix): the part of a micro-batch's rows worth
    computing once. 0 when below ``MIN_SHARED_PREFIX`` or with a single row."""
    return common_prefix_length([(input_ids, attention_mask, first_column)])


def forward_logits(model: Any, input_ids: Tensor, attention_mask: Tensor, first_column: int = 0,
                   share_prefix: bool = True, prefix: StepPrefix | None = None) -> Tensor:
    """Logits of positions ``first_column .. L-1``: [B, L - first_column, V].

    ``logits_to_keep`` makes the model apply its output layer to those positions only: the hidden
    states of the prompt are still computed (later tokens attend to them), but the [*, V] projection,
    softmax and their backward are skipped where nothing is trained, which is most of an agent
    episode's tokens (system prompt, tool schemas, tool results).

    Shared prefix (``share_prefix``, not in train mode: gradient checkpointing turns the cache off):
    the rows of a micro-batch usually start alike (one task's group repeats its prompt; every task
    of an env repeats the system prompt and tool schemas). That prefix runs once, batch 1, with
    gradients; its keys and values are repeated to the B rows (``batch_repeat_interleave``, whose
    backward sums the rows' gradients into the one prefix) and only the suffixes run at batch B,
    attending to it. Exact: a causal prefix never sees what follows it, so every row's prefix
    states are the same computation (float rounding aside: other matmul shapes).

    ``prefix``: a step's shared prefix, already run (``tracegym.train.step_prefix``); rows it covers
    start from its keys and values, and only what they share beyond it runs at batch 1.

    A model marked with ``model.autocast`` runs under ``torch.autocast`` (``train/precision.py``):
    the logits come out bfloat16 and the log-prob arithmetic upcasts them chunk by chunk."""
    with training_forward_context(model, input_ids.device):  # model.autocast (tracegym/train/precision.py)
        return _forward_kept(model, None, input_ids, attention_mask, first_column, share_prefix, prefix)


def _forward_kept(model: Any, body: Any, input_ids: Tensor, attention_mask: Tensor, first_column: int,
                  share_prefix: bool, step: StepPrefix | None = None) -> Tensor:
    """Positions ``first_column .. L-1`` of the model's output: logits [B, n, V] (``body`` None) or,
    through ``body`` (``output_head``), the final hidden states [B, n, H] the output layer would read."""
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, L]; got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    length = input_ids.shape[1]
    if length < 2:
        raise ValueError("sequences need at least 2 tokens to have a next-token log-prob")
    if not 0 <= first_column < length - 1:
        raise ValueError(f"first_column must be in [0, {length - 2}] for sequences of {length} tokens, got {first_column}")
    sharing = share_prefix and not getattr(model, "training", False)
    prefix = shared_prefix_length(input_ids, attention_mask, first_column) if sharing else 0
    if step is not None and not (sharing and step.covers(input_ids, attention_mask, first_column)):
        step = None
    if step is not None:
        prefix = max(prefix, step.length)  # a single row, or rows that share no more than the step's prefix
    if prefix:
        out = _forward_after_prefix(model, body, input_ids, attention_mask, first_column, prefix, step)
        if out is not None:
            return out
    if body is not None:
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return hidden[:, first_column:]  # [B, n, H]
    kwargs = {"logits_to_keep": length - first_column} if first_column > 0 else {}
    output = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    logits = output.logits if hasattr(output, "logits") else output
    if logits.shape[1] != length - first_column:  # a model without logits_to_keep support
        logits = logits[:, first_column:].contiguous()
    return logits  # [B, L - first_column, V]


def _forward_after_prefix(model: Any, body: Any, input_ids: Tensor, attention_mask: Tensor, first_column: int,
                          prefix: int, step: StepPrefix | None = None) -> Tensor | None:
    """The shared-prefix forward of :func:`forward_logits` (None when the model's cache is not a
    plain full-attention one, whose rows can be repeated and extended exactly); through ``body``,
    hidden states instead of logits. With ``step`` (covering these rows, ``prefix >= step.length``)
    the cache starts from the step's prefix and only tokens ``step.length .. prefix`` run at batch 1."""
    from transformers import DynamicCache

    rows, length = input_ids.shape
    start = step.length if step is not None else 0
    if step is not None:
        cache = step.cache(model, 1 if prefix > start else rows)
    else:
        cache = DynamicCache(config=getattr(model, "config", None))
    if prefix > start:
        head_kwargs: dict[str, Any] = {} if body is not None else {"logits_to_keep": 1}
        (body or model)(input_ids=input_ids[:1, start:prefix], attention_mask=attention_mask[:1, :prefix],
                        position_ids=torch.arange(start, prefix, device=input_ids.device)[None], cache=cache,
                        use_cache=True, **head_kwargs)
        if not plain_cache_layers(cache):
            return None
        cache.batch_repeat_interleave(rows)  # [1, H, P, D] -> [B, H, P, D] per layer (differentiable)
    positions = torch.arange(prefix, length, device=input_ids.device)[None].expand(rows, -1)  # [B, L - P]
    if body is not None:
        hidden = body(input_ids=input_ids[:, prefix:], attention_mask=attention_mask, position_ids=positions,
                      cache=cache, use_cache=True).last_hidden_state
        return hidden[:, -(length - first_column):]  # [B, L - first_column, H]
    output = model(input_ids=input_ids[:, prefix:], attention_mask=attention_mask, position_ids=positions,
                   cache=cache, use_cache=True, logits_to_keep=length - first_column)
    logits = output.logits
    if logits.shape[1] != length - first_column:
        logits = logits[:, -(length - first_column):].contiguous()
    return logits  # [B, L - first_column, V]


def _logprobs_and_entropy(model: Any, input_ids: Tensor, attention_mask: Tensor, temperature: float, chunk_rows: int | None,
                          first_column: int, share_prefix: bool, with_entropy: bool, fused_head: bool,
                          prefix: StepPrefix | None = None) -> tuple[Tensor, Tensor]:
    """Target-aligned (log-probs [B, L-1], entropies [B, L-1] or empty): through the fused output
    layer where the model allows it (``output_head``), else from full logits."""
    _check_temperature(temperature)
    targets = _shifted_targets(input_ids, first_column)
    found = output_head(model) if fused_head else None
    with training_forward_context(model, input_ids.device):  # model.autocast (tracegym/train/precision.py)
        if found is not None:
            hidden = _forward_kept(model, found[0], input_ids, attention_mask, first_column, share_prefix, prefix)
            logp, entropy = _run_fused(hidden, found[1], targets, temperature,
                                        FUSED_CHUNK_ROWS if chunk_rows is None else chunk_rows, with_entropy)
        else:
            logits = _forward_kept(model, None, input_ids, attention_mask, first_column, share_prefix, prefix)
    if found is None:
        logp, entropy = _run(logits, targets, temperature, DEFAULT_CHUNK_ROWS if chunk_rows is None else chunk_rows, with_entropy)
    return pad_front(logp[:, :-1], first_column), (pad_front(entropy[:, :-1], first_column) if with_entropy else entropy)


def _shifted_targets(input_ids: Tensor, first_column: int = 0) -> Tensor:
    """Targets of positions ``first_column .. L-1``: position t predicts token t + 1; the last
    position gets a dummy target 0 and its output column is dropped (cheaper than slicing the
    [B, L, V] logits)."""
    return torch.cat([input_ids[:, first_column + 1 :], torch.zeros_like(input_ids[:, :1])], dim=1)


def pad_front(values: Tensor, first_column: int) -> Tensor:
    """[B, L-1-first_column] -> [B, L-1] with zeros in front (columns that were not computed)."""
    if first_column == 0:
        return values
    return torch.cat([values.new_zeros(values.shape[0], first_column), values], dim=1)


def token_logprobs(
    model: Any, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0,
    chunk_rows: int | None = None, first_column: int = 0, share_prefix: bool = True, fused_head: bool = True,
    prefix: StepPrefix | None = None,
) -> Tensor:
    """Log-prob of each next token under ``model``: [B, L] ids -> [B, L-1] float32 (target-aligned).

    Values at padded positions are meaningless; mask them with ``Batch.loss_mask``. Columns before
    ``first_column`` are not computed and hold 0 (pass ``Batch.first_loss_column``). The rows'
    common prefix runs once (``share_prefix``, see ``forward_logits``). ``fused_head``: apply the
    output layer chunk by chunk inside the log-prob function where the model allows it (no [B, L, V]
    logits; ``output_head``); False always takes full logits (the two agree to float rounding).
    ``chunk_rows``: positions per chunk (default ``FUSED_CHUNK_ROWS`` fused, ``DEFAULT_CHUNK_ROWS`` not).
    ``prefix``: a step's shared prefix already run (``tracegym.train.step_prefix``; call its
    ``backward()`` after the step's last micro-batch when training).
    """
    return _logprobs_and_entropy(model, input_ids, attention_mask, temperature, chunk_rows, first_column, share_prefix,
                                 with_entropy=False, fused_head=fused_head, prefix=prefix)[0]


def token_logprobs_and_entropy(
    model: Any, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0,
    chunk_rows: int | None = None, first_column: int = 0, share_prefix: bool = True, fused_head: bool = True,
    prefix: StepPrefix | None = None,
) -> tuple[Tensor, Tensor]:
    """``(log-probs, entropies)``, both [B, L-1] float32 and target-aligned, from one forward pass;
    columns before ``first_column`` hold 0 (arguments as ``token_logprobs``)."""
    return _logprobs_and_entropy(model, input_ids, attention_mask, temperature, chunk_rows, first_column, share_prefix,
                                 with_entropy=True, fused_head=fused_head, prefix=prefix)


# the names these had while only this module used them (kept for callers of the old names)
_forward_logits = forward_logits
_pad_front = pad_front

__all__ = ["FUSED_CHUNK_ROWS", "FUSED_HEAD_MODEL_TYPES", "MIN_SHARED_PREFIX", "forward_logits", "output_head", "logprobs_from_logits", "pad_front", "shared_prefix_length",
           "token_entropy", "token_logprobs", "token_logprobs_and_entropy"]
