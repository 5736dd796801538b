"""On-policy distillation (``tracegym distill``): the student learns from a teacher on its own samples.

One step, top to bottom (``train_distill`` below reads exactly like this)::

    tasks   = tasks_at(train_tasks, seed, cursor, tasks_per_step)       # rl.py: seeded, resumable order
    groups  = collect_groups(sampler, cfg, tasks, renderer, seed=...)   # rl.py: student episodes, engine log-probs kept
    data    = examples_from_groups(groups, renderer)                    # advantages 0; loss mask 1 on sampled tokens
    batch   = score_with_teacher(model, teacher, make_batch(data), ...) # teacher.score: log-probs of the sampled tokens,
                                                                        # A_t = -(log pi_student - log pi_teacher)
    metrics = policy_update(model, batch, loss, optimizer)              # importance-weighted PG (TIS to the sampler)
              or jsd_update(model, teacher, batch, beta, optimizer)     # GKD: generalized JSD over the vocabulary
    sampler.update_weights(model)

The rollout pieces of ``tracegym.recipes.rl`` (``collect_groups``, ``load_policy``, ``make_sampler``,
``evaluate_policy``) read ``cfg.model``, ``cfg.lora``, ``cfg.env``, ``cfg.rollout``, ``cfg.eval`` and
``cfg.group_size``; ``DistillConfig`` has exactly those sections under the same names, so it is passed
to them as it is (no adapter object, nothing copied).

Why the advantage is ``-(log pi_student - log pi_teacher)``: the reverse KL
``KL(pi_s || pi_T) = E_{y ~ pi_s} [log pi_s(y) - log pi_T(y)]`` of a sampled sequence is a sum over its
tokens, and its policy gradient is ``E[sum_t (log pi_s(y_t) - log pi_T(y_t)) grad log pi_s(y_t)]``
(plus terms that vanish in expectation, and the future tokens' terms, which this per-token form drops
as tinker-cookbook and the Qwen3 report do: no discount, no sum over later tokens). So each sampled
token is a policy-gradient sample with reward ``log pi_T - log pi_s``: the teacher grades every token,
a dense signal where RL has one reward per episode. The samples come from the sampler (an engine
that may differ slightly from the trainer); ``tis_cap`` weighs each token by
``min(pi_old / pi_sampler, cap)`` (``tracegym.algos.tis``), the importance weight to the sampler.

The student log-prob in ``A_t`` is the trainer's own scoring of the sampled tokens
(``student_logprobs: trainer``, the exact gradient above; TIS needs this scoring anyway) or the
engine's recorded one (``sampler``). The teacher scores at temperature 1 (its own distribution);
the student at the sampling temperature (the distribution it sampled from; 1 by default).

``loss: jsd`` (GKD, Agarwal et al. 2024) replaces the sampled-token estimate by the exact generalized
Jensen-Shannon divergence between the student's and the teacher's next-token distributions at every
sampled position (the states come from the student; the whole vocabulary is compared there), which
needs the teacher's full logits: a local teacher. It is computed chunk by chunk of positions without
extra ``[B, L, V]`` float copies (``generalized_jsd``), like ``tracegym.train.logprobs``.

The teacher (``Teacher``: ``score(batch) -> [B, T]`` log-probs of the batch's target tokens, aligned
like the student's) is one of:

- ``LocalTeacher`` (``teacher.engine: hf``): a model folder (+ adapter) loaded with transformers in
  this process, scored by ``batch_logprobs`` exactly as the student is (micro-batches, right padding,
  float32 log-softmax); it also gives the full logits ``loss: jsd`` needs.
- ``EngineTeacher`` (``vllm`` in process, ``openai`` over HTTP: ``vllm serve``, ``tracegym serve``):
  an engine's ``prompt_logprobs`` on each row's un-padded tokens (up to its last trained token),
  scattered into ``[B, T]`` (column ``t`` holds the log-prob of token ``t + 1``). Only the actual
  tokens' log-probs come back, never a distribution, so ``loss: jsd`` is refused for it (config).

Either way the teacher must read the student's token ids as the student does. A local or vLLM
teacher's tokenizer is compared with the student's (``check_same_tokenizer``); a server's cannot be
read, so ``check_remote_tokenizer`` sends the student's ids of probe strings (echo, no id
extensions) and compares the server's text of each id with the student's: a server with another
vocabulary reads them as other text. The server must still serve a model with the student's
tokenizer: the check catches a different vocabulary, not every difference.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from tracegym.algos.aggregation import aggregate, masked_mean
from tracegym.algos.config import PolicyLossConfig
from tracegym.batch import Batch, examples_from_groups, make_batch, split_microbatches
from tracegym.config import DistillConfig, TeacherConfig, dump_config
from tracegym.recipes._run import check_resumed_tasks, check_run_dir, split_tasks, start_logging, step_times, stops_here
from tracegym.rl.collect import collect_groups, evaluate_policy, rollout_metrics
from tracegym.rl.policy import load_policy, make_renderer, make_sampler
from tracegym.rl.tasks import tasks_at
from tracegym.train.checkpoint import load_latest_intact, save_checkpoint, save_final
from tracegym.train.logging import MetricsLogger, ProgressBar
from tracegym.train.logprobs import forward_logits, pad_front
from tracegym.train.lora import count_parameters
from tracegym.train.optim import build_optimizer, build_scheduler, clip_gradients
from tracegym.train.policy_update import batch_logprobs, policy_update, reduce_part_metrics, score_batch
from tracegym.train.result import TrainResult
from tracegym.train.seed import seed_everything

log = logging.getLogger(__name__)

JSD_CHUNK_ROWS = 256  # positions per chunk: a few [256, V] float32 temporaries (49k vocab: ~50 MB each)


class DistillResult(TrainResult):
    """What ``train_distill`` returns: the run folder, the final model folder (None when stopped
    early), the last step and the rows this invocation logged."""


# --- the teacher -----------------------------------------------------------------------------------


def load_teacher(teacher_cfg: TeacherConfig, dtype: str, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """(frozen teacher in eval mode on ``device``, its tokenizer): ``teacher.model`` loaded like any
    model (an adapter folder is merged onto its base), then ``teacher.adapter`` merged on top."""
    from tracegym.models import load

    teacher, tokenizer = load(teacher_cfg.model, dtype)
    if teacher_cfg.adapter is not None:
        from peft import PeftModel

        adapter = Path(teacher_cfg.adapter)
        if not (adapter / "adapter_config.json").is_file():
            raise FileNotFoundError(f"teacher.adapter: no peft adapter (adapter_config.json) in {adapter}")
        # merged: the teacher is then a plain model, one forward pass with no adapter indirection
        teacher = PeftModel.from_pretrained(teacher, str(adapter)).merge_and_unload()
    return teacher.requires_grad_(False).eval().to(device), tokenizer


# Strings whose token ids must agree: plain text, digits, whitespace, accents, and the chat markup
# the renderers write (the special tokens themselves are compared by id below as well).
TOKENIZER_PROBES = (
    "Hello world! What is 12 * 7 + 3?",
    "  indented\n\ttab 0.5e-3 é ü 你好",
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"calculate\"}\n</tool_call><|im_end|>\n",
)


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why ``teacher`` would not tokenize like ``student`` (None when they agree): vocabulary size,
    the id of every special token of the student (chat markers included), the ids of the probes."""
    if len(student) != len(teacher):
        return f"vocabulary sizes differ ({len(student)} vs {len(teacher)})"
    for token in dict.fromkeys(getattr(student, "all_special_tokens", [])):
        ours, theirs = student.convert_tokens_to_ids(token), teacher.convert_tokens_to_ids(token)
        if ours != theirs:
            return f"special token {token!r} has id {ours} for the student but {theirs} for the teacher"
    for text in TOKENIZER_PROBES:
        if student.encode(text, add_special_tokens=False) != teacher.encode(text, add_special_tokens=False):
            return f"{text!r} tokenizes differently"
    return None


def check_same_tokenizer(student: Any, teacher: Any, teacher_name: str) -> None:
    """Raise a one-line ``ValueError`` when the teacher's tokenizer differs from the student's:
    the teacher scores the student's token ids one for one, so they must mean the same text."""
    problem = tokenizer_mismatch(student, teacher)
    if problem is not None:
        raise ValueError(f"teacher {teacher_name!r} does not share the student's tokenizer: {problem}; "
                         "distillation scores the student's tokens with the teacher id for id")


def _bare(text: str) -> str:
    return "".join(text.split())


def remote_tokenizer_mismatch(student: Any, ids: Sequence[int], texts: Sequence[str]) -> str | None:
    """Why a server reading ``ids`` as ``texts`` (its text of each id) does not share ``student``'s
    tokenizer (None when it does). Each id's text is compared with the student's decoding of it (or
    its raw token piece), whitespace ignored; ids whose text is empty or a partial UTF-8 sequence
    on either side are skipped, and up to 10% may differ (decoding quirks): another vocabulary
    reads nearly every id as other text."""
    compared, differing = 0, []
    for token, theirs in zip(ids, texts):
        ours = student.decode([int(token)], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        piece = student.convert_ids_to_tokens(int(token))
        a, b = _bare(ours), _bare(theirs)
        if not a or not b or "\ufffd" in a or "\ufffd" in b:
            continue
        compared += 1
        if b not in (a, _bare(piece if isinstance(piece, str) else "")):
            differing.append((int(token), ours, theirs))
    if differing and len(differing) * 10 > compared:
        token, ours, theirs = differing[0]
        return (f"the server reads {len(differing)} of {compared} probe token ids as other text "
                f"(id {token}: {ours!r} for the student, {theirs!r} on the server)")
    return None


def check_remote_tokenizer(engine: Any, student: Any, teacher_name: str) -> None:
    """Raise a one-line ``ValueError`` when a served teacher reads the student's token ids of the
    probe strings as other text (``remote_tokenizer_mismatch``), or when the server cannot be
    asked. A server that returns no token text cannot be checked: logged, not refused."""
    ids = [int(t) for text in TOKENIZER_PROBES for t in student.encode(text, add_special_tokens=False)]
    where = getattr(engine, "base_url", getattr(engine, "name", "the teacher engine"))
    try:
        texts = engine.prompt_token_texts(ids)
    except RuntimeError as exc:  # OpenAIEngineError: the server refused or did not answer
        raise ValueError(f"teacher {teacher_name!r} at {where}: {exc}") from None
    if texts is None:
        log.warning("teacher %r at %s returns no token text: its tokenizer cannot be checked; it must be the "
                    "student's", teacher_name, where)
        return
    problem = remote_tokenizer_mismatch(student, ids, texts)
    if problem is not None:
        raise ValueError(f"teacher {teacher_name!r} at {where} does not share the student's tokenizer: {problem}; "
                         "distillation scores the student's tokens with the teacher id for id")


@runtime_checkable
class Teacher(Protocol):
    """What scores the student's samples (see the module docstring)."""

    name: str

    def score(self, batch: Batch, micro_batch_size: int) -> Tensor:
        """Log-probs [B, T] of ``batch``'s target tokens under the teacher at temperature 1, target-aligned
        like ``Batch.loss_mask``; meaningful on loss-mask columns (0 or any value elsewhere)."""
        ...

    def close(self) -> None:
        """Release the teacher's resources (a server connection, vLLM's temporary folders)."""
        ...


class LocalTeacher:
    """A frozen model in this process (``teacher.engine: hf``), scored exactly as the student is
    (``batch_logprobs``); ``module`` gives ``loss: jsd`` its full logits."""

    def __init__(self, module: torch.nn.Module, name: str = "teacher"):
        self.module = module
        self.name = name

    def score(self, batch: Batch, micro_batch_size: int) -> Tensor:
        return batch_logprobs(self.module, batch, micro_batch_size, temperature=1.0)  # [B, T]

    def close(self) -> None:
        pass


def teacher_sequences(batch: Batch) -> list[list[int]]:
    """Each row's un-padded tokens up to its last trained target (target column ``t`` is token
    ``t + 1``): all a teacher has to score. A row with no trained token gives ``[]``."""
    trained = batch.loss_mask.bool()  # [B, T]
    rows: list[list[int]] = []
    for b in range(batch.size):
        columns = trained[b].nonzero()
        rows.append(batch.input_ids[b, : int(columns[-1]) + 2].tolist() if columns.numel() else [])
    return rows


def engine_teacher_logprobs(engine: Any, batch: Batch) -> Tensor:
    """``engine.prompt_logprobs`` of ``teacher_sequences(batch)`` scattered into [B, T] float32 on
    the batch's device: row ``b``'s value ``i`` (token ``i + 1`` given the tokens before it) lands in
    column ``i``, as ``token_logprobs`` aligns the student's; columns past a row's last trained
    token hold 0."""
    sequences = teacher_sequences(batch)
    wanted = [b for b, seq in enumerate(sequences) if len(seq) >= 2]
    values = engine.prompt_logprobs([sequences[b] for b in wanted]) if wanted else []
    if len(values) != len(wanted):
        raise RuntimeError(f"the teacher engine scored {len(values)} of {len(wanted)} sequences")
    out = torch.zeros(tuple(batch.loss_mask.shape), dtype=torch.float32)  # [B, T]
    for b, row in zip(wanted, values):
        if len(row) != len(sequences[b]) - 1:
            raise RuntimeError(f"the teacher engine returned {len(row)} log-probs for a sequence of "
                               f"{len(sequences[b])} tokens (expected {len(sequences[b]) - 1})")
        out[b, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(batch.loss_mask.device)


class EngineTeacher:
    """A teacher served by an engine that scores given sequences (``teacher.engine: vllm | openai``):
    ``prompt_logprobs`` of each row's un-padded tokens (``engine_teacher_logprobs``)."""

    def __init__(self, engine: Any, name: str = "teacher"):
        from tracegym.engines.base import scores_prompts

        if not scores_prompts(engine):
            raise ValueError(f"engine {getattr(engine, 'name', type(engine).__name__)!r} cannot score given sequences "
                             "(no prompt_logprobs), so it cannot be a distillation teacher")
        self.engine = engine
        self.name = name

    def score(self, batch: Batch, micro_batch_size: int) -> Tensor:
        return engine_teacher_logprobs(self.engine, batch)  # [B, T]

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def make_teacher(cfg: TeacherConfig, dtype: str, device: torch.device, student_tokenizer: Any) -> Teacher:
    """The teacher ``cfg`` describes, with its tokenizer checked against the student's; one-line
    ``ValueError``s for what is wrong (a tokenizer, an unknown engine option, a server that does not
    answer). ``dtype`` and ``device``: the hf teacher's (vLLM picks its own; ``engine_options``)."""
    if cfg.engine == "hf":
        module, tokenizer = load_teacher(cfg, dtype, device)
        check_same_tokenizer(student_tokenizer, tokenizer, cfg.model)
        return LocalTeacher(module, cfg.model)

    from tracegym.engines import make_engine

    if cfg.engine == "vllm":
        if (Path(cfg.model) / "adapter_config.json").is_file():
            raise ValueError(f"teacher.model {cfg.model!r} is a LoRA adapter folder, which vLLM does not load as a "
                             "model: merge it first (tracegym export --merge) and give the merged folder")
        engine: Any = make_engine("vllm", model=cfg.model, **cfg.engine_options)
        check = lambda: check_same_tokenizer(student_tokenizer, engine.tokenizer, cfg.model)  # noqa: E731
    else:
        options = dict(cfg.engine_options)
        if cfg.api_key_env is not None:
            options["api_key_env"] = cfg.api_key_env
        engine = make_engine("openai", model=cfg.model, tokenizer=student_tokenizer, base_url=cfg.base_url, **options)
        check = lambda: check_remote_tokenizer(engine, student_tokenizer, cfg.model)  # noqa: E731
    try:
        check()
    except BaseException:
        engine.close()
        raise
    return EngineTeacher(engine, cfg.model)


# --- advantages ------------------------------------------------------------------------------------


def distill_advantages(
    student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, clip: float | None = None
) -> Tensor:
    """Per-token advantage ``A_t = -(log pi_student(y_t) - log pi_teacher(y_t))`` on ``mask`` tokens,
    0 elsewhere; clipped to ``[-clip, clip]`` when ``clip`` is set. All tensors [B, T], target-aligned."""
    if not student_logprobs.shape == teacher_logprobs.shape == mask.shape:
        raise ValueError(f"student {tuple(student_logprobs.shape)}, teacher {tuple(teacher_logprobs.shape)} and "
                         f"mask {tuple(mask.shape)} log-probs must have one shape")
    advantages = teacher_logprobs - student_logprobs
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    # where, not a product: values at unmasked columns (padding, prompt) may be anything, even inf
    return torch.where(mask.bool(), advantages, torch.zeros_like(advantages))


def score_with_teacher(
    model: torch.nn.Module, teacher: Teacher | torch.nn.Module, batch: Batch, loss_cfg: PolicyLossConfig, *,
    micro_batch_size: int, temperature: float, student_logprobs: str = "trainer", advantage_clip: float | None = None,
    top_p: float = 1.0,
) -> tuple[Batch, dict[str, float]]:
    """``batch`` with the distillation advantages and what the loss needs, and the ``distill/`` metrics.

    ``score_batch`` adds the trainer's old log-probs when the loss needs them (TIS); the teacher (a
    ``Teacher``, or a frozen model taken as a ``LocalTeacher``) scores the sampled tokens at
    temperature 1; the student log-prob in ``A_t`` is the trainer's
    (``student_logprobs="trainer"``, recomputed here if ``score_batch`` did not) or the engine's
    (``"sampler"``; rows without engine log-probs fall back to the trainer's).
    """
    batch = score_batch(model, None, batch, loss_cfg, micro_batch_size=micro_batch_size, temperature=temperature,
                        epochs=1, top_p=top_p)
    scorer = LocalTeacher(teacher) if isinstance(teacher, torch.nn.Module) else teacher
    teacher_logprobs = scorer.score(batch, micro_batch_size)  # [B, T]
    trainer_missing = student_logprobs == "trainer" or not bool(batch.has_engine_logprobs.all())
    if trainer_missing and batch.old_logprobs is None:
        # the old policy is the current one (a single pass): the same numbers TIS would compare
        batch = batch.with_logprobs(old=batch_logprobs(model, batch, micro_batch_size, temperature=temperature))
    if student_logprobs == "trainer":
        student = batch.old_logprobs
    else:
        known = batch.has_engine_logprobs[:, None]  # [B, 1]
        student = batch.engine_logprobs if batch.old_logprobs is None else torch.where(
            known, batch.engine_logprobs, batch.old_logprobs)
    assert student is not None
    mask = batch.loss_mask
    advantages = distill_advantages(student, teacher_logprobs, mask, advantage_clip)
    log_ratio = torch.where(mask.bool(), student - teacher_logprobs, torch.zeros_like(student))  # [B, T]
    metrics = {
        "distill/reverse_kl": float(masked_mean(log_ratio, mask)),  # single-sample estimate per token
        "distill/teacher_logprob": float(masked_mean(torch.where(mask.bool(), teacher_logprobs, 0.0), mask)),
        "distill/student_logprob": float(masked_mean(torch.where(mask.bool(), student, 0.0), mask)),
        "distill/tokens": float(mask.sum()),
    }
    if advantage_clip is not None:
        clipped = (log_ratio.abs() > advantage_clip) & mask.bool()
        metrics["distill/advantage_clipped_frac"] = float(masked_mean(clipped.float(), mask))
    return dataclasses.replace(batch, advantages=advantages), metrics


# --- GKD: generalized Jensen-Shannon divergence ----------------------------------------------------


def _jsd_rows(student_logp: Tensor, teacher_logp: Tensor, beta: float) -> Tensor:
    """Generalized JSD per row of two log-distributions [n, V] -> [n] (float32)."""
    def kl(p_log: Tensor, q_log: Tensor) -> Tensor:  # KL(p || q) per row; 0 * log 0 = 0
        p = p_log.exp()
        return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(-1)

    if beta == 0.0:
        return kl(teacher_logp, student_logp)  # forward KL(T || S)
    if beta == 1.0:
        return kl(student_logp, teacher_logp)  # reverse KL(S || T)
    mixture = torch.logaddexp(student_logp + math.log(1.0 - beta), teacher_logp + math.log(beta))  # log M
    return beta * kl(teacher_logp, mixture) + (1.0 - beta) * kl(student_logp, mixture)


def _jsd_grad_rows(student_logp: Tensor, teacher_logp: Tensor, beta: float) -> Tensor:
    """d JSD / d student logits [n, V]. With S = softmax(z) and g_i = dJ/dS_i, dJ/dz = S (g - sum S g):
    beta in (0,1): g = (1-beta) log(S/M) (the terms of d log M cancel since sum M d(log M) = 0);
    beta = 1: g = log S - log T + 1 (the 1 cancels); beta = 0: dJ/dz = S - T directly."""
    p = student_logp.exp()
    if beta == 0.0:
        return p - teacher_logp.exp()
    if beta == 1.0:
        g = student_logp - teacher_logp
    else:
        mixture = torch.logaddexp(student_logp + math.log(1.0 - beta), teacher_logp + math.log(beta))
        g = (1.0 - beta) * (student_logp - mixture)
    return p * (g - (p * g).sum(-1, keepdim=True))


class _ChunkedGeneralizedJSD(torch.autograd.Function):
    """(student logits [N, V], teacher logits [N, V], rows [R]) -> JSD [N] float32, 0 off ``rows``.

    Saves only the two logits tensors (which exist anyway); forward and backward take the
    log-softmax of ``chunk_rows`` selected positions at a time, so temporaries stay [chunk, V]."""

    @staticmethod
    def forward(ctx: Any, student: Tensor, teacher: Tensor, rows: Tensor, beta: float, chunk_rows: int) -> Tensor:
        out = torch.zeros(student.shape[0], dtype=torch.float32, device=student.device)
        for start in range(0, rows.numel(), chunk_rows):
            index = rows[start : start + chunk_rows]
            s = torch.log_softmax(student.index_select(0, index).float(), dim=-1)  # [n_c, V]
            t = torch.log_softmax(teacher.index_select(0, index).float(), dim=-1)
            out[index] = _jsd_rows(s, t, beta)
        ctx.save_for_backward(student, teacher, rows)
        ctx.beta, ctx.chunk_rows = beta, chunk_rows
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        student, teacher, rows = ctx.saved_tensors
        grad = torch.zeros_like(student)  # [N, V]: rows not selected get no gradient
        for start in range(0, rows.numel(), ctx.chunk_rows):
            index = rows[start : start + ctx.chunk_rows]
            s = torch.log_softmax(student.index_select(0, index).float(), dim=-1)
            t = torch.log_softmax(teacher.index_select(0, index).float(), dim=-1)
            g = _jsd_grad_rows(s, t, ctx.beta) * grad_out[index, None].float()
            grad.index_copy_(0, index, g.to(student.dtype))
        return grad, None, None, None, None


def generalized_jsd(
    student_logits: Tensor, teacher_logits: Tensor, beta: float, mask: Tensor | None = None,
    chunk_rows: int = JSD_CHUNK_ROWS,
) -> Tensor:
    """GKD's generalized JSD between ``softmax(student_logits)`` and ``softmax(teacher_logits)`` per
    position: logits [..., V] -> [...] float32, differentiable in the student's logits only.

    ``JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M)``, ``M = beta T + (1 - beta) S``; ``beta = 0``
    is the forward KL(T || S) and ``beta = 1`` the reverse KL(S || T) (the plain formula would give 0
    at both ends). ``mask`` [...]: only positions where it is nonzero are computed (0 elsewhere).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: the models' vocabularies differ")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    lead = student_logits.shape[:-1]
    flat_student = student_logits.reshape(-1, student_logits.shape[-1])  # a view for contiguous logits
    flat_teacher = teacher_logits.detach().reshape(-1, teacher_logits.shape[-1])
    selected = torch.ones(flat_student.shape[0], dtype=torch.bool, device=flat_student.device) if mask is None \
        else mask.reshape(-1).to(flat_student.device).bool()
    rows = selected.nonzero().squeeze(-1)
    out = _ChunkedGeneralizedJSD.apply(flat_student, flat_teacher, rows, float(beta), int(chunk_rows))
    return out.reshape(lead)


def token_generalized_jsd(model: Any, teacher: Any, part: Batch, beta: float, chunk_rows: int = JSD_CHUNK_ROWS) -> Tensor:
    """Per-token JSD of one micro-batch, [b, T] target-aligned like ``Batch.loss_mask``: column ``t``
    compares the two next-token distributions at position ``t`` (where token ``t + 1`` was sampled);
    computed on loss-mask columns only, 0 elsewhere. Gradient flows into ``model`` only."""
    first = part.first_loss_column
    student_logits = forward_logits(model, part.input_ids, part.attention_mask, first)  # [b, L - first, V]
    with torch.no_grad():
        teacher_logits = forward_logits(teacher, part.input_ids, part.attention_mask, first)
    # the logits' last position predicts nothing (no target): a zero mask column stands for it
    mask = torch.cat([part.loss_mask[:, first:], part.loss_mask.new_zeros(part.size, 1)], dim=1)  # [b, L - first]
    jsd = generalized_jsd(student_logits, teacher_logits, beta, mask=mask, chunk_rows=chunk_rows)
    return pad_front(jsd[:, :-1], first)  # [b, T]


def jsd_update(
    model: torch.nn.Module, teacher: torch.nn.Module, batch: Batch, beta: float, optimizer: torch.optim.Optimizer,
    scheduler: Any, *, micro_batch_size: int, max_grad_norm: float | None, train_mode: bool = False,
) -> dict[str, float]:
    """One optimizer step on the token-mean generalized JSD of ``batch`` (full-batch normalizers in
    every micro-batch, so accumulation equals one big batch); ``train/`` metrics like ``policy_update``."""
    device = next(model.parameters()).device
    parts: list[dict[str, float]] = []
    model.train(train_mode)
    try:
        optimizer.zero_grad(set_to_none=True)
        for part in split_microbatches(batch, micro_batch_size):
            part = part.to(device)
            jsd = token_generalized_jsd(model, teacher, part, beta)  # [b, T]
            loss = aggregate(jsd, part.loss_mask, "token_mean", normalizers=part.normalizers)
            loss.backward()
            parts.append({"loss": float(loss.detach()), "jsd": float(masked_mean(jsd.detach(), part.loss_mask)),
                          "num_tokens": float(part.loss_mask.sum())})
        grad_norm = clip_gradients(model.parameters(), max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
    finally:
        model.eval()
    out = {f"train/{key}": value for key, value in reduce_part_metrics(parts).items()}
    out.update({"train/grad_norm": grad_norm, "lr": lr})
    return out


# --- the loop --------------------------------------------------------------------------------------


def policy_loss_config(cfg: DistillConfig) -> PolicyLossConfig:
    """The policy loss of ``cfg.loss`` with ``cfg.tis_cap`` (no KL term: the teacher is the target);
    for ``jsd`` the defaults (only ``load_policy`` reads it then, for its ``kl_coef`` of 0)."""
    if cfg.loss == "jsd":
        return PolicyLossConfig()
    return PolicyLossConfig(loss=cfg.loss, tis_cap=cfg.tis_cap)


@dataclass
class DistillRun:
    """What the distillation loop holds from one step to the next (built by ``prepare_run``)."""

    cfg: DistillConfig
    loss_cfg: PolicyLossConfig
    run_dir: Path
    model: Any
    tokenizer: Any
    teacher: Teacher
    renderer: Any
    sampler: Any
    pad_id: int
    temperature: float  # > 0 (validated): the trainer scores what the engine sampled from
    optimizer: Any
    scheduler: Any
    train_tasks: list[Any]
    test_tasks: list[Any]
    logger: MetricsLogger = None  # type: ignore[assignment]  (set by prepare_run)
    progress: ProgressBar = None  # type: ignore[assignment]
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def eval_seed(self) -> int:
        return self.cfg.seed + 1_000_003


def train_distill(cfg: DistillConfig, resume: bool = False, stop_at_step: int | None = None) -> DistillResult:
    """Run on-policy distillation as ``cfg`` says; ``resume`` continues from the latest intact
    checkpoint in ``cfg.output_dir``. ``stop_at_step`` returns right after that step without saving,
    as if the process had been killed there (tests check that resume then equals a straight run)."""
    run = prepare_run(cfg, resume)
    final_dir = None
    try:
        while run.step < cfg.steps:
            t_start = time.perf_counter()
            groups, metrics = collect_step(run, t_start)    # 1. the student's own episodes
            # 2. token-exact examples (loss mask 1 on sampled tokens), advantages filled in by the teacher
            data = examples_from_groups(groups, run.renderer, max_length=cfg.max_length)
            metrics.update({"examples/count": float(len(data.examples)),
                            "examples/dropped_too_long": float(data.dropped_too_long)})
            t_train = time.perf_counter()
            if data.examples:
                metrics.update(update_student(run, data))   # 3. the teacher grades every sampled token, 4. update, sync
            run.step += 1
            metrics.update(step_times(t_start, t_train))
            end_of_step(run, metrics, groups)               # 5. evaluate, log
            if stops_here(run.step, stop_at_step, cfg.steps):
                return DistillResult(run.run_dir, None, run.step, run.history)
            maybe_checkpoint(run)
        final_dir = save_final(run.model, run.tokenizer, run.run_dir, {
            "base_model": cfg.model.name, "lora": cfg.lora.enabled, "renderer": cfg.model.renderer or cfg.model.name,
            "recipe": "distill", "env": cfg.env.name, "teacher": cfg.teacher.model,
            "untrusted_tool_output": cfg.rollout.untrusted_tool_output})
    finally:
        run.progress.close()
        run.logger.close(final_dir)
        run.teacher.close()
    return DistillResult(run.run_dir, final_dir, run.step, run.history)


# --- the steps of the loop -------------------------------------------------------------------------


def prepare_run(cfg: DistillConfig, resume: bool) -> DistillRun:
    """Load tasks, the student (policy, sampler, optimizer) and the teacher (tokenizer checked),
    restore a checkpoint and log step 0."""
    from tracegym.envs import make

    run_dir = Path(cfg.output_dir)
    check_run_dir(run_dir, resume)
    loss_cfg = policy_loss_config(cfg)
    probe = make(cfg.env.name, **cfg.env.options)  # a bad env name/option fails before any model loads
    train_tasks, test_tasks = split_tasks(cfg, probe)
    dump_config(cfg, run_dir)
    seed_everything(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, _ = load_policy(cfg, loss_cfg, device)  # type: ignore[arg-type]  (same section names)
    teacher = make_teacher(cfg.teacher, cfg.model.dtype, device, tokenizer)  # tokenizer checked
    renderer = make_renderer(cfg, tokenizer)  # type: ignore[arg-type]
    sampler = make_sampler(cfg, model, tokenizer, renderer)  # type: ignore[arg-type]
    optimizer = build_optimizer(model, cfg.optim)
    run = DistillRun(cfg, loss_cfg, run_dir, model, tokenizer, teacher, renderer, sampler,
                     pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
                     temperature=cfg.rollout.temperature, optimizer=optimizer,
                     scheduler=build_scheduler(optimizer, cfg.optim, cfg.steps), train_tasks=train_tasks,
                     test_tasks=test_tasks)
    restored = load_latest_intact(run_dir, model, optimizer, run.scheduler) if resume else None
    if restored is not None:
        check_resumed_tasks(restored, cfg, train_tasks)
        run.step = restored.step
        sampler.update_weights(model)
    start_logging(run, resume, cfg.steps, "distill", lambda: log_start(run))
    return run


def log_start(run: DistillRun) -> None:
    """Row 0: parameter counts and optionally an evaluation."""
    cfg = run.cfg
    trainable, total = count_parameters(run.model)
    row: dict[str, Any] = {"params/trainable": trainable, "params/total": total}
    if run.test_tasks and cfg.eval.at_start:
        row.update(evaluate_policy(cfg, run.sampler, run.renderer, run.test_tasks, run.eval_seed))  # type: ignore[arg-type]
    run.history.append(run.logger.log(0, row))


def collect_step(run: DistillRun, t_start: float) -> tuple[list[Any], dict[str, Any]]:
    """The step's tasks and the student's own episodes of them (the hf engine records each sampled
    token's log-prob); the row's rollout figures."""
    cfg = run.cfg
    tasks = tasks_at(run.train_tasks, cfg.seed, run.step * cfg.tasks_per_step, cfg.tasks_per_step)
    groups, result = collect_groups(run.sampler, cfg, tasks, run.renderer,  # type: ignore[arg-type]
                                    seed=cfg.seed * 1_000_003 + run.step)
    metrics: dict[str, Any] = rollout_metrics(groups, [result])
    metrics["time/rollout_s"] = time.perf_counter() - t_start
    return groups, metrics


def update_student(run: DistillRun, data: Any) -> dict[str, Any]:
    """The teacher's log-probs of the sampled tokens (advantages ``-(log pi_student - log pi_teacher)``),
    one update (importance-weighted PG, or GKD's JSD), then the sampler's weight sync."""
    cfg = run.cfg
    batch = make_batch(data.examples, pad_token_id=run.pad_id, group_ids=data.group_index)
    batch, metrics = score_with_teacher(
        run.model, run.teacher, batch, run.loss_cfg, micro_batch_size=cfg.micro_batch_size, temperature=run.temperature,
        student_logprobs=cfg.student_logprobs, advantage_clip=cfg.advantage_clip, top_p=cfg.rollout.top_p)
    metrics = dict(metrics)
    if cfg.loss == "jsd":  # the sampled-token scoring above then only feeds the distill/ metrics
        assert isinstance(run.teacher, LocalTeacher)  # the config refuses jsd with another engine
        metrics.update(jsd_update(run.model, run.teacher.module, batch, cfg.jsd_beta, run.optimizer, run.scheduler,
                                  micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.optim.max_grad_norm,
                                  train_mode=cfg.model.gradient_checkpointing))
    else:
        metrics.update(policy_update(run.model, batch, run.loss_cfg, run.optimizer, run.scheduler, epochs=1,
                                     micro_batch_size=cfg.micro_batch_size, temperature=run.temperature,
                                     max_grad_norm=cfg.optim.max_grad_norm,
                                     train_mode=cfg.model.gradient_checkpointing))
    run.sampler.update_weights(run.model)
    return metrics


def end_of_step(run: DistillRun, metrics: dict[str, Any], groups: list[Any]) -> None:
    """Evaluate when due, log the row and move the progress bar."""
    cfg = run.cfg
    if run.test_tasks and ((cfg.eval.every and run.step % cfg.eval.every == 0) or run.step == cfg.steps):
        metrics.update(evaluate_policy(cfg, run.sampler, run.renderer, run.test_tasks,  # type: ignore[arg-type]
                                       run.eval_seed))
    if run.step % cfg.logging.log_every == 0 or run.step == cfg.steps:
        run.history.append(run.logger.log(run.step, metrics))
    kl_text = f" reverse_kl {metrics['distill/reverse_kl']:.4f}" if "distill/reverse_kl" in metrics else ""
    run.progress.update(1, info=f"reward {metrics['reward/mean']:.3f}{kl_text}",
                        tokens=int(sum(t.num_generated_tokens for g in groups for t in g.trajectories)))


def maybe_checkpoint(run: DistillRun) -> None:
    """Every ``checkpoint.every`` steps and at the last: weights, optimizer, scheduler and the tasks
    trained on (their seed and count; the cursor is ``step * tasks_per_step``)."""
    cfg = run.cfg
    if (cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0) or run.step == cfg.steps:
        state = {"tasks": {"seed": cfg.tasks.seed, "train": len(run.train_tasks)},
                 "task_cursor": run.step * cfg.tasks_per_step}
        save_checkpoint(run.run_dir, run.step, run.model, run.optimizer, run.scheduler, state,
                        keep_last=cfg.checkpoint.keep_last)



__all__ = [
    "DistillResult", "EngineTeacher", "LocalTeacher", "Teacher", "check_remote_tokenizer", "check_same_tokenizer",
    "distill_advantages", "engine_teacher_logprobs", "generalized_jsd", "jsd_update", "load_teacher", "make_teacher",
    "policy_loss_config", "remote_tokenizer_mismatch", "score_with_teacher", "teacher_sequences",
    "token_generalized_jsd", "tokenizer_mismatch", "train_distill",
]
