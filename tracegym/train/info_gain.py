"""InfoPO-style information gain of each turn's observation, scored with the policy model.

For turn ``t`` of a trajectory that has a turn ``t+1``::

    I_t = (1/|a_{t+1}|) sum_j [ log pi(a_{t+1,j} | h, o_t, a_{t+1,<j}) - log pi(a_{t+1,j} | h, o~, a_{t+1,<j}) ]

``h`` is the conversation up to and including turn ``t``'s assistant message, ``o_t`` the env's
answer to it (``Turn.env_messages``: tool results, user turns) and ``o~`` the same messages (roles,
tool names and tool-call ids kept) with every content replaced by a neutral placeholder
("No information found."). ``a_{t+1}`` are the tokens sampled in turn ``t+1``
(``turns[t+1].completion_ids``). ``I_t`` says how much the observation moved the policy towards the
action it then took; InfoPO credits it to ``a_t``, the action that produced the observation. The
last turn has no next action: ``I = 0`` (and so has a turn whose next completion is empty).

Prompts, token-exact:

- actual: ``turns[t+1].prompt_ids`` (what the engine saw);
- counterfactual: ``renderer.continue_prompt(turns[t].prompt_ids, turns[t].completion_ids, o~)``:
  the recorded tokens of the prefix, then the placeholder messages and the generation prompt,
  rendered as the rollout runner renders a real observation.

The rollout runner builds ``turns[t+1].prompt_ids`` with exactly that call on ``o_t``. When a
trajectory's recorded prompt differs from it (a trajectory from elsewhere, another renderer), the
actual prompt is re-rendered the same way with ``o_t`` so the two prompts differ in the
observation only (logged once as a warning).

Unlike the InfoPO reference code, which overwrites the observation's tokens in place with the
placeholder's (padded or cut to the observation's token length), the placeholder is rendered as the
message content: the counterfactual prompt is a well-formed conversation, and its length differs
from the actual one by the length difference of the contents.

Both prompts are scored teacher-forced under ``torch.no_grad`` in eval mode, at the sampling
temperature (``token_logprobs``), in micro-batches of right-padded sequences sorted by length.
Identical (prompt, completion) sequences are scored once, so a placeholder equal to the
observation gives ``I_t = 0`` exactly.

``score_info_gain`` returns new groups with ``Turn.metrics["info_gain"] = I_t`` on every turn; the
``info_gain`` advantage estimator (``tracegym.algos.info_gain``) reads them.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch

from tracegym.train.logprobs import token_logprobs
from tracegym.train.step_prefix import StepPrefix
from tracegym.types import Message, Trajectory, TrajectoryGroup, Turn

logger = logging.getLogger(__name__)

DEFAULT_PLACEHOLDER = "No information found."
METRIC = "info_gain"


def placeholder_messages(messages: Sequence[Message], placeholder: str = DEFAULT_PLACEHOLDER) -> list[Message]:
    """``messages`` with every content replaced by ``placeholder`` (role, name, tool-call id kept)."""
    return [m.model_copy(update={"content": placeholder}) for m in messages]


def counterfactual_prompt(turn: Turn, renderer: Any, placeholder: str = DEFAULT_PLACEHOLDER) -> list[int]:
    """The prompt of the turn after ``turn`` with ``turn.env_messages`` replaced by the placeholder."""
    return list(renderer.continue_prompt(turn.prompt_ids, turn.completion_ids,
                                         placeholder_messages(turn.env_messages, placeholder)))


def _next_prompts(trajectory: Trajectory, t: int, renderer: Any, placeholder: str, warned: list[bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(actual prompt, counterfactual prompt) of turn ``t + 1``."""
    turn, following = trajectory.turns[t], trajectory.turns[t + 1]
    actual = tuple(following.prompt_ids)
    rebuilt = tuple(renderer.continue_prompt(turn.prompt_ids, turn.completion_ids, list(turn.env_messages)))
    if rebuilt != actual:
        if not warned[0]:
            logger.warning(
                "info_gain: task %s sample %d turn %d: the recorded prompt is not continue_prompt(previous prompt, "
                "completion, env messages); scoring the re-rendered prompt instead (further cases not logged)",
                trajectory.task_id, trajectory.sample_index, t + 1)
            warned[0] = True
        actual = rebuilt
    return actual, tuple(counterfactual_prompt(turn, renderer, placeholder))


def _pad_id(renderer: Any, pad_token_id: int | None) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    tokenizer = getattr(renderer, "tokenizer", None)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def mean_completion_logprobs(
    model: Any,
    sequences: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    *,
    temperature: float = 1.0,
    micro_batch_size: int = 4,
    pad_token_id: int = 0,
    prefix: StepPrefix | None = None,
) -> list[float]:
    """``(1/n) sum_j log pi(c_j | p, c_<j)`` of every ``(prompt p, completion c)`` (c non-empty),
    teacher-forced, no gradient, in micro-batches of right-padded sequences sorted by length.
    ``prefix``: a prefix the prompts share, already run (``tracegym.train.step_prefix``)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    for prompt, completion in sequences:
        if not prompt or not completion:
            raise ValueError("every sequence needs a non-empty prompt and completion")
    device = next(iter(model.parameters())).device
    order = sorted(range(len(sequences)), key=lambda k: len(sequences[k][0]) + len(sequences[k][1]))
    out = [0.0] * len(sequences)
    for start in range(0, len(order), micro_batch_size):
        part = order[start : start + micro_batch_size]
        rows = [list(sequences[k][0]) + list(sequences[k][1]) for k in part]
        length = max(len(r) for r in rows)
        ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[r, : len(row)] = 1
        # column c predicts token c + 1: the completion of prompt length p sits in columns p-1 .. p+n-2
        first = min(len(sequences[k][0]) for k in part) - 1
        logp = token_logprobs(model, ids.to(device), mask.to(device), temperature=temperature, first_column=first,
                              prefix=prefix)
        logp = logp.double().cpu()
        for r, k in enumerate(part):
            p, n = len(sequences[k][0]), len(sequences[k][1])
            out[k] = float(logp[r, p - 1 : p - 1 + n].mean())
    return out


def score_info_gain(
    groups: Sequence[TrajectoryGroup],
    model: Any,
    renderer: Any,
    *,
    placeholder: str = DEFAULT_PLACEHOLDER,
    temperature: float = 1.0,
    micro_batch_size: int = 4,
    pad_token_id: int | None = None,
) -> list[TrajectoryGroup]:
    """New groups whose every turn carries ``metrics["info_gain"] = I_t`` (see the module docstring).

    ``temperature``: the sampling temperature (log-probs of ``softmax(logits / temperature)``).
    ``pad_token_id``: padding of the micro-batches (masked out; default: the tokenizer's pad or eos).
    The model is put in eval mode for the scoring and given back in the mode it was in.
    """
    warned = [False]
    # (group, trajectory, turn) -> (actual key, counterfactual key); equal keys give exactly 0
    pairs: dict[tuple[int, int, int], tuple[tuple, tuple]] = {}
    unique: dict[tuple, int] = {}
    for g, group in enumerate(groups):
        for i, trajectory in enumerate(group.trajectories):
            for t in range(len(trajectory.turns) - 1):
                action = tuple(trajectory.turns[t + 1].completion_ids)
                if not action:
                    continue
                actual, counterfactual = _next_prompts(trajectory, t, renderer, placeholder, warned)
                if actual == counterfactual:
                    continue
                keys = ((actual, action), (counterfactual, action))
                for key in keys:
                    unique.setdefault(key, len(unique))
                pairs[(g, i, t)] = keys
    values: list[float] = []
    if unique:
        was_training = bool(getattr(model, "training", False))
        model.eval()
        try:
            with torch.no_grad():
                values = mean_completion_logprobs(model, list(unique), temperature=temperature,
                                                  micro_batch_size=micro_batch_size,
                                                  pad_token_id=_pad_id(renderer, pad_token_id))
        finally:
            model.train(was_training)
    out: list[TrajectoryGroup] = []
    for g, group in enumerate(groups):
        trajectories = []
        for i, trajectory in enumerate(group.trajectories):
            turns = []
            for t, turn in enumerate(trajectory.turns):
                keys = pairs.get((g, i, t))
                gain = values[unique[keys[0]]] - values[unique[keys[1]]] if keys is not None else 0.0
                if not math.isfinite(gain):
                    raise ValueError(
                        f"info_gain scoring: task {group.task_id} sample {trajectory.sample_index} turn {t}: the "
                        f"next turn's mean log-prob difference is {gain!r} (a non-finite log-prob under the policy)"
                    )
                turns.append(turn.model_copy(update={"metrics": {**turn.metrics, METRIC: float(gain)}}))
            trajectories.append(trajectory.model_copy(update={"turns": tuple(turns)}))
        out.append(group.model_copy(update={"trajectories": tuple(trajectories)}))
    return out


__all__ = ["DEFAULT_PLACEHOLDER", "counterfactual_prompt", "mean_completion_logprobs", "placeholder_messages",
           "score_info_gain"]
