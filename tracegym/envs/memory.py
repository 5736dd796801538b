"""Memory across episodes: ``remember(text)`` and ``recall(query)`` tools any env can opt into with
its ``memory`` option (``env: {name: web, options: {memory: {store: runs/x/memory.jsonl}}}``, or
``--env-option 'memory={store: runs/x/memory.jsonl}'``).

The store is episodic and per run: every ``remember`` adds one entry (its text, the scope, the split
and task of the episode that wrote it), appended to ``store`` (a JSONL file; without one the store
lives in the process). ``recall`` returns the ``top_k`` entries of the episode's scope that best
match the query, ranked by BM25 (``bm25s``, as the ``search`` env). The scope is the env, or with
``scope: family`` (default) the env and the task's ``family`` (the web env's site families), so a
shop's notes never reach a booking task.

**No leak from evaluation.** An episode reads only entries written by training episodes (split
``train``): what test episodes write is kept, tagged ``test``, and never returned, to a training
episode or to another test episode, unless ``read_test_writes: true`` (test-time learning across
attempts, on purpose). Branching is refused: the store is shared by every episode of the run.

An inner env whose scripted expert plans memory calls (``vault``) defines ``on_memory_calls(names)``:
the wrapper calls it with the names of the memory calls it answered, since they never reach the
inner env's ``step``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from tracegym.envs.base import Env, EnvWrapper, Task
from tracegym.envs.tools import in_call_order
from tracegym.types import Message, StepResult, ToolCall

__all__ = ["MemoryConfig", "MemoryEnv", "MemoryStore", "memory_store"]

MEMORY_TOOLS = ("remember", "recall")
_NOTE = ("You also have a memory that lasts across tasks: remember(text) stores a short note, recall(query) "
         "returns the notes that best match the query.")


class MemoryConfig(BaseModel):
    """The ``memory`` env option."""

    model_config = ConfigDict(extra="forbid")

    store: str | None = None
    """JSONL file of the run's memory (read at start, appended to); None: in this process only."""

    scope: Literal["env", "family"] = "family"
    """Entries shared by every task of the env, or only by tasks of the same ``data["family"]``."""

    top_k: int = Field(3, ge=1)
    max_chars: int = Field(500, ge=1)
    """Longest note ``remember`` keeps (longer ones are cut, and the answer says so)."""

    read_test_writes: bool = False
    """Let episodes read what test episodes wrote (test-time learning); off: train entries only."""


class MemoryStore:
    """The entries of one run's memory, shared by its episodes (thread-safe)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self.entries: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        if self.path is not None and self.path.is_file():
            text = self.path.read_text(encoding="utf-8")
            for line in text.splitlines():
                try:
                    entry = json.loads(line)
                    if isinstance(entry, dict) and isinstance(entry.get("text"), str):
                        self.entries.append(entry)
                except ValueError:
                    continue  # a line torn by a killed run
            if text and not text.endswith("\n"):
                with self.path.open("a", encoding="utf-8") as handle:
                    handle.write("\n")

    def add(self, text: str, scope: str, split: str, task_id: str) -> None:
        entry = {"text": text, "scope": scope, "split": split, "task_id": task_id}
        with self._lock:
            self.entries.append(entry)
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(entry) + "\n")

    def search(self, query: str, scope: str, splits: Sequence[str], k: int) -> list[str]:
        """The ``k`` best BM25 matches of ``query`` among the entries of ``scope`` written in ``splits``."""
        import bm25s

        with self._lock:
            texts = [e["text"] for e in self.entries if e.get("scope") == scope and e.get("split") in splits]
        if not texts:
            return []
        retriever = bm25s.BM25()
        retriever.index(bm25s.tokenize(texts, show_progress=False), show_progress=False)
        tokens = bm25s.tokenize([query], show_progress=False)
        if not tokens.vocab:  # no word of the query is known: the newest notes
            return texts[-k:][::-1]
        ids, scores = retriever.retrieve(tokens, k=min(k, len(texts)), show_progress=False)
        return [texts[int(i)] for i, s in zip(ids[0], scores[0]) if float(s) > 0] or texts[-k:][::-1]


_STORES: dict[str, MemoryStore] = {}
_STORES_LOCK = threading.Lock()


def memory_store(path: str | None) -> MemoryStore:
    """The process's store for ``path`` (one object per file, or one in-process store for None)."""
    key = str(Path(path).resolve()) if path is not None else ""
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = MemoryStore(path)
        return _STORES[key]


_SCHEMAS = [
    {"type": "function", "function": {
        "name": "remember", "description": "Store a short note for later tasks.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string", "description": "The note."}},
                       "required": ["text"]}}},
    {"type": "function", "function": {
        "name": "recall", "description": "Find the stored notes that best match a query.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "What to look for."}},
                       "required": ["query"]}}},
]


class MemoryEnv(EnvWrapper):
    """``inner`` with the ``remember``/``recall`` tools (see the module docstring)."""

    def __init__(self, inner: Env, config: MemoryConfig):
        clash = [s["function"]["name"] for s in inner.tool_schemas() if s["function"]["name"] in MEMORY_TOOLS]
        if clash:
            raise ValueError(f"env {inner.name!r} already has a tool named {clash[0]!r}: it cannot take the memory option")
        super().__init__(inner, f"{inner.description} (with memory)")
        self.config = config
        self.store = memory_store(config.store)
        self.task: Task | None = None
        self.turn = 0
        self.counters = {"remembered": 0, "recalled": 0}

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [*self.inner.tool_schemas(), *_SCHEMAS]

    def branch_refusal(self) -> str | None:
        return "its memory store is shared by every episode of the run"

    def _scope(self) -> str:
        assert self.task is not None
        family = self.task.data.get("family", "") if isinstance(self.task.data, dict) else ""
        return f"{self.inner.name}/{family}" if self.config.scope == "family" else self.inner.name

    async def reset(self, task: Task) -> list[Message]:
        messages = list(await self.inner.reset(task))
        self.task, self.turn = task, 0
        self.counters = {"remembered": 0, "recalled": 0}
        for i, message in enumerate(messages):
            if message.role == "system":
                messages[i] = message.model_copy(update={"content": f"{message.content}\n\n{_NOTE}"})
                break
        else:
            messages.insert(0, Message(role="system", content=_NOTE))
        return messages

    def _answer(self, call: ToolCall) -> Message:
        assert self.task is not None
        argument = "text" if call.name == "remember" else "query"
        value = call.arguments.get(argument) if isinstance(call.arguments, dict) else None
        if not isinstance(value, str) or not value.strip() or set(call.arguments) != {argument}:
            content = f"Error: {call.name} takes one argument, {argument!r} (a non-empty string)."
        elif call.name == "remember":
            text = value.strip()[: self.config.max_chars]
            self.store.add(text, self._scope(), self.task.split, self.task.id)
            self.counters["remembered"] += 1
            cut = len(value.strip()) > self.config.max_chars
            content = "Remembered" + (f" (cut to {self.config.max_chars} characters)." if cut else ".")
        else:
            splits = ("train", "test") if self.config.read_test_writes else ("train",)
            found = self.store.search(value, self._scope(), splits, self.config.top_k)
            self.counters["recalled"] += 1
            content = "\n".join(f"- {text}" for text in found) if found else "No notes match."
        return Message(role="tool", content=content, tool_call_id=call.id, name=call.name)

    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        if self.task is None:
            raise RuntimeError("MemoryEnv.step called before reset(task)")
        self.turn += 1
        mine = [c for c in message.tool_calls if c.name in MEMORY_TOOLS]
        answers = [self._answer(c) for c in mine]
        notify = getattr(self.inner, "on_memory_calls", None)
        if mine and callable(notify):  # an inner env whose expert plans memory calls tracks them (vault)
            notify([c.name for c in mine])
        if mine and len(mine) == len(message.tool_calls) and not parse_errors:
            # only memory calls: the inner env has nothing to do (and must not read this as a final answer)
            limit = self.max_turns
            truncated = limit is not None and self.turn >= limit
            return StepResult(messages=tuple(answers), truncated=truncated,
                              info={**({"success": 0} if truncated else {}), **self._info()})
        others = tuple(c for c in message.tool_calls if c.name not in MEMORY_TOOLS)
        result = await self.inner.step(message.model_copy(update={"tool_calls": others}) if mine else message, parse_errors)
        out = in_call_order(message.tool_calls, list(result.messages), answers)
        return StepResult(messages=tuple(out), reward=result.reward, terminated=result.terminated,
                          truncated=result.truncated, info={**result.info, **self._info()})

    def _info(self) -> dict[str, Any]:
        return {"memory/remembered": self.counters["remembered"], "memory/recalled": self.counters["recalled"]}
