"""Calc proposer: the proposer side of proposer/solver self-play on the calculator's word problems.

The agent does not solve problems: it writes new ones for a solver. Each task is a seed, a topic
(one of the calculator's scenes), a target number of calculations ``k`` (option ``num_calls``, an
int or a range within 1..6, default 1..3) and two opening quantities for variety, shown as::

    Write a new arithmetic word problem about a bakery and its cookies that needs 2 calculations.
    For variety, start from 37 trays of 24 cookies each. Call propose(question, expression) where
    expression computes the answer.

The only tool, ``propose(question, expression)``, checks the proposal and ends the episode (one
proposal per episode; a message without a call ends it with 0.0). A proposal is valid iff

- ``expression`` evaluates with the calculator's safe evaluator (no division by zero) to a finite
  integer (``6 / 2`` counts, ``7 / 2`` does not) with ``|value| <= 10**9``;
- it has between 1 and ``3 * k`` operators (``ast.BinOp`` nodes);
- every number in ``expression`` appears, in digits, in ``question`` (the solver can solve it);
- ``question`` is 20..400 characters, does not contain the answer as a number (no giveaway, its
  absolute value counted too) and does not contain ``expression`` verbatim (spaces ignored).

The opening quantities are only a prompt for variety (they make thousands of distinct seeds); they
are not a validity rule, which checks only what the solver needs. The env's reward is validity
(1.0 / 0.0); a self-play recipe replaces it with :func:`learnability_reward` once solvers have
tried the problem. ``info`` of the last step: ``valid`` (0/1), ``reason`` (a number: a key of
:data:`REASONS`, 0 = accepted), ``operators``, ``question_chars`` (numbers only, so they reach
``Trajectory.metrics``) and ``proposal`` ({question, expression, answer, valid}: dropped from the
metrics, which keep numbers only). The tool answers "Accepted." or "Rejected: <reason>.".

From a finished trajectory :func:`proposal_from_messages` recovers the accepted proposal, and
:func:`solver_task` turns it into a ``calculator`` task (``CalculatorEnv`` plays and scores it).

The expert proposes the problem drawn with the calculator's ``generate_problem`` from the seed's
rng when the seed was made (a draw that breaks a rule, e.g. an answer equal to one of the problem's
numbers, is redrawn), with its chain of expressions composed into one: valid by construction.
"""

from __future__ import annotations

import ast
import math
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from tracegym.algos.hierarchical import learnability_reward  # noqa: F401  (re-exported: the proposer's reward)
from tracegym.envs.base import Task
from tracegym.envs.tasks import distinct_tasks, parse_int_range
from tracegym.envs.tools import ToolEnv, tool
from tracegym.environments.calculator import _SCENES, evaluate_expression, format_number, generate_problem
from tracegym.types import Message, StepResult, ToolCall

__all__ = [
    "CalcProposerEnv",
    "ProposalCheck",
    "REASONS",
    "check_proposal",
    "compose_templates",
    "learnability_reward",
    "proposal_from_messages",
    "solver_task",
]

MAX_ANSWER = 10**9
MIN_QUESTION_CHARS = 20
MAX_QUESTION_CHARS = 400

#: ``info["reason"]`` codes (numbers, so they survive into ``Trajectory.metrics``).
REASONS: dict[int, str] = {
    0: "accepted",
    1: "the expression does not evaluate",
    2: "the expression divides by zero",
    3: "the result is not an integer",
    4: f"the result is larger than {MAX_ANSWER:,} in absolute value",
    5: "the expression has too few or too many operators",
    6: f"the question must be {MIN_QUESTION_CHARS} to {MAX_QUESTION_CHARS} characters long",
    7: "a number of the expression does not appear in the question",
    8: "the question gives the answer away",
    9: "the question contains the expression",
    10: "no proposal was made",
}
NO_PROPOSAL = 10

SYSTEM_PROMPT = (
    "You write arithmetic word problems for a student who solves them with a calculator. Call the "
    "tool propose(question, expression) once: question is the word problem, expression is the "
    "arithmetic expression that computes its answer, using numbers, + - * / // % ** and parentheses. "
    "Rules: the answer must be a whole number of at most 1,000,000,000; write every number of the "
    "expression in the question, in digits; do not write the answer or the expression in the "
    f"question; the question is {MIN_QUESTION_CHARS} to {MAX_QUESTION_CHARS} characters long; use "
    "between 1 and 3 operators per calculation asked for."
)

# Numbers as the question writes them: "12,345", "3.5", "24". Signs are left out: "-" is a hyphen
# as often as a minus in prose.
_QUESTION_NUMBER_RE = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")


def _question_numbers(question: str) -> set[float]:
    return {float(x.replace(",", "")) for x in _QUESTION_NUMBER_RE.findall(question)}


def _parse(expression: str) -> ast.AST:
    """The expression's syntax tree, normalised as the calculator's evaluator does it (the same
    text it evaluates, so operators and numbers counted here are the ones it computed with)."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return ast.parse(text, mode="eval")


@dataclass(frozen=True)
class ProposalCheck:
    """The verdict on one proposal: ``reason`` is a key of :data:`REASONS` (0 when valid);
    ``answer`` is the expression's value when it evaluated to an integer, else None."""

    valid: bool
    reason: int
    operators: int
    answer: int | None

    @property
    def reason_text(self) -> str:
        return REASONS[self.reason]


def check_proposal(question: str, expression: str, num_calls: int) -> ProposalCheck:
    """Check a proposed (question, expression) for a seed asking for ``num_calls`` calculations
    (the rules are in the module docstring; the first rule broken is the reason)."""
    try:
        value = evaluate_expression(expression)
        tree = _parse(expression)
    except ZeroDivisionError:
        return ProposalCheck(False, 2, 0, None)
    except (ValueError, SyntaxError, TypeError, OverflowError, RecursionError):
        return ProposalCheck(False, 1, 0, None)
    operators = sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))
    if not math.isfinite(value) or float(value) != int(value):
        return ProposalCheck(False, 3, operators, None)
    answer = int(value)
    if abs(answer) > MAX_ANSWER:
        return ProposalCheck(False, 4, operators, answer)
    if not 1 <= operators <= 3 * num_calls:
        return ProposalCheck(False, 5, operators, answer)
    text = question.strip()
    if not MIN_QUESTION_CHARS <= len(text) <= MAX_QUESTION_CHARS:
        return ProposalCheck(False, 6, operators, answer)
    in_question = _question_numbers(text)
    used = {float(node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)}
    if not used <= in_question:
        return ProposalCheck(False, 7, operators, answer)
    if float(abs(answer)) in in_question:
        return ProposalCheck(False, 8, operators, answer)
    if re.sub(r"\s+", "", expression) in re.sub(r"\s+", "", text):
        return ProposalCheck(False, 9, operators, answer)
    return ProposalCheck(True, 0, operators, answer)


def compose_templates(templates: Sequence[str]) -> str:
    """A calculator chain (``{x}``: the previous result) as one expression:
    ``["15 * 51", "{x} // 36"]`` -> ``"(15 * 51) // 36"``."""
    if not templates:
        raise ValueError("a chain needs at least one expression")
    expression = templates[0]
    for template in templates[1:]:
        expression = template.replace("{x}", f"({expression})")
    return expression


def proposal_from_messages(messages: Sequence[Message]) -> dict[str, Any] | None:
    """The accepted proposal of a proposer episode's messages, as {question, expression, answer},
    or None when no ``propose`` call was accepted.

    Each assistant message's ``propose`` calls are paired with the tool messages that answer them
    (by ``tool_call_id`` when the calls have ids, else in order: the env answers calls in order and
    its parse-error messages carry no tool name); the call answered "Accepted." is the proposal. The
    answer is recomputed from the expression."""
    messages = list(messages)
    for i, message in enumerate(messages):
        if message.role != "assistant" or not message.tool_calls:
            continue
        replies: list[Message] = []
        for later in messages[i + 1:]:
            if later.role != "tool":
                break
            if later.name is not None:
                replies.append(later)
        by_id = {m.tool_call_id: m for m in replies if m.tool_call_id is not None}
        for position, call in enumerate(message.tool_calls):
            if call.name != "propose":
                continue
            reply = by_id.get(call.id) if call.id is not None else (replies[position] if position < len(replies) else None)
            if reply is None or not reply.content.startswith("Accepted"):
                continue
            question, expression = call.arguments.get("question"), call.arguments.get("expression")
            if not isinstance(question, str) or not isinstance(expression, str):
                continue
            try:
                value = evaluate_expression(expression)
            except (ValueError, ZeroDivisionError):
                continue
            return {"question": question, "expression": expression, "answer": int(value)}
    return None


def solver_task(proposal: dict[str, Any], task_id: str, split: str = "train") -> Task:
    """A ``calculator`` task of a proposal ({question, expression[, answer]}): ``CalculatorEnv``
    plays it (its expert makes the one call ``expression``, then answers). ValueError when the
    expression does not evaluate to an integer or disagrees with the given answer."""
    question, expression = proposal["question"], proposal["expression"]
    value = evaluate_expression(expression)
    if float(value) != int(value):
        raise ValueError(f"expression {expression!r} is not an integer ({format_number(value)})")
    answer = int(value)
    if proposal.get("answer") is not None and float(proposal["answer"]) != answer:
        raise ValueError(f"proposal answer {proposal['answer']!r} differs from its expression's value {answer}")
    operators = sum(isinstance(node, ast.BinOp) for node in ast.walk(_parse(expression)))
    return Task(id=task_id, split=split, data={
        "question": question,
        "answer": answer,
        "num_calls": max(1, operators),
        "templates": [expression],  # one call computes it all: no {x}
        "reference_calls": [{"name": "calculate", "arguments": {"expression": expression}}],
    })


# --- seeds ----------------------------------------------------------------------------------------


def _topic(scene: Any) -> str:
    """"a bakery and its cookies", "Maria and her marbles"."""
    actor = scene.actor[0].lower() + scene.actor[1:] if scene.actor.startswith(("A ", "An ")) else scene.actor
    possessive = {"It": "its", "She": "her", "He": "his", "They": "their"}.get(scene.pronoun, "its")
    return f"{actor} and {possessive} {scene.item}"


def _seed(rng: random.Random, min_calls: int, max_calls: int) -> dict[str, Any]:
    """One seed: a calculator problem drawn from ``rng`` gives the topic and the opening numbers,
    and is kept as the expert's proposal (redrawn until it passes every rule)."""
    k = rng.randint(min_calls, max_calls)
    while True:
        problem = generate_problem(rng, k)
        expression = compose_templates(problem["templates"])
        if check_proposal(problem["question"], expression, k).valid:
            break
    scene = next(s for s in _SCENES if problem["question"].startswith(f"{s.actor} {s.verb_have} "))
    a, b = problem["templates"][0].split(" * ")
    topic = _topic(scene)
    calculations = f"{k} calculation{'s' if k > 1 else ''}"
    prompt = (
        f"Write a new arithmetic word problem about {topic} that needs {calculations}. For variety, start from "
        f"{a} {scene.container} of {b} {scene.item} each. Call propose(question, expression) where expression "
        f"computes the answer."
    )
    return {
        "prompt": prompt,
        "topic": topic,
        "num_calls": k,
        "start": [int(a), int(b)],
        "reference": {"question": problem["question"], "expression": expression, "answer": problem["answer"]},
    }


class CalcProposerEnv(ToolEnv):
    """Write one new calculator word problem per episode; reward 1 iff it is valid."""

    name = "calc_proposer"
    description = "Propose a new calculator word problem (question + expression); reward = validity."
    reward_range = (0.0, 1.0)
    branchable = True  # the episode's state (the task, the proposal, ToolEnv counters) is plain data

    def __init__(
        self, num_calls: int | Sequence[int] | str = (1, 3), max_turns: int | None = None, test_fraction: float = 0.2,
        max_tool_output_chars: int | None = None,
    ) -> None:
        # Up to 6: longer chains do not reliably fit the 400-character question limit.
        self.min_calls, self.max_calls = parse_int_range(num_calls, "num_calls", 1, 6)
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.test_fraction = test_fraction
        # One proposal ends the episode; the spare turns absorb malformed calls.
        super().__init__(max_turns=max_turns if max_turns is not None else 3, max_tool_output_chars=max_tool_output_chars)
        self.task: Task | None = None
        self.proposal: dict[str, Any] | None = None

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return distinct_tasks(
            split, n, random.Random(f"calc_proposer/{seed}/{self.min_calls}/{self.max_calls}"),
            lambda rng: _seed(rng, self.min_calls, self.max_calls),
            lambda data: data["prompt"], "calcprop", self.test_fraction, what="proposer seeds",
        )

    def solver_task_from(self, messages: Sequence[Message], task_id: str) -> Task | None:
        """The self-play hook (``tracegym.recipes.selfplay``): the ``calculator`` task a finished
        proposer episode proposed, or None when it proposed nothing valid."""
        proposal = proposal_from_messages(messages)
        if proposal is None:
            return None
        try:
            return solver_task(proposal, task_id)
        except ValueError:
            return None

    async def reset(self, task: Task) -> list[Message]:
        self.task = task
        self.proposal = None
        return [Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=task.data["prompt"])]

    @tool(timeout=2.0)
    def propose(self, question: str, expression: str) -> str:
        """Propose a new word problem; this ends the episode.

        Args:
            question: The word problem, with every number of the expression written in digits.
            expression: The arithmetic expression that computes the answer, e.g. "(37 * 24) - 129".
        """
        assert self.task is not None
        verdict = check_proposal(question, expression, int(self.task.data["num_calls"]))
        self.proposal = {"question": question, "expression": expression, "answer": verdict.answer,
                         "valid": int(verdict.valid)}
        self.end_episode(
            float(verdict.valid), verdict.valid, valid=int(verdict.valid), reason=verdict.reason,
            operators=verdict.operators, question_chars=len(question.strip()), proposal=dict(self.proposal),
        )
        return "Accepted." if verdict.valid else f"Rejected: {verdict.reason_text}."

    def on_text(self, message: Message) -> StepResult:
        # No propose call: the episode ends without a proposal (like an unanswered calculator task).
        return StepResult(terminated=True, reward=0.0,
                          info={"success": 0, "valid": 0, "reason": NO_PROPOSAL, "operators": 0, "question_chars": 0})

    def expert_action(self) -> Message:
        if self.task is None:
            raise RuntimeError("expert_action called before reset")
        reference = self.task.data["reference"]
        call = ToolCall(name="propose", arguments={"question": reference["question"], "expression": reference["expression"]},
                        id="call_0")
        return Message(role="assistant", tool_calls=(call,))
