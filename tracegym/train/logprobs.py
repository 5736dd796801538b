"""Per-token log-probs and entropies of a causal LM, without extra ``[B, L, V]`` float copies.

``log_softmax(logits).gather(target)`` materialises a second ``[B, L, V]`` tensor (49k vocab x
4k tokens x 4 bytes = 800 MB per sequence) and keeps it for backward. Here the log-prob of the
target is ``logit[target] - logsumexp(logits)``, computed in chunks of rows so the temporaries of
``logsumexp`` (and of the float32 upcast and the temperature division) never exceed
``chunk_size x V``. The output is target-aligned: column ``t`` is ``log p(input_ids[:, t+1] |
input_ids[:, :t+1])``, shape ``[B, L-1]``, matching ``tracegym.batch.Batch``.

The temperature must be the engine's sampling temperature, or trainer and engine log-probs differ
by construction (logits are divided by it before the softmax, as in vLLM).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_ROWS = 1024  # rows of V logits per chunk: 1024 x 49k x 4 bytes = 200 MB of temporaries


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs (greedy has no distribution), got {temperature}")


def _chunk_logprobs(chunk: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """[n, V] logits, [n] targets -> [n] log-probs (float32)."""
    chunk = chunk.float()  # no copy when already float32
    if temperature != 1.0:
        chunk = chunk / temperature
    target_logit = chunk.gather(-1, targets[:, None]).squeeze(-1)
    return target_logit - torch.logsumexp(chunk, dim=-1)


def _chunk_entropy(chunk: Tensor, temperature: float) -> Tensor:
    """[n, V] logits -> [n] entropies (float32): logsumexp(z) - sum softmax(z) * z."""
    chunk = chunk.float()
    if temperature != 1.0:
        chunk = chunk / temperature
    probs = torch.softmax(chunk, dim=-1)
    return torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1)


def _map_chunks(fn: Callable[..., Tensor], logits: Tensor, targets: Tensor | None, temperature: float, chunk_rows: int) -> Tensor:
    """Apply ``fn`` to chunks of positions of ``logits`` [..., V] -> [...] float32.

    The chunks are slices (views) of one row at a time, so a non-contiguous input such as
    ``logits[:, :-1]`` is never copied whole. With autograd on, each chunk runs under activation
    checkpointing: backward recomputes the chunk's temporaries (upcast, temperature division,
    softmax) instead of keeping them, so at most one chunk of them is alive at a time and only the
    logits themselves are saved.
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    lead_shape = logits.shape[:-1]
    if logits.dim() == 1:
        logits3 = logits.view(1, 1, -1)
    elif logits.dim() == 2:
        logits3 = logits.unsqueeze(0)
    else:
        logits3 = logits.flatten(0, -3)  # [R, S, V]; unchanged (a view) for [B, L, V]
    targets3 = targets.reshape(logits3.shape[:-1]) if targets is not None else None  # [R, S]
    checkpointed = torch.is_grad_enabled() and logits.requires_grad
    rows = []
    for r in range(logits3.shape[0]):
        pieces = []
        for start in range(0, logits3.shape[1], chunk_rows):
            chunk = logits3[r, start : start + chunk_rows]  # [n, V], a view
            args: tuple[Any, ...] = (chunk,) if targets3 is None else (chunk, targets3[r, start : start + chunk_rows])
            if checkpointed:
                pieces.append(checkpoint(fn, *args, temperature, use_reentrant=False))
            else:
                pieces.append(fn(*args, temperature))
        rows.append(torch.cat(pieces) if pieces else logits3.new_zeros(0, dtype=torch.float32))
    return torch.stack(rows).reshape(lead_shape)


def logprobs_from_logits(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> Tensor:
    """``log softmax(logits / temperature)[target]`` for logits [..., V] and targets [...] -> [...] float32.

    Differentiable; computed ``chunk_rows`` positions at a time as ``logit[target] - logsumexp``.
    """
    _check_temperature(temperature)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    return _map_chunks(_chunk_logprobs, logits, targets, temperature, chunk_rows)


def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Tensor:
    """Entropy ``H = logsumexp(z) - sum softmax(z) z`` of ``softmax(logits / temperature)`` per
    position: logits [..., V] -> [...] float32. Differentiable; chunked like ``logprobs_from_logits``."""
    _check_temperature(temperature)
    return _map_chunks(_chunk_entropy, logits, None, temperature, chunk_rows)


def _next_token_logits(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, L]; got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    if input_ids.shape[1] < 2:
        raise ValueError("sequences need at least 2 tokens to have a next-token log-prob")
    output = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    logits = output.logits if hasattr(output, "logits") else output  # [B, L, V]
    return logits[:, :-1, :]  # position t predicts token t + 1 (a view, no copy)


def token_logprobs(
    model: Any, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> Tensor:
    """Log-prob of each next token under ``model``: [B, L] ids -> [B, L-1] float32 (target-aligned).

    Values at padded positions are meaningless; mask them with ``Batch.loss_mask``.
    """
    logits = _next_token_logits(model, input_ids, attention_mask)
    return logprobs_from_logits(logits, input_ids[:, 1:], temperature, chunk_rows)


def token_logprobs_and_entropy(
    model: Any, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> tuple[Tensor, Tensor]:
    """``(token_logprobs, token_entropy)``, both [B, L-1] float32, from one forward pass."""
    logits = _next_token_logits(model, input_ids, attention_mask)
    return (
        logprobs_from_logits(logits, input_ids[:, 1:], temperature, chunk_rows),
        token_entropy(logits, temperature, chunk_rows),
    )


__all__ = ["logprobs_from_logits", "token_entropy", "token_logprobs", "token_logprobs_and_entropy"]
