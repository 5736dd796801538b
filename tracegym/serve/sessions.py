"""Gateway sessions: record every chat call of an unmodified agent, token-exact, and merge a
session's calls into one ``Trajectory``.

An agent written with the ``openai`` SDK (or a framework on top of it) re-sends the whole
conversation on every call. Rendering that conversation again would re-tokenize the model's own
earlier replies, and a re-tokenization is not always what the model sampled (whitespace the reply
stripped, JSON the SDK re-serialized, a template that rewrites history): the trainer would then
score tokens the model never produced. So a session call is *bridged* when it can be: when the
request's messages start with an earlier call's messages followed by the reply this gateway gave
to it (compared as messages: role, text, tool names and arguments; call ids and JSON spacing do
not matter), the prompt is that call's prompt + its sampled ids + the renderer's
``continue_prompt`` for the messages after the reply (tool results, user turns): the sampled tokens
stay exactly as sampled. Otherwise (the harness dropped or edited messages, changed its tools, or
starts over) the prompt is rendered fresh, and when it does not extend the previous call's tokens
the session has a *token break*: the merged trajectory is cut there (``build_examples`` starts a new
example from that call's full prompt), never glued onto a re-tokenized guess.

Merging (``Session.trajectory``): one trajectory per session, one ``Turn`` per call in order (its
prompt, sampled ids, log-probs, parsed message and parse errors), the reward on the last turn;
``info["token_breaks"]`` counts the calls whose prompt does not extend the previous call's
prompt + completion (``metrics["gateway/token_breaks"]`` too), ``info["break_reasons"]`` says why
each was not bridged.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tracegym.types import Message, Trajectory, Turn

SESSION_HEADER = "x-tracegym-session"


def _message_key(message: Message) -> tuple:
    """What makes two messages the same conversation step: role, text (outer whitespace aside) and
    calls (name and arguments; ids, raw JSON text and key order aside)."""
    calls = tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in message.tool_calls)
    return message.role, (message.content or "").strip(), calls


def _tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    return json.dumps(list(tools or ()), sort_keys=True)


@dataclass(frozen=True)
class RecordedCall:
    """One chat call of a session: what was asked, the exact prompt ids, what was sampled."""

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...]
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: str  # "stop" or "length"
    reply: Message  # the assistant message this gateway answered with
    parse_errors: tuple[str, ...]
    bridged_from: int | None  # index of the call this prompt extends, or None
    why_not_bridged: str | None  # None for bridged calls and a session's first call


@dataclass(frozen=True)
class SessionSampling:
    """Sampling a gateway imposes on every session call, whatever the agent's request says: RL needs
    its samples drawn at the rollout's temperature (the trainer's log-probs assume it), each call
    bounded, and a run reproducible. ``max_tokens`` caps a call's budget (None: the request's);
    ``seed``: call k of session s samples with a seed made from ``(seed, s, k)`` (None: the request's)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    seed: int | None = None

    def call_seed(self, session_id: str, call_index: int) -> int | None:
        if self.seed is None:
            return None
        return zlib.crc32(f"{self.seed}/{session_id}/{call_index}".encode())


@dataclass
class Session:
    id: str
    created: float = field(default_factory=time.time)
    calls: list[RecordedCall] = field(default_factory=list)
    sampling: SessionSampling | None = None  # the gateway's imposed sampling (None: the request's own)

    def plan_prompt(self, renderer: Any, messages: Sequence[Message],
                    tools: Sequence[dict[str, Any]] | None) -> tuple[list[int], int | None, str | None]:
        """The prompt of a new call: ``(ids, bridged_from, why_not_bridged)`` (module doc)."""
        if not self.calls:
            return renderer.render_prompt(messages, tools), None, None
        reason = "history_rewritten"
        wanted = [_message_key(m) for m in messages]
        for index in range(len(self.calls) - 1, -1, -1):  # the newest call the conversation continues
            call = self.calls[index]
            n = len(call.messages)
            if len(wanted) <= n or wanted[:n] != [_message_key(m) for m in call.messages] \
                    or wanted[n] != _message_key(call.reply):
                continue
            if _tools_key(call.tools) != _tools_key(tools):
                reason = "tools_changed"
                continue
            ids = renderer.continue_prompt(call.prompt_ids, call.completion_ids, list(messages[n + 1:]))
            return ids, index, None
        if len(wanted) and all(m.role != "assistant" for m in messages):
            reason = "new_conversation"
        return renderer.render_prompt(messages, tools), None, reason

    def record(self, call: RecordedCall) -> None:
        self.calls.append(call)

    def token_breaks(self) -> list[int]:
        """Indices of the calls whose prompt does not extend the previous call's prompt + completion."""
        breaks = []
        for i in range(1, len(self.calls)):
            before = list(self.calls[i - 1].prompt_ids) + list(self.calls[i - 1].completion_ids)
            if list(self.calls[i].prompt_ids[:len(before)]) != before:
                breaks.append(i)
        return breaks

    def trajectory(self, *, model: str = "", reward: float = 0.0, success: bool | None = None,
                   info: dict[str, Any] | None = None, task_id: str | None = None) -> Trajectory:
        """The session as one trajectory (module doc); ``reward`` on its last turn."""
        if not self.calls:
            raise ValueError(f"session {self.id!r} made no chat call: nothing to merge")
        turns = [Turn(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, completion_logprobs=c.logprobs,
                      finish_reason="length" if c.finish_reason == "length" else "stop", message=c.reply,
                      parse_errors=c.parse_errors) for c in self.calls]
        turns[-1] = turns[-1].model_copy(update={"reward": float(reward)})
        breaks = self.token_breaks()
        last = self.calls[-1]
        return Trajectory(
            env="gateway", task_id=task_id or self.id, tools=last.tools, messages=(*last.messages, last.reply),
            turns=tuple(turns), reward=float(reward), success=bool(reward >= 1.0) if success is None else success,
            metrics={"gateway/token_breaks": float(len(breaks)), "gateway/calls": float(len(self.calls))},
            policy=model,
            info={**(info or {}), "session": self.id, "token_breaks": len(breaks), "break_at_calls": breaks,
                  "break_reasons": [c.why_not_bridged for c in self.calls[1:] if c.bridged_from is None]},
        )


class SessionStore:
    """The gateway's sessions (thread-safe: routes run on the event loop, users call ``finish`` from
    their own threads). ``record_dir``: where ``finish`` appends each merged trajectory
    (``trajectories.jsonl``, one line per session, written whole) when set."""

    def __init__(self, record_dir: str | Path | None = None, model: str = "", sampling: SessionSampling | None = None):
        self.record_dir = Path(record_dir) if record_dir is not None else None
        self.model = model
        self.sampling = sampling
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.finished = 0
        self.total_breaks = 0
        if self.record_dir is not None:
            self.record_dir.mkdir(parents=True, exist_ok=True)

    def get(self, session_id: str) -> Session:
        with self._lock:
            if session_id not in self._sessions:
                self._sessions[session_id] = Session(session_id, sampling=self.sampling)
            return self._sessions[session_id]

    def discard(self, session_id: str) -> Session | None:
        """Forget a session without merging it (an agent that failed); its calls are returned."""
        with self._lock:
            return self._sessions.pop(session_id, None)

    def finish(self, session_id: str, *, reward: float = 0.0, success: bool | None = None,
               info: dict[str, Any] | None = None, task_id: str | None = None) -> Trajectory:
        """Merge the session into its trajectory, forget it, and append the trajectory to the record."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise KeyError(f"no session {session_id!r} (never called, or already finished)")
        trajectory = session.trajectory(model=self.model, reward=reward, success=success, info=info, task_id=task_id)
        with self._lock:
            self.finished += 1
            self.total_breaks += trajectory.info["token_breaks"]
            if self.record_dir is not None:
                with open(self.record_dir / "trajectories.jsonl", "a", encoding="utf-8") as f:
                    f.write(trajectory.model_dump_json() + "\n")
        return trajectory

    def stats(self) -> dict[str, Any]:
        with self._lock:
            open_sessions = [{"id": s.id, "calls": len(s.calls), "token_breaks": len(s.token_breaks())}
                             for s in self._sessions.values()]
            return {"open": open_sessions, "finished": self.finished, "token_breaks": self.total_breaks}


__all__ = ["RecordedCall", "SESSION_HEADER", "Session", "SessionSampling", "SessionStore"]
