"""Streamed chat completions: server-sent events (``data: {chunk}``) as tokens arrive, ending with
``data: [DONE]``. Content is sent only once it can never be taken back: text that could still be
the start of a stop string or of a tool call waits."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Iterator

from tracegym.render.toolcalls import TOOL_CALL_OPEN
from tracegym.serve.backends import Handle
from tracegym.serve.errors import APIError
from tracegym.serve.generation import Choice, apply_event
from tracegym.serve.plan import RequestPlan
from tracegym.serve.replies import final_message, logprob_entry
from tracegym.serve.state import ServerState

_GENERATION_FAILED = f"data: {json.dumps(APIError(500, 'generation failed', type='server_error').body())}\n\n"


def stream_content(plan: RequestPlan, choice: Choice, final: bool) -> str:
    """The content that can be sent now without ever being taken back."""
    text = choice.cut_text if choice.cut_text is not None else choice.text
    end = len(text)
    if choice.cut_text is None and not final and plan.params.stop:
        end -= max(len(s) for s in plan.params.stop) - 1  # could be the start of a stop string
    if plan.tools_mode:
        at = text.find(TOOL_CALL_OPEN)
        if at >= 0:
            end = min(end, at)
        else:
            for j in range(len(TOOL_CALL_OPEN) - 1, 0, -1):
                if text[:end].endswith(TOOL_CALL_OPEN[:j]):
                    end -= j
                    break
    candidate = text[:max(end, 0)].strip()
    return candidate if candidate.startswith(choice.sent) else choice.sent


class ChatStream:
    """The SSE chunks of one streamed chat completion, read from the request's event queue.

    Every chunk carries ``usage: null`` when the client asked for ``include_usage`` (the usage
    itself comes in a last chunk with no choices), as OpenAI sends it."""

    def __init__(self, state: ServerState, plan: RequestPlan, choices: list[Choice], events: asyncio.Queue,
                 handle: Handle, completion_id: str):
        self.state, self.plan, self.choices = state, plan, choices
        self.events, self.handle, self.completion_id = events, handle, completion_id

    def _chunk(self, choice_items: list[dict[str, Any]], usage: Any = None,
               prompt_ids: list[int] | None = None) -> str:
        payload: dict[str, Any] = {"id": self.completion_id, "object": "chat.completion.chunk",
                                   "created": int(time.time()), "model": self.state.model_name,
                                   "system_fingerprint": None, "choices": choice_items}
        if self.plan.include_usage:
            payload["usage"] = usage
        if prompt_ids is not None:  # return_token_ids: on the first chunk only, as vLLM sends it
            payload["prompt_token_ids"] = list(prompt_ids)
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _item(self, choice: Choice, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        """One choice's part of a chunk; the token ids and log-probs gathered since the last one go with it."""
        out: dict[str, Any] = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": finish}
        if self.plan.logprobs:
            out["logprobs"] = {"content": choice.pending_lps, "refusal": None}
        out["token_ids"] = choice.pending_ids
        choice.pending_ids, choice.pending_lps = [], []
        return out

    def _opening(self) -> Iterator[str]:
        """Each choice's role chunk."""
        for choice in self.choices:
            prompt_ids = self.plan.prompt if self.plan.return_token_ids and choice.index == 0 else None
            yield self._chunk([self._item(choice, {"role": "assistant", "content": ""})], prompt_ids=prompt_ids)

    def _progress(self, choice: Choice) -> Iterator[str]:
        """After a sampled token: the content that became safe to send (with log-probs: every token)."""
        plan = self.plan
        choice.pending_ids.append(choice.tokens[-1])
        if plan.logprobs:
            choice.pending_lps.append(logprob_entry(self.state, choice, len(choice.tokens) - 1, plan))
        now = stream_content(plan, choice, final=False)
        if len(now) > len(choice.sent) or plan.logprobs:
            delta = {"content": now[len(choice.sent):]} if len(now) > len(choice.sent) else {}
            choice.sent = now
            yield self._chunk([self._item(choice, delta)])

    def _closing(self, choice: Choice) -> Iterator[str]:
        """A finished choice: the rest of its content, its tool calls (name, then arguments), its finish reason."""
        message, finish, errors = final_message(self.state, self.plan, choice)
        content = message["content"] or ""
        if content.startswith(choice.sent) and len(content) > len(choice.sent):
            yield self._chunk([self._item(choice, {"content": content[len(choice.sent):]})])
            choice.sent = content
        for k, call in enumerate(message.get("tool_calls", ())):
            head = {"index": k, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            yield self._chunk([self._item(choice, {"tool_calls": [head]})])
            args = {"index": k, "function": {"arguments": call["function"]["arguments"]}}
            yield self._chunk([self._item(choice, {"tool_calls": [args]})])
        last = self._item(choice, {}, finish)
        if errors:
            last["parse_errors"] = list(errors)
        yield self._chunk([last])

    def _usage(self) -> str:
        completion_tokens = sum(len(c.tokens) for c in self.choices)
        prompt_tokens = len(self.plan.prompt)
        return self._chunk([], {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                "total_tokens": prompt_tokens + completion_tokens})

    async def sse(self) -> AsyncIterator[str]:
        """The whole stream. When the client goes away before the end, the rows still decoding are freed."""
        finished = 0
        try:
            for chunk in self._opening():
                yield chunk
            while finished < len(self.choices):
                event = await self.events.get()
                done = apply_event(self.choices, event)
                choice = self.choices[event[1]]
                if not done:
                    for chunk in self._progress(choice):
                        yield chunk
                    continue
                finished += 1
                if choice.finish == "abort":
                    yield _GENERATION_FAILED
                    return
                for chunk in self._closing(choice):
                    yield chunk
            if self.plan.include_usage:
                yield self._usage()
            yield "data: [DONE]\n\n"
        finally:
            if finished < len(self.choices):
                self.handle.cancel()  # the client went away: free the rows
