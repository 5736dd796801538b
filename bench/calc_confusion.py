"""Which calculator decisions an RL run changed: per sentence template of the word problems, how
often each evaluation picked the right operator, and what it picked instead (no model needed).

Reads the ``trajectories.jsonl`` of two or more ``tracegym eval`` runs on the same calculator tasks
(the SFT start and RL runs from ``bench/strong_start.py``), walks each episode's calls against the
task's reference calls (``info.reference_calls``) up to the first wrong operator, and prints one row
per template (numbers, actors and objects replaced) with ``right/seen`` per run and the operators
used at that template. A call counts only when the episode reached it with every earlier operator
right, so each run's denominator is its own.

    .venv/bin/python bench/calc_confusion.py runs/strong_start/sft_test120x2 runs/strong_start/seed_0/rl
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterator

_CALL = re.compile(r"\s*\(?\s*(-?\d+)\s*\)?\s*(//|\*\*|[-+*/%])\s*(-?\d+)\s*$")
_OBJECTS = ("pens cookies eggs bolts books marbles pencils bags tins cartons packs boxes kits crates "
            "trays baskets jars shelves pen cookie egg bolt book marble pencil").split()


def operator(expression: str | None) -> str:
    """The operator of a two-operand call (``"765 // 36"`` -> ``"//"``), ``"?"`` when it is not one."""
    match = _CALL.match(expression or "")
    return match.group(2) if match else "?"


def template(sentence: str) -> str:
    """A problem sentence with its numbers, actor and objects replaced, so that every task that
    uses one phrasing shares a row (``"It spends 40 dollars of that money."`` -> ``"X spends N ..."``)."""
    text = re.sub(r"\d+", "N", sentence)
    text = re.sub(r"^(A \w+|Maria|It|She)\b", "X", text)
    return re.sub(r"\b(" + "|".join(_OBJECTS) + r")\b", "OBJ", text)


def episode_decisions(episode: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """``(template, needed operator, used operator)`` for each dependent call (the first call has
    no choice of operator) up to and including the first wrong operator."""
    reference = [call["arguments"]["expression"] for call in episode["info"]["reference_calls"]]
    used = [call["arguments"].get("expression") if isinstance(call.get("arguments"), dict) else None
            for turn in episode["turns"] for call in (turn["message"].get("tool_calls") or [])]
    user = next(m["content"] for m in episode["messages"] if m["role"] == "user")
    sentences = re.split(r"(?<=\.)\s+", user.strip())
    for i in range(1, len(reference)):
        needed, got = operator(reference[i]), operator(used[i]) if i < len(used) else "none"
        yield template(sentences[i]), needed, got
        if got != needed:
            return


def confusion(run: Path) -> dict[tuple[str, str], Counter]:
    """``{(template, needed): Counter(used)}`` over a run's ``trajectories.jsonl``."""
    table: dict[tuple[str, str], Counter] = defaultdict(Counter)
    path = run / "trajectories.jsonl" if run.is_dir() else run
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            episode = json.loads(line)
            for key, needed, used in episode_decisions(episode):
                table[(key, needed)][used] += 1
        except (KeyError, ValueError, StopIteration) as error:
            raise SystemExit(f"{path}:{line_no}: not a calculator eval episode ({error!r})") from None
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="eval output folders (or trajectories.jsonl files)")
    parser.add_argument("--min-seen", type=int, default=5, help="rows seen fewer times in every run are left out")
    args = parser.parse_args()
    tables = [confusion(run) for run in args.runs]
    keys = sorted(set().union(*tables), key=lambda k: -sum(sum(t[k].values()) for t in tables))
    print("| needed | template | " + " | ".join(f"{run.parent.name}/{run.name}" for run in args.runs) + " |")
    print("|---|---|" + "---|" * len(args.runs))
    for key in keys:
        if max(sum(t[key].values()) for t in tables) < args.min_seen:
            continue
        cells = []
        for table in tables:
            used = table[key]
            wrong = ", ".join(f"{op} {n}" for op, n in used.most_common() if op != key[1])
            cells.append(f"{used[key[1]]}/{sum(used.values())}" + (f" ({wrong})" if wrong else ""))
        print(f"| `{key[1]}` | {key[0]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
