"""Pass-rate curriculum (``tasks.curriculum``): spend the rollouts on tasks whose groups disagree.

Group-relative estimators (GRPO and its kin) learn only from the differences between the samples
of one task: a group that is solved every time, or never, has all advantages 0 and trains nothing
(``skip_uniform_groups`` drops it, and DAPO's dynamic sampling, ``resample_rounds``, draws further
tasks within the step to replace it). The same holds across steps: once the policy is competent,
most tasks are always solved or never solved, and the plain seeded order spends most rollouts on
them. A task's reward is a Bernoulli with its pass rate p; the variance p(1-p) is what a group
baseline leaves to learn from (0 at p in {0, 1}, largest at p = 1/2), and a group of G samples is
uniform with probability p^G + (1-p)^G. So the curriculum keeps an estimate of p per train task and
draws tasks with 0 < p < 1 with weight p(1-p), the expected signal of their next group.

The estimate is successes / attempts over the task's last ``window`` groups (a sliding window of
counts, not an exponential moving average): it reaches exactly 0 or 1 when the recent groups all
agree, so "no signal expected" is a plain integer test; an average that keeps a share of every old
group never reaches 0 or 1 again, and a task solved long ago would stay "informative" forever.

An ``explore`` share of every draw goes to the tasks without an informative estimate, ranked by
when they were last tried: never tried ones first (in the plain seeded order, so a run's first step
draws exactly the tasks the plain order would), then those seen solved or failed every time, least
recently tried first. So no task is dropped for good: a task the policy mastered or gave up on comes
back for a re-check once the fresher ones have had theirs, and a policy that improved (or forgot)
moves it back into the informative pool. The same ranking fills any share that lacks candidates
(no informative task yet, or no uninformative one left).

The draw is a pure function of the estimates and an RNG derived from (seed, step, round)
(:func:`curriculum_rng`); with :meth:`PassRateCurriculum.state_dict` in the checkpoint, a resumed
run draws the same tasks as an uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

#: ``last_tried`` of a task never tried: ranks before every step index.
NEVER = -1


def curriculum_rng(seed: int, step: int, round_index: int = 0) -> np.random.Generator:
    """The generator of step ``step``'s draw (``round_index``: a dynamic-sampling round of further
    tasks): derived, like ``tasks_at``'s order, from numbers alone, so resume needs no RNG state."""
    return np.random.default_rng([seed, 4273, step, round_index])


class PassRateCurriculum:
    """Per-train-task pass-rate estimates and the draw of a step's tasks from them.

    Tasks are the indices ``0 .. num_tasks-1`` of the train-task list. ``order``: the plain seeded
    order (a permutation of the indices) that breaks ties between tasks tried equally long ago,
    never tried ones included; ``range(num_tasks)`` when not given.
    """

    def __init__(self, num_tasks: int, explore: float = 0.25, window: int = 2,
                 order: Sequence[int] | None = None) -> None:
        if num_tasks <= 0:
            raise ValueError(f"a curriculum needs at least one task, got {num_tasks}")
        if not 0.0 <= explore <= 1.0:
            raise ValueError(f"explore is a share in [0, 1], got {explore}")
        if window <= 0:
            raise ValueError(f"window counts groups and must be positive, got {window}")
        order = list(range(num_tasks)) if order is None else [int(i) for i in order]
        if sorted(order) != list(range(num_tasks)):
            raise ValueError(f"order must be a permutation of 0..{num_tasks - 1}")
        self.num_tasks, self.explore, self.window = num_tasks, explore, window
        self.rank = [0] * num_tasks  # position of each task in the plain seeded order
        for position, index in enumerate(order):
            self.rank[index] = position
        self.recent: list[list[tuple[int, int]]] = [[] for _ in range(num_tasks)]  # (successes, attempts) per group
        self.last_tried = [NEVER] * num_tasks  # step of the task's latest draw

    # -- estimates --

    def counts(self, index: int) -> tuple[int, int]:
        """(successes, attempts) over the task's last ``window`` groups."""
        window = self.recent[index]
        return sum(s for s, _ in window), sum(a for _, a in window)

    def pass_rate(self, index: int) -> float | None:
        """The estimated pass rate of task ``index``; None before any of its episodes finished."""
        successes, attempts = self.counts(index)
        return successes / attempts if attempts else None

    def is_informative(self, index: int) -> bool:
        """Its recent samples disagree (0 < p < 1): its next group is expected to carry signal."""
        successes, attempts = self.counts(index)
        return 0 < successes < attempts

    def record(self, index: int, successes: int, attempts: int, step: int) -> None:
        """Task ``index`` was drawn at ``step`` and ``successes`` of its ``attempts`` kept episodes
        succeeded. ``attempts`` 0 (every episode failed in the env) only marks it tried."""
        if not 0 <= successes <= attempts:
            raise ValueError(f"successes must be within 0..attempts, got {successes} of {attempts}")
        self.last_tried[index] = step
        if attempts:
            self.recent[index] = (self.recent[index] + [(successes, attempts)])[-self.window:]

    # -- the draw --

    def pick(self, count: int, rng: np.random.Generator, exclude: Iterable[int] = ()) -> list[int]:
        """``count`` task indices: ``round(explore * count)`` from the uninformative tasks (never
        tried first, then least recently tried), the rest drawn without replacement from the
        informative ones with weight p(1-p); either share that lacks candidates is filled from the
        other. ``exclude``: tasks already drawn this step (an earlier dynamic-sampling round). Only
        when ``count`` exceeds the tasks left does a task appear twice (as an epoch wrap does in the
        plain order)."""
        excluded = set(exclude)
        pool = [i for i in range(self.num_tasks) if i not in excluded]
        informative = [i for i in pool if self.is_informative(i)]
        uninformative = self._by_staleness(i for i in pool if not self.is_informative(i))
        explore_share = min(count, math.floor(self.explore * count + 0.5))  # half up: 0.25 of 2 is 1
        exploit = min(count - min(explore_share, len(uninformative)), len(informative))
        picked: list[int] = []
        if exploit:
            weights = np.array([self._signal(i) for i in informative])
            chosen = rng.choice(len(informative), size=exploit, replace=False, p=weights / weights.sum())
            picked = [informative[int(j)] for j in chosen]
        picked += uninformative[:count - len(picked)]
        if len(picked) < count:  # more tasks asked than are left this step: repeat, stalest first
            everything = self._by_staleness(range(self.num_tasks))
            while len(picked) < count:
                picked += everything[:count - len(picked)]
        return picked

    def _signal(self, index: int) -> float:
        p = self.pass_rate(index)
        return 0.0 if p is None else p * (1.0 - p)

    def _by_staleness(self, indices: Iterable[int]) -> list[int]:
        return sorted(indices, key=lambda i: (self.last_tried[i], self.rank[i]))

    # -- checkpoints --

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and lists (checkpoints load with ``torch.load(weights_only=True)``)."""
        return {"num_tasks": self.num_tasks, "recent": [[list(g) for g in window] for window in self.recent],
                "last_tried": list(self.last_tried)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_tasks"]) != self.num_tasks:
            raise ValueError(f"the saved curriculum covers {state['num_tasks']} train tasks, this run has {self.num_tasks}")
        # a smaller ``window`` than the saved run's keeps only the newest groups
        self.recent = [[(int(s), int(a)) for s, a in window][-self.window:] for window in state["recent"]]
        self.last_tried = [int(step) for step in state["last_tried"]]


@dataclass
class CurriculumStats:
    """What the draws since the trainer last asked looked like (``curriculum/*`` metrics)."""

    picked: int = 0
    explored: int = 0  # never tried before
    revisited: int = 0  # seen solved every time or failed every time: a re-check
    informative: int = 0  # 0 < p < 1 when drawn
    pass_rates: list[float] = field(default_factory=list)  # estimates of the drawn tasks that had one

    def add(self, curriculum: PassRateCurriculum, picked: Sequence[int]) -> None:
        """Count a draw, with the estimates as they were when it was drawn."""
        for index in picked:
            p = curriculum.pass_rate(index)
            self.picked += 1
            self.explored += curriculum.last_tried[index] == NEVER
            self.informative += curriculum.is_informative(index)
            if p is not None:
                self.pass_rates.append(p)
                self.revisited += p in (0.0, 1.0)

    def metrics(self, curriculum: PassRateCurriculum) -> dict[str, float]:
        """``curriculum/mean_pass_rate`` (of the drawn tasks that had an estimate; absent when none
        had), ``explored``, ``revisited``, ``informative_share``, and the pools now:
        ``informative_tasks`` (0 < p < 1) and ``unseen_tasks`` (never tried)."""
        out = {
            "curriculum/explored": float(self.explored),
            "curriculum/revisited": float(self.revisited),
            "curriculum/informative_share": self.informative / self.picked if self.picked else 0.0,
            "curriculum/informative_tasks": float(sum(curriculum.is_informative(i) for i in range(curriculum.num_tasks))),
            "curriculum/unseen_tasks": float(sum(step == NEVER for step in curriculum.last_tried)),
        }
        if self.pass_rates:
            out["curriculum/mean_pass_rate"] = sum(self.pass_rates) / len(self.pass_rates)
        return out


def make_curriculum(settings: Any, num_tasks: int, order: Sequence[int]) -> PassRateCurriculum | None:
    """The curriculum ``tasks.curriculum`` asks for (``settings``: a ``CurriculumConfig`` or None);
    None when it is absent or disabled."""
    if settings is None or not settings.enabled:
        return None
    return PassRateCurriculum(num_tasks, explore=settings.explore, window=settings.window, order=order)
