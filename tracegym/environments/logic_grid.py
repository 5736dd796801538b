"""Logic grid: an Einstein puzzle split between two players who must talk to solve it.

    There are 3 houses in a row, numbered 1 to 3 from left to right. ...
    Alice's clues: "Corvin's house is directly left of the teal house." "The fox's house is not house 1."
    Bob's clues:   "Corvin keeps the heron." "The heron's house is next to the amber house." ...
    Question:      "Who keeps the fox?"

Each house has one owner, one colour and one pet (three categories, ``houses`` values each); the
hidden solution is one permutation per category. Clues of five kinds ("X's house is house k", "...
is not house k", "X is in the same house as Y", "X is directly left of Y", "X is next to Y") are
drawn until the solution is the only assignment that fits them all, then every clue the others
imply is dropped, so each remaining clue matters. The clues are then split between the two roles
so that neither role's half determines the answer to the question (a single attribute lookup)
while both halves together do: the team has to communicate. All of this is checked by brute force
over every assignment (216 for 3 houses, 13,824 for 4), kept as bit sets in Python integers: one
bit per assignment, so a clue is one integer, "all these clues hold" is an ``&`` and "how many
assignments are left" is ``bit_count()``. Generating a 4-house puzzle takes about a millisecond.

Two envs on the same tasks (same generator, ids and options), for comparing a team with one agent:

- :class:`LogicGridEnv` (``logic_grid``), a ``TeamEnv`` with roles ``alice`` and ``bob``, who take
  turns, Alice first. A role's plain text goes to its partner as ``"Alice says: ..."``; the tool
  ``answer(value)`` (either role) ends the episode with team reward 1 iff it is right. After
  ``max_messages`` turns without an answer the episode is truncated with reward 0.
- :class:`LogicGridSoloEnv` (``logic_grid_solo``), a ``ToolEnv``: one agent sees every clue.

The train/test split is a hash of the puzzle's text (``distinct_tasks``), so the splits never share
a puzzle whatever the seeds.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from tracegym.envs.base import Task
from tracegym.envs.tasks import distinct_tasks, parse_int_range
from tracegym.envs.team import TeamEnv, TeamStep
from tracegym.envs.tools import ToolEnv, tool, tool_schema, validate_tool_arguments
from tracegym.types import Message, StepResult, ToolCall

__all__ = [
    "CATEGORIES",
    "LogicGridEnv",
    "LogicGridSoloEnv",
    "generate_puzzle",
    "logic_grid_tasks",
    "normalize_answer",
]

# --- the vocabulary -------------------------------------------------------------------------------

#: The attribute categories, in a fixed order (index c in the world encoding below).
CATEGORIES: tuple[str, ...] = ("name", "colour", "pet")

# Single words, so an answer is one word to match; no name is a role name (alice, bob), so "Alice
# says" never reads as a clue about an owner. Each puzzle draws its values from these pools, so
# models cannot learn fixed value-to-house associations.
_POOLS: dict[str, tuple[str, ...]] = {
    "name": ("Ansel", "Brielle", "Corvin", "Dalia", "Emrys", "Fenna", "Galen", "Isolde"),
    "colour": ("amber", "crimson", "ivory", "jade", "ochre", "slate", "teal", "violet"),
    "pet": ("ferret", "fox", "gecko", "hare", "heron", "newt", "parrot", "tortoise"),
}
_PLURAL = {"name": "Owners", "colour": "Colours", "pet": "Pets"}

# Clue kinds and how often each is drawn: "is house k" clues are the easiest (they place an item
# outright), so they are drawn least; relational clues make the puzzle a puzzle.
_KIND_WEIGHTS: dict[str, int] = {"at": 1, "not_at": 2, "same": 3, "left": 2, "next": 2}

MIN_HOUSES, MAX_HOUSES = 3, 4

# --- all assignments as bit sets ------------------------------------------------------------------


@dataclass(frozen=True)
class _Clue:
    """One clue over value indices: ``x``/``y`` are (category, value); ``house`` is 0-based."""

    kind: str
    x: tuple[int, int]
    y: tuple[int, int] | None
    house: int | None
    mask: int  # the assignments where it holds


@dataclass(frozen=True)
class _Worlds:
    """Every assignment of ``houses`` houses: world ``w`` has digit ``d_c`` (base ``houses!``) per
    category, ``perms[d_c][v]`` being the house of value ``v`` of category ``c``."""

    houses: int
    perms: tuple[tuple[int, ...], ...]
    count: int
    all: int  # every world
    pos: dict[tuple[int, int, int], int]  # (category, value, house) -> worlds where it holds
    clues: tuple[_Clue, ...]  # every clue there is (true in some worlds, false in others)
    same: dict[tuple[int, int, int, int], int]  # (c1, v1, c2, v2) -> worlds where they share a house

    def decode(self, world: int) -> list[list[int]]:
        """House of each value, per category: ``[[house of value v] per category]``."""
        p = len(self.perms)
        digits = []
        for _ in CATEGORIES:
            world, d = divmod(world, p)
            digits.append(d)
        digits.reverse()  # category 0 is the most significant digit
        return [list(self.perms[d]) for d in digits]


@functools.lru_cache(maxsize=None)
def _worlds(houses: int) -> _Worlds:
    """Build the bit sets once per house count (a few milliseconds for 4 houses)."""
    perms = tuple(itertools.permutations(range(houses)))
    p, k = len(perms), len(CATEGORIES)
    count = p**k
    everything = (1 << count) - 1
    pos: dict[tuple[int, int, int], int] = {}
    for c in range(k):
        # Digit c has stride p**(k-1-c): a run of `stride` worlds per value of the digit, repeated
        # for every value of the higher digits. Built by arithmetic, not by looping over worlds.
        stride = p ** (k - 1 - c)
        block = (1 << stride) - 1
        repeat = sum(1 << (j * p * stride) for j in range(p**c))
        for v in range(houses):
            for h in range(houses):
                base = sum(block << (i * stride) for i, perm in enumerate(perms) if perm[v] == h)
                pos[(c, v, h)] = base * repeat  # the runs never overlap: the product is an OR
    items = [(c, v) for c in range(k) for v in range(houses)]

    def left(a: tuple[int, int], b: tuple[int, int]) -> int:
        out = 0
        for h in range(houses - 1):
            out |= pos[(*a, h)] & pos[(*b, h + 1)]
        return out

    clues: list[_Clue] = []
    same: dict[tuple[int, int, int, int], int] = {}
    for (c, v) in items:
        for h in range(houses):
            clues.append(_Clue("at", (c, v), None, h, pos[(c, v, h)]))
            clues.append(_Clue("not_at", (c, v), None, h, everything ^ pos[(c, v, h)]))
    for a, b in itertools.combinations(items, 2):
        if a[0] != b[0]:
            mask = 0
            for h in range(houses):
                mask |= pos[(*a, h)] & pos[(*b, h)]
            same[(*a, *b)] = same[(*b, *a)] = mask
            clues.append(_Clue("same", a, b, None, mask))
        clues.append(_Clue("left", a, b, None, left(a, b)))
        clues.append(_Clue("left", b, a, None, left(b, a)))
        clues.append(_Clue("next", a, b, None, left(a, b) | left(b, a)))
    return _Worlds(houses, perms, count, everything, pos, tuple(clues), same)


# --- puzzle generation ----------------------------------------------------------------------------


def _and(clues: Sequence[_Clue], start: int) -> int:
    mask = start
    for clue in clues:
        mask &= clue.mask
    return mask


def _undetermined(worlds: _Worlds, mask: int, given: tuple[int, int], asked: int) -> bool:
    """True when the worlds of ``mask`` leave at least two answers to "which value of category
    ``asked`` shares a house with ``given``"."""
    possible = sum(1 for a in range(worlds.houses) if mask & worlds.same[(*given, asked, a)])
    return possible >= 2


def _phrase(category: str, value: str) -> str:
    """The house of an item, as a noun phrase: "Corvin's house", "the teal house", "the fox's house"."""
    return {"name": f"{value}'s house", "colour": f"the {value} house", "pet": f"the {value}'s house"}[category]


def _capital(text: str) -> str:
    return text[0].upper() + text[1:]


def _clue_text(clue: dict[str, Any]) -> str:
    kind, (xc, xv) = clue["kind"], clue["x"]
    x = _phrase(xc, xv)
    if kind == "at":
        return _capital(f"{x} is house {clue['house']}.")
    if kind == "not_at":
        return _capital(f"{x} is not house {clue['house']}.")
    yc, yv = clue["y"]
    if kind == "same":
        pair = {xc: xv, yc: yv}
        if "name" in pair and "pet" in pair:
            return f"{pair['name']} keeps the {pair['pet']}."
        if "name" in pair:
            return f"{pair['name']} lives in the {pair['colour']} house."
        return f"The {pair['pet']} lives in the {pair['colour']} house."
    y = _phrase(yc, yv)
    if kind == "left":
        return _capital(f"{x} is directly left of {y}.")
    return _capital(f"{x} is next to {y}.")  # next


_QUESTIONS: dict[tuple[str, str], str] = {  # (asked category, given category) -> question
    ("name", "colour"): "Who lives in the {colour} house?",
    ("name", "pet"): "Who keeps the {pet}?",
    ("colour", "name"): "What colour is {name}'s house?",
    ("colour", "pet"): "What colour is the house where the {pet} lives?",
    ("pet", "name"): "Which pet does {name} keep?",
    ("pet", "colour"): "Which pet lives in the {colour} house?",
}


def _preamble(houses: int, values: dict[str, list[str]]) -> str:
    lines = [
        f"There are {houses} houses in a row, numbered 1 to {houses} from left to right. Each house has "
        "one owner, one colour and one pet, and no two houses share an owner, a colour or a pet.",
        *(f"{_PLURAL[c]}: {', '.join(values[c])}." for c in CATEGORIES),
        '"A is directly left of B" means A\'s house number is one less than B\'s; '
        '"A is next to B" means their house numbers differ by one.',
    ]
    return "\n".join(lines)


def _numbered(clues: Sequence[str]) -> str:
    return "\n".join(f"{i}. {text}" for i, text in enumerate(clues, 1))


def generate_puzzle(rng: random.Random, houses: int = 3, max_tries: int = 200) -> dict[str, Any]:
    """One puzzle of ``houses`` houses as JSON-able data (see the module docstring): the solution,
    every clue (``kind``, ``x``/``y`` as [category, value], ``house`` 1-based, ``text``, ``role``),
    each role's clue texts, the question and its answer."""
    if not MIN_HOUSES <= houses <= MAX_HOUSES:
        raise ValueError(f"houses must be in {MIN_HOUSES}..{MAX_HOUSES}, got {houses}")
    worlds = _worlds(houses)
    for _ in range(max_tries):
        puzzle = _try_puzzle(rng, worlds)
        if puzzle is not None:
            return puzzle
    raise RuntimeError(f"no valid {houses}-house puzzle in {max_tries} tries")  # never seen in practice


def _try_puzzle(rng: random.Random, worlds: _Worlds) -> dict[str, Any] | None:
    n = worlds.houses
    solution = rng.randrange(worlds.count)
    by_kind: dict[str, list[_Clue]] = {kind: [] for kind in _KIND_WEIGHTS}
    for clue in worlds.clues:
        if clue.mask >> solution & 1:
            by_kind[clue.kind].append(clue)
    # Draw true clues, a kind first (weighted) then a clue of it, keeping those that rule something
    # out, until one assignment is left. The "at" clues alone determine everything, so this ends.
    chosen: list[_Clue] = []
    mask = worlds.all
    while mask.bit_count() > 1:
        kinds = [k for k in _KIND_WEIGHTS if by_kind[k]]
        kind = rng.choices(kinds, weights=[_KIND_WEIGHTS[k] for k in kinds])[0]
        clue = by_kind[kind].pop(rng.randrange(len(by_kind[kind])))
        if mask & clue.mask != mask:
            chosen.append(clue)
            mask &= clue.mask
    # Drop every clue the others imply (in random order): what is left is minimal.
    for clue in rng.sample(chosen, len(chosen)):
        rest = [c for c in chosen if c is not clue]
        if _and(rest, worlds.all).bit_count() == 1:
            chosen = rest
    if len(chosen) < 2:
        return None
    # Split the clues in halves until some question is left open by each half alone.
    questions = [(g, vg, a) for g in range(len(CATEGORIES)) for a in range(len(CATEGORIES)) if a != g for vg in range(n)]
    for _ in range(20):
        order = rng.sample(range(len(chosen)), len(chosen))
        cut = len(chosen) // 2 + rng.randrange(len(chosen) % 2 + 1)  # an odd count: either half bigger
        halves = (sorted(order[:cut]), sorted(order[cut:]))
        masks = [_and([chosen[i] for i in half], worlds.all) for half in halves]
        open_questions = [q for q in questions if all(_undetermined(worlds, m, (q[0], q[1]), q[2]) for m in masks)]
        if open_questions:
            return _render(rng, worlds, solution, chosen, halves, rng.choice(open_questions))
    return None


def _render(rng: random.Random, worlds: _Worlds, solution: int, chosen: list[_Clue],
            halves: tuple[list[int], list[int]], question: tuple[int, int, int]) -> dict[str, Any]:
    """The puzzle as text and JSON-able data, with values drawn from the pools."""
    n = worlds.houses
    values = {c: sorted(rng.sample(_POOLS[c], n)) for c in CATEGORIES}
    house_of = worlds.decode(solution)  # [category][value] -> house
    table = {c: [""] * n for c in CATEGORIES}
    for ci, c in enumerate(CATEGORIES):
        for v, h in enumerate(house_of[ci]):
            table[c][h] = values[c][v]

    def item(ci: int, v: int) -> list[str]:
        return [CATEGORIES[ci], values[CATEGORIES[ci]][v]]

    role_of = {i: "alice" for i in halves[0]} | {i: "bob" for i in halves[1]}
    clues = []
    for i, clue in enumerate(chosen):
        data: dict[str, Any] = {"kind": clue.kind, "x": item(*clue.x)}
        if clue.y is not None:
            data["y"] = item(*clue.y)
        if clue.house is not None:
            data["house"] = clue.house + 1
        data["text"] = _clue_text(data)
        data["role"] = role_of[i]
        clues.append(data)
    given_c, given_v, asked_c = question
    given, asked = CATEGORIES[given_c], CATEGORIES[asked_c]
    answer = table[asked][house_of[given_c][given_v]]
    text = _QUESTIONS[(asked, given)].format(**{given: values[given][given_v]})
    text += f" Answer with one of: {', '.join(values[asked])}."
    return {
        "houses": n,
        "values": values,
        "solution": table,  # category -> value per house (house 1 first)
        "preamble": _preamble(n, values),
        "clues": clues,
        "role_clues": {r: [c["text"] for c in clues if c["role"] == r] for r in ("alice", "bob")},
        "question": text,
        "question_given": [given, values[given][given_v]],
        "question_asked": asked,
        "answer": answer,
    }


def _content(puzzle: dict[str, Any]) -> str:
    """The text that identifies a task (and splits it): preamble, each role's clues, question."""
    return json.dumps([puzzle["preamble"], puzzle["role_clues"], puzzle["question"]], sort_keys=True)


def logic_grid_tasks(split: str, n: int, seed: int, min_houses: int, max_houses: int, test_fraction: float) -> list[Task]:
    """The tasks both envs share: the same options give the same tasks and ids."""
    return distinct_tasks(
        split, n, random.Random(f"logic_grid/{seed}/{min_houses}/{max_houses}"),
        lambda rng: generate_puzzle(rng, rng.randint(min_houses, max_houses)),
        _content, "logic", test_fraction, what="logic puzzles",
    )


# --- scoring --------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """Lower case, punctuation dropped, spaces collapsed, a leading article dropped:
    ``" The Fox! "`` -> ``"fox"``."""
    words = re.sub(r"[^\w\s]|_", " ", str(text).lower()).split()
    if len(words) > 1 and words[0] in ("the", "a", "an"):
        words = words[1:]
    return " ".join(words)


def _is_correct(task: Task, value: str) -> bool:
    return normalize_answer(value) == normalize_answer(task.data["answer"])


def _verdict(task: Task, value: str) -> str:
    if _is_correct(task, value):
        return f"Correct: the answer is {task.data['answer']}."
    return f"Wrong: you answered {value!r}, the answer was {task.data['answer']}."


def _check_options(houses: int | Sequence[int] | str, test_fraction: float) -> tuple[int, int]:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    return parse_int_range(houses, "houses", MIN_HOUSES, MAX_HOUSES)


# --- the single-agent baseline --------------------------------------------------------------------

SOLO_SYSTEM_PROMPT = (
    "You solve logic puzzles. Read the clues, work out who lives where, and when you know the answer "
    "call the `answer` tool with it. Your first answer is final."
)


class LogicGridSoloEnv(ToolEnv):
    """The logic-grid tasks for one agent that sees every clue (the baseline for the team env)."""

    name = "logic_grid_solo"
    description = "Einstein logic-grid puzzles, every clue in view; answer with the answer(value) tool."
    reward_range = (0.0, 1.0)
    branchable = True  # the episode's state (the task, ToolEnv counters) is plain data
    default_max_turns = 3

    def __init__(self, houses: int | Sequence[int] | str = 3, max_turns: int | None = None,
                 test_fraction: float = 0.2, max_tool_output_chars: int | None = None) -> None:
        self.min_houses, self.max_houses = _check_options(houses, test_fraction)
        self.test_fraction = test_fraction
        super().__init__(max_turns=max_turns, max_tool_output_chars=max_tool_output_chars)
        self.task: Task | None = None

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return logic_grid_tasks(split, n, seed, self.min_houses, self.max_houses, self.test_fraction)

    async def reset(self, task: Task) -> list[Message]:
        self.task = task
        data = task.data
        clues = [c["text"] for c in data["clues"]]  # the generator's order: it does not reveal the split
        user = f"{data['preamble']}\n\nClues:\n{_numbered(clues)}\n\nQuestion: {data['question']}"
        return [Message(role="system", content=SOLO_SYSTEM_PROMPT), Message(role="user", content=user)]

    @tool(timeout=2.0)
    def answer(self, value: str) -> str:
        """Give the final answer to the question; it ends the puzzle.

        Args:
            value: The answer, one of the values the question lists, e.g. "Corvin" or "fox".
        """
        assert self.task is not None
        correct = _is_correct(self.task, value)
        self.end_episode(1.0 if correct else 0.0, correct, answer=value)
        return _verdict(self.task, value)

    def on_text(self, message: Message) -> StepResult:
        # The answer goes through the tool, as in the team env (where text is talk); text alone is a
        # turn spent thinking, reminded of the tool, and the turn limit still applies.
        return StepResult(messages=(Message(role="user", content="When you know the answer, call the `answer` tool with it."),))

    def expert_action(self) -> Message:
        if self.task is None:
            raise RuntimeError("expert_action called before reset")
        call = ToolCall(name="answer", arguments={"value": self.task.data["answer"]}, id="answer_0")
        return Message(role="assistant", tool_calls=(call,))


# --- the team env ---------------------------------------------------------------------------------

_DISPLAY = {"alice": "Alice", "bob": "Bob"}
_ANSWER_TOOL = LogicGridSoloEnv.answer  # one definition of the tool: the same schema and validation in both envs

TEAM_SYSTEM_PROMPT = (
    "You are {me}. You and your partner, {partner}, solve a logic puzzle together. You each hold half "
    "of the clues, and neither half is enough on its own. Talk to your partner by writing messages: "
    "everything you write outside a tool call is delivered to {partner}, and {partner}'s messages reach "
    "you as \"{partner} says: ...\". You take turns, and the team has {max_messages} messages in all. "
    "When you know the answer, call the `answer` tool with it; the first answer either of you gives "
    "is final for both of you."
)


class LogicGridEnv(TeamEnv):
    """Two players, each with half of the clues of one logic-grid puzzle, talk until one answers.

    Turns alternate, Alice first, whatever a turn contained: a message with parse errors or a bad
    tool call still passes the turn on (the actor gets the errors as ``tool`` messages, the partner
    gets the actor's words). Every turn that does not end the episode tells the partner something
    (``"(said nothing)"`` for an empty message), so each role's conversation alternates.
    """

    name = "logic_grid"
    description = "Two-player Einstein puzzle: each role holds half of the clues; talk, then answer(value)."
    reward_range = (0.0, 1.0)
    roles = ("alice", "bob")

    def __init__(self, houses: int | Sequence[int] | str = 3, max_messages: int = 6, test_fraction: float = 0.2) -> None:
        self.min_houses, self.max_houses = _check_options(houses, test_fraction)
        if max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {max_messages}")
        self.max_messages = max_messages
        self.test_fraction = test_fraction
        self.task: Task | None = None
        self.turns = 0
        self.done = False
        self.heard: dict[str, list[str]] = {}  # what each role was told by its partner (the expert reads it)

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        return logic_grid_tasks(split, n, seed, self.min_houses, self.max_houses, self.test_fraction)

    def tool_schemas(self, role: str) -> list[dict[str, Any]]:
        self._check_role(role)
        return [tool_schema(_ANSWER_TOOL)]

    def _check_role(self, role: str) -> None:
        if role not in self.roles:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(self.roles)}")

    @staticmethod
    def _partner(role: str) -> str:
        return "bob" if role == "alice" else "alice"

    async def reset(self, task: Task) -> dict[str, list[Message]]:
        self.task = task
        self.turns = 0
        self.done = False
        self.heard = {r: [] for r in self.roles}
        data = task.data
        views = {}
        for role in self.roles:
            partner = self._partner(role)
            system = TEAM_SYSTEM_PROMPT.format(me=_DISPLAY[role], partner=_DISPLAY[partner], max_messages=self.max_messages)
            user = (f"{data['preamble']}\n\nYour clues ({_DISPLAY[partner]} has the others):\n"
                    f"{_numbered(data['role_clues'][role])}\n\nQuestion: {data['question']}")
            views[role] = [Message(role="system", content=system), Message(role="user", content=user)]
        return views

    def next_role(self) -> str | None:
        if self.task is None or self.done:
            return None
        return self.roles[self.turns % len(self.roles)]

    async def step(self, role: str, message: Message, parse_errors: Sequence[str] = ()) -> TeamStep:
        if self.task is None:
            raise RuntimeError("LogicGridEnv.step called before reset(task)")
        if self.done:
            raise RuntimeError("LogicGridEnv.step called after the episode ended; call reset(task)")
        if role != self.next_role():
            raise ValueError(f"it is {self.next_role()!r}'s turn, not {role!r}'s")
        self.turns += 1
        partner = self._partner(role)
        mine = [Message(role="tool", content=f"Error: {problem}") for problem in parse_errors]
        answered: str | None = None
        for call in message.tool_calls:
            mine.append(self._run_call(call, answered))
            if answered is None and not mine[-1].content.startswith("Error:"):
                answered = call.arguments["value"]
        info: dict[str, Any] = {"messages_exchanged": self.turns, "parse_errors": len(parse_errors),
                                "tool_errors": sum(m.content.startswith("Error:") for m in mine) - len(parse_errors)}
        if answered is not None:
            self.done = True
            correct = _is_correct(self.task, answered)
            told = Message(role="user", content=f"{_DISPLAY[role]} answered {answered!r}. {_verdict(self.task, answered)}")
            return TeamStep(views={role: tuple(mine), partner: (told,)}, reward=1.0 if correct else 0.0,
                            terminated=True, info={**info, "success": int(correct), "answer": answered})
        text = message.content.strip()
        self.heard[partner].append(text)
        said = Message(role="user", content=f"{_DISPLAY[role]} says: {text or '(said nothing)'}")
        views = {role: tuple(mine), partner: (said,)} if mine else {partner: (said,)}
        if self.turns >= self.max_messages:
            self.done = True
            return TeamStep(views=views, truncated=True, info={**info, "success": 0})
        return TeamStep(views=views, info=info)

    def _run_call(self, call: ToolCall, answered: str | None) -> Message:
        """The tool message answering one call (an ``Error:`` text for a bad one)."""

        def reply(text: str) -> Message:
            return Message(role="tool", content=text, tool_call_id=call.id, name=call.name)

        if answered is not None:
            return reply("Error: not run, the episode ended at an earlier call.")
        if call.name != "answer":
            return reply(f"Error: unknown tool '{call.name}'. Available tools: answer.")
        _, problem = validate_tool_arguments(_ANSWER_TOOL, call.arguments)
        if problem is not None:
            return reply(f"Error: invalid arguments for tool 'answer': {problem}.")
        assert self.task is not None
        return reply(_verdict(self.task, call.arguments["value"]))

    def expert_action(self, role: str) -> Message:
        """A role that has heard every clue of its partner answers; otherwise it shares its clues
        verbatim. So Alice shares at once and Bob, who then knows everything, answers."""
        self._check_role(role)
        if self.task is None:
            raise RuntimeError("expert_action called before reset")
        partner_clues = self.task.data["role_clues"][self._partner(role)]
        heard = "\n".join(self.heard.get(role, []))
        if all(clue in heard for clue in partner_clues):
            call = ToolCall(name="answer", arguments={"value": self.task.data["answer"]}, id=f"answer_{self.turns}")
            return Message(role="assistant", tool_calls=(call,))
        clues = "\n".join(f"- {c}" for c in self.task.data["role_clues"][role])
        return Message(role="assistant", content=f"Here are all my clues:\n{clues}")

    def close(self) -> None:
        pass
