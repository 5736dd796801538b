"""Preference data from rollouts: pairs of trajectories of one task (DPO, DMPO) and labelled
single trajectories (KTO), stored as JSONL a user can read.

``build_pairs`` groups trajectories by ``(env, task_id)``; within a task, a trajectory is preferred
over another when its episode reward is higher by at least ``min_gap`` (ties never make a pair)
and a failed episode is never preferred over a successful one. ``max_pairs_per_task`` caps the
pairs of a task, taking first those whose trajectories were used least (so with 3 successes and 3
failures and a cap of 3 each trajectory appears once), then the larger gaps.

Truncation at the first divergent turn (``truncate_at_divergence``): two samples of one task often
share their first turns token for token (same prompt, same sampled completion). Both are cut after
the first turn whose *sampled completion* differs while its prompt is the same, so the compared
sequences are "shared prefix + the two different actions": the prefix's log-probs cancel exactly in
the DPO margin and the divergent action is what is compared. When the env, not the policy, made
them differ first (a different observation after equal actions) nothing is cut. Two trajectories
with the same tokens in every turn carry no preference signal and are skipped.

Episodes that ended in an env or engine error say nothing about the policy and are left out, as
are trajectories without turns. Files: one ``PreferencePair`` (or ``LabelledTrajectory``) per JSON
line, written to a temporary file and renamed into place.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict

from tracegym.data.store import BadLineError
from tracegym.types import Trajectory, read_json_rows_numbered

__all__ = [
    "LabelledTrajectory",
    "PreferencePair",
    "build_pairs",
    "divergent_turn",
    "label_trajectories",
    "pairs_to_labelled",
    "read_labelled",
    "read_pairs",
    "truncate_trajectory",
    "write_labelled",
    "write_pairs",
]

log = logging.getLogger(__name__)

_ERROR_END_REASONS = ("env_error", "engine_error")


class PreferencePair(BaseModel):
    """Two trajectories of one task: ``chosen`` earned ``reward_gap`` more reward than ``rejected``.

    ``truncated_at``: both were cut after this turn (0-based), the first one whose sampled
    completions differ; None when they are whole."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env: str
    task_id: str
    chosen: Trajectory
    rejected: Trajectory
    reward_gap: float
    truncated_at: int | None = None


class LabelledTrajectory(BaseModel):
    """One trajectory labelled ``desirable`` (KTO's data): a success, or a reward above a threshold."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trajectory: Trajectory
    desirable: bool


def _usable(trajectory: Trajectory) -> bool:
    return bool(trajectory.turns) and trajectory.error is None and trajectory.end_reason not in _ERROR_END_REASONS


def divergent_turn(a: Trajectory, b: Trajectory) -> int | None:
    """The first turn where ``a`` and ``b`` saw the same prompt but sampled different completions;
    None when they never do before the env made them differ (different prompts), or one's turns
    are a prefix of the other's."""
    for index, (turn_a, turn_b) in enumerate(zip(a.turns, b.turns)):
        if turn_a.prompt_ids != turn_b.prompt_ids:
            return None
        if turn_a.completion_ids != turn_b.completion_ids:
            return index
    return None


def truncate_trajectory(trajectory: Trajectory, num_turns: int) -> Trajectory:
    """``trajectory`` with only its first ``num_turns`` turns, and its messages up to and including
    the last kept assistant message (the env's answer to it stays in that turn's ``env_messages``).
    Reward and success are the whole episode's (they are why it was chosen or rejected)."""
    if not 0 < num_turns <= len(trajectory.turns):
        raise ValueError(f"cannot keep {num_turns} of {len(trajectory.turns)} turns")
    messages, assistants = [], 0
    for message in trajectory.messages:
        messages.append(message)
        if message.role == "assistant":
            assistants += 1
            if assistants == num_turns:
                break
    info = {**trajectory.info, "truncated_from_turns": len(trajectory.turns)}
    return trajectory.model_copy(update={"turns": trajectory.turns[:num_turns], "messages": tuple(messages), "info": info})


def _pair(chosen: Trajectory, rejected: Trajectory, truncate: bool) -> PreferencePair | None:
    """The pair of two trajectories (truncated at their divergent turn when asked), or None when
    their tokens are the same in every turn (no signal)."""
    if [(t.prompt_ids, t.completion_ids) for t in chosen.turns] == [(t.prompt_ids, t.completion_ids) for t in rejected.turns]:
        return None
    cut = divergent_turn(chosen, rejected) if truncate else None
    if cut is not None:
        chosen, rejected = truncate_trajectory(chosen, cut + 1), truncate_trajectory(rejected, cut + 1)
    return PreferencePair(env=chosen.env, task_id=chosen.task_id, chosen=chosen, rejected=rejected,
                          reward_gap=chosen.reward - rejected.reward, truncated_at=cut)


def build_pairs(
    trajectories: Iterable[Trajectory],
    min_gap: float = 0.5,
    truncate_at_divergence: bool = True,
    max_pairs_per_task: int | None = None,
    counts: dict[str, int] | None = None,
) -> list[PreferencePair]:
    """Preference pairs from rollouts (see the module docstring), tasks in order of first appearance.

    ``counts`` (optional) is filled with ``trajectories``, ``unusable`` (errors, no turns),
    ``tasks``, ``tasks_with_pairs``, ``pairs``, ``truncated``, ``identical`` (same tokens, skipped)
    and ``capped`` (left out by ``max_pairs_per_task``).
    """
    if min_gap < 0:
        raise ValueError(f"min_gap must be >= 0, got {min_gap}")
    tally = {"trajectories": 0, "unusable": 0, "tasks": 0, "tasks_with_pairs": 0, "pairs": 0, "truncated": 0,
             "identical": 0, "capped": 0}
    groups: dict[tuple[str, str], list[Trajectory]] = {}
    for trajectory in trajectories:
        tally["trajectories"] += 1
        if not _usable(trajectory):
            tally["unusable"] += 1
            continue
        groups.setdefault((trajectory.env, trajectory.task_id), []).append(trajectory)
    pairs: list[PreferencePair] = []
    for group in groups.values():
        tally["tasks"] += 1
        # every ordered (better, worse) candidate, largest gap first, then sample order (deterministic)
        candidates = []
        for i, better in enumerate(group):
            for j, worse in enumerate(group):
                gap = better.reward - worse.reward
                if gap > 0 and gap >= min_gap and not (worse.success and not better.success):
                    candidates.append((-gap, i, j))
        candidates.sort()
        uses = [0] * len(group)
        made: list[PreferencePair] = []
        while candidates and (max_pairs_per_task is None or len(made) < max_pairs_per_task):
            # the candidate whose two trajectories were used least so far (ties: the order above)
            best = min(range(len(candidates)), key=lambda k: (uses[candidates[k][1]] + uses[candidates[k][2]], k))
            _, i, j = candidates.pop(best)
            pair = _pair(group[i], group[j], truncate_at_divergence)
            if pair is None:
                tally["identical"] += 1
                continue
            uses[i] += 1
            uses[j] += 1
            made.append(pair)
        tally["capped"] += len(candidates)
        tally["truncated"] += sum(p.truncated_at is not None for p in made)
        tally["tasks_with_pairs"] += bool(made)
        pairs.extend(made)
    tally["pairs"] = len(pairs)
    if counts is not None:
        counts.update(tally)
    return pairs


def label_trajectories(trajectories: Iterable[Trajectory], min_reward: float | None = None) -> list[LabelledTrajectory]:
    """KTO data: every usable trajectory, desirable when it succeeded or (``min_reward`` set) its
    reward is at least ``min_reward``; trajectories with an env/engine error or no turns are left out."""
    return [
        LabelledTrajectory(trajectory=t, desirable=t.success or (min_reward is not None and t.reward >= min_reward))
        for t in trajectories
        if _usable(t)
    ]


def pairs_to_labelled(pairs: Sequence[PreferencePair]) -> list[LabelledTrajectory]:
    """KTO data from pairs: each chosen trajectory desirable, each rejected one undesirable, every
    distinct trajectory once (one may be in several pairs)."""
    seen: set[str] = set()
    out: list[LabelledTrajectory] = []
    for pair in pairs:
        for trajectory, desirable in ((pair.chosen, True), (pair.rejected, False)):
            key = trajectory.model_dump_json()
            if key not in seen:
                seen.add(key)
                out.append(LabelledTrajectory(trajectory=trajectory, desirable=desirable))
    return out


# --- files ------------------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def _write_atomic(path: str | Path, items: Iterable[BaseModel]) -> int:
    """One JSON line per item into a temporary file, fsync'd and renamed onto ``path``: a reader
    never sees half a file. Returns the number of lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for item in items:
            f.write(item.model_dump_json() + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return n


def _read(path: str | Path, cls: type[M]) -> list[M]:
    """Every line of ``path`` as ``cls``; a torn line (not JSON) is skipped with a warning naming
    ``file:line``; valid JSON that is not a ``cls`` raises ``BadLineError`` naming ``file:line``."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{cls.__name__} file not found: {path}")
    rows, unreadable = read_json_rows_numbered(path)
    for number, reason in unreadable:
        log.warning("skipping %s:%d: %s", path, number, reason)
    out = []
    for number, row in rows:
        try:
            out.append(cls.model_validate(row))
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "(row)"
            raise BadLineError(path, number, f"not a {cls.__name__}: {where}: {first.get('msg', 'invalid')}") from None
    return out


def write_pairs(path: str | Path, pairs: Iterable[PreferencePair]) -> int:
    """Write pairs as JSONL (one ``PreferencePair`` per line, atomically); returns how many."""
    return _write_atomic(path, pairs)


def read_pairs(path: str | Path) -> list[PreferencePair]:
    """Read a pairs JSONL file written by ``write_pairs``."""
    return _read(path, PreferencePair)


def write_labelled(path: str | Path, items: Iterable[LabelledTrajectory]) -> int:
    """Write labelled trajectories as JSONL (one ``LabelledTrajectory`` per line, atomically)."""
    return _write_atomic(path, items)


def read_labelled(path: str | Path) -> list[LabelledTrajectory]:
    """Read a labelled-trajectories JSONL file written by ``write_labelled``."""
    return _read(path, LabelledTrajectory)
