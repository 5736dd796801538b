"""LLM-judge rewards (``reward.judge``): a language model behind any OpenAI-compatible endpoint scores
the episodes of a step, and its score joins the verifiable reward by weight.

Two modes:

- ``rubric``: each episode alone. The judge reads the rubric and the episode's transcript and replies
  ``{"reason": ..., "score": s}`` with ``s`` in [0, 1].
- ``ranking`` (RULER-style, group-relative; OpenPipe's RULER): the judge reads all episodes of one
  task together, labelled ``Attempt 1..N``, and scores each relative to the others
  (``{"scores": [{"id": 1, "score": s}, ...]}``). With ``position_bias: true`` the group is judged a
  second time with the attempts in a shuffled order; each episode's score is the mean of its two
  scores, and ``judge/position_bias`` is the mean ``|s_first - s_shuffled|`` (0: the order did not
  matter).

The reward of an episode becomes ``verifiable_weight * env_reward + weight * judge_score``: every
turn
reward is scaled by ``verifiable_weight`` and ``weight * judge_score`` is added to the last turn, so
the episode reward stays the sum of its turn rewards; ``reward/judge`` (the unweighted score) is
logged like any reward part, and the judge's raw replies are kept in ``Trajectory.info["judge"]``.

Failures are counted, never a silent 0: a reply that does not parse (``judge/parse_failures``) or a
judge that cannot be reached after its retries (``judge/errors``) fails the judgment of that
episode's group; ``on_failure: drop_group`` (default) leaves the group out of the step
(``judge/dropped_groups``: its rewards would not be comparable), ``stop`` raises. Replies are cached
by a hash of the request (in memory and, in a run, in ``judge_cache.jsonl`` in the run folder, so a
resumed run or a repeated evaluation pays nothing twice). Cost: ``judge/calls`` (requests sent),
``judge/cache_hits``, ``judge/tokens`` (prompt + completion tokens the server reported for the
requests sent), ``judge/seconds`` (wall time of the step's judging).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tracegym.config.rl import DEFAULT_RUBRIC, JudgeConfig
from tracegym.types import Message, Trajectory, TrajectoryGroup

__all__ = ["DEFAULT_RUBRIC", "GroupJudgment", "Judge", "agreement", "episode_raw", "JudgeConfig", "JudgeError", "JudgeStats", "judge_groups", "parse_ranking",
           "parse_score", "spearman", "transcript"]

_RAW_CHARS = 2_000  # of each raw reply kept in Trajectory.info


class JudgeError(RuntimeError):
    """A judgment that could not be made (``on_failure: stop``)."""


@dataclass
class JudgeStats:
    """What judging cost and how it went (one step, or one ``tracegym judge`` run)."""

    calls: int = 0
    cache_hits: int = 0
    tokens: int = 0
    seconds: float = 0.0
    parse_failures: int = 0
    errors: int = 0
    failed_groups: int = 0
    bias: list[float] = field(default_factory=list)  # |s_first - s_shuffled| of every re-judged episode
    scores: list[float] = field(default_factory=list)

    def merge(self, other: "JudgeStats") -> "JudgeStats":
        """The sum of two steps' (or rounds') stats."""
        return JudgeStats(self.calls + other.calls, self.cache_hits + other.cache_hits, self.tokens + other.tokens,
                          self.seconds + other.seconds, self.parse_failures + other.parse_failures,
                          self.errors + other.errors, self.failed_groups + other.failed_groups,
                          self.bias + other.bias, self.scores + other.scores)

    def metrics(self, prefix: str = "judge/") -> dict[str, float]:
        out = {"calls": float(self.calls), "cache_hits": float(self.cache_hits), "tokens": float(self.tokens),
               "seconds": self.seconds, "parse_failures": float(self.parse_failures), "errors": float(self.errors),
               "dropped_groups": float(self.failed_groups)}
        if self.scores:
            out["score_mean"] = sum(self.scores) / len(self.scores)
        if self.bias:
            out["position_bias"] = sum(self.bias) / len(self.bias)
        return {prefix + key: value for key, value in out.items()}


# --- what the judge reads -------------------------------------------------------------------------


def _message_text(message: Message) -> str:
    parts = [message.content] if message.content else []
    for call in message.tool_calls:
        parts.append(f"call {call.name}({json.dumps(call.arguments, ensure_ascii=False, sort_keys=True)})")
    return "\n".join(parts)


def transcript(trajectory: Trajectory, max_chars: int = 6_000) -> str:
    """The episode as the judge reads it: every message but the system prompt (the agent's
    instructions, the same in every episode), one ``[role]`` block each; the middle is cut when
    longer than ``max_chars``."""
    blocks = []
    for message in trajectory.messages:
        if message.role == "system":
            continue
        role = f"tool {message.name}" if message.role == "tool" and message.name else message.role
        blocks.append(f"[{role}]\n{_message_text(message).strip()}")
    text = "\n\n".join(blocks)
    if len(text) > max_chars:
        half = (max_chars - 40) // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    return text


_SYSTEM = ("You are an impartial judge of an AI agent's work. You read what the user asked and what the "
           "agent did, and you reply with JSON only.")


def rubric_messages(rubric: str, episode: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": _SYSTEM},
            {"role": "user", "content": f"Rubric:\n{rubric}\n\nThe agent's episode:\n{episode}\n\n"
                                        'Reply with a JSON object only: {"reason": "<one sentence>", "score": <a number from 0 to 1>}.'}]


def ranking_messages(rubric: str, episodes: Sequence[str]) -> list[dict[str, str]]:
    attempts = "\n\n".join(f"=== Attempt {i + 1} ===\n{text}" for i, text in enumerate(episodes))
    example = ", ".join(f'{{"id": {i + 1}, "score": <0 to 1>}}' for i in range(min(len(episodes), 2)))
    return [{"role": "system", "content": _SYSTEM},
            {"role": "user", "content": f"Rubric:\n{rubric}\n\n{len(episodes)} attempts at the same task follow. "
                                        "Compare them with each other and score each from 0 to 1: a better attempt "
                                        "scores higher, equally good attempts score the same.\n\n"
                                        f"{attempts}\n\nReply with a JSON object only, one entry per attempt: "
                                        f'{{"scores": [{example}{", ..." if len(episodes) > 2 else ""}]}}.'}]


# --- what the judge said --------------------------------------------------------------------------


def _json_object(text: str) -> Any:
    """The JSON object in a reply: the whole text, a fenced block, or the outermost ``{...}``."""
    stripped = text.strip()
    fenced = re.search(r"```(?:json)?\s*(.*?)```", stripped, re.S)
    candidates = [stripped] + ([fenced.group(1)] if fenced else [])
    if "{" in stripped and "}" in stripped:
        candidates.append(stripped[stripped.index("{"):stripped.rindex("}") + 1])
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return None


def _unit(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) and 0.0 <= number <= 1.0 else None


def parse_score(text: str) -> float | None:
    """The score of a rubric reply (``{"score": s}``, s in [0, 1]); None when there is none."""
    data = _json_object(text)
    if isinstance(data, dict) and "score" in data:
        return _unit(data["score"])
    match = re.search(r'"?score"?\s*[:=]\s*([0-9]*\.?[0-9]+)', text)
    return _unit(match.group(1)) if match else None


def parse_ranking(text: str, n: int) -> list[float] | None:
    """The ``n`` scores of a ranking reply, in attempt order (``{"scores": [{"id": i, "score": s}]}``,
    every id 1..n exactly once, or a list of n numbers); None otherwise."""
    data = _json_object(text)
    entries = data.get("scores") if isinstance(data, dict) else data
    if not isinstance(entries, list) or len(entries) != n:
        return None
    if all(isinstance(e, dict) for e in entries):
        scores: dict[int, float] = {}
        for entry in entries:
            ident, score = entry.get("id"), _unit(entry.get("score"))
            if isinstance(ident, str) and ident.strip().isdigit():
                ident = int(ident)
            if not isinstance(ident, int) or isinstance(ident, bool) or score is None or ident in scores:
                return None
            scores[ident] = score
        return [scores[i] for i in range(1, n + 1)] if set(scores) == set(range(1, n + 1)) else None
    values = [_unit(e) for e in entries]
    return None if any(v is None for v in values) else values  # type: ignore[return-value]


# --- the judge ------------------------------------------------------------------------------------


@dataclass
class GroupJudgment:
    """The judge's verdict on one group: a score per episode (None when the judgment failed: a reply
    that did not parse, a request that failed) and its raw replies (rubric: one per episode, in
    order; ranking: one per order judged), kept either way."""

    scores: list[float] | None
    raw: list[str]


@dataclass
class _Reply:
    content: str | None  # None: the request failed
    error: str = ""


class Judge:
    """Sends judge requests (retries, a cache, a pool of ``concurrency`` threads) and turns groups of
    episodes into scores. ``cache_path``: a JSONL file of earlier replies (read, then appended)."""

    def __init__(self, cfg: JudgeConfig, cache_path: str | Path | None = None, *, transport: Any = None):
        from tracegym.engines.openai import OpenAIEngine

        self.cfg = cfg
        # the chat path of the openai engine: its retries, backoff and key redaction; no tokenizer needed
        self.engine = OpenAIEngine(cfg.model, cfg.base_url, api_key_env=cfg.api_key_env or "",
                                   token_ids="local", timeout_s=cfg.timeout_s, max_retries=cfg.max_retries,
                                   max_concurrency=cfg.concurrency, transport=transport)
        self.cache_path = Path(cache_path) if cache_path is not None and cfg.cache else None
        self._cache: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="tracegym-judge")
        if self.cache_path is not None and self.cache_path.is_file():
            text = self.cache_path.read_text(encoding="utf-8")
            for line in text.splitlines():
                try:
                    entry = json.loads(line)
                    self._cache[entry["key"]] = entry
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a killed run: that reply is asked again
            if text and not text.endswith("\n"):  # the next entry starts on a line of its own
                with self.cache_path.open("a", encoding="utf-8") as handle:
                    handle.write("\n")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.engine.close()

    def _ask(self, messages: list[dict[str, str]], stats: JudgeStats) -> _Reply:
        body = {"model": self.cfg.model, "messages": messages, "temperature": self.cfg.temperature,
                "max_tokens": self.cfg.max_tokens}
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        with self._lock:
            hit = self._cache.get(key) if self.cfg.cache else None
            if hit is not None:
                stats.cache_hits += 1
                return _Reply(hit["content"])
        try:
            data = self.engine.post("/chat/completions", body)
            content = str(((data.get("choices") or [{}])[0].get("message") or {}).get("content") or "")
        except Exception as exc:  # unreachable, 4xx/5xx after retries, a body that is not a reply
            with self._lock:
                stats.calls += 1
                stats.errors += 1
            return _Reply(None, f"{type(exc).__name__}: {exc}")
        usage = data.get("usage") or {}
        with self._lock:
            stats.calls += 1
            stats.tokens += int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
            if self.cfg.cache:
                entry = {"key": key, "content": content}
                self._cache[key] = entry
                if self.cache_path is not None:
                    self.cache_path.parent.mkdir(parents=True, exist_ok=True)
                    with self.cache_path.open("a", encoding="utf-8") as handle:
                        handle.write(json.dumps(entry) + "\n")
        return _Reply(content)

    def _judge_group(self, group: TrajectoryGroup, seed: int, stats: JudgeStats) -> GroupJudgment:
        texts = [transcript(t, self.cfg.max_transcript_chars) for t in group.trajectories]
        if self.cfg.mode == "rubric":
            replies = list(self._pool.map(lambda text: self._ask(rubric_messages(self.cfg.rubric, text), stats), texts))
            scores = [parse_score(r.content) if r.content is not None else None for r in replies]
            self._count_failures(replies, scores, stats)
            raw = [(r.content if r.content is not None else f"(request failed: {r.error})")[:_RAW_CHARS] for r in replies]
            return GroupJudgment(None if any(s is None for s in scores) else scores, raw)  # type: ignore[arg-type]
        orders = [list(range(len(texts)))]
        if self.cfg.position_bias and len(texts) > 1:
            shuffled = list(range(len(texts)))
            random.Random(seed).shuffle(shuffled)
            orders.append(shuffled if shuffled != orders[0] else shuffled[::-1])
        replies = list(self._pool.map(
            lambda order: self._ask(ranking_messages(self.cfg.rubric, [texts[i] for i in order]), stats), orders))
        parsed = [parse_ranking(r.content, len(texts)) if r.content is not None else None for r in replies]
        self._count_failures(replies, parsed, stats)
        raw = [(r.content if r.content is not None else f"(request failed: {r.error})")[:_RAW_CHARS] for r in replies]
        if any(p is None for p in parsed):
            return GroupJudgment(None, raw)
        per_order = []
        for order, scores in zip(orders, parsed):
            back = [0.0] * len(texts)
            for position, episode in enumerate(order):
                back[episode] = scores[position]  # type: ignore[index]
            per_order.append(back)
        if len(per_order) == 2:
            with self._lock:
                stats.bias.extend(abs(a - b) for a, b in zip(*per_order))
        return GroupJudgment([sum(s[i] for s in per_order) / len(per_order) for i in range(len(texts))], raw)

    def _count_failures(self, replies: Sequence[_Reply], parsed: Sequence[Any], stats: JudgeStats) -> None:
        with self._lock:
            stats.parse_failures += sum(1 for r, p in zip(replies, parsed) if r.content is not None and p is None)

    def score_groups(self, groups: Sequence[TrajectoryGroup], seed: int = 0) -> tuple[list[GroupJudgment], JudgeStats]:
        """One judgment per group (``scores`` None where it failed: counted in the stats, or raised
        with ``on_failure: stop``)."""
        stats = JudgeStats()
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, min(len(groups), self.cfg.concurrency))) as groups_pool:
            judged = list(groups_pool.map(lambda ig: self._judge_group(ig[1], seed + 7_919 * ig[0], stats),
                                          enumerate(groups)))
        stats.seconds = time.perf_counter() - started
        for group, result in zip(groups, judged):
            if result.scores is None:
                stats.failed_groups += 1
                if self.cfg.on_failure == "stop":
                    raise JudgeError(f"the judge could not score the group of task {group.task_id!r} "
                                     f"({stats.parse_failures} unparsed replies, {stats.errors} failed requests; "
                                     "reward.judge.on_failure: stop)")
            else:
                stats.scores.extend(result.scores)
        return judged, stats


def _judged(trajectory: Trajectory, score: float, raw: list[str], cfg: JudgeConfig) -> Trajectory:
    """``trajectory`` with turn rewards scaled by ``verifiable_weight`` and ``weight * score`` on the last turn."""
    turns = [turn.model_copy(update={"reward": turn.reward * cfg.verifiable_weight}) for turn in trajectory.turns]
    if turns:
        turns[-1] = turns[-1].model_copy(update={"reward": turns[-1].reward + cfg.weight * score})
    reward = trajectory.reward * cfg.verifiable_weight + cfg.weight * score
    return trajectory.model_copy(update={
        "turns": tuple(turns), "reward": reward, "metrics": {**trajectory.metrics, "reward/judge": score},
        "info": {**trajectory.info, "judge": {"mode": cfg.mode, "score": score, "raw": raw}}})


def episode_raw(judgment: GroupJudgment, index: int, mode: str) -> list[str]:
    """The raw replies that bear on episode ``index`` of a group: its own (rubric) or all (ranking)."""
    return [judgment.raw[index]] if mode == "rubric" else list(judgment.raw)


def judge_groups(judge: Judge, groups: Sequence[TrajectoryGroup], tasks: Sequence[Any], seed: int
                 ) -> tuple[list[TrajectoryGroup], list[Any], JudgeStats]:
    """The step's groups with the judge's score in their rewards; groups whose judgment failed leave
    the step with their tasks. Returns the groups, their tasks and the stats (``.metrics()``: ``judge/*``)."""
    judged, stats = judge.score_groups(groups, seed)
    kept_groups, kept_tasks = [], []
    for group, task, result in zip(groups, tasks, judged):
        if result.scores is None:
            continue
        trajectories = tuple(_judged(t, score, episode_raw(result, i, judge.cfg.mode), judge.cfg)
                             for i, (t, score) in enumerate(zip(group.trajectories, result.scores)))
        kept_groups.append(group.model_copy(update={"trajectories": trajectories}))
        kept_tasks.append(task)
    return kept_groups, kept_tasks, stats


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when either side is constant."""
    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out
    rx, ry = ranks(x), ranks(y)
    n = len(rx)
    if n < 2:
        return float("nan")
    mx, my = sum(rx) / n, sum(ry) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def agreement(groups: Sequence[TrajectoryGroup], scores: Sequence[Sequence[float]], *, n_resamples: int = 1000,
              seed: int = 0) -> dict[str, Any]:
    """How well judge ``scores`` (one list per group) agree with the episodes' own rewards: Spearman
    over all episodes with a percentile bootstrap interval over tasks (groups resampled), and the
    within-group pairwise accuracy (of the pairs of one task whose rewards differ, the share the
    judge orders the same way; ties of the judge count half): what a group-relative estimator sees."""
    rewards = [[t.reward for t in g.trajectories] for g in groups]
    flat_r = [r for rs in rewards for r in rs]
    flat_s = [s for ss in scores for s in ss]
    rng = random.Random(seed)
    boot = []
    for _ in range(n_resamples if len(groups) > 1 else 0):
        picks = [rng.randrange(len(groups)) for _ in groups]
        value = spearman([r for i in picks for r in rewards[i]], [s for i in picks for s in scores[i]])
        if not math.isnan(value):
            boot.append(value)
    boot.sort()
    ci = [boot[int(0.025 * (len(boot) - 1))], boot[int(math.ceil(0.975 * (len(boot) - 1)))]] if boot else None
    agree, pairs = 0.0, 0
    for rs, ss in zip(rewards, scores):
        for i in range(len(rs)):
            for j in range(i + 1, len(rs)):
                if rs[i] != rs[j]:
                    pairs += 1
                    same = (rs[i] - rs[j]) * (ss[i] - ss[j])
                    agree += 1.0 if same > 0 else 0.5 if ss[i] == ss[j] else 0.0
    return {"episodes": len(flat_r), "tasks": len(groups), "spearman": spearman(flat_r, flat_s), "spearman_ci": ci,
            "pairs": pairs, "pairwise_accuracy": agree / pairs if pairs else None}
