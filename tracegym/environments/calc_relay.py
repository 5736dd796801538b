"""Calc relay: a two-role team solves the calculator's word problems with split knowledge.

Roles ``("planner", "solver")``, and neither can do the task alone:

- the **planner** reads the word problem but has no tools and gives no answer: it writes
  instructions for the solver;
- the **solver** has the calculator's ``calculate(expression)`` tool and gives the final
  ``<answer>N</answer>``, but never sees the problem: only what the planner wrote, as user messages
  ``"Planner: <text>"``.

Flow: the planner speaks ``planner_turns`` times (default 1), then the solver acts until it answers:
any number of turns of ``calculate`` calls (their results go to the solver only), then a message
without tool calls. That message ends the episode: reward 1.0 iff its ``<answer>`` equals the
task's answer numerically (scored exactly as ``CalculatorEnv.score_answer``), else 0.0; a solver
message with no ``<answer>`` at all also ends it with 0.0 (as in ``calculator``: the solver stopped
without answering; there is no channel back to the planner). A bad expression or a malformed call
is answered with an ``"Error: ..."`` tool message and the episode goes on. ``max_turns`` (all roles
together; default ``num_calls + planner_turns + 2``, i.e. ``num_calls + 3`` with one planner turn:
the plan, one call per operation, the answer and one spare) truncates it with 0.0.

The planner has no tools: a tool call it writes anyway is answered with an error tool message to
the planner (counted in ``planner_tool_calls``); its text still goes to the solver.

Tasks are exactly ``calculator``'s for the same ``num_calls`` (an int or a range, default 1),
``test_fraction`` and seed, ids and splits included, so a single-agent baseline on ``calculator``
runs on the same problems. The solver's side of the episode is played by an internal
``CalculatorEnv`` (its tool, error handling, counters and scoring), so the two envs cannot drift.

The expert team: the planner turns the task's ``templates`` (the chain of expressions, ``{x}`` the
previous result) into one instruction, "Compute 37 * 24. Then subtract 129 from the result
(result - 129). ..."; the solver (scripted, reading the task) makes the calls in order and answers.

``info`` of every step: ``tool_calls``, ``tool_errors``, ``tool_timeouts``, ``parse_errors`` (the
solver's), ``turns`` (all roles), ``solver_turns``, ``planner_turns``, ``plan_chars`` (characters
the planner wrote), ``planner_tool_calls``; the last step adds ``success`` (0/1) and, when the
solver gave no answer, ``no_answer``.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from tracegym.envs.base import Task
from tracegym.envs.team import TeamEnv, TeamStep
from tracegym.environments.calculator import CalculatorEnv
from tracegym.types import Message

__all__ = ["CalcRelayEnv", "describe_chain", "PLANNER_PROMPT", "SOLVER_PROMPT"]

PLANNER_PROMPT = (
    "You are the planner of a two-person team that solves an arithmetic word problem. You can read "
    "the problem; your partner, the solver, cannot: it sees only what you write. The solver has a "
    "calculator and gives the final answer; you have no tools and do not answer yourself. Write the "
    "solver clear step-by-step instructions: which numbers to combine with which operation, in order, "
    "each step using the previous result. Counting only full groups is whole-number division (//) and "
    "what is left over is the remainder (%)."
)

SOLVER_PROMPT = (
    "You are the solver of a two-person team. Your partner, the planner, has read an arithmetic word "
    "problem that you cannot see, and tells you what to compute. You have a calculator tool, "
    "`calculate`, that evaluates an expression such as (37 * 24) - 129. Follow the planner's "
    "instructions: make one calculator call per operation and use its result in the next one. When "
    "you have the final result, reply with the final number only, inside answer tags, for example "
    "<answer>42</answer>. A reply without answer tags ends the task unanswered."
)

# How the expert planner words one step of the chain: "{x} <op> <n>" -> an instruction that keeps
# the expression too (small models follow "result - 129" more reliably than prose alone).
_STEP_WORDS = {
    "+": "add {n} to the result",
    "-": "subtract {n} from the result",
    "*": "multiply the result by {n}",
    "//": "divide the result by {n}, keeping only the whole part",
    "/": "divide the result by {n}",
    "%": "take the remainder of the result divided by {n}",
}
_STEP_RE = re.compile(r"^\{x\}\s*(//|[-+*/%])\s*(\S+)$")


def describe_chain(templates: Sequence[str]) -> str:
    """The expert planner's instruction for a chain of expression templates (``{x}``: the previous
    result), e.g. ``["37 * 24", "{x} - 129"]`` -> "Compute 37 * 24. Then subtract 129 from the
    result (result - 129). Give the final result as your answer."."""
    if not templates:
        raise ValueError("a chain needs at least one expression")
    parts = [f"Compute {templates[0]}."]
    for template in templates[1:]:
        m = _STEP_RE.match(template.strip())
        if m:
            op, n = m.groups()
            words = _STEP_WORDS[op].format(n=n)
            parts.append(f"Then {words} (result {op} {n}).")
        else:  # a template of another shape: say it with "the result" in place of {x}
            parts.append(f"Then compute {template.replace('{x}', 'the result')}.")
    parts.append("Give the final result as your answer.")
    return " ".join(parts)


class CalcRelayEnv(TeamEnv):
    """Planner (sees the problem, no tools) -> solver (calculator, answers, does not see it)."""

    name = "calc_relay"
    description = "Calculator word problems split between a planner (sees the problem) and a solver (has the calculator)."
    reward_range = (0.0, 1.0)
    roles = ("planner", "solver")

    def __init__(
        self, num_calls: int | Sequence[int] | str = 1, planner_turns: int = 1, max_turns: int | None = None,
        test_fraction: float = 0.2, max_tool_output_chars: int | None = None,
    ) -> None:
        if isinstance(planner_turns, bool) or not isinstance(planner_turns, int) or planner_turns < 1:
            raise ValueError(f"planner_turns must be an int >= 1, got {planner_turns!r}")
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        # The calculator validates num_calls and test_fraction and owns the task generator: the
        # relay's tasks are its tasks by construction.
        self.calculator_options: dict[str, Any] = {"num_calls": num_calls, "test_fraction": test_fraction}
        probe = CalculatorEnv(**self.calculator_options)
        self.min_calls, self.max_calls = probe.min_calls, probe.max_calls
        self.test_fraction = test_fraction
        self.planner_turns = planner_turns
        self.max_turns = max_turns if max_turns is not None else self.max_calls + planner_turns + 2
        self.max_tool_output_chars = max_tool_output_chars
        self.task: Task | None = None
        self._solver: CalculatorEnv | None = None
        self._turn = 0  # turns of all roles so far
        self._planner_spoken = 0
        self._solver_turns = 0
        self._plan_chars = 0
        self._planner_tool_calls = 0
        self._done = False

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return CalculatorEnv(**self.calculator_options).tasks(split, n, seed)

    def tool_schemas(self, role: str) -> list[dict[str, Any]]:
        if role == "planner":
            return []
        if role == "solver":
            return CalculatorEnv(**self.calculator_options).tool_schemas()
        raise ValueError(f"unknown role {role!r}; roles are {list(self.roles)}")

    async def reset(self, task: Task) -> dict[str, list[Message]]:
        self.task = task
        # The solver's half runs in a private calculator env; its own turn limit never binds (the
        # team's max_turns does), so it gets the same limit as the whole team.
        self._solver = CalculatorEnv(**self.calculator_options, max_turns=self.max_turns,
                                     max_tool_output_chars=self.max_tool_output_chars)
        await self._solver.reset(task)
        self._turn = self._planner_spoken = self._solver_turns = self._plan_chars = self._planner_tool_calls = 0
        self._done = False
        planner_system = PLANNER_PROMPT
        if self.planner_turns > 1:
            planner_system += f" You write {self.planner_turns} messages before the solver starts."
        return {
            "planner": [Message(role="system", content=planner_system),
                        Message(role="user", content=f"Problem: {task.data['question']}")],
            # The solver's first user message is the planner's first message (see step).
            "solver": [Message(role="system", content=SOLVER_PROMPT)],
        }

    def next_role(self) -> str | None:
        if self.task is None or self._done:
            return None
        return "planner" if self._planner_spoken < self.planner_turns else "solver"

    def _counters(self) -> dict[str, Any]:
        assert self._solver is not None
        counters = self._solver.counters
        return {
            "tool_calls": counters["tool_calls"], "tool_errors": counters["tool_errors"],
            "tool_timeouts": counters["tool_timeouts"], "parse_errors": counters["parse_errors"],
            "turns": self._turn, "solver_turns": self._solver_turns, "planner_turns": self._planner_spoken,
            "plan_chars": self._plan_chars, "planner_tool_calls": self._planner_tool_calls,
        }

    async def step(self, role: str, message: Message, parse_errors: Sequence[str] = ()) -> TeamStep:
        if self.task is None or self._solver is None:
            raise RuntimeError("CalcRelayEnv.step called before reset(task)")
        if self._done:
            raise RuntimeError("CalcRelayEnv.step called after the episode ended; call reset(task)")
        expected = self.next_role()
        if role != expected:
            raise ValueError(f"it is {expected!r}'s turn, not {role!r}'s")
        self._turn += 1
        if role == "planner":
            return self._planner_step(message, parse_errors)
        return await self._solver_step(message, parse_errors)

    def _planner_step(self, message: Message, parse_errors: Sequence[str]) -> TeamStep:
        self._planner_spoken += 1
        text = message.content.strip()
        self._plan_chars += len(text)
        views: dict[str, list[Message]] = {"solver": [Message(role="user", content=f"Planner: {text or '(no message)'}")]}
        # The planner has no tools: tell it so (each call gets its answer, so the transcript pairs
        # them), and still pass its words on.
        own: list[Message] = [Message(role="tool", content=f"Error: {problem}") for problem in parse_errors]
        for call in message.tool_calls:
            own.append(Message(role="tool", content="Error: the planner has no tools; only your text reaches the solver.",
                               tool_call_id=call.id, name=call.name))
        self._planner_tool_calls += len(message.tool_calls) + len(parse_errors)
        left = self.planner_turns - self._planner_spoken
        if left > 0:  # keep the planner's conversation alternating while it has more to say
            own.append(Message(role="user", content=f"The solver has not started yet. You may add to your "
                                                    f"instructions ({left} more message{'s' if left > 1 else ''})."))
        if own:
            views["planner"] = own
        truncated = self._turn >= self.max_turns
        return self._finish(views, 0.0, False, truncated, {})

    async def _solver_step(self, message: Message, parse_errors: Sequence[str]) -> TeamStep:
        assert self._solver is not None
        self._solver_turns += 1
        result = await self._solver.step(message, parse_errors)
        extra = {k: result.info[k] for k in ("no_answer", "answer") if k in result.info}
        if result.terminated:
            extra["success"] = result.info.get("success", 0)
        truncated = not result.terminated and (result.truncated or self._turn >= self.max_turns)
        return self._finish({"solver": list(result.messages)}, result.reward, result.terminated, truncated, extra)

    def _finish(self, views: dict[str, list[Message]], reward: float, terminated: bool, truncated: bool,
                extra: dict[str, Any]) -> TeamStep:
        self._done = terminated or truncated
        info = {**self._counters(), **extra}
        if self._done:
            info.setdefault("success", 0)
        return TeamStep(views={r: tuple(m) for r, m in views.items()}, reward=reward, terminated=terminated,
                        truncated=truncated, info=info)

    def expert_action(self, role: str) -> Message:
        if self.task is None or self._solver is None:
            raise RuntimeError("expert_action called before reset")
        if role == "planner":
            if self._planner_spoken == 0:
                return Message(role="assistant", content=describe_chain(self.task.data["templates"]))
            return Message(role="assistant", content="That is the whole plan: follow the steps above in order.")
        if role == "solver":
            # The scripted solver reads the task (privileged): the calculator's expert, which makes
            # the chain's calls in order from the results it got, then answers.
            return self._solver.expert_action()
        raise ValueError(f"unknown role {role!r}; roles are {list(self.roles)}")

    def close(self) -> None:
        if self._solver is not None:
            self._solver.close()
