"""Context policies (``rollout.context``): what an episode's prompt shows of its history.

``full`` shows everything. ``window`` keeps the opening messages (those before the first assistant
message: the system prompt and the task) and the last ``keep_turns`` turns; ``observation_masking``
keeps every message but replaces the tool results of older turns by a placeholder (the cheap
"observation masking" of agent-context studies: the model's own reasoning and calls stay, the bulky
outputs go). A turn here is an assistant message and the messages that answered it.

``summarize`` lets the model manage its own context (the "summary turn" of context-folding agents):
once the next prompt passes ``summarize_at`` tokens, the policy first answers a user message
(``summary_request``) with a summary. That turn is sampled, recorded (``Turn.kind == "summary"``)
and trained like any other, but never sent to the env. The transcript keeps the request and the
summary; from then on the prompt shows the opening messages, the latest summary (after
``summary_header``, as a user message), the last ``keep_turns`` turns before it and every turn since.

The runner renders a rewritten history afresh (``render_prompt``) instead of extending the previous
prompt, so the prompt no longer extends the last turn's tokens: ``build_examples`` then starts a new
segment there, and each segment trains on exactly the prompt the model saw and the tokens it
sampled; the episode's advantages reach every segment through its turns.
"""

from __future__ import annotations

from typing import Sequence

from tracegym.config.shared import ContextConfig
from tracegym.types import Message

__all__ = ["ContextConfig", "apply_context", "expert_summary", "needs_summary", "rewrites_history", "summary_positions"]


def summary_positions(messages: Sequence[Message], context: ContextConfig) -> list[int]:
    """Indices of the summary requests in ``messages`` (each followed by the summary it got)."""
    if context.policy != "summarize":
        return []
    return [i for i in range(len(messages) - 1)
            if messages[i].role == "user" and messages[i].content == context.summary_request
            and messages[i + 1].role == "assistant"]


def _turn_starts(messages: Sequence[Message], context: ContextConfig) -> list[int]:
    """Assistant messages that acted in the env (summaries left out)."""
    summaries = {i + 1 for i in summary_positions(messages, context)}
    return [i for i, m in enumerate(messages) if m.role == "assistant" and i not in summaries]


def rewrites_history(messages: Sequence[Message], context: ContextConfig) -> bool:
    """Whether ``context`` shows ``messages`` otherwise than in full (more turns than it keeps, or a
    summary written)."""
    if context.policy == "summarize":
        return bool(summary_positions(messages, context))
    return context.policy != "full" and len(_turn_starts(messages, context)) > context.keep_turns


def needs_summary(messages: Sequence[Message], prompt_tokens: int, context: ContextConfig) -> bool:
    """``summarize``: whether the policy writes a summary before acting on a prompt of
    ``prompt_tokens`` tokens: it passes ``summarize_at`` and the env was stepped since the last
    summary (a summary never follows a summary, so an over-long one cannot loop)."""
    if context.policy != "summarize" or prompt_tokens <= context.summarize_at:
        return False
    requests = summary_positions(messages, context)
    since = requests[-1] + 2 if requests else 0
    return any(i >= since for i in _turn_starts(messages, context))


def apply_context(messages: Sequence[Message], context: ContextConfig) -> list[Message]:
    """The messages the prompt shows under ``context`` (a new list; ``messages`` is not changed)."""
    if not rewrites_history(messages, context):
        return list(messages)
    starts = _turn_starts(messages, context)
    opening = list(messages[:min(i for i, m in enumerate(messages) if m.role == "assistant")])
    if context.policy == "summarize":
        requests = summary_positions(messages, context)
        last = requests[-1]
        before = [i for i in starts if i < last]
        cut = before[-context.keep_turns] if len(before) >= context.keep_turns else (before[0] if before else last)
        older = {j for i in requests[:-1] for j in (i, i + 1)}  # earlier summaries: the last one supersedes them
        kept = [m for j, m in enumerate(messages[cut:last], start=cut) if j not in older]
        note = Message(role="user", content=f"{context.summary_header}\n{messages[last + 1].content}")
        return opening + [note] + kept + list(messages[last + 2:])
    cut = starts[-context.keep_turns]  # the first message of the oldest turn kept whole
    if context.policy == "window":
        return opening + list(messages[cut:])
    masked = [m.model_copy(update={"content": context.placeholder}) if m.role == "tool" else m
              for m in messages[starts[0]:cut]]
    return opening + masked + list(messages[cut:])


def expert_summary(messages: Sequence[Message], context: ContextConfig) -> str:
    """The scripted expert's summary: the tool calls it made so far, one a line (the expert acts from
    the env's state, so it needs no more; a model writes its own)."""
    lines = []
    for i in _turn_starts(messages, context):
        for call in messages[i].tool_calls:
            args = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
            lines.append(f"- {call.name}({args})")
    return "Calls so far:\n" + "\n".join(lines) if lines else "No calls yet."
