"""Context policies (``rollout.context``): what an episode's prompt shows of its history.

``full`` shows everything. ``window`` keeps the opening messages (those before the first assistant
message: the system prompt and the task) and the last ``keep_turns`` turns; ``observation_masking``
keeps every message but replaces the tool results of older turns by a placeholder (the cheap
"observation masking" of agent-context studies: the model's own reasoning and calls stay, the bulky
outputs go). A turn here is an assistant message and the messages that answered it.

The runner renders a rewritten history afresh (``render_prompt``) instead of extending the previous
prompt, so the prompt no longer extends the last turn's tokens: ``build_examples`` then starts a new
segment there, and each segment trains on exactly the prompt the model saw and the tokens it
sampled; the episode's advantages reach every segment through its turns.
"""

from __future__ import annotations

from typing import Sequence

from tracegym.config.shared import ContextConfig
from tracegym.types import Message

__all__ = ["ContextConfig", "apply_context", "rewrites_history"]


def _turn_starts(messages: Sequence[Message]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.role == "assistant"]


def rewrites_history(messages: Sequence[Message], context: ContextConfig) -> bool:
    """Whether ``context`` shows ``messages`` otherwise than in full (more turns than it keeps)."""
    return context.policy != "full" and len(_turn_starts(messages)) > context.keep_turns


def apply_context(messages: Sequence[Message], context: ContextConfig) -> list[Message]:
    """The messages the prompt shows under ``context`` (a new list; ``messages`` is not changed)."""
    if not rewrites_history(messages, context):
        return list(messages)
    starts = _turn_starts(messages)
    cut = starts[-context.keep_turns]  # the first message of the oldest turn kept whole
    opening = list(messages[:starts[0]])
    if context.policy == "window":
        return opening + list(messages[cut:])
    masked = [m.model_copy(update={"content": context.placeholder}) if m.role == "tool" else m
              for m in messages[starts[0]:cut]]
    return opening + masked + list(messages[cut:])
