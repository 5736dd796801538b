"""``search``: offline multi-hop question answering over a generated encyclopedia.

The agent has the three browser primitives of OpenResearcher, over a BM25 index of a seeded corpus of
fictional entities (:mod:`tracegym.environments.corpus`):

- ``search(query)``: the top 5 pages (doc id, title, the line that best matches the query);
- ``open(doc_id)``: the page text (cut at ``page_chars`` characters, with a note when cut);
- ``find(doc_id, pattern)``: the lines of a page that contain ``pattern`` (case-insensitive).

A question chains 1 to 4 relations ("In which country does the mountain where the river that flows
through X has its source stand?"); each hop needs one search and one page read. The final answer goes
in ``<answer>...</answer>``; reward 1 iff it equals the gold entity name after normalisation (case,
punctuation, articles, spacing).

The BM25 index is built once per (corpus seed, size), saved under
``tracegym.models.cache_dir()/search/<key>/`` (written to a temporary folder, then ``os.replace``),
and shared read-only by every env instance of the process through a module-level cache.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import string
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tracegym.cache import cache_dir
from tracegym.envs.base import Task
from tracegym.environments.corpus import (
    CORPUS_VERSION,
    Corpus,
    Entity,
    Question,
    generate_corpus,
    index_text,
    random_walk,
    tokenize,
)
from tracegym.envs.tools import ToolEnv, tool
from tracegym.types import Message, StepResult, ToolCall

__all__ = [
    "SearchBackend",
    "SearchEnv",
    "SearchHit",
    "get_backend",
    "index_dir",
    "normalize_answer",
    "parse_hops",
]

TOP_K = 5
MAX_HOPS = 6
_SNIPPET_CHARS = 160
_MAX_FIND_LINES = 20


# --- the index -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchHit:
    doc_id: str
    title: str
    score: float
    snippet: str


def index_dir(corpus_seed: int, corpus_size: int) -> Path:
    """Where the index of one corpus lives on disk."""
    return cache_dir() / "search" / f"v{CORPUS_VERSION}-seed{corpus_seed}-n{corpus_size}"


class SearchBackend:
    """A corpus with its BM25 index. Read-only after construction: safe to share between envs."""

    def __init__(self, corpus: Corpus, retriever: Any, loaded_from_cache: bool) -> None:
        self.corpus = corpus
        self.retriever = retriever
        self.loaded_from_cache = loaded_from_cache

    @classmethod
    def build(cls, corpus_size: int, corpus_seed: int, use_disk_cache: bool = True) -> SearchBackend:
        """Generate the corpus and load its index from the disk cache, or build and save it."""
        corpus = generate_corpus(corpus_size, corpus_seed)
        folder = index_dir(corpus_seed, corpus_size)
        if use_disk_cache:
            retriever = _load_index(folder, corpus)
            if retriever is not None:
                return cls(corpus, retriever, loaded_from_cache=True)
        retriever = _build_index(corpus)
        if use_disk_cache:
            _save_index_atomically(retriever, folder, corpus)
        return cls(corpus, retriever, loaded_from_cache=False)

    def search(self, query: str, k: int = TOP_K) -> list[SearchHit]:
        """The ``k`` best pages for ``query`` by BM25; ties broken by doc order (deterministic)."""
        tokens = tokenize(query)
        ids = self.retriever.get_tokens_ids(tokens)
        if not ids:
            return []
        scores = np.asarray(self.retriever.get_scores_from_ids(ids))  # (num_docs,)
        candidates = np.flatnonzero(scores > 0)
        if candidates.size == 0:
            return []
        # Sort by (-score, doc index): stable and independent of argpartition's tie handling.
        order = candidates[np.lexsort((candidates, -scores[candidates]))][:k]
        query_terms = set(tokens)
        return [self._hit(int(i), float(scores[i]), query_terms) for i in order]

    def _hit(self, index: int, score: float, query_terms: set[str]) -> SearchHit:
        entity = self.corpus.entities[index]
        best = max(entity.lines, key=lambda line: len(query_terms & set(tokenize(line))))
        snippet = best if len(best) <= _SNIPPET_CHARS else best[: _SNIPPET_CHARS - 3] + "..."
        return SearchHit(entity.doc_id, entity.title, score, snippet)

    def rank_of(self, query: str, doc_id: str, k: int = TOP_K) -> int | None:
        """1-based rank of ``doc_id`` in the top ``k`` for ``query``, or None."""
        for rank, hit in enumerate(self.search(query, k), start=1):
            if hit.doc_id == doc_id:
                return rank
        return None


# BM25 parameters; part of the cache's identity (an index built with others is rebuilt).
BM25_PARAMS = {"k1": 1.5, "b": 0.75, "method": "lucene"}


def _build_index(corpus: Corpus) -> Any:
    import bm25s

    retriever = bm25s.BM25(**BM25_PARAMS)
    retriever.index([tokenize(index_text(e)) for e in corpus], show_progress=False)
    return retriever


def _load_index(folder: Path, corpus: Corpus) -> Any | None:
    """The cached index if it exists and was built from exactly this corpus, else None."""
    import bm25s

    meta_path = folder / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if (meta.get("fingerprint") != corpus.fingerprint or meta.get("num_docs") != len(corpus)
            or meta.get("bm25") != BM25_PARAMS):
        return None
    try:
        return bm25s.BM25.load(str(folder), mmap=True, show_progress=False, verbosity=0)
    except Exception:  # a damaged cache is rebuilt, never fatal
        return None


def _save_index_atomically(retriever: Any, folder: Path, corpus: Corpus) -> None:
    """Write into a temporary sibling folder, then ``os.replace`` it into place, so a reader never
    sees a half-written index. A stale folder (other fingerprint) is moved aside first; if another
    process wins the race, its (identical) index is kept and ours is discarded."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        retriever.save(str(tmp), show_progress=False)
        meta = {"fingerprint": corpus.fingerprint, "num_docs": len(corpus), "seed": corpus.seed,
                "corpus_version": CORPUS_VERSION, "bm25": BM25_PARAMS}
        (tmp / "meta.json").write_text(json.dumps(meta))
        if folder.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale-", dir=folder.parent))
            try:
                os.replace(folder, stale / "old")
            except OSError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process put its index there first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_backends: dict[tuple[int, int], SearchBackend] = {}
_backends_lock = threading.Lock()


def get_backend(corpus_size: int = 2000, corpus_seed: int = 0) -> SearchBackend:
    """The process-wide shared backend of one corpus (built or loaded on first use)."""
    key = (corpus_size, corpus_seed)
    with _backends_lock:
        backend = _backends.get(key)
        if backend is None:
            backend = SearchBackend.build(corpus_size, corpus_seed)
            _backends[key] = backend
        return backend


# --- answers and options -------------------------------------------------------------------------

_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT_TABLE = str.maketrans({c: " " for c in string.punctuation})


def normalize_answer(text: str) -> str:
    """Lower-case, punctuation to spaces, articles dropped, whitespace collapsed."""
    text = _ARTICLES_RE.sub(" ", text.lower().translate(_PUNCT_TABLE))
    return " ".join(text.split())


def parse_hops(hops: int | str | tuple[int, int] | list[int]) -> tuple[int, int]:
    """``3`` -> (3, 3); ``(1, 4)``, ``[1, 4]`` or ``"1-4"`` -> (1, 4) (inclusive range)."""
    if isinstance(hops, bool):
        raise ValueError(f"hops must be an int or a range, got {hops!r}")
    if isinstance(hops, int):
        lo = hi = hops
    elif isinstance(hops, str) and re.fullmatch(r"\s*\d+\s*(-\s*\d+\s*)?", hops):
        parts = [int(p) for p in hops.split("-")]
        lo, hi = parts[0], parts[-1]
    elif isinstance(hops, (tuple, list)) and len(hops) == 2 and all(isinstance(h, int) for h in hops):
        lo, hi = hops
    else:
        raise ValueError(f"hops must be an int, a (min, max) pair or a 'min-max' string, got {hops!r}")
    if not 1 <= lo <= hi <= MAX_HOPS:
        raise ValueError(f"hops must lie in 1..{MAX_HOPS} with min <= max, got {hops!r}")
    return lo, hi


SYSTEM_PROMPT = """You answer questions about a fictional encyclopedia. None of its facts are known to you: look everything up with the tools.
- search(query): the 5 best-matching pages, each with its doc id, title and a matching line.
- open(doc_id): the text of a page.
- find(doc_id, pattern): the lines of a page that contain pattern.
A question may chain several facts ("the river that flows through the birthplace of X"): find X's page, read the linked entity, then look that one up, and so on.
When you know the answer, reply with only the entity's name inside answer tags, e.g. <answer>Mount Kelvar</answer>."""


# --- the environment -----------------------------------------------------------------------------


class SearchEnv(ToolEnv):
    """Multi-hop questions answered with search / open / find over a generated encyclopedia."""

    name = "search"
    description = "Offline search-and-browse (search, open, find) for 1-4 hop questions over a generated encyclopedia."
    default_max_turns = 20
    # The episode's state is the task and the calls made; the corpus and its BM25 index are shared
    # read-only by every instance of the same corpus, so a snapshot refers to them, never copies them.
    branchable = True
    snapshot_exclude = ("_backend",)

    def __init__(
        self,
        hops: int | str | tuple[int, int] | list[int] = (1, 4),
        corpus_size: int = 2000,
        corpus_seed: int = 0,
        page_chars: int = 1500,
        max_turns: int | None = None,
        max_tool_output_chars: int | None = None,
    ) -> None:
        super().__init__(max_turns=max_turns, max_tool_output_chars=max_tool_output_chars)
        self.hops = parse_hops(hops)
        if not isinstance(corpus_size, int) or corpus_size < 100:
            raise ValueError(f"corpus_size must be an int >= 100, got {corpus_size!r}")
        if not isinstance(page_chars, int) or page_chars < 50:
            raise ValueError(f"page_chars must be an int >= 50, got {page_chars!r}")
        self.corpus_size = corpus_size
        self.corpus_seed = int(corpus_seed)
        self.page_chars = page_chars
        self._backend: SearchBackend | None = None
        self.task: Task | None = None
        self._calls_made: set[str] = set()

    @property
    def backend(self) -> SearchBackend:
        if self._backend is None:
            self._backend = get_backend(self.corpus_size, self.corpus_seed)
        return self._backend

    def restore_state(self, state: Any) -> None:
        corpus = (self.corpus_size, self.corpus_seed)
        super().restore_state(state)
        if (self.corpus_size, self.corpus_seed) != corpus:  # not the options this instance was built with
            self._backend = None
        if self.task is not None:
            _ = self.backend  # as in reset: load the index now, not inside a tool call (which has a timeout)

    # -- tasks --

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        """``n`` distinct questions whose start entities belong to ``split`` (an 80/20 split of the
        corpus's entities, so no test question starts from an entity a train question names)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        corpus = self.backend.corpus
        want_test = split == "test"
        starts = [e.doc_id for e in corpus if corpus.is_test_entity(e.doc_id) == want_test]
        rng = random.Random(f"search-tasks-{split}-{seed}-{self.hops}")
        out: list[Task] = []
        seen: set[tuple[str, ...]] = set()
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 50 * n + 1000:
                raise ValueError(f"cannot make {n} distinct {split} questions with hops={self.hops} from a corpus of {len(corpus)}")
            hops = rng.randint(*self.hops)
            question = random_walk(corpus, rng.choice(starts), hops, rng)
            if question is None:
                continue
            key = question.chain + question.relations
            if key in seen:
                continue
            seen.add(key)
            out.append(self._make_task(split, question))
        return out

    def _make_task(self, split: str, q: Question) -> Task:
        return Task(
            id=f"search-s{self.corpus_seed}-n{self.corpus_size}-{q.chain[0]}-{'.'.join(q.relations)}",
            split=split,
            data={
                "question": q.text,
                "answer": q.answer,
                "hops": len(q.relations),
                "chain": list(q.chain),
                "relations": list(q.relations),
                "corpus_size": self.corpus_size,
                "corpus_seed": self.corpus_seed,
                "reference_calls": self._reference_calls(q.chain),
            },
        )

    def _reference_calls(self, chain: tuple[str, ...]) -> list[dict[str, Any]]:
        """What a careful agent does per hop: search the entity's name, open its page (where the
        next entity is named). The last entity's name is the answer and needs no look-up."""
        corpus = self.backend.corpus
        calls: list[dict[str, Any]] = []
        for doc_id in chain[:-1]:
            calls.append({"name": "search", "arguments": {"query": corpus.by_id[doc_id].name}})
            calls.append({"name": "open", "arguments": {"doc_id": doc_id}})
        return calls

    # -- episode --

    async def reset(self, task: Task) -> list[Message]:
        data = task.data
        for key in ("question", "answer", "chain", "reference_calls"):
            if key not in data:
                raise ValueError(f"search task {task.id!r} has no {key!r}")
        if (data.get("corpus_size"), data.get("corpus_seed")) != (self.corpus_size, self.corpus_seed):
            raise ValueError(
                f"task {task.id!r} was made for corpus (size={data.get('corpus_size')}, seed={data.get('corpus_seed')}) "
                f"but this env serves (size={self.corpus_size}, seed={self.corpus_seed})"
            )
        self.task = task
        self._calls_made = set()
        _ = self.backend  # load the index now, not inside the first tool call (which has a timeout)
        return [Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=data["question"])]

    def _record(self, name: str, arguments: dict[str, Any]) -> None:
        self._calls_made.add(_call_key(name, arguments))

    def _entity(self, doc_id: str) -> Entity:
        entity = self.backend.corpus.get(doc_id.strip())
        if entity is None:
            raise ValueError(f"unknown doc id {doc_id!r}; use a doc id from the search results (like 'd000123')")
        return entity

    @tool
    def search(self, query: str) -> str:
        """Search the encyclopedia; returns the 5 best-matching pages with doc id, title and a matching line.

        Args:
            query: Keywords, e.g. an entity's name.
        """
        self._record("search", {"query": query})
        if not query.strip():
            raise ValueError("query is empty")
        hits = self.backend.search(query)
        if not hits:
            return f"No results for {query!r}."
        return "\n".join(f"{i}. [{h.doc_id}] {h.title}\n   {h.snippet}" for i, h in enumerate(hits, start=1))

    @tool
    def open(self, doc_id: str) -> str:
        """Open a page by its doc id and return its text.

        Args:
            doc_id: A doc id from the search results, e.g. "d000123".
        """
        self._record("open", {"doc_id": doc_id})
        entity = self._entity(doc_id)
        text = f"[{entity.doc_id}] {entity.text}"
        if len(text) > self.page_chars:
            text = (text[: self.page_chars] + f"\n[... truncated: showing {self.page_chars} of {len(text)} characters;"
                    f" use find(doc_id, pattern) to look for the rest]")
        return text

    @tool
    def find(self, doc_id: str, pattern: str) -> str:
        """Return the lines of a page that contain a pattern (case-insensitive).

        Args:
            doc_id: A doc id from the search results.
            pattern: The text to look for, e.g. "born".
        """
        self._record("find", {"doc_id": doc_id, "pattern": pattern})
        entity = self._entity(doc_id)
        if not pattern.strip():
            raise ValueError("pattern is empty")
        needle = pattern.lower()
        lines = entity.text.splitlines()
        matches = [f"L{i}: {line}" for i, line in enumerate(lines, start=1) if needle in line.lower()]
        if not matches:
            return f"No line of {entity.doc_id} contains {pattern!r}."
        shown = matches[:_MAX_FIND_LINES]
        more = f"\n[{len(matches) - len(shown)} more matching lines not shown]" if len(matches) > len(shown) else ""
        return "\n".join(shown) + more

    def score_answer(self, answer: str) -> float:
        assert self.task is not None
        return float(normalize_answer(answer) == normalize_answer(self.task.data["answer"]))

    def on_text(self, message: Message) -> StepResult:
        result = super().on_text(message)
        info = {**result.info, "hops": self.task.data["hops"] if self.task else 0}
        return StepResult(messages=result.messages, reward=result.reward, terminated=result.terminated,
                          truncated=result.truncated, info=info)

    # -- expert --

    def expert_action(self) -> Message:
        """The next reference call not yet made in this episode, then the answer. Computed from the
        gold chain, so it also finishes an episode that another policy started."""
        if self.task is None:
            raise RuntimeError("expert_action called before reset(task)")
        corpus = self.backend.corpus
        for call in self.task.data["reference_calls"]:
            if _call_key(call["name"], call["arguments"]) in self._calls_made:
                continue
            if call["name"] == "search":
                text = f"I need the page of {call['arguments']['query']}."
            else:
                text = f"Opening the page of {corpus.by_id[call['arguments']['doc_id']].name}."
            tool_call = ToolCall(name=call["name"], arguments=dict(call["arguments"]), id=f"call_{self.turn}_0")
            return Message(role="assistant", content=text, tool_calls=(tool_call,))
        answer = self.task.data["answer"]
        return Message(role="assistant", content=f"<answer>{answer}</answer>")


def _call_key(name: str, arguments: dict[str, Any]) -> str:
    return name + json.dumps(arguments, sort_keys=True)
