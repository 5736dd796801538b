"""A renderer for a made-up chat template, "bracket": ``<|im_start|>[role]\\ncontent<|im_end|>`` turns,
tool schemas as ``Tools:`` lines ending the system message, a call as a line ``>>> NAME {args}``,
results in ``[result]`` turns. Any tokenizer with ``<|im_start|>``/``<|im_end|>`` works (SmolLM2's).

    tracegym renderers check MODEL_DIR --plugin examples/plugins/bracket_renderer.py --renderer bracket
    tracegym rollout --plugin examples/plugins/bracket_renderer.py --renderer bracket ...   # sft, rl, serve too
``CHAT_TEMPLATE`` is the same template in Jinja (saved with checkpoints as ``chat_template.jinja``)."""

import json

from tracegym.render import register_renderer
from tracegym.render.base import Renderer, Segment, special, split_system_message, text
from tracegym.render.toolcalls import call_error, check_call_object, snippet
from tracegym.types import Message

START, END, CALL = "<|im_start|>", "<|im_end|>", ">>> "
FORMAT = 'Write each call on its own line: >>> NAME {"argument": value}'
CHAT_TEMPLATE = """{%- set ns = namespace(system=none, first=0) -%}
{%- if messages and messages[0].role == 'system' -%}{%- set ns.system = messages[0].content -%}{%- set ns.first = 1 -%}{%- endif -%}
{%- if tools -%}{%- set ns.system = (ns.system + '\\n\\n' if ns.system is not none else '') + 'Tools:' -%}
{%- for tool in tools -%}{%- set ns.system = ns.system + '\\n' + (tool | tojson) -%}{%- endfor -%}{%- endif -%}
{%- if ns.system is not none -%}<|im_start|>[system]{{ '\\n' + ns.system }}<|im_end|>{%- endif -%}
{%- for m in messages[ns.first:] -%}
{%- if m.role == 'assistant' -%}{%- set ns.body = m.content or '' -%}
{%- for call in m.tool_calls or [] -%}{%- set ns.body = ns.body + ('\\n' if ns.body else '') + '>>> ' + call.function.name + ' ' + (call.function.arguments | tojson) -%}{%- endfor -%}
<|im_start|>[assistant]{{ '\\n' + ns.body }}<|im_end|>
{%- else -%}<|im_start|>[{{ 'result' if m.role == 'tool' else m.role }}]{{ '\\n' + m.content }}<|im_end|>{%- endif -%}
{%- endfor -%}{%- if add_generation_prompt -%}<|im_start|>[assistant]{{ '\\n' }}{%- endif -%}"""


class BracketRenderer(Renderer):
    """The made-up "bracket" template (examples/plugins/bracket_renderer.py)."""

    name, end_of_turn, stop_tokens, chat_template = "bracket", END, (END,), CHAT_TEMPLATE

    def __init__(self, tokenizer, **options):
        super().__init__(tokenizer, **options)
        self._read_tokenizer(required=(START, END))

    def _turn(self, role, body, kind="text"):
        return [special(START), text(f"[{role}]\n"), Segment(kind, body), special(END)]

    def _generation_prompt(self):
        return [special(START), text("[assistant]\n")]

    def _layout(self, messages, tools, start):
        tools_text = "Tools:\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) if tools else None
        system, rest = split_system_message(messages, tools_text) if start else (None, list(messages))
        segments = self._turn("system", system) if system is not None else []
        for m in rest:
            role = "result" if m.role == "tool" else m.role
            body = self._assistant_text(m) if m.role == "assistant" else self.tool_content(m.content) if role == "result" else m.content
            segments += self._turn(role, body, "body" if m.role == "assistant" else "text")
        return segments

    def _assistant_text(self, message):
        calls = [f"{CALL}{c.name} {json.dumps(c.arguments, ensure_ascii=False)}" for c in message.tool_calls]
        return "\n".join(([message.content] if message.content else []) + calls)

    def _parse_assistant_text(self, value):
        content, calls, errors = [], [], []
        for line in value.split("\n"):
            if not line.startswith(CALL):
                content.append(line)
                continue
            name, _, raw = line[len(CALL):].partition(" ")
            try:
                arguments = json.loads(raw)
            except ValueError:
                errors.append(call_error(len(calls) + len(errors), f"invalid JSON in {snippet(raw)!r}", FORMAT))
                continue
            call, error = check_call_object({"name": name, "arguments": arguments}, line, len(calls) + len(errors),
                                            f"call_{len(calls)}", expected_format=FORMAT)
            calls.append(call) if call else errors.append(error)
        message = Message(role="assistant", content="\n".join(content).strip(), tool_calls=tuple(calls))
        return message, tuple(errors)


register_renderer("bracket", BracketRenderer)
