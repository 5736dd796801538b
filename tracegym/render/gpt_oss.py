"""GPT-OSS: OpenAI's harmony format, token for token as the reference implementation renders it.

There is no chat template to compare with (the GPT-OSS tokenizer packages ship none); the reference
is PyPI ``openai-harmony`` (``load_harmony_encoding(HARMONY_GPT_OSS)``), and the golden test
(tests/test_render_gpt_oss.py) compares ids with its ``render_conversation_for_completion`` and
``render_conversation`` for every prefix of its conversations.

A harmony message is ``<|start|>{header}<|message|>{content}<|end|>``; the header is the author
(``assistant``, ``user``, a tool's ``functions.NAME``), an optional `` to={recipient}``, then
``<|channel|>{channel}`` and an optional content type (`` <|constrain|>json``). Every text piece
between two special tokens is tokenised on its own, as the reference does.

How tracegym's messages map onto harmony messages:

- First, always, a ``system`` message: the model identity, ``Knowledge cutoff: 2024-06``, an optional
  ``Current date:`` line (``conversation_start_date``), ``Reasoning: {reasoning_effort}`` and the
  channel rule; with tools, a line saying calls go to the commentary channel.
- The conversation's own system message becomes a ``developer`` message, ``# Instructions`` then the
  text; the tools follow in it as harmony's TypeScript-like ``namespace functions { ... }``
  (:func:`schema_to_typescript`). No system message and no tools: no developer message.
- An assistant message's reasoning is its leading ``<think>`` block, as for ``qwen3``
  (``Message`` has no field for it): an ``analysis`` message. Without tool calls its answer is a
  ``final`` message. With tool calls, text next to them is a ``commentary`` message (a preamble) and
  each call is ``assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>ARGS<|call|>``,
  the arguments as compact JSON. A tool result is ``functions.NAME to=assistant<|channel|>commentary``
  (``Message.name``, else the name of the call whose id it answers, else the bare ``functions``;
  ``continue_prompt`` knows the calls of the completion it continues by the ids ``parse_completion``
  gives them, ``call_0``, ``call_1``, ...).

Consequences for the token layer:

- The stop tokens are ``<|return|>`` (the answer is done) and ``<|call|>`` (a call waits for its
  result): the reference's ``stop_tokens_for_assistant_actions``. ``encode_completion`` ends with one.
  Messages inside a completion (analysis, a preamble, earlier calls of a parallel batch) end with
  ``<|end|>`` or ``<|call|>`` followed by ``<|start|>assistant``; ``parse_completion`` reads past a
  ``<|call|>`` only where ``<|start|>`` follows it (an engine that stops on ``<|call|>`` never samples
  that, so a model calls one tool per turn; a scripted expert's parallel calls still round-trip).
- ``history_preserving`` is False, for two rules of the reference. A sampled ``<|return|>`` is
  written ``<|end|>`` in history, so every turn that ends with an answer and is followed by another
  message is rewritten at its last token. And when the last assistant message of a rendered
  conversation is a ``final`` one, the ``analysis`` messages before the conversation's *first*
  ``final`` message are dropped (openai-harmony 0.0.8: reasoning written after the first answer
  stays, reasoning inside a tool loop stays until an answer comes). Calls keep ``<|call|>``, so a
  tool loop without answers in between extends token by token.
- ``continue_prompt`` keeps the sampled tokens and applies those two rules to them. It cannot bring
  back what an earlier prompt dropped: the reference drops the analysis only while the last assistant
  message is an answer, so when a later turn calls a tool it shows that analysis again, and there
  ``continue_prompt`` gives the reference's prompt without it (that prompt still extends the previous
  one, so ``build_examples`` does not split there).
  A model that
  writes its recipient in the channel part of the header (``<|channel|>commentary to=functions.add``,
  as OpenAI's examples show) keeps it there; the reference would write it after the role, where
  ``encode_completion`` writes it.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from tracegym.render.base import Renderer, Segment, UntrustedToolOutput, special, text
from tracegym.render.call_errors import settle_errors
from tracegym.render.qwen3 import split_reasoning, with_reasoning
from tracegym.render.toolcalls import snippet
from tracegym.types import CallError, Message, ParsedCompletion, ToolCall

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"

ReasoningEffort = Literal["low", "medium", "high"]
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
CHANNELS = ("analysis", "commentary", "final")
NAMESPACE = "functions"

EXPECTED_FORMAT = (
    "Call a tool in a message of its own: <|channel|>commentary to=functions.<tool name> "
    '<|constrain|>json<|message|>{"<parameter>": <value>}<|call|>'
)


# -- tools as TypeScript (the reference's conversion of JSON schemas) ------------------------------
def _lines(value: str) -> list[str]:
    """``value`` split into lines the way Rust's ``str::lines`` does (no empty last line, ``\\r\\n`` too)."""
    parts = value.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    return [part[:-1] if part.endswith("\r") else part for part in parts]


def _json_value(value: Any) -> str:
    """A JSON value as serde_json's ``Display`` writes it (compact)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _has_enum(schema: Mapping[str, Any]) -> bool:
    values = schema.get("enum")
    return isinstance(values, list) and bool(values)


def _default_note(schema: Mapping[str, Any], quote_strings: bool) -> str | None:
    """``default: ...`` for a schema with a default: a string quoted unless it belongs to an enum
    (or ``quote_strings`` is False), anything else as JSON."""
    if "default" not in schema:
        return None
    value = schema["default"]
    if isinstance(value, str):
        return f'default: "{value}"' if quote_strings and not _has_enum(schema) else f"default: {value}"
    return f"default: {_json_value(value)}"


def _nullable(schema: Any, rendered: str) -> str:
    if isinstance(schema, Mapping) and schema.get("nullable") is True and "null" not in rendered:
        return f"{rendered} | null"
    return rendered


def _variants(variants: list[Any], indent: str, skip_first: str | None, property_description: str | None) -> list[str]:
    """Each ``oneOf`` variant as `` | TYPE // notes``; ``skip_first``: the first variant's description
    is not repeated (it was written above the property)."""
    out = []
    for index, variant in enumerate(variants):
        rendered = _nullable(variant, schema_to_typescript(variant, indent + "   "))
        notes = []
        description = variant.get("description") if isinstance(variant, Mapping) else None
        if isinstance(description, str) and not (index == 0 and skip_first) and description != property_description:
            notes.append(description)
        note = _default_note(variant, quote_strings=True) if isinstance(variant, Mapping) else None
        if note:
            notes.append(note)
        out.append(f"{indent} | {rendered}" + (f" // {' '.join(notes)}" if notes else ""))
    return out


def _object_type(schema: Mapping[str, Any], indent: str) -> str:
    out = []
    description = schema.get("description")
    if isinstance(description, str):
        out.append(f"{indent}// {description}\n")
    out.append("{\n")
    properties = schema.get("properties")
    required = {name for name in schema.get("required", []) or [] if isinstance(name, str)} \
        if isinstance(schema.get("required"), list) else set()
    for key, value in (properties.items() if isinstance(properties, Mapping) else ()):
        value = value if isinstance(value, Mapping) else {}
        mark = "" if key in required else "?"
        title = value.get("title")
        if isinstance(title, str):
            out.append(f"{indent}// {title}\n{indent}//\n")
        own = value.get("description") if isinstance(value.get("description"), str) else None
        one_of = value.get("oneOf")
        if own is not None and one_of is None:
            out.append(f"{indent}// {own}\n")
        examples = value.get("examples")
        if isinstance(examples, list) and examples:
            out.append(f"{indent}// Examples:\n")
            out.extend(f'{indent}// - "{example}"\n' for example in examples if isinstance(example, str))
        if one_of is not None and isinstance(one_of, list):
            first = one_of[0] if one_of else None
            repeated = own is not None and isinstance(first, Mapping) and first.get("description") == own
            above = own is not None and not repeated
            if above:
                out.append(f"{indent}// {own}\n")
            note = _default_note(value, quote_strings=True)
            if note:
                out.append(f"{indent}// {note}\n")
            out.append(f"{indent}{key}{mark}:\n")
            out.extend(line + "\n" for line in _variants(one_of, indent, "skip" if above else None, own))
            out.append(f"{indent},\n")
            continue
        rendered = _nullable(value, schema_to_typescript(value, indent + "    "))
        line = f"{indent}{key}{mark}: {rendered},"
        if one_of is None:
            note = _default_note(value, quote_strings=True)
            if note:
                line += f" // {note}"
        out.append(line + "\n")
    out.append(f"{indent}}}")
    return "".join(out)


def schema_to_typescript(schema: Any, indent: str = "") -> str:
    """A JSON schema as the TypeScript-like type harmony declares a tool's parameters with:
    objects as ``{ name?: type, }`` blocks with descriptions as ``//`` comments, ``integer`` as
    ``number``, string enums as unions of literals, arrays as ``T[]``, ``oneOf`` as ``| A | B``."""
    if not isinstance(schema, Mapping):
        return "any"
    one_of = schema.get("oneOf")
    if one_of is not None:
        if not isinstance(one_of, list):
            return "any"
        return "".join(f"\n{line}" for line in _variants(one_of, indent, None, None))
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if k == "integer" else k for k in kind if isinstance(k, str)]
        if names:
            return " | ".join(names)
        kind = None
    if not isinstance(kind, str):
        return "any"
    if kind == "object":
        return _object_type(schema, indent)
    if kind == "string":
        values = schema.get("enum")
        literals = [f'"{v}"' for v in values if isinstance(v, str)] if isinstance(values, list) else []
        return " | ".join(literals) if literals else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return f"{schema_to_typescript(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"


def _function(tool: Mapping[str, Any]) -> tuple[str, str, Any]:
    """``(name, description, parameters or None)`` of an OpenAI-format schema or a bare one."""
    function = tool.get("function", tool)
    description = function.get("description")
    return str(function["name"]), description if isinstance(description, str) else "", function.get("parameters")


def tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    """The ``# Tools`` section of the developer message: the tools as the ``functions`` namespace."""
    lines = ["# Tools", "", f"## {NAMESPACE}", "", f"namespace {NAMESPACE} {{", ""]
    for tool in tools:
        name, description, parameters = _function(tool)
        lines.extend(f"// {line}" for line in _lines(description))
        if parameters is None:
            lines.append(f"type {name} = () => any;\n")
        else:
            lines.append(f"type {name} = (_: {schema_to_typescript(parameters)}) => any;\n")
    lines.append(f"}} // namespace {NAMESPACE}")
    return "\n".join(lines)


# -- harmony messages ------------------------------------------------------------------------------
@dataclass(frozen=True)
class HarmonyMessage:
    """One harmony message: its header parts, its content and the token that ends it."""

    author: str
    content: str
    channel: str | None = None
    recipient: str | None = None
    constrain: str | None = None  # the content type after <|constrain|> ("json")
    end: str = END

    def segments(self) -> list[Segment]:
        out = [special(START), text(self.author)]
        if self.recipient is not None:
            out.append(text(f" to={self.recipient}"))
        if self.channel is not None:
            out += [special(CHANNEL), text(self.channel)]
        if self.constrain is not None:
            out += [text(" "), special(CONSTRAIN), text(self.constrain)]
        return out + [special(MESSAGE), text(self.content), special(self.end)]


def drop_analysis(channels: Sequence[tuple[str, str | None]]) -> list[bool]:
    """Which messages the reference keeps, given each message's ``(author, channel)``: when the last
    assistant message is a ``final`` one, the ``analysis`` messages before the first ``final`` go."""
    last_assistant = next((channel for author, channel in reversed(channels) if author == "assistant"), None)
    first_final = next((i for i, (_, channel) in enumerate(channels) if channel == "final"), None)
    if last_assistant != "final" or first_final is None:
        return [True] * len(channels)
    return [not (i < first_final and channel == "analysis") for i, (_, channel) in enumerate(channels)]


def call_arguments(call: ToolCall) -> str:
    """A call's arguments as the model writes them: compact JSON."""
    return json.dumps(call.arguments, ensure_ascii=False, separators=(",", ":"))


@dataclass
class _Parsed:
    """One message read back from completion tokens."""

    header: str
    content: str
    end: str | None  # None: cut before its end


def _read_header(header: str) -> tuple[str, str | None, str | None, str | None]:
    """``(author, channel, recipient, content type)`` of a header's text; the recipient may stand in
    the role part or the channel part, as the reference's parser accepts."""
    role_part, _, channel_part = header.partition(CHANNEL)
    words = role_part.split()
    author = words[0] if words else ""
    recipient = next((w[3:] for w in words[1:] if w.startswith("to=")), None)
    channel = content_type = None
    rest = channel_part.replace(CONSTRAIN, f" {CONSTRAIN}").split()
    if rest:
        channel = rest[0]
        for word in rest[1:]:
            if word.startswith("to="):
                recipient = word[3:]
            else:
                content_type = word
    return author, channel, recipient, content_type


class GptOssRenderer(Renderer):
    """OpenAI's harmony format for GPT-OSS: channels, ``functions`` tools, ``<|call|>`` / ``<|return|>``."""

    name = "gpt_oss"
    history_preserving = False
    reasoning = True
    end_of_turn = END
    stop_tokens = (RETURN, CALL)

    def __init__(
        self,
        tokenizer: Any,
        *,
        reasoning_effort: ReasoningEffort = "medium",
        conversation_start_date: str | None = None,
        model_identity: str = MODEL_IDENTITY,
        untrusted_tool_output: UntrustedToolOutput = "none",
    ):
        super().__init__(tokenizer, untrusted_tool_output=untrusted_tool_output)
        if reasoning_effort not in ("low", "medium", "high"):
            raise ValueError(f"reasoning_effort must be low, medium or high, got {reasoning_effort!r}")
        self.reasoning_effort = reasoning_effort
        self.conversation_start_date = conversation_start_date
        self.model_identity = model_identity
        self._read_tokenizer([START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL])
        self._id_names = {token_id: name for name, token_id in self._special_ids.items()}

    # -- layout ----------------------------------------------------------------------------------
    def system_text(self, has_tools: bool) -> str:
        """The harmony system message's text."""
        top = [self.model_identity, f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}"]
        if self.conversation_start_date is not None:
            top.append(f"Current date: {self.conversation_start_date}")
        channels = f"# Valid channels: {', '.join(CHANNELS)}. Channel must be included for every message."
        if has_tools:
            channels += f"\nCalls to these tools must go to the commentary channel: '{NAMESPACE}'."
        return "\n\n".join(["\n".join(top), f"Reasoning: {self.reasoning_effort}", channels])

    def developer_text(self, instructions: str | None, tools: Sequence[dict] | None) -> str | None:
        """The developer message's text (the conversation's system message and the tools), or None."""
        sections = ["# Instructions", instructions] if instructions is not None else []
        if tools:
            sections.append(self.with_untrusted_notice(tools_section(tools)))
        return "\n\n".join(sections) if sections else None

    def assistant_messages(self, message: Message) -> list[HarmonyMessage]:
        """The harmony messages of one assistant message (see the module doc)."""
        parts = split_reasoning(message.content)
        reasoning, answer = parts if parts is not None else ("", message.content)
        reasoning = reasoning.strip("\n")
        out = [HarmonyMessage("assistant", reasoning, channel="analysis")] if reasoning.strip() else []
        if not message.tool_calls:
            return out + [HarmonyMessage("assistant", answer, channel="final")]
        if answer:
            out.append(HarmonyMessage("assistant", answer, channel="commentary"))
        out += [HarmonyMessage("assistant", call_arguments(call), channel="commentary",
                               recipient=f"{NAMESPACE}.{call.name}", constrain="json", end=CALL)
                for call in message.tool_calls]
        return out

    def harmony_messages(
        self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool,
        earlier_calls: Sequence[ToolCall] = (),
    ) -> list[HarmonyMessage]:
        """``messages`` as harmony messages, before the reference's analysis rule. ``start``: they
        open the conversation (the system and developer messages belong here). ``earlier_calls``:
        calls made before ``messages``, for tool results that name their call only by its id."""
        out: list[HarmonyMessage] = []
        rest = list(messages)
        if start:
            instructions = rest.pop(0).content if rest and rest[0].role == "system" else None
            out.append(HarmonyMessage("system", self.system_text(bool(tools))))
            developer = self.developer_text(instructions, tools)
            if developer is not None:
                out.append(HarmonyMessage("developer", developer))
        call_names = {call.id: call.name for call in earlier_calls if call.id}
        for message in rest:
            if message.role == "assistant":
                call_names.update({call.id: call.name for call in message.tool_calls if call.id})
                out += self.assistant_messages(message)
            elif message.role == "tool":
                name = message.name or call_names.get(message.tool_call_id or "")
                author = self.tool_role(f"{NAMESPACE}.{name}" if name else NAMESPACE)
                out.append(HarmonyMessage(author, self.tool_content(message.content), channel="commentary",
                                          recipient="assistant"))
            elif message.role == "system":  # a later system message: more instructions
                out.append(HarmonyMessage("developer", f"# Instructions\n\n{message.content}"))
            else:
                out.append(HarmonyMessage(message.role, message.content))
        return out

    def _layout(self, messages: Sequence[Message], tools: Sequence[dict] | None, start: bool) -> list[Segment]:
        shown = self.harmony_messages(messages, tools, start)
        keep = drop_analysis([(m.author, m.channel) for m in shown]) if start else [True] * len(shown)
        return [segment for m, kept in zip(shown, keep) if kept for segment in m.segments()]

    def _generation_prompt(self) -> list[Segment]:
        return [special(START), text("assistant")]

    def _segments_to_ids(self, segments: Sequence[Segment]) -> list[int]:
        """Every text piece tokenised on its own, as the reference renders a message."""
        ids: list[int] = []
        for segment in segments:
            if segment.kind == "special":
                ids.append(self._special_ids[segment.text])
            else:
                ids.extend(self.encode_text(segment.text))
        return ids

    # -- completions -----------------------------------------------------------------------------
    def encode_completion(self, message: Message) -> list[int]:
        """What the model generates after ``<|start|>assistant``: the turn's harmony messages, the
        last ending with ``<|return|>`` (an answer) or ``<|call|>`` (a call)."""
        if message.role != "assistant":
            raise ValueError(f"encode_completion takes an assistant message, got role {message.role!r}")
        shown = self.assistant_messages(message)
        if shown[-1].end == END:
            shown[-1] = replace(shown[-1], end=RETURN)
        segments = [segment for m in shown for segment in m.segments()][2:]  # the prompt has <|start|>assistant
        return self._segments_to_ids(segments)

    def _assistant_text(self, message: Message) -> str:
        return self.tokenizer.decode(self.encode_completion(message), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def _parse_assistant_text(self, value: str) -> tuple[Message, tuple[str, ...]]:
        """Completion text -> message: the text is tokenised with its special tokens and parsed."""
        ids = list(self.tokenizer(value, add_special_tokens=False)["input_ids"])
        parsed = self.parse_completion(ids)
        return parsed.message, tuple(parsed.errors)

    def canonical_message(self, message: Message) -> Message:
        """The content with its reasoning in canonical ``<think>`` form (what parsing gives back)."""
        parts = split_reasoning(message.content)
        if parts is None:
            return message
        return message.model_copy(update={"content": with_reasoning(parts[0], parts[1])})

    def _split(self, completion_ids: Sequence[int]) -> tuple[list[_Parsed], bool, list[str]]:
        """Completion ids -> (messages, ended with a stop token, errors). Reads past ``<|call|>`` only
        where ``<|start|>`` follows; ids outside the vocabulary are dropped and reported."""
        vocab_size = self._vocab_size
        tokens: list[int] = []
        bad = 0
        for raw_token in completion_ids:
            try:
                token = operator.index(raw_token)
            except TypeError:
                token = -1
            if isinstance(raw_token, bool) or not 0 <= token < vocab_size:
                bad += 1
                continue
            tokens.append(token)
        errors = [f"The completion held {bad} token id(s) outside the vocabulary; they were dropped."] if bad else []
        names = self._id_names
        messages: list[_Parsed] = []
        header: list[int] = []
        content: list[int] = []
        state = "header"  # the first header goes on from the prompt's <|start|>assistant
        stray: list[int] = []  # tokens between a message's end and the next <|start|>
        ended = False

        def close(end: str | None) -> None:
            prefix = "assistant" if not messages else ""
            messages.append(_Parsed(prefix + self._decode(header), self._decode(content), end))

        for k, token in enumerate(tokens):
            name = names.get(token)
            following = names.get(tokens[k + 1]) if k + 1 < len(tokens) else None
            stops = name == RETURN or (name == CALL and following != START)
            if state == "header" and name == MESSAGE:
                state, content = "content", []
            elif state == "header" and name in (START, END, CALL, RETURN):
                errors.append(f"A message header ended before <|message|>: {snippet(self._decode(header))!r}")
                close(None)
                state, header = ("header", []) if name == START else ("between", [])
            elif state == "header":
                header.append(token)
            elif state == "content" and name in (END, CALL, RETURN):
                close(name)
                state = "between"
            elif state == "content" and name == START:
                errors.append("A message was not closed before the next <|start|>.")
                close(None)
                state, header = "header", []
            elif state == "content":
                content.append(token)
            elif name == START:
                state, header = "header", []
            elif not stops:
                stray.append(token)
            if stops:
                ended = True
                break
        else:
            if state == "content" or (state == "header" and header):
                close(None)  # cut by the token limit
        if stray:
            errors.append(f"Text outside a message was ignored: {snippet(self._decode(stray))!r}")
        return messages, ended, errors

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def parse_completion(self, completion_ids: Sequence[int]) -> ParsedCompletion:
        """Sampled completion -> assistant message: analysis messages become the ``<think>`` block,
        preambles and the answer the content, ``to=functions.NAME`` messages the calls. A call that is
        not JSON is ``bad_json``, arguments that are not an object ``bad_args``, a call to something
        outside ``functions`` ``unknown_tool``, a call cut by the token limit ``truncated``."""
        try:
            messages, ended, errors = self._split(completion_ids)
        except Exception as exc:  # noqa: BLE001 - a tokenizer should not fail here; if it does, report
            messages, ended, errors = [], False, [f"Could not decode the completion: {type(exc).__name__}: {exc}"]
        reasoning: list[str] = []
        said: list[str] = []
        calls: list[ToolCall] = []
        call_errors: list[str] = []
        attempts = 0
        for parsed in messages:
            author, channel, recipient, _content_type = _read_header(parsed.header)
            if recipient is None or recipient == "all":
                if parsed.content:
                    (reasoning if channel == "analysis" else said).append(parsed.content)
                continue
            index = attempts
            attempts += 1
            if parsed.end is None:
                call_errors.append(CallError(f"Tool call {index + 1}: the call to {recipient!r} is never closed by "
                                             f"<|call|>: {snippet(parsed.content)!r}. {EXPECTED_FORMAT}", "truncated"))
                continue
            if not recipient.startswith(f"{NAMESPACE}.") or len(recipient) == len(NAMESPACE) + 1:
                call_errors.append(CallError(f"Tool call {index + 1}: unknown tool {recipient!r}: tools are called "
                                             f"as to=functions.<tool name>. {EXPECTED_FORMAT}", "unknown_tool"))
                continue
            tool = recipient[len(NAMESPACE) + 1 :]
            try:
                arguments = json.loads(parsed.content) if parsed.content.strip() else None
            except (ValueError, RecursionError) as exc:
                msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc) or type(exc).__name__
                call_errors.append(CallError(f"Tool call {index + 1}: invalid JSON ({msg}) in "
                                             f"{snippet(parsed.content)!r}. {EXPECTED_FORMAT}", "bad_json"))
                continue
            if arguments is None:
                call_errors.append(CallError(f"Tool call {index + 1}: the block is empty. {EXPECTED_FORMAT}", "bad_json"))
                continue
            if not isinstance(arguments, dict):
                call_errors.append(CallError(f'Tool call {index + 1}: "arguments" of {tool!r} must be a JSON object, '
                                             f"got {type(arguments).__name__}. {EXPECTED_FORMAT}", "bad_args"))
                continue
            calls.append(ToolCall(name=tool, arguments=arguments, raw=parsed.content, id=f"call_{len(calls)}"))
        content = with_reasoning("\n".join(reasoning), "\n".join(said))
        settled = settle_errors(tuple(errors) + tuple(call_errors), cut=not ended)
        return ParsedCompletion(message=Message(role="assistant", content=content, tool_calls=tuple(calls)),
                                errors=settled, ended_with_eot=ended)

    # -- history ---------------------------------------------------------------------------------
    def continue_prompt(
        self,
        previous_prompt: Sequence[int],
        completion_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int]:
        """The next prompt as the reference writes it: the sampled tokens kept, a final
        ``<|return|>`` written ``<|end|>`` (a cut completion closed with ``<|end|>``), the new messages
        and ``<|start|>assistant``; then the analysis rule over the whole history."""
        ids = list(previous_prompt) + list(completion_ids)
        end_id, return_id = self._special_ids[END], self._special_ids[RETURN]
        if not completion_ids or completion_ids[-1] not in self.stop_token_ids:
            ids.append(end_id)
        elif completion_ids[-1] == return_id:
            ids[-1] = end_id
        calls = self.parse_completion(completion_ids).message.tool_calls if completion_ids else ()
        shown = self.harmony_messages(new_messages, None, start=False, earlier_calls=calls)
        ids += self._segments_to_ids([segment for m in shown for segment in m.segments()] + self._generation_prompt())
        return self._drop_analysis_ids(ids)

    def _drop_analysis_ids(self, ids: list[int]) -> list[int]:
        """``ids`` without the analysis messages the reference drops (``drop_analysis``)."""
        start_id, message_id = self._special_ids[START], self._special_ids[MESSAGE]
        starts = [k for k, token in enumerate(ids) if token == start_id]
        spans: list[tuple[int, int, str, str | None]] = []  # (start, end, author, channel) of full messages
        for n, begin in enumerate(starts):
            stop = starts[n + 1] if n + 1 < len(starts) else len(ids)
            header_end = next((j for j in range(begin + 1, stop) if ids[j] == message_id), None)
            if header_end is None:  # the generation prompt
                continue
            author, channel, _, _ = _read_header(self._decode(ids[begin + 1 : header_end]))
            spans.append((begin, stop, author, channel))
        keep = drop_analysis([(author, channel) for _, _, author, channel in spans])
        if all(keep):
            return ids
        out: list[int] = []
        pos = 0
        for (begin, stop, _, _), kept in zip(spans, keep):
            if not kept:
                out += ids[pos:begin]
                pos = stop
        return out + ids[pos:]
