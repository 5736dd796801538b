"""Calculator: compositional arithmetic word problems that need a chain of calculator calls.

    "A bakery bakes 37 trays of 24 cookies. It sells 129 cookies. It packs the rest into tins of
     5 cookies. How many full tins does it pack?"

Every sentence after the first is one operation on the previous result, so a problem with
``n`` calls is a chain of ``n`` dependent operations (the first a 2-digit x 2-digit product), with
numbers large enough that a 135M-parameter model needs the tool. Difficulty: ``num_calls`` (an int
or a ``(min, max)`` range). The final answer is written as ``<answer>N</answer>``; reward 1 iff it
equals the ground truth numerically.

Reward parts (option ``reward_parts``, ``tracegym.envs.rewards``): ``answer`` (the outcome: 1 for
the right final answer, at the answering turn) and ``calls`` (process: a calculator call whose
result equals one of the chain's reference intermediate results earns ``1/num_calls`` at its turn,
each reference result at most once, so the part sums to at most 1 per episode). Unset, the reward is
the answer alone, as it always was. ``{"answer": 1.0, "calls": 0.3}`` keeps the answer dominant: a
policy that makes every right call and never answers right gets at most 0.3, a right answer at least
1.0. The calls part can be farmed by brute force (every operator on the previous result in one
message hits the next reference value), which is why its weight should stay well below the answer's.

The train/test split is a function of the problem's text (a hash of it), so the two splits can
share neither an id nor a problem, whatever the seeds. The expert makes the calls in dependency
order, one per turn, each built from the result the tool returned, then answers.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tracegym.envs.base import Task
from tracegym.envs.tasks import distinct_tasks, parse_int_range
from tracegym.envs.tools import ToolEnv, tool
from tracegym.types import Message, ToolCall

__all__ = ["CalculatorEnv", "evaluate_expression", "generate_problem", "parse_number"]

# --- the safe evaluator ---------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e30  # results beyond this are refused (they are never needed and cost memory)

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ZeroDivisionError("division by zero")
        if isinstance(node.op, ast.Pow):
            # Bound the size before computing: 9 ** 9 ** 9 would take the machine down.
            if abs(right) > 64 or (abs(left) > 1 and right * math.log10(abs(left)) > math.log10(MAX_MAGNITUDE)):
                raise ValueError("power too large")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ValueError("result is not a real number")
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported syntax: {ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__}")


def evaluate_expression(expression: str) -> int | float:
    """Evaluate ``+ - * / // % **`` and parentheses over integers and decimals, without ``eval``:
    the expression is parsed with ``ast`` and only numbers and these operators are allowed."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # "12,345" -> "12345"
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}; use numbers, + - * / // % ** and parentheses") from None
    return _eval_node(tree)


def format_number(value: int | float) -> str:
    """Integers as integers (``12.0`` -> ``12``), other floats with up to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)


def parse_number(text: str) -> float | None:
    """A final answer as a number: ``"1,234"``, ``"$56"``, ``"78."``, ``"9 pens"`` are read; text with
    no number, or with several, is None."""
    cleaned = text.strip().replace(",", "").replace("$", "")
    numbers = re.findall(r"-?\d+(?:\.\d+)?", cleaned)
    if len(numbers) != 1:
        return None
    return float(numbers[0])


# --- problem generation ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Scene:
    actor: str  # "A shop"
    pronoun: str  # "It"
    verb_have: str  # "has"
    container: str  # "boxes"
    item: str  # "pens"
    group: str  # "bags"
    sell: str  # "sells"
    receive: str  # "receives"
    price_item: str  # "pen"


_SCENES = (
    _Scene("A shop", "It", "has", "boxes", "pens", "bags", "sells", "receives", "pen"),
    _Scene("A bakery", "It", "bakes", "trays", "cookies", "tins", "sells", "bakes", "cookie"),
    _Scene("A farm", "It", "collects", "baskets", "eggs", "cartons", "sells", "collects", "egg"),
    _Scene("A factory", "It", "makes", "crates", "bolts", "packs", "ships", "makes", "bolt"),
    _Scene("A library", "It", "owns", "shelves", "books", "boxes", "lends out", "buys", "book"),
    _Scene("Maria", "She", "has", "jars", "marbles", "bags", "gives away", "buys", "marble"),
    _Scene("A school", "It", "orders", "cartons", "pencils", "kits", "hands out", "orders", "pencil"),
)


@dataclass
class _Chain:
    """A problem under construction: sentences, one expression template per call, the value."""

    sentences: list[str]
    templates: list[str]  # "{x} - 129": {x} is the previous call's result
    expressions: list[str]  # the same with the true values filled in
    value: int
    unit: str  # "items" | "groups" | "money"


def _first_step(rng: random.Random, scene: _Scene) -> _Chain:
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    return _Chain(
        sentences=[f"{scene.actor} {scene.verb_have} {a} {scene.container} of {b} {scene.item} each."],
        templates=[f"{a} * {b}"],
        expressions=[f"{a} * {b}"],
        value=a * b,
        unit="items",
    )


def _add(chain: _Chain, sentence: str, template: str, value: int, unit: str) -> None:
    expression = template.replace("{x}", str(chain.value))
    chain.sentences.append(sentence)
    chain.templates.append(template)
    chain.expressions.append(expression)
    chain.value = value
    chain.unit = unit


def _take_or_add(rng: random.Random, chain: _Chain, take: bool, take_sentence: str, add_sentence: str) -> None:
    """Append taking away a sizeable part of the value (when ``take`` and the value is >= 40), else
    adding 101..999; ``{c}`` in the sentence is the amount, the unit stays."""
    v = chain.value
    if take and v >= 40:
        c = rng.randint(max(11, v // 8), max(12, v * 2 // 3))
        _add(chain, take_sentence.replace("{c}", str(c)), f"{{x}} - {c}", v - c, chain.unit)
    else:
        c = rng.randint(101, 999)
        _add(chain, add_sentence.replace("{c}", str(c)), f"{{x}} + {c}", v + c, chain.unit)


def _next_step(rng: random.Random, scene: _Scene, chain: _Chain, last: bool) -> None:
    """Append one dependent operation. Units move items -> groups -> money; quantities stay > 0."""
    v, p = chain.value, scene.pronoun
    choices: list[str] = []
    if chain.unit == "items":
        choices = ["sell", "receive", "group", "price"] + (["leftover"] if last else [])
    elif chain.unit == "groups":
        choices = ["give_groups", "group_price", "group_items"]
    else:
        choices = ["spend", "earn", "split"]
    kind = rng.choice(choices)
    if kind in ("sell", "receive"):
        _take_or_add(rng, chain, kind == "sell", f"{p} {scene.sell} {{c}} {scene.item}.",
                     f"{p} {scene.receive} {{c}} more {scene.item}.")
    elif kind == "group":
        k = rng.randint(6, 48)
        if v // k < 2:
            k = 3
        _add(chain, f"{p} packs the {scene.item} into {scene.group} of {k}, keeping only full {scene.group}.", f"{{x}} // {k}", v // k, "groups")
    elif kind == "leftover":
        k = rng.randint(7, 97)
        _add(chain, f"{p} packs the {scene.item} into {scene.group} of {k}.", f"{{x}} % {k}", v % k, "leftover")
    elif kind == "price":
        c = rng.randint(3, 29)
        _add(chain, f"{p} sells all the {scene.item} at {c} dollars per {scene.price_item}.", f"{{x}} * {c}", v * c, "money")
    elif kind == "give_groups" and v >= 4:
        c = rng.randint(1, v // 2)
        _add(chain, f"{p} gives away {c} of the {scene.group}.", f"{{x}} - {c}", v - c, "groups")
    elif kind in ("give_groups", "group_price"):
        c = rng.randint(13, 97)
        _add(chain, f"{p} sells every one of the {scene.group} for {c} dollars.", f"{{x}} * {c}", v * c, "money")
    elif kind == "group_items":
        c = rng.randint(13, 97)
        _add(chain, f"{p} then puts {c} {scene.item} into every one of the {scene.group}.", f"{{x}} * {c}", v * c, "items")
    elif kind in ("spend", "earn"):
        _take_or_add(rng, chain, kind == "spend", f"{p} spends {{c}} dollars of that money.",
                     f"{p} earns another {{c}} dollars.")
    else:  # split
        k = rng.randint(3, 17)
        _add(chain, f"{p} shares the money equally among {k} people, in whole dollars.", f"{{x}} // {k}", v // k, "money")


_QUESTIONS = {
    "items": "How many {item} are there now?",
    "groups": "How many {group} are there now?",
    "money": "How many dollars are there now?",
    "leftover": "How many {item} are left over?",
}


def generate_problem(rng: random.Random, num_calls: int) -> dict[str, Any]:
    """One word problem needing exactly ``num_calls`` dependent calculator calls."""
    if num_calls < 1:
        raise ValueError(f"num_calls must be >= 1, got {num_calls}")
    scene = rng.choice(_SCENES)
    chain = _first_step(rng, scene)
    for i in range(1, num_calls):
        _next_step(rng, scene, chain, last=i == num_calls - 1)
    question = " ".join(chain.sentences) + " " + _QUESTIONS[chain.unit].format(item=scene.item, group=scene.group)
    if chain.unit == "money" and chain.sentences[-1].endswith("in whole dollars."):
        question = question.replace("How many dollars are there now?", "How many dollars does each person get?")
    return {
        "question": question,
        "answer": chain.value,
        "num_calls": num_calls,
        "templates": chain.templates,
        "reference_calls": [{"name": "calculate", "arguments": {"expression": e}} for e in chain.expressions],
    }


SYSTEM_PROMPT = (
    "You solve arithmetic word problems. You have a calculator tool, `calculate`, that evaluates an "
    "expression such as (37 * 24) - 129. Work step by step: make one calculator call per operation "
    "and use its result in the next one. When you know the result, reply with the final number only, "
    "inside answer tags, for example <answer>42</answer>."
)


class CalculatorEnv(ToolEnv):
    """Chains of dependent arithmetic operations, one calculator call each."""

    name = "calculator"
    description = "Arithmetic word problems needing 1..N dependent calculator calls; answer <answer>N</answer>."
    reward_range = (0.0, 1.0)
    branchable = True  # the episode's state (task, tool results, ToolEnv counters) is plain data
    offered_reward_parts = {"answer": (0.0, 1.0), "calls": (0.0, 1.0)}

    def __init__(
        self, num_calls: int | Sequence[int] | str = (1, 4), max_turns: int | None = None, test_fraction: float = 0.2,
        max_tool_output_chars: int | None = None, reward_parts: dict[str, float] | None = None,
    ) -> None:
        """``reward_parts``: weights of the reward parts ``answer`` and ``calls`` (module docstring),
        e.g. ``{"answer": 1.0, "calls": 0.3}``; None: the answer alone, no parts reported."""
        self.min_calls, self.max_calls = parse_int_range(num_calls, "num_calls", 1, 12)
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.test_fraction = test_fraction
        # Room for every call plus the answer, and a few mistakes.
        super().__init__(max_turns=max_turns if max_turns is not None else self.max_calls + 4,
                         max_tool_output_chars=max_tool_output_chars, reward_parts=reward_parts)
        self.task: Task | None = None
        self.results: list[str] = []  # the tool results of this episode, in order (the expert reads them)
        self.unmatched_reference_values: list[int | float] = []  # not yet reproduced by a call (calls part)

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return distinct_tasks(
            split, n, random.Random(f"calculator/{seed}/{self.min_calls}/{self.max_calls}"),
            lambda rng: generate_problem(rng, rng.randint(self.min_calls, self.max_calls)),
            lambda problem: problem["question"], "calc", self.test_fraction,
        )

    async def reset(self, task: Task) -> list[Message]:
        self.task = task
        self.results = []
        self.unmatched_reference_values = [
            evaluate_expression(call["arguments"]["expression"]) for call in task.data["reference_calls"]
        ] if self.reward_parts is not None and "calls" in self.reward_parts else []
        return [Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=task.data["question"])]

    @tool(timeout=2.0)
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return the result.

        Args:
            expression: Numbers with + - * / // % ** and parentheses, e.g. "(37 * 24) - 129".
        """
        value = evaluate_expression(expression)
        result = format_number(value)
        self.results.append(result)
        self._earn_for_call(value)
        return result

    def _earn_for_call(self, value: int | float) -> None:
        """Calls part: a result equal to a reference result not reproduced yet earns 1/num_calls; each
        reference result is consumed, so repeating a call earns nothing."""
        for i, reference in enumerate(self.unmatched_reference_values):
            if abs(value - reference) < 1e-6:
                del self.unmatched_reference_values[i]
                self.earn("calls", 1.0 / len(self.task.data["reference_calls"]))  # type: ignore[union-attr]
                return

    def score_answer(self, answer: str) -> float:
        assert self.task is not None
        value = parse_number(answer)
        return 1.0 if value is not None and abs(value - float(self.task.data["answer"])) < 1e-6 else 0.0

    def expert_action(self) -> Message:
        if self.task is None:
            raise RuntimeError("expert_action called before reset")
        templates: list[str] = self.task.data["templates"]
        done = len(self.results)
        if done < len(templates):
            previous = self.results[-1] if self.results else ""
            expression = templates[done].replace("{x}", previous)
            call = ToolCall(name="calculate", arguments={"expression": expression}, id=f"call_{done}")
            return Message(role="assistant", tool_calls=(call,))
        return Message(role="assistant", content=f"<answer>{self.results[-1] if self.results else ''}</answer>")
