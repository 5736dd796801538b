"""The ``code`` environment: write a small Python function from a spec; hidden unit tests grade it.

Each task asks for one function (``def caesar(text: str) -> str``) described in prose with two
worked examples. The functions are generated and fictional, not taken from any benchmark: 14
families (letter shifts, letter counts, digit rules, list rotation, numbers that read the same in
base b, running totals, de-duplication, ranked values, chunking, countdowns, run-length codes,
grouping names, stock records, headline case), each with random parameters (a shift of k, a set
of letters, a separator, a chunk size, a list of small words, the function's name), so the same
family gives hundreds of distinct functions. Families have a difficulty level 1..3.

Tools:

- ``run_python(code)``: runs a program in a fresh sandbox and shows its stdout, stderr and exit
  status (each cut to ``max_output_chars``). Stateless: nothing carries over between calls.
- ``submit(code)``: grades the code on ``num_tests`` hidden tests (edge cases and random inputs,
  never shown). The expected outputs are computed on the host by the task's reference solution and
  never enter the sandbox; the harness (``code_harness.py``) returns the function's values behind
  a per-run random nonce and the host compares them, so printing "all tests passed", exiting with
  status 0 or forging result lines earns nothing: only correct return values do. Values compare as
  in a Python test (``(1, 2)`` is not ``[1, 2]``), except that a bool never equals an int.

Reward: the fraction of hidden tests passed (``reward="fraction"``, the default) or 1/0 for all or
not all (``reward="all"``); ``success`` is 1 when every test passed. The episode ends at the
submission that passes every test or uses the last of ``max_submissions`` (default 1); an earlier
failing submission earns nothing and the episode goes on. A message without a tool call ends the
episode with reward 0 (``no_submission``): code in a text message is not graded.

Isolation: every run uses :class:`tracegym.envs.sandbox.Sandbox` with bubblewrap. Without it the
env refuses to be built (``SandboxUnavailable``, fail closed) unless ``isolation="unsafe_local"``
(no namespaces: the model's code can read your files; your own machine and trusted models only).

The train/test split is a hash of the function's definition (family, parameters, name), so the
two splits never ask for the same function, not even with other examples; the examples and hidden
tests are drawn from a generator seeded by that definition, so a task id always means the same
data. Branching works (``branchable``): no sandbox lives between calls, the episode's state is
plain data. The expert runs the reference solution on the first example with ``run_python``, then
submits it (two calls).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import secrets
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

from tracegym.envs import sandbox
from tracegym.envs.base import Task
from tracegym.envs.sandbox import SandboxLimits, SandboxResult, SandboxUnavailable
from tracegym.envs.tasks import distinct_tasks, parse_int_range
from tracegym.envs.tools import ToolEnv, tool
from tracegym.environments.code_harness import encode_value
from tracegym.types import Message, StepResult, ToolCall

__all__ = ["FAMILIES", "CodeEnv", "Family", "Grade", "build_task_data", "grade_output", "values_match"]

HARNESS_SOURCE = (Path(__file__).with_name("code_harness.py")).read_text(encoding="utf-8")

#: The tools' own time limit (ToolEnv). The sandbox kills a run at ``wall_s`` (at most
#: ``MAX_WALL_S``), so this only has to exceed that plus the sandbox's start and teardown.
_TOOL_TIMEOUT_S = 300.0
MAX_WALL_S = 240.0
MAX_TESTS = 50
#: Bytes of a run's stdout/stderr the sandbox keeps: room for ``MAX_TESTS`` full result lines.
_SANDBOX_MAX_OUTPUT = 256_000

Params = dict[str, Any]


# --- generated words and names (fictional) ---------------------------------------------------------

_SYLLABLES = ("ka", "lo", "mi", "zu", "ren", "tas", "vo", "bel", "qui", "dor", "sha", "nix", "pe", "wun", "gra",
              "fei", "om", "ty")
_SMALL_WORDS = ("a", "an", "the", "of", "in", "on", "at", "by", "for", "to", "and", "or", "but", "with", "from", "into")


def _word(rng: random.Random, low: int = 1, high: int = 3) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(low, high)))


def _cased(rng: random.Random, word: str) -> str:
    """``word`` lowercase, Capitalised or UPPERCASE."""
    return rng.choice((word, word, word.capitalize(), word.upper()))


def _sentence(rng: random.Random, low: int = 1, high: int = 5) -> str:
    """A few fictional words with mixed case, and sometimes a digit or punctuation."""
    words = [_cased(rng, _word(rng)) for _ in range(rng.randint(low, high))]
    if rng.random() < 0.4:
        words.append(str(rng.randint(0, 99)))
    text = " ".join(words)
    return text + rng.choice(("", "", ".", "!", "?", ","))


def _ordinal(k: int) -> str:
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(k, "th")
    return f"{k}{suffix}"


def _block(code: str) -> str:
    """A function body from an indented triple-quoted string: dedented, then indented 4 spaces."""
    return textwrap.indent(textwrap.dedent(code).strip("\n"), "    ")


# --- the families -------------------------------------------------------------------------------------


class Family:
    """One kind of function. A definition is a dict of JSON parameters (``function``: the name
    included) drawn by :meth:`draw`; everything else is rendered from it."""

    name: ClassVar[str]
    level: ClassVar[int]
    summary: ClassVar[str]

    def draw(self, rng: random.Random) -> Params:
        raise NotImplementedError

    def signature(self, p: Params) -> str:
        """The parameter list and return annotation: ``(text: str) -> str``."""
        raise NotImplementedError

    def spec(self, p: Params) -> str:
        raise NotImplementedError

    def body(self, p: Params) -> str:
        raise NotImplementedError

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        """One test's positional arguments (JSON data: str, int, lists, str-keyed dicts)."""
        raise NotImplementedError

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        """Fixed edge cases, always among the hidden tests (first)."""
        return []

    def example_inputs(self, rng: random.Random, p: Params) -> list[list[Any]]:
        """The two inputs of the worked examples in the prompt."""
        first = self.random_input(rng, p)
        for _ in range(20):
            second = self.random_input(rng, p)
            if second != first:
                break
        return [first, second]

    def source(self, p: Params) -> str:
        """The reference solution."""
        return f"def {p['function']}{self.signature(p)}:\n{self.body(p)}\n"


class CaesarShift(Family):
    name = "caesar_shift"
    level = 1
    summary = "shift letters k places forward or backward, wrapping around"

    def draw(self, rng: random.Random) -> Params:
        return {"function": rng.choice(("shift_letters", "rotate_alphabet", "caesar", "encode_message")),
                "k": rng.randint(1, 25), "direction": rng.choice(("forward", "backward")),
                "upper": rng.random() < 0.5}

    def signature(self, p: Params) -> str:
        return "(text: str) -> str"

    def spec(self, p: Params) -> str:
        wrap = "from 'z' to 'a'" if p["direction"] == "forward" else "from 'a' to 'z'"
        cases = ("Uppercase letters are shifted the same way and stay uppercase; every other character stays unchanged."
                 if p["upper"] else "Every other character (uppercase letters included) stays unchanged.")
        return (f"Return `text` with every lowercase letter shifted {p['k']} places {p['direction']} in the alphabet, "
                f"wrapping around {wrap}. {cases}")

    def body(self, p: Params) -> str:
        shift = p["k"] if p["direction"] == "forward" else -p["k"]
        upper = ("    elif 'A' <= ch <= 'Z':\n"
                 "        out.append(chr((ord(ch) - ord('A') + shift) % 26 + ord('A')))\n") if p["upper"] else ""
        return _block(
            f"shift = {shift}\n"
            "out = []\n"
            "for ch in text:\n"
            "    if 'a' <= ch <= 'z':\n"
            "        out.append(chr((ord(ch) - ord('a') + shift) % 26 + ord('a')))\n"
            f"{upper}"
            "    else:\n"
            "        out.append(ch)\n"
            "return ''.join(out)"
        )

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        return [_sentence(rng)]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[""], ["Zz-Aa 09!"]]


class CountLetters(Family):
    name = "count_letters"
    level = 1
    summary = "count the characters that are one of a few given letters"

    def draw(self, rng: random.Random) -> Params:
        letters = "".join(sorted(rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(2, 5))))
        return {"function": rng.choice(("count_letters", "letter_tally", "count_marked", "tally_chars")),
                "letters": letters, "ignore_case": rng.random() < 0.5}

    def signature(self, p: Params) -> str:
        return "(text: str) -> int"

    def spec(self, p: Params) -> str:
        listed = ", ".join(f"'{c}'" for c in p["letters"])
        case = ("Uppercase and lowercase count alike ('A' counts as 'a')." if p["ignore_case"]
                else "Only lowercase letters count: 'A' does not count as 'a'.")
        return f"Return how many characters of `text` are one of the letters {listed}. {case}"

    def body(self, p: Params) -> str:
        lower = ".lower()" if p["ignore_case"] else ""
        return _block(f"""
            letters = set({p['letters']!r})
            return sum(1 for ch in text{lower} if ch in letters)
        """)

    def _text(self, rng: random.Random, p: Params, with_letters: bool) -> str:
        text = _sentence(rng, 2, 6)
        if with_letters:  # make sure the counted letters occur, in both cases
            extra = "".join(rng.choice((c, c.upper())) for c in rng.choices(p["letters"], k=3))
            text = f"{text} {extra}"
        return text

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        return [self._text(rng, p, with_letters=rng.random() < 0.5)]

    def example_inputs(self, rng: random.Random, p: Params) -> list[list[Any]]:
        return [[self._text(rng, p, with_letters=True)] for _ in range(2)]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[""], [p["letters"].upper() + p["letters"]]]


class DigitRule(Family):
    name = "digit_rule"
    level = 1
    summary = "sum or count the digits of n that pass a threshold rule"

    def draw(self, rng: random.Random) -> Params:
        op, rule = rng.choice(("sum", "count")), rng.choice(("at_least", "below", "equal"))
        # A sum of zeros is always 0: sums need a threshold that lets a non-zero digit count.
        lowest = {"at_least": 1, "below": 2 if op == "sum" else 1, "equal": 1 if op == "sum" else 0}[rule]
        return {"function": rng.choice(("digit_score", "tally_digits", "digit_measure", "weigh_digits")),
                "op": op, "rule": rule, "t": rng.randint(lowest, 9)}

    def signature(self, p: Params) -> str:
        return "(n: int) -> int"

    def spec(self, p: Params) -> str:
        what = "sum" if p["op"] == "sum" else "number"
        rule = {"at_least": f"at least {p['t']}", "below": f"less than {p['t']}", "equal": f"equal to {p['t']}"}[p["rule"]]
        return (f"Return the {what} of the decimal digits of `n` that are {rule}. A minus sign is ignored: "
                f"-305 has the digits 3, 0 and 5. If no digit qualifies, return 0.")

    def body(self, p: Params) -> str:
        test = {"at_least": ">=", "below": "<", "equal": "=="}[p["rule"]]
        add = "d" if p["op"] == "sum" else "1"
        return _block(f"""
            total = 0
            for ch in str(abs(n)):
                d = int(ch)
                if d {test} {p['t']}:
                    total += {add}
            return total
        """)

    def _counts(self, p: Params, digit: int) -> bool:
        return {"at_least": digit >= p["t"], "below": digit < p["t"], "equal": digit == p["t"]}[p["rule"]]

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        digits = [rng.randint(0, 9) for _ in range(rng.randint(1, 7))]
        if rng.random() < 0.75:  # most tests have a digit that counts: "always 0" must not pass them
            digits[rng.randrange(len(digits))] = rng.choice([d for d in range(10) if self._counts(p, d)])
        n = int("".join(map(str, digits)))
        return [-n if rng.random() < 0.25 else n]

    def example_inputs(self, rng: random.Random, p: Params) -> list[list[Any]]:
        # Each example has digits that count and digits that do not; the second is negative.
        examples: list[list[Any]] = []
        while len(examples) < 2:
            n = abs(self.random_input(rng, p)[0])
            kinds = {self._counts(p, int(ch)) for ch in str(n)}
            if kinds == {True, False} and [n] not in examples:
                examples.append([n if not examples else -n])
        return examples

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[0], [-int(str(p["t"]) * 3)]]


class RotateList(Family):
    name = "rotate_list"
    level = 1
    summary = "rotate a list left or right by k places"

    def draw(self, rng: random.Random) -> Params:
        return {"function": rng.choice(("rotate", "rotate_items", "shift_list", "cycle_items")),
                "k": rng.randint(1, 9), "direction": rng.choice(("left", "right"))}

    def signature(self, p: Params) -> str:
        return "(items: list[int]) -> list[int]"

    def spec(self, p: Params) -> str:
        k = p["k"]
        moved = (f"the first {k} items move to the end" if p["direction"] == "left"
                 else f"the last {k} items move to the front")
        return (f"Return a new list with the items of `items` rotated {p['direction']} by {k} places: {moved}. "
                f"When the list is shorter than {k}, rotate by {k} modulo its length. An empty list gives [].")

    def body(self, p: Params) -> str:
        rotated = "items[k:] + items[:k]" if p["direction"] == "left" else "items[len(items) - k:] + items[:len(items) - k]"
        return _block(f"""
            if not items:
                return []
            k = {p['k']} % len(items)
            return {rotated}
        """)

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        return [[rng.randint(-20, 99) for _ in range(rng.randint(2, 12))]]

    def example_inputs(self, rng: random.Random, p: Params) -> list[list[Any]]:
        # Longer than k, so that the first example shows a real rotation.
        longer = [rng.randint(-20, 99) for _ in range(rng.randint(p["k"] + 1, p["k"] + 5))]
        return [[longer], self.random_input(rng, p)]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[[]], [[7]], [list(range(1, p["k"] + 1))]]


class PalindromeBase(Family):
    name = "palindrome_base"
    level = 1
    summary = "does n written in base b read the same both ways"

    def draw(self, rng: random.Random) -> Params:
        return {"function": rng.choice(("is_mirror_number", "reads_same_both_ways", "is_palindrome_in_base", "symmetric_digits")),
                "base": rng.randint(2, 10)}

    def signature(self, p: Params) -> str:
        return "(n: int) -> bool"

    def spec(self, p: Params) -> str:
        return (f"Return True if the non-negative integer `n`, written in base {p['base']} without leading zeros, "
                f"reads the same forwards and backwards, else False. 0 is written as '0'.")

    def body(self, p: Params) -> str:
        return _block(f"""
            digits = []
            while n > 0:
                digits.append(n % {p['base']})
                n //= {p['base']}
            return digits == digits[::-1]
        """)

    def _palindrome(self, rng: random.Random, base: int) -> int:
        half = [rng.randint(1, base - 1)] + [rng.randint(0, base - 1) for _ in range(rng.randint(0, 4))]
        digits = half + half[::-1][rng.randint(0, 1):]
        return sum(d * base ** i for i, d in enumerate(reversed(digits)))

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        # Half palindromes: a constant answer must not pass half the tests by luck of the draw.
        if rng.random() < 0.5:
            return [self._palindrome(rng, p["base"])]
        return [rng.randint(1, 5000)]

    def example_inputs(self, rng: random.Random, p: Params) -> list[list[Any]]:
        return [[self._palindrome(rng, p["base"])], [p["base"] ** 3 + 1 + p["base"]]]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[0], [p["base"]], [p["base"] - 1]]


class RunningFold(Family):
    name = "running_fold"
    level = 2
    summary = "running sum (skipping multiples of m), maximum, minimum, or a total that restarts"

    def draw(self, rng: random.Random) -> Params:
        op = rng.choice(("sum", "sum", "max", "min", "restart"))
        params: Params = {"function": rng.choice(("running_totals", "prefix_scan", "running_values", "cumulative")), "op": op}
        if op == "sum":
            params["skip"] = rng.choice([None, *range(2, 10)])
        elif op == "restart":
            params["limit"] = rng.randint(10, 40)
        return params

    def signature(self, p: Params) -> str:
        return "(nums: list[int]) -> list[int]"

    def spec(self, p: Params) -> str:
        op = p["op"]
        if op == "sum":
            skip = f" Numbers divisible by {p['skip']} (0 included) are left out of the sum." if p["skip"] else ""
            return f"Return a list of the same length as `nums` whose i-th item is the sum of nums[0] .. nums[i].{skip}"
        if op in ("max", "min"):
            word = "largest" if op == "max" else "smallest"
            return f"Return a list of the same length as `nums` whose i-th item is the {word} of nums[0] .. nums[i]."
        return (f"Keep a running total of `nums`: add each number in turn, and whenever the total becomes greater "
                f"than {p['limit']}, it restarts at 0. Return the list of the totals after each number.")

    def body(self, p: Params) -> str:
        op = p["op"]
        if op == "sum":
            add = f"    if x % {p['skip']} != 0:\n        total += x\n" if p["skip"] else "    total += x\n"
            return _block(
                "result = []\n"
                "total = 0\n"
                "for x in nums:\n"
                f"{add}"
                "    result.append(total)\n"
                "return result"
            )
        if op in ("max", "min"):
            return _block(f"""
                result = []
                for x in nums:
                    result.append(x if not result else {op}(result[-1], x))
                return result
            """)
        return _block(f"""
            result = []
            total = 0
            for x in nums:
                total += x
                if total > {p['limit']}:
                    total = 0
                result.append(total)
            return result
        """)

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        return [[rng.randint(-9, 20) for _ in range(rng.randint(1, 10))]]

    def example_inputs(self, rng: random.Random, p: Params) -> list[list[Any]]:
        return [[[rng.randint(-9, 20) for _ in range(rng.randint(5, 9))]] for _ in range(2)]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[[]], [[0]]]


class Dedupe(Family):
    name = "dedupe"
    level = 2
    summary = "remove repeats, keeping the first or last n occurrences (case-insensitive words too)"

    def draw(self, rng: random.Random) -> Params:
        return {"function": rng.choice(("unique_in_order", "drop_repeats", "dedupe", "distinct_items")),
                "keep": rng.choice(("first", "last")), "kind": rng.choice(("int", "str", "str_nocase")),
                "count": rng.randint(1, 3)}

    def signature(self, p: Params) -> str:
        kind = "int" if p["kind"] == "int" else "str"
        return f"(items: list[{kind}]) -> list[{kind}]"

    def spec(self, p: Params) -> str:
        n = p["count"]
        thing = "value" if p["kind"] == "int" else "word"
        how_many = f"at most {n} occurrences" if n > 1 else "one occurrence"
        text = (f"Return the items of `items` with repeats removed: keep {how_many} of each {thing}, "
                f"the {p['keep']} {'ones' if n > 1 else 'one'}, in their original order.")
        if p["kind"] == "str_nocase":
            text += " Words that differ only in case count as the same word; keep each kept word's own spelling."
        elif p["kind"] == "str":
            text += " Words that differ in case are different words."
        return text

    def body(self, p: Params) -> str:
        key = "x.lower()" if p["kind"] == "str_nocase" else "x"
        source = "reversed(items)" if p["keep"] == "last" else "items"
        result = "result[::-1]" if p["keep"] == "last" else "result"
        return _block(f"""
            seen = {{}}
            result = []
            for x in {source}:
                key = {key}
                seen[key] = seen.get(key, 0) + 1
                if seen[key] <= {p['count']}:
                    result.append(x)
            return {result}
        """)

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        length = rng.randint(0, 12)
        if p["kind"] == "int":
            return [[rng.randint(0, 6) for _ in range(length)]]
        pool = [_word(rng, 1, 2) for _ in range(4)]
        return [[_cased(rng, rng.choice(pool)) if p["kind"] == "str_nocase" else rng.choice(pool) for _ in range(length)]]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        same = [5, 5, 5, 5] if p["kind"] == "int" else ["Ko", "ko", "KO", "ko"]
        return [[[]], [same]]

    def example_inputs(self, rng: random.Random, p: Params) -> list[list[Any]]:
        # Few distinct items in long lists: some item repeats more often than it is kept.
        if p["kind"] == "int":
            pool: list[Any] = rng.sample(range(10), 3)
        else:
            pool = [_word(rng, 1, 2) for _ in range(3)]
        examples = []
        for _ in range(2):
            items = [rng.choice(pool) for _ in range(3 * p["count"] + 2)]
            examples.append([[_cased(rng, x) for x in items] if p["kind"] == "str_nocase" else items])
        return examples


class RankedValue(Family):
    name = "ranked_value"
    level = 2
    summary = "the k-th largest or smallest distinct value, or a default"

    _NAMES = {"largest": ("nth_largest_distinct", "ranked_high", "top_distinct", "pick_from_top"),
              "smallest": ("nth_smallest_distinct", "ranked_low", "bottom_distinct", "pick_from_bottom")}

    def draw(self, rng: random.Random) -> Params:
        order = rng.choice(("largest", "smallest"))
        return {"function": rng.choice(self._NAMES[order]), "order": order, "k": rng.randint(1, 4),
                "default": rng.choice((-1, 0, None))}

    def signature(self, p: Params) -> str:
        return "(nums: list[int]) -> int | None" if p["default"] is None else "(nums: list[int]) -> int"

    def spec(self, p: Params) -> str:
        k = p["k"]
        if k == 1:
            return f"Return the {p['order']} value in `nums`. If `nums` is empty, return {p['default']}."
        return (f"Return the {_ordinal(k)} {p['order']} distinct value in `nums` (equal values count once). "
                f"If `nums` has fewer than {k} distinct values, return {p['default']}.")

    def body(self, p: Params) -> str:
        reverse = p["order"] == "largest"
        return _block(f"""
            distinct = sorted(set(nums), reverse={reverse})
            if len(distinct) < {p['k']}:
                return {p['default']}
            return distinct[{p['k'] - 1}]
        """)

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        return [[rng.randint(-10, 30) for _ in range(rng.randint(1, 10))]]

    def example_inputs(self, rng: random.Random, p: Params) -> list[list[Any]]:
        # One example with a ranked value (a repeat included), one that gives the default.
        values = rng.sample(range(-10, 31), p["k"] + 2)
        ranked = values + [rng.choice(values)]
        rng.shuffle(ranked)
        few = [v for v in rng.sample(range(-10, 31), p["k"] - 1) for _ in range(2)]
        rng.shuffle(few)
        return [[ranked], [few]]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[[]], [[5, 5, 5]]]


class Chunk(Family):
    name = "chunk"
    level = 2
    summary = "split a list into groups of k (keep, drop or pad a short last group)"

    def draw(self, rng: random.Random) -> Params:
        return {"function": rng.choice(("chunk", "split_into_groups", "batch_items", "group_in_blocks")),
                "size": rng.randint(2, 6), "tail": rng.choice(("keep", "drop", "pad")), "pad": rng.choice((0, -1))}

    def signature(self, p: Params) -> str:
        return "(items: list[int]) -> list[list[int]]"

    def spec(self, p: Params) -> str:
        k = p["size"]
        tail = {"keep": "The last group may be shorter.",
                "drop": f"A last group shorter than {k} is left out.",
                "pad": f"A last group shorter than {k} is filled up with {p['pad']} to length {k}."}[p["tail"]]
        return f"Split `items` into consecutive groups of {k} and return the list of the groups. {tail} An empty list gives []."

    def body(self, p: Params) -> str:
        k = p["size"]
        short_tail = f"if groups and len(groups[-1]) < {k}:\n"
        fix = {"keep": "",
               "drop": f"{short_tail}    groups.pop()\n",
               "pad": f"{short_tail}    groups[-1] = groups[-1] + [{p['pad']}] * ({k} - len(groups[-1]))\n"}[p["tail"]]
        return _block(f"groups = [items[i:i + {k}] for i in range(0, len(items), {k})]\n{fix}return groups")

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        return [[rng.randint(1, 50) for _ in range(rng.randint(1, 14))]]

    def example_inputs(self, rng: random.Random, p: Params) -> list[list[Any]]:
        # Both examples have a short last group, so that the rule for it shows.
        k = p["size"]
        lengths = rng.sample([n for n in range(k + 1, 3 * k) if n % k], 2)
        return [[[rng.randint(1, 50) for _ in range(n)]] for n in lengths]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[[]], [list(range(1, p["size"] + 1))]]


class StepsToZero(Family):
    name = "steps_to_zero"
    level = 2
    summary = "count the steps of a divide-or-subtract countdown"

    def draw(self, rng: random.Random) -> Params:
        return {"function": rng.choice(("steps_to_zero", "countdown_steps", "wind_down", "hops_to_zero")),
                "divisor": rng.randint(2, 9), "step": rng.randint(1, 3)}

    def signature(self, p: Params) -> str:
        return "(n: int) -> int"

    def spec(self, p: Params) -> str:
        d, s = p["divisor"], p["step"]
        return (f"Start from the non-negative integer `n` and repeat until the number is 0: if it is divisible by {d}, "
                f"divide it by {d}; otherwise subtract {s} (a result below 0 becomes 0). Return how many steps "
                f"that takes (0 steps for n = 0).")

    def body(self, p: Params) -> str:
        return _block(f"""
            steps = 0
            while n > 0:
                if n % {p['divisor']} == 0:
                    n //= {p['divisor']}
                else:
                    n = max(n - {p['step']}, 0)
                steps += 1
            return steps
        """)

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        return [rng.randint(1, 10 ** rng.randint(1, 4))]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[0], [1], [p["divisor"]]]


class RunLength(Family):
    name = "run_length"
    level = 2
    summary = "run-length encode a string in a given format"

    def draw(self, rng: random.Random) -> Params:
        return {"function": rng.choice(("run_length_encode", "compress_runs", "squeeze_runs", "pack_runs")),
                "count_first": rng.random() < 0.5, "omit_ones": rng.random() < 0.5,
                "sep": rng.choice(("", "-", ",", " "))}

    def signature(self, p: Params) -> str:
        return "(text: str) -> str"

    def spec(self, p: Params) -> str:
        order = ("the length of the run followed by the character" if p["count_first"]
                 else "the character followed by the length of the run")
        text = f"Compress `text` by writing each run of one repeated character as {order}"
        text += ", except that a run of length 1 is written as the character alone." if p["omit_ones"] else "."
        text += f" Separate the runs with '{p['sep']}'." if p["sep"] else " Write the runs one after another."
        return text + " An empty text gives ''."

    def body(self, p: Params) -> str:
        part = "f'{count}{ch}'" if p["count_first"] else "f'{ch}{count}'"
        if p["omit_ones"]:
            part = f"ch if count == 1 else {part}"
        return _block(f"""
            parts = []
            i = 0
            while i < len(text):
                j = i
                while j < len(text) and text[j] == text[i]:
                    j += 1
                ch, count = text[i], j - i
                parts.append({part})
                i = j
            return {p['sep']!r}.join(parts)
        """)

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        runs: list[str] = []
        for _ in range(rng.randint(1, 6)):
            ch = rng.choice([c for c in "abcxyz" if not runs or c != runs[-1][0]])
            runs.append(ch * rng.randint(1, 5))
        return ["".join(runs)]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[""], ["q"]]


class GroupByInitial(Family):
    name = "group_by_initial"
    level = 3
    summary = "group names by first letter into a dict (key case, order, minimum length)"

    def draw(self, rng: random.Random) -> Params:
        return {"function": rng.choice(("group_by_initial", "index_names", "bucket_by_letter", "names_by_first_letter")),
                "key_case": rng.choice(("lowercase", "uppercase")), "order": rng.choice(("input", "sorted")),
                "min_len": rng.randint(1, 3)}

    def signature(self, p: Params) -> str:
        return "(names: list[str]) -> dict[str, list[str]]"

    def spec(self, p: Params) -> str:
        order = ("in the order they appear in `names`" if p["order"] == "input"
                 else "sorted in plain string order (uppercase before lowercase)")
        return (f"Group the names in `names` by their first letter. Return a dict that maps each first letter, "
                f"written in {p['key_case']}, to the list of the names that start with it in either case, {order}. "
                f"Names shorter than {p['min_len']} character{'s' if p['min_len'] > 1 else ''} (the empty name "
                f"included) are skipped. Repeated names are kept.")

    def body(self, p: Params) -> str:
        case = "lower" if p["key_case"] == "lowercase" else "upper"
        sort = "for key in groups:\n    groups[key].sort()\n" if p["order"] == "sorted" else ""
        return _block(
            "groups = {}\n"
            "for name in names:\n"
            f"    if len(name) < {p['min_len']}:\n"
            "        continue\n"
            f"    groups.setdefault(name[0].{case}(), []).append(name)\n"
            f"{sort}"
            "return groups"
        )

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        initials = rng.sample("bdgklmnprstvz", 3)
        names = []
        for _ in range(rng.randint(1, 8)):
            name = rng.choice(initials) + _word(rng, 0, 2)
            names.append(rng.choice((name.capitalize(), name.capitalize(), name)))
        if rng.random() < 0.3:
            names.insert(rng.randint(0, len(names)), rng.choice(("", "Q")))
        return [names]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        return [[[]], [["ada", "Ada", "", "Bo", "ada"]]]


class StockRecords(Family):
    name = "stock_records"
    level = 3
    summary = "total the quantities of 'item<sep>qty' records into a dict"

    def draw(self, rng: random.Random) -> Params:
        return {"function": rng.choice(("inventory_totals", "stock_count", "tally_stock", "sum_quantities")),
                "sep": rng.choice((":", "=", " x ", "@")), "nocase": rng.random() < 0.5,
                "positive_only": rng.random() < 0.5}

    def signature(self, p: Params) -> str:
        return "(records: list[str]) -> dict[str, int]"

    def spec(self, p: Params) -> str:
        text = (f"Each string in `records` has the form '<item>{p['sep']}<quantity>', where quantity is an integer "
                f"that may be negative (a return). Return a dict that maps each item to its total quantity, items in "
                f"the order they first appear.")
        if p["nocase"]:
            text += " Item names that differ only in case are the same item; use the lowercase name as the key."
        if p["positive_only"]:
            text += " Leave out items whose total is 0 or less."
        return text

    def body(self, p: Params) -> str:
        key = "item.lower()" if p["nocase"] else "item"
        result = "{item: total for item, total in totals.items() if total > 0}" if p["positive_only"] else "totals"
        return _block(f"""
            totals = {{}}
            for record in records:
                item, quantity = record.rsplit({p['sep']!r}, 1)
                key = {key}
                totals[key] = totals.get(key, 0) + int(quantity)
            return {result}
        """)

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        items = [_word(rng, 1, 2) for _ in range(3)]
        records = []
        for _ in range(rng.randint(1, 7)):
            item = rng.choice(items)
            item = _cased(rng, item) if p["nocase"] else item
            records.append(f"{item}{p['sep']}{rng.randint(-5, 12)}")
        return [records]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        sep = p["sep"]
        return [[[]], [[f"Bolt{sep}4", f"bolt{sep}-4", f"BOLT{sep}2"]]]


class HeadlineCase(Family):
    name = "headline_case"
    level = 3
    summary = "capitalise words except a given list of small words"

    def draw(self, rng: random.Random) -> Params:
        small = sorted(rng.sample(_SMALL_WORDS, rng.randint(3, 5)))
        return {"function": rng.choice(("headline_case", "title_words", "capitalize_title", "make_heading")),
                "small": small, "last_capital": rng.random() < 0.5}

    def signature(self, p: Params) -> str:
        return "(text: str) -> str"

    def spec(self, p: Params) -> str:
        listed = ", ".join(f"'{w}'" for w in p["small"])
        edges = "the first or the last word" if p["last_capital"] else "the first word"
        return (f"Words in `text` are separated by single spaces. Return the text with every word capitalized (first "
                f"letter uppercase, the rest lowercase), except the small words {listed}, which are written all "
                f"lowercase unless they are {edges}.")

    def body(self, p: Params) -> str:
        last = " and i < len(words) - 1" if p["last_capital"] else ""
        return _block(f"""
            small = {{{', '.join(repr(w) for w in p['small'])}}}
            words = text.split(' ')
            out = []
            for i, word in enumerate(words):
                lower = word.lower()
                if i > 0{last} and lower in small:
                    out.append(lower)
                else:
                    out.append(lower[:1].upper() + lower[1:])
            return ' '.join(out)
        """)

    def random_input(self, rng: random.Random, p: Params) -> list[Any]:
        words = []
        for _ in range(rng.randint(2, 7)):
            word = rng.choice(p["small"]) if rng.random() < 0.4 else _word(rng)
            words.append(_cased(rng, word))
        return [" ".join(words)]

    def edge_inputs(self, p: Params) -> list[list[Any]]:
        first = p["small"][0]
        return [[""], [f"{first.upper()} {first} zed {first}"]]


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        CaesarShift(), CountLetters(), DigitRule(), RotateList(), PalindromeBase(),
        RunningFold(), Dedupe(), RankedValue(), Chunk(), StepsToZero(), RunLength(),
        GroupByInitial(), StockRecords(), HeadlineCase(),
    )
}


# --- task data ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def _reference_function(source: str, name: str) -> Any:
    """The reference solution as a host function. The source is this module's own generated code
    (never the model's), so running it on the host is safe; it is what the hidden tests' expected
    values come from."""
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<reference {name}>", "exec"), namespace)
    return namespace[name]


def _call_repr(name: str, args: Sequence[Any]) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def build_task_data(family_name: str, params: Params, num_tests: int) -> dict[str, Any]:
    """Everything a task carries, from its definition: the prompt (spec and two worked examples),
    the reference solution, the hidden tests' inputs and their expected values (encoded with
    :func:`encode_value`), and the expert's reference calls. Deterministic in the definition; the
    first hidden tests are the same for every ``num_tests``."""
    family = FAMILIES[family_name]
    definition = f"{family_name}:{json.dumps(params, sort_keys=True)}"
    rng = random.Random(f"code-tests/{definition}")
    name = params["function"]
    source = family.source(params)
    reference = _reference_function(source, name)

    def run(args: list[Any]) -> Any:
        return reference(*copy.deepcopy(args))

    examples = family.example_inputs(rng, params)
    seen = {json.dumps(a) for a in examples}
    tests: list[list[Any]] = []
    for args in family.edge_inputs(params):
        if len(tests) < num_tests and json.dumps(args) not in seen:
            seen.add(json.dumps(args))
            tests.append(args)
    while len(tests) < num_tests:
        for _ in range(30):  # a fresh input if one comes; a repeat is still a valid test
            args = family.random_input(rng, params)
            if json.dumps(args) not in seen:
                break
        seen.add(json.dumps(args))
        tests.append(args)

    signature = f"def {name}{family.signature(params)}"
    shown = "\n".join(f"    {_call_repr(name, a)} == {run(a)!r}" for a in examples)
    prompt = (f"Write a Python function:\n\n    {signature}\n\n{family.spec(params)}\n\nExamples:\n{shown}\n\n"
              f"Check your code with run_python, then submit the complete function with submit.")
    check = f"{source}\nprint({_call_repr(name, examples[0])})\n"
    return {
        "family": family_name,
        "level": family.level,
        "function": name,
        "params": params,
        "definition": definition,
        "signature": signature,
        "prompt": prompt,
        "examples": [{"args": a, "result": repr(run(a))} for a in examples],
        "reference": source,
        "tests": tests,
        "expected": [encode_value(run(a)) for a in tests],
        "reference_calls": [
            {"name": "run_python", "arguments": {"code": check}},
            {"name": "submit", "arguments": {"code": source}},
        ],
    }


def values_match(got: Any, expected: Any) -> bool:
    """Whether a returned value (encoded, as the harness sent it) equals the expected one: Python
    ``==`` on the decoded values (NaN equals nothing), except that a bool only equals a bool
    (``True`` is not ``1``) and floats compare with a 1e-9 tolerance. Tuples, sets and dicts with
    non-str keys are tagged by :func:`encode_value`, so ``(1, 2)`` is not ``[1, 2]``."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(expected, str) or expected is None:
        return type(got) is type(expected) and got == expected
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(values_match, got, expected))
    if isinstance(expected, dict):
        if expected == {"__float__": "nan"}:
            return False  # NaN equals nothing, itself included, as in Python
        return (isinstance(got, dict) and got.keys() == expected.keys()
                and all(values_match(got[k], expected[k]) for k in expected))
    return False


# --- grading --------------------------------------------------------------------------------------


@dataclass
class Grade:
    """The outcome of one submission."""

    passed: int
    total: int
    results: list[str] = field(default_factory=list)  # per test: passed | wrong | error | timeout | too_large | not_run
    first_error: str | None = None
    problem: str | None = None  # why no test could run (the code failed to define the function, ...)
    sandbox_timeout: bool = False
    test_timeouts: int = 0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def _records(stdout: str, nonce: str) -> list[dict[str, Any]]:
    """The JSON objects on lines carrying ``nonce`` (anything else, or a line that is not valid
    JSON after it, is ignored: it did not come from the harness)."""
    marker = nonce + " "
    found: list[dict[str, Any]] = []
    for line in stdout.splitlines():
        at = line.find(marker)
        if at < 0:
            continue
        try:
            record = json.loads(line[at + len(marker):])
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


def grade_output(run: SandboxResult, nonce: str, expected: Sequence[Any], function: str) -> Grade:
    """Compare the harness's result lines in ``run`` with the expected values (host side);
    ``function`` is the name the tests call (for the message when it is missing)."""
    total = len(expected)
    records = _records(run.stdout, nonce)
    define = next((r for r in records if r.get("stage") == "define"), None)
    by_test: dict[int, dict[str, Any]] = {}
    for record in records:
        index = record.get("test")
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < total:
            by_test[index] = record  # the harness writes a test's line after the call returns: the last one counts
    grade = Grade(passed=0, total=total, sandbox_timeout=run.killed == "wall_time")
    if define is None or define.get("status") != "ok":
        status = define.get("status") if define else None
        if status == "error":
            grade.problem = f"your code raised an error before any test ran: {str(define.get('error', ''))[:300]}"
        elif status == "timeout":
            grade.problem = "running your code (before calling the function) took longer than the time limit per test"
        elif status == "missing":
            grade.problem = f"your code does not define a function named {function}"
        elif grade.sandbox_timeout:
            grade.problem = "your code ran past the time limit before any test ran"
        else:
            grade.problem = f"the grader got no results: your code ended the process before the tests ran ({run.describe()})"
        grade.results = ["not_run"] * total
        return grade
    for index in range(total):
        record = by_test.get(index)
        if record is None:
            grade.results.append("not_run")
            continue
        status = record.get("status")
        if status == "ok" and "value" in record and values_match(record["value"], expected[index]):
            grade.passed += 1
            grade.results.append("passed")
        elif status == "ok":
            grade.results.append("wrong")
        elif status == "error":
            grade.results.append("error")
            if grade.first_error is None:
                grade.first_error = f"test {index + 1}: {str(record.get('error', ''))[:300]}"
        elif status == "timeout":
            grade.results.append("timeout")
            grade.test_timeouts += 1
        elif status == "too_large":
            grade.results.append("too_large")
        else:
            grade.results.append("wrong")
    return grade


def _clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its head and tail (a traceback's last
    line is the one that matters)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n...[{len(text) - 2 * half:,} characters cut]...\n{text[len(text) - half:]}"


SYSTEM_PROMPT = (
    "You write Python functions. Tools: run_python(code) runs a Python 3 program in a fresh sandbox "
    "(standard library only, no network, no input) and shows what it printed; submit(code) sends your "
    "finished function to hidden unit tests that call it and check the values it returns. Give the "
    "complete function, with any imports it needs. The function must return its result, not print it."
)


class CodeEnv(ToolEnv):
    """Write one Python function from a spec; hidden unit tests, run in a sandbox, grade it."""

    name = "code"
    description = "Write a Python function from a spec; run_python to try it, submit to hidden unit tests in a sandbox."
    reward_range = (0.0, 1.0)
    branchable = True  # no sandbox lives between calls: the state is the task, the counters, the grades
    default_max_turns = 8

    def __init__(
        self,
        families: list[str] | str | None = None,
        difficulty: int | list[int] | str = "1..3",
        num_tests: int = 10,
        reward: Literal["fraction", "all"] = "fraction",
        max_submissions: int = 1,
        isolation: Literal["bwrap", "unsafe_local"] = "bwrap",
        wall_s: float = 10.0,
        cpu_s: int = 10,
        mem_mb: int = 256,
        test_timeout_s: float = 1.0,
        max_output_chars: int = 2000,
        max_turns: int | None = None,
        test_fraction: float = 0.2,
        max_tool_output_chars: int | None = None,
    ) -> None:
        """``families``: family names (a list or "a,b"; None: all); ``difficulty``: the levels to
        draw from (``2``, ``"1..2"``, ``[1, 3]``); ``num_tests``: hidden tests per task (1..50);
        ``reward``: "fraction" of tests passed or "all" (1/0); ``max_submissions``: submissions
        before the episode ends; ``isolation``: "bwrap" (refuses to build without bubblewrap) or
        "unsafe_local" (no isolation); ``wall_s``/``cpu_s``/``mem_mb``: sandbox limits of every run;
        ``test_timeout_s``: time per hidden test (the harness stops at the first test over it);
        ``max_output_chars``: run_python's stdout and stderr are each cut to this."""
        if isolation not in ("bwrap", "unsafe_local"):
            raise ValueError(f"isolation must be 'bwrap' or 'unsafe_local', got {isolation!r}")
        if isolation == "bwrap":
            reason = sandbox.bwrap_unavailable_reason()
            if reason is not None:
                raise SandboxUnavailable(
                    f"env 'code' runs model-written code and cannot isolate it here: {reason}. Install bubblewrap "
                    "(Debian/Ubuntu: apt-get install bubblewrap), or pass isolation='unsafe_local' to run the code "
                    "WITHOUT isolation on a machine you own (never for untrusted models)"
                )
        self.isolation: Literal["bwrap", "unsafe_local"] = isolation
        low, high = parse_int_range(difficulty, "difficulty", 1, 3)
        if isinstance(families, str):
            families = [f.strip() for f in families.split(",") if f.strip()]
        if families is not None:
            unknown = [f for f in families if f not in FAMILIES]
            if unknown or not families:
                raise ValueError(f"unknown code families {unknown or families!r}; known: {', '.join(FAMILIES)}")
        # In FAMILIES' order, whatever order they were named in: the same selection, the same tasks.
        chosen = [f for f in FAMILIES if (families is None or f in families) and low <= FAMILIES[f].level <= high]
        if not chosen:
            raise ValueError(f"no family among {families or list(FAMILIES)} has a difficulty in {low}..{high}")
        self.families: list[str] = chosen
        if not 1 <= num_tests <= MAX_TESTS:
            raise ValueError(f"num_tests must be in 1..{MAX_TESTS}, got {num_tests}")
        if reward not in ("fraction", "all"):
            raise ValueError(f"reward must be 'fraction' or 'all', got {reward!r}")
        if max_submissions < 1:
            raise ValueError(f"max_submissions must be >= 1, got {max_submissions}")
        if not 0 < wall_s <= MAX_WALL_S:
            raise ValueError(f"wall_s must be in (0, {MAX_WALL_S:g}], got {wall_s}")
        if not 0 < test_timeout_s <= wall_s:
            raise ValueError(f"test_timeout_s must be in (0, wall_s={wall_s:g}], got {test_timeout_s}")
        if mem_mb < 64 or cpu_s < 1:
            raise ValueError(f"mem_mb must be >= 64 (python needs ~30 MB to start) and cpu_s >= 1, got {mem_mb} and {cpu_s}")
        if max_output_chars < 100:
            raise ValueError(f"max_output_chars must be >= 100, got {max_output_chars}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.num_tests = num_tests
        self.reward_mode: Literal["fraction", "all"] = reward
        self.max_submissions = max_submissions
        self.limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, mem_mb=mem_mb, max_output=_SANDBOX_MAX_OUTPUT)
        self.test_timeout_s = test_timeout_s
        self.max_output_chars = max_output_chars
        self.test_fraction = test_fraction
        super().__init__(max_turns=max_turns, max_tool_output_chars=max_tool_output_chars)
        self.task: Task | None = None
        self._new_episode_state()

    def _new_episode_state(self) -> None:
        self.submissions = 0
        self.last_grade: dict[str, Any] | None = None
        self.stats: dict[str, int] = {"python_runs": 0, "sandbox_timeouts": 0, "sandbox_errors": 0, "test_timeouts": 0}

    # -- tasks --

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        def draw(rng: random.Random) -> dict[str, Any]:
            family = FAMILIES[rng.choice(self.families)]
            params = family.draw(rng)
            return {"family": family.name, "params": params,
                    "definition": f"{family.name}:{json.dumps(params, sort_keys=True)}"}

        try:
            found = distinct_tasks(split, n, random.Random(f"code/{seed}/{','.join(self.families)}"), draw,
                                   lambda d: d["definition"], "code", self.test_fraction, what="code tasks")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: the families {self.families} define too few distinct functions; "
                               "select more families or difficulty levels") from exc
        return [
            Task(id=t.id, split=t.split, data=build_task_data(t.data["family"], t.data["params"], self.num_tests))
            for t in found
        ]

    async def reset(self, task: Task) -> list[Message]:
        self.task = task
        self._new_episode_state()
        prompt = task.data["prompt"]
        if self.max_submissions > 1:
            prompt += (f" You may submit up to {self.max_submissions} times; the episode ends at a submission "
                       "that passes every test.")
        return [Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=prompt)]

    # -- the sandbox --

    def _run_sandboxed(self, files: dict[str, str], argv: list[str], stdin: str = "") -> SandboxResult:
        """One run in a fresh sandbox, closed before returning (nothing outlives the call).
        RuntimeError (counted in ``sandbox_errors``) when the sandbox itself fails."""
        try:
            with sandbox.Sandbox(self.limits, isolation=self.isolation, files=files) as box:
                result = box.run(argv, stdin=stdin)
        except (SandboxUnavailable, OSError) as exc:
            self.stats["sandbox_errors"] += 1
            raise RuntimeError(f"the sandbox could not run the code ({type(exc).__name__}: {exc}); try again") from exc
        if result.killed == "wall_time":
            self.stats["sandbox_timeouts"] += 1
        return result

    def _ending(self, result: SandboxResult) -> str:
        """How a run ended, in words that do not depend on timing (replays must match)."""
        if result.killed == "wall_time":
            return f"killed: the program ran past the {self.limits.wall_s:g} s time limit"
        if result.killed is not None or (result.returncode is not None and result.returncode < 0):
            return result.describe()
        return f"exit status {result.returncode}"

    # -- tools --

    @tool(timeout=_TOOL_TIMEOUT_S)
    def run_python(self, code: str) -> str:
        """Run a Python 3 program in a fresh sandbox and show its output.

        Args:
            code: The whole program (standard library only); print what you want to see.
        """
        self.stats["python_runs"] += 1
        result = self._run_sandboxed({"main.py": code}, ["python3", "main.py"])
        parts = []
        for label, text, cut in (("stdout", result.stdout, result.stdout_truncated),
                                 ("stderr", result.stderr, result.stderr_truncated)):
            if text:
                note = " (cut by the sandbox)" if cut else ""
                parts.append(f"{label}{note}:\n{_clip(text.rstrip(chr(10)), self.max_output_chars)}")
        if not parts:
            parts.append("(no output)")
        parts.append(self._ending(result))
        return "\n".join(parts)

    @tool(timeout=_TOOL_TIMEOUT_S)
    def submit(self, code: str) -> str:
        """Submit the finished function; hidden unit tests call it and check what it returns.

        Args:
            code: The complete function definition, with any imports it needs.
        """
        assert self.task is not None, "submit before reset"
        data = self.task.data
        nonce = secrets.token_hex(16)  # new per run: code that has not seen it cannot forge a result line
        tests_file = json.dumps({"function": data["function"], "tests": data["tests"], "test_timeout_s": self.test_timeout_s})
        run = self._run_sandboxed(
            {"harness.py": HARNESS_SOURCE, "submission.py": code, "tests.json": tests_file},
            ["python3", "-I", "harness.py"], stdin=nonce + "\n",
        )
        grade = grade_output(run, nonce, data["expected"], data["function"])
        self.submissions += 1
        self.stats["test_timeouts"] += grade.test_timeouts
        self.last_grade = {"tests_passed": grade.passed, "tests_total": grade.total}
        final = grade.all_passed or self.submissions >= self.max_submissions
        if final:
            if self.reward_mode == "fraction":
                reward = grade.passed / grade.total
            else:
                reward = float(grade.all_passed)
            self.end_episode(reward, grade.all_passed, **self._outcome_info())
        return self._grade_message(grade, final)

    def _grade_message(self, grade: Grade, final: bool) -> str:
        lines = []
        if grade.problem is not None:
            lines.append(f"No test ran: {grade.problem}.")
        if grade.sandbox_timeout and grade.problem is None:
            lines.append(f"Stopped: your code ran past the {self.limits.wall_s:g} s time limit.")
        if grade.all_passed:
            lines.append(f"All {grade.total} hidden tests passed.")
        else:
            lines.append(f"Passed {grade.passed} of {grade.total} hidden tests.")
        if grade.problem is None:
            counts = {kind: grade.results.count(kind) for kind in ("wrong", "error", "timeout", "too_large", "not_run")}
            words = {"wrong": "returned a wrong value", "error": "raised an exception",
                     "timeout": f"ran past the {self.test_timeout_s:g} s limit per test",
                     "too_large": "returned a value too large to check", "not_run": "did not run"}
            failed = [f"{n} {words[kind]}" for kind, n in counts.items() if n]
            if failed:
                lines.append("Failed: " + "; ".join(failed) + ".")
            if grade.first_error:
                lines.append(f"First exception: {grade.first_error}")
        if not final:
            left = self.max_submissions - self.submissions
            lines.append(f"You may submit again ({left} submission{'s' if left > 1 else ''} left).")
        return "\n".join(lines)

    def _outcome_info(self, **extra: Any) -> dict[str, Any]:
        assert self.task is not None
        grade = self.last_grade or {"tests_passed": 0, "tests_total": len(self.task.data["expected"])}
        return {**grade, "submissions": self.submissions, **self.stats,
                "family": self.task.data["family"], "level": self.task.data["level"], **extra}

    def on_text(self, message: Message) -> StepResult:
        """A message without a tool call ends the episode with reward 0: only ``submit`` grades
        (code written in a text message is not run)."""
        return StepResult(terminated=True, reward=0.0, info={"success": 0, **self._outcome_info(no_submission=1)})

    # -- expert --

    def expert_action(self) -> Message:
        """Check the reference solution on the first example, then submit it."""
        if self.task is None:
            raise RuntimeError("expert_action called before reset")
        check, submission = self.task.data["reference_calls"]
        call = check if self.stats["python_runs"] == 0 and self.submissions == 0 else submission
        tool_call = ToolCall(name=call["name"], arguments=dict(call["arguments"]), id=f"call_{self.turn}")
        return Message(role="assistant", tool_calls=(tool_call,))
