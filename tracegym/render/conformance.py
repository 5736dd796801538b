"""Renderer conformance: does a renderer write exactly what a tokenizer's own chat template writes?

``run_conformance(renderer)`` checks a renderer against the chat template of the tokenizer it is
bound to (``renderer.tokenizer.chat_template``), over a built-in set of conversations
(``CONVERSATIONS``: plain chat, tools, a tool loop, parallel calls, a follow-up query and, for
families that reason, ``<think>`` blocks). ``tracegym renderers check`` runs it on a model folder.

Checks, one row per check and conversation:

- ``golden``: for every prefix of the conversation, ``render_ids`` equals the ids of
  ``apply_chat_template`` (a generation prompt after every prefix that does not end with the
  assistant). The template gets ``renderer.template_inputs``: the OpenAI-format messages and tools, or,
  for a template that renders no ``tools`` argument, the tool parts written into the messages.
  A conversation the template refuses (an exception) is SKIP, with the template's message.
- ``extension``: turn n+1's prompt starts with turn n's prompt + its completion
  (``encode_completion``). A renderer that says ``history_preserving = False`` passes with the first
  place the template rewrites history named; one that says True fails there.
- ``continue``: ``continue_prompt`` builds exactly the template's next prompt from the previous one,
  the completion and the new messages (where the template rewrites history, as it rewrites it).
- ``tool_calls``: ``parse_completion(encode_completion(m))`` gives ``canonical_message(m)`` back
  (content, call names and arguments) with no errors and the end of turn seen, and re-encodes to
  the same ids; a completion cut before its end parses without raising.
- ``stop_tokens``: the renderer has stop tokens, each a single special token of the tokenizer; every
  completion ends with one; the tokenizer's end-of-sequence token is one of them.

A FAIL names the first token where the renderer and the template differ, as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tracegym.render.base import Renderer
from tracegym.types import Message, ToolCall

Status = Literal["PASS", "FAIL", "SKIP"]

ADD_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
LOOKUP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up (returns a short «definition»).",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}
TOOLS: tuple[dict[str, Any], ...] = (ADD_TOOL, LOOKUP_TOOL)


def _call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def _user(text: str) -> Message:
    return Message(role="user", content=text)


def _assistant(text: str = "", *calls: ToolCall) -> Message:
    return Message(role="assistant", content=text, tool_calls=calls)


def _result(text: str, name: str) -> Message:
    return Message(role="tool", content=text, name=name, tool_call_id="call_0")


@dataclass(frozen=True)
class Conversation:
    """One conversation of the suite: its name, messages and tool schemas (None: no tools)."""

    name: str
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] | None = None


SYSTEM = Message(role="system", content="Answer briefly. Give the final answer as <answer>...</answer>.")

CONVERSATIONS: tuple[Conversation, ...] = (
    Conversation("chat", (SYSTEM, _user("Say hello in French."), _assistant("Bonjour ! 👋"),
                          _user("And in German?"), _assistant("Hallo!"))),
    Conversation("no_system", (_user("What is 2+2?"), _assistant("<answer>4</answer>"))),
    Conversation("tool_call", (SYSTEM, _user("Add 2 and 3."), _assistant("", _call("add", a=2, b=3)),
                               _result("5", "add"), _assistant("<answer>5</answer>")), TOOLS),
    Conversation("tool_loop", (
        _user("What is 10 + 32, and what does 'café' mean?"),
        _assistant("", _call("add", a=10, b=32)),
        _result("Error: the service is busy", "add"),
        _assistant("Retrying.", _call("add", a=10, b=32)),
        _result("42", "add"),
        _assistant("", _call("lookup", word="café — coffee")),
        _result('{"text": "a coffee\\nhouse"}', "lookup"),
        _assistant("42; a café is a coffee house.\n<answer>42</answer>"),
        _user("Thanks. And 1 + 1?"),
        _assistant("<answer>2</answer>"),
    ), TOOLS),
    Conversation("parallel_calls", (
        SYSTEM, _user("Add 2 and 3, and 4 and 5."),
        _assistant("", _call("add", a=2, b=3), _call("add", a=4, b=5)),
        _result("5", "add"), _result("9", "add"),
        _assistant("<answer>5, 9</answer>"),
    ), TOOLS),
)

REASONING_CONVERSATION = Conversation("reasoning", (
    SYSTEM, _user("What is 2+3, looked up?"),
    _assistant("<think>\nI add first.\n</think>\n\nAdding.", _call("add", a=2, b=3)),
    _result("5", "add"),
    _assistant("<think>\nNow look it up.\n</think>", _call("lookup", word="five")),
    _result('{"text": "5"}', "lookup"),
    _assistant("<think>\nDone.\n</think>\n\n<answer>5</answer>"),
    _user("And doubled?"),
    _assistant("<think>\n5*2\n</think>\n\n<answer>10</answer>"),
), TOOLS)


@dataclass(frozen=True)
class CheckResult:
    """One row of the report: a check on one conversation."""

    check: str
    case: str
    status: Status
    detail: str


def conversations_for(renderer: Renderer) -> tuple[Conversation, ...]:
    """The built-in conversations, with the reasoning one for families that reason."""
    return CONVERSATIONS + ((REASONING_CONVERSATION,) if renderer.reasoning else ())


# -- showing a difference ------------------------------------------------------------------------
def token_text(tokenizer: Any, token_id: int) -> str:
    """One token as text (``repr``, so whitespace shows)."""
    return repr(tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False))


def first_difference(tokenizer: Any, ours: Sequence[int], theirs: Sequence[int], theirs_name: str = "template") -> str:
    """Where ``ours`` and ``theirs`` first differ: the position, both tokens as text and the text
    just before; '' when they are equal."""
    ours, theirs = list(ours), list(theirs)
    if ours == theirs:
        return ""
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    before = tokenizer.decode(ours[max(0, index - 6) : index], skip_special_tokens=False,
                              clean_up_tokenization_spaces=False)
    mine = token_text(tokenizer, ours[index]) if index < len(ours) else "(end)"
    other = token_text(tokenizer, theirs[index]) if index < len(theirs) else "(end)"
    return f"token {index}: renderer {mine} vs {theirs_name} {other} (after {before[-40:]!r})"


# -- the template's side -------------------------------------------------------------------------
_PLACEHOLDER_TOOL = {"type": "function", "function": {"name": "tracegym_probe", "parameters": {"type": "object"}}}


def template_knows_tools(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template renders a ``tools`` argument (its text changes)."""
    messages = [{"role": "user", "content": "u"}]
    try:
        with_tools = tokenizer.apply_chat_template(messages, tools=[_PLACEHOLDER_TOOL], tokenize=False)
        without = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render tools does not know them
        return False
    return with_tools != without


def template_ids(
    renderer: Renderer, messages: Sequence[Message], tools: Sequence[dict] | None, generation_prompt: bool,
    knows_tools: bool,
) -> list[int]:
    """Ids of the tokenizer's own template for ``messages`` (raises what the template raises)."""
    inputs, template_tools = renderer.template_inputs(messages, tools, knows_tools)
    out = renderer.tokenizer.apply_chat_template(
        inputs, tools=template_tools, tokenize=True, add_generation_prompt=generation_prompt
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _assistant_positions(messages: Sequence[Message]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.role == "assistant"]


# -- the checks ----------------------------------------------------------------------------------
def check_golden(renderer: Renderer, conversation: Conversation, knows_tools: bool) -> CheckResult:
    """Every prefix (from the first message that is not a system message): ``render_ids`` equals the
    template's ids. SKIP from the first prefix the template refuses."""
    messages, tools = conversation.messages, conversation.tools
    first = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    for end in range(first + 1, len(messages) + 1):
        prefix = messages[:end]
        generation_prompt = prefix[-1].role != "assistant"
        try:
            expected = template_ids(renderer, prefix, tools, generation_prompt, knows_tools)
        except Exception as exc:  # noqa: BLE001 - the template refuses this conversation
            return CheckResult("golden", conversation.name, "SKIP", f"{end - first - 1} prefix(es) equal the template, "
                               f"then it refuses message {end}: {_one_line(exc)}")
        ours = renderer.render_ids(prefix, tools, add_generation_prompt=generation_prompt)
        if ours != expected:
            where = first_difference(renderer.tokenizer, ours, expected)
            return CheckResult("golden", conversation.name, "FAIL", f"prefix of {end} message(s): {where}")
    return CheckResult("golden", conversation.name, "PASS", f"{len(messages) - first} prefixes equal the template")


def _turn_prompts(renderer: Renderer, conversation: Conversation) -> list[tuple[list[int], list[int], list[int], int]]:
    """``(prompt, completion, next prompt, next start)`` per assistant turn, all rendered by the
    renderer; the next prompt of the last turn is the whole conversation without a generation prompt."""
    messages, tools = conversation.messages, conversation.tools
    positions = _assistant_positions(messages)
    turns = []
    for k, position in enumerate(positions):
        prompt = renderer.render_prompt(messages[:position], tools)
        completion = renderer.encode_completion(messages[position])
        if k + 1 < len(positions):
            following = renderer.render_prompt(messages[: positions[k + 1]], tools)
            turns.append((prompt, completion, following, positions[k + 1]))
        else:
            turns.append((prompt, completion, renderer.render_ids(messages, tools, add_generation_prompt=False), -1))
    return turns


def check_extension(renderer: Renderer, conversation: Conversation) -> CheckResult:
    """Each prompt starts with the previous prompt + completion (or the renderer says it does not)."""
    for k, (prompt, completion, following, _) in enumerate(_turn_prompts(renderer, conversation)):
        history = prompt + completion
        if following[: len(history)] != history:
            where = first_difference(renderer.tokenizer, history, following[: len(history)], "next prompt")
            if renderer.history_preserving:
                return CheckResult("extension", conversation.name, "FAIL", f"turn {k + 1} is rewritten later: {where}")
            return CheckResult("extension", conversation.name, "PASS",
                               f"history_preserving=False: the template rewrites turn {k + 1} ({where})")
    return CheckResult("extension", conversation.name, "PASS", "every prompt extends the previous one + its completion")


def check_continue(renderer: Renderer, conversation: Conversation) -> CheckResult:
    """``continue_prompt`` builds the template's next prompt from the previous one, token by token."""
    messages = conversation.messages
    positions = _assistant_positions(messages)
    compared = 0
    for k, (prompt, completion, following, start) in enumerate(_turn_prompts(renderer, conversation)):
        if start < 0:
            continue
        built = renderer.continue_prompt(prompt, completion, messages[positions[k] + 1 : start])
        if built != following:
            where = first_difference(renderer.tokenizer, built, following)
            return CheckResult("continue", conversation.name, "FAIL", f"prompt of turn {k + 2}: {where}")
        compared += 1
    return CheckResult("continue", conversation.name, "PASS", f"{compared} prompt(s) built token by token equal the template")


def _same_message(a: Message, b: Message) -> bool:
    calls = [(c.name, dict(c.arguments)) for c in a.tool_calls]
    return a.content == b.content and calls == [(c.name, dict(c.arguments)) for c in b.tool_calls]


def check_tool_calls(renderer: Renderer, conversation: Conversation) -> CheckResult:
    """parse(encode(m)) == canonical(m) and re-encodes to the same ids; a cut completion parses."""
    for message in (m for m in conversation.messages if m.role == "assistant"):
        ids = renderer.encode_completion(message)
        parsed = renderer.parse_completion(ids)
        expected = renderer.canonical_message(message)
        if parsed.errors or not parsed.ended_with_eot or not _same_message(parsed.message, expected):
            got = f"content {parsed.message.content!r}, calls {[c.name for c in parsed.message.tool_calls]}"
            return CheckResult("tool_calls", conversation.name, "FAIL",
                               f"parse(encode({message.content[:30]!r}...)) gave {got}, errors {list(parsed.errors)[:1]}")
        again = renderer.encode_completion(parsed.message)
        if again != ids:
            where = first_difference(renderer.tokenizer, again, ids, "first encoding")
            return CheckResult("tool_calls", conversation.name, "FAIL", f"re-encoding the parsed message: {where}")
        cut = renderer.parse_completion(ids[: max(1, len(ids) // 2)])
        if cut.ended_with_eot:
            return CheckResult("tool_calls", conversation.name, "FAIL", "a completion cut in half reads as ended")
    calls = sum(len(m.tool_calls) for m in conversation.messages)
    return CheckResult("tool_calls", conversation.name, "PASS", f"{calls} call(s) round-trip")


def check_stop_tokens(renderer: Renderer) -> CheckResult:
    """Stop tokens exist, are single special tokens, end every completion, include the EOS token."""
    tokenizer = renderer.tokenizer
    stops = list(renderer.stop_token_ids)
    if not stops:
        return CheckResult("stop_tokens", "-", "FAIL", "the renderer has no stop token in this tokenizer")
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(getattr(tokenizer, "get_added_vocab", dict)().values())
    plain = [token_text(tokenizer, i) for i in stops if i not in special]
    if plain:
        return CheckResult("stop_tokens", "-", "FAIL", f"stop token(s) {', '.join(plain)} are not special tokens")
    for conversation in CONVERSATIONS:
        for message in (m for m in conversation.messages if m.role == "assistant"):
            last = renderer.encode_completion(message)[-1]
            if last not in stops:
                return CheckResult("stop_tokens", "-", "FAIL", f"a completion ends with {token_text(tokenizer, last)}, no stop token")
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos not in stops:
        return CheckResult("stop_tokens", "-", "FAIL",
                           f"the tokenizer's eos token {token_text(tokenizer, eos)} is not a stop token")
    return CheckResult("stop_tokens", "-", "PASS", "stops: " + ", ".join(token_text(tokenizer, i) for i in stops))


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]


def _guarded(check: str, case: str, run: Any) -> CheckResult:
    """``run()``, with an exception of the renderer turned into a FAIL row."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - a renderer that raises fails the check, with the reason
        return CheckResult(check, case, "FAIL", f"the renderer raised {_one_line(exc)}")


def run_conformance(renderer: Renderer, conversations: Sequence[Conversation] | None = None) -> list[CheckResult]:
    """Every check of the module doc against ``renderer.tokenizer``'s own chat template."""
    if not isinstance(getattr(renderer.tokenizer, "chat_template", None), str):
        raise ValueError("the tokenizer has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja)")
    knows_tools = template_knows_tools(renderer.tokenizer)
    results: list[CheckResult] = []
    for conversation in conversations if conversations is not None else conversations_for(renderer):
        golden = _guarded("golden", conversation.name, lambda c=conversation: check_golden(renderer, c, knows_tools))
        results.append(golden)
        if golden.status == "SKIP":
            continue
        results.append(_guarded("extension", conversation.name, lambda c=conversation: check_extension(renderer, c)))
        results.append(_guarded("continue", conversation.name, lambda c=conversation: check_continue(renderer, c)))
        results.append(_guarded("tool_calls", conversation.name, lambda c=conversation: check_tool_calls(renderer, c)))
    results.append(_guarded("stop_tokens", "-", lambda: check_stop_tokens(renderer)))
    return results


def format_table(results: Sequence[CheckResult]) -> str:
    """The results as a plain-text table, one row per check."""
    header = ("check", "conversation", "result", "detail")
    rows = [header] + [(r.check, r.case, r.status, r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}" for row in rows]
    failed = sum(r.status == "FAIL" for r in results)
    skipped = sum(r.status == "SKIP" for r in results)
    lines.append(f"{len(results) - failed - skipped} checks passed, {failed} failed, {skipped} skipped")
    return "\n".join(lines)
