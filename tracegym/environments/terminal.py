"""Terminal: file-system chores done with shell commands in a sandbox, checked on the final work dir.

    "Do these chores:
     1. Write the lines of rusiko/kofele.log that contain ERROR to kera.txt, in their original
        order. Then write the number of those lines to fasegu.txt (just the number).
     2. Set the permissions (octal, as chmod takes them) of romame/rime.conf to 700."

Each episode gets its own :class:`~tracegym.envs.sandbox.Sandbox` (bubblewrap: no network, no
host files, rlimits) whose work dir holds the task's initial files. The agent has one tool,
``run(command)``, a bash command whose output (stdout and stderr, bounded) and exit status come
back; it ends the episode with a message without tool calls (``<answer>done</answer>``). Then the
HOST reads the work dir (``Sandbox.list_files``, which never follows a link) and checks it against
the task's goal: files and their contents, directories, absent paths, permission bits, a tar.gz
archive's members. Nothing is verified by running commands in the agent's shell, which the agent
could have changed (an alias, a function named ``cat``). The work dir is hostile input, so the
check is bounded in every dimension: the walk stops past 32 levels, 5,000 entries or its time
(reward 0, the reason in ``failed_checks``), only the files the checks name are read (each inode
once, 256 KB each, 16 MB in all), an archive is read through its member headers (sparse members and
members larger than the archive refused), and the check runs on a thread of its own with a time
limit, so one episode's check never stalls the event loop the other episodes share.

Reward: 1 iff every check passes (``reward="all"``), or the fraction of goal checks passed
(``reward="fraction"``); with partial credit, a "guard" (a file the chore must keep, true before
the agent acts) that fails zeroes the reward, so neither doing nothing nor deleting everything
earns anything. An episode cut by ``max_turns`` earns 0. The sandbox's CPU budget
(``cpu_budget_s``, all the episode's processes together, between calls too) ends every later
command once spent.

Two modes, one option:

- ``stateless=False`` (default): one persistent bash session per episode; the current directory,
  variables, files and background processes survive between calls, as in a terminal. A command
  that runs past ``wall_s`` kills the session; the next call starts a new shell on the same files.
- ``stateless=True``: every call runs ``bash`` afresh in a work dir reset to the task's initial
  files, so only what the last call left is checked; a multi-step task must be done in one call.

Tasks: 15 families of generated, fictional chores (directory trees, files with given lines, moving
and renaming by extension, ``chmod``, counting, sorting, ``grep``, ``sed``, ``cat``, ``find
-delete``, ``tar``, CSV sums, ``head``/``tail``) with made-up names and contents; many take 2-3
commands. A task combines ``chores`` of them (an int or a ``(min, max)`` range: the difficulty),
each in its own directory so they never interfere. The train/test split is a hash of the task's
text. The expert runs the reference commands, one per turn (joined with ``&&`` into one call when
stateless), then answers.

The env cannot branch: its state is a live shell and a directory on disk, which a snapshot of
Python data does not capture.
"""

from __future__ import annotations

import asyncio
import math
import random
import shlex
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from tracegym.envs.base import Task
from tracegym.envs.sandbox import (
    FileEntry,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    ShellSession,
    TreeLimitError,
    TreeLimits,
    bwrap_unavailable_reason,
)
from tracegym.envs.hostfs import read_tar_gz
from tracegym.envs.tasks import distinct_tasks, parse_int_range
from tracegym.envs.tools import ToolEnv, tool
from tracegym.types import Message, StepResult, ToolCall

__all__ = [
    "FAMILIES", "CheckOutcome", "TerminalEnv", "generate_task", "score", "system_prompt", "verify_sandbox",
    "verify_work_dir",
]

Isolation = Literal["bwrap", "unsafe_local"]
RewardMode = Literal["all", "fraction"]

#: Longest ``wall_s`` allowed: the tool's own timeout (below) must stay above it, so the sandbox
#: (which kills every process of the command) always acts first, never the tool thread's timeout.
MAX_WALL_S = 300.0
_TOOL_TIMEOUT_S = MAX_WALL_S + 30.0
#: Bytes of each work-dir file read for verification; goal files are a few KB at most.
_READ_LIMIT = 262_144
#: Largest decompressed tar archive the host inspects (a gzip bomb stops here, nothing is extracted).
_MAX_TAR_BYTES = 4_000_000
#: Bounds of the host's walk of the final work dir; past one the check fails with the reason.
_CHECK_LIMITS = TreeLimits(max_depth=32, max_entries=5_000, max_read_bytes=16 * 2**20, read_limit=_READ_LIMIT,
                           timeout_s=10.0)
#: Seconds the whole check (stopping the shell, the walk, the comparisons) may take on its thread.
_CHECK_TIMEOUT_S = 20.0
#: Seconds the event loop waits for an episode's sandbox to close (the rest goes on in the background).
_CLOSE_WAIT_S = 10.0


# --- fictional names and contents -------------------------------------------------------------------

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


class _Names:
    """Made-up lowercase words; :meth:`fresh` never returns the same word twice in one task, so the
    paths of different chores never collide."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self) -> str:
        """A word for file contents (may repeat)."""
        return "".join(self.rng.choice(_CONSONANTS) + self.rng.choice(_VOWELS) for _ in range(self.rng.randint(2, 3)))

    def fresh(self) -> str:
        """A word used nowhere else in the task (paths, the word to replace or count)."""
        while True:
            candidate = self.word()
            if candidate not in self.used:
                self.used.add(candidate)
                return candidate

    def words(self, low: int, high: int, avoid: Sequence[str] = ()) -> str:
        """``low``..``high`` words separated by spaces, none containing a word of ``avoid`` (so that
        "the word X" has one meaning, whether the agent matches substrings or whole words)."""
        chosen: list[str] = []
        for _ in range(self.rng.randint(low, high)):
            word = self.word()
            while any(a in word or word in a for a in avoid):
                word = self.word()
            chosen.append(word)
        return " ".join(chosen)


def _text(lines: Sequence[str]) -> str:
    return "".join(f"{line}\n" for line in lines)


def _english_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _q(path: str) -> str:
    return shlex.quote(path)


@dataclass
class _Chore:
    """One chore: its instruction, the files it starts from, the reference commands and the checks."""

    family: str
    text: str
    files: dict[str, str] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)  # initial permission bits other than 0o644
    steps: list[str] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)


def _file(path: str, text: str) -> dict[str, Any]:
    return {"kind": "file", "path": path, "text": text}


def _kept(path: str, text: str) -> dict[str, Any]:
    """A guard: a file the chore must leave as it was (true before the agent acts, so it earns no
    partial credit; breaking it forfeits the chore's partial credit)."""
    return {**_file(path, text), "guard": True}


def _number(path: str, value: int) -> dict[str, Any]:
    return {"kind": "number", "path": path, "value": value}


def _dir(path: str) -> dict[str, Any]:
    return {"kind": "dir", "path": path}


def _absent(path: str) -> dict[str, Any]:
    return {"kind": "absent", "path": path}


def _mode(path: str, mode: int, mask: int = 0o7777) -> dict[str, Any]:
    return {"kind": "mode", "path": path, "mode": mode, "mask": mask}


# --- the families -----------------------------------------------------------------------------------


def _make_dirs(rng: random.Random, names: _Names) -> _Chore:
    root = names.fresh()
    leaves: list[str] = []
    for _ in range(rng.randint(2, 4)):
        depth = rng.randint(1, 2)
        leaves.append("/".join([root, *(names.fresh() for _ in range(depth))]))
    chore = _Chore("make_dirs", f"Create the directories {_english_list(leaves)} (with any missing parents).")
    chore.steps.append("mkdir -p " + " ".join(_q(p) for p in leaves))
    chore.checks += [_dir(p) for p in leaves]
    if rng.random() < 0.5:
        keep = f"{rng.choice(leaves)}/.keep"
        chore.text += f" Then create an empty file {keep}."
        chore.steps.append(f"touch {_q(keep)}")
        chore.checks.append(_file(keep, ""))
    return chore


def _write_file(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    path = f"{folder}/{names.fresh()}.txt"
    lines = [names.words(2, 5) + (f" {rng.randint(1, 99)}" if rng.random() < 0.3 else "") for _ in range(rng.randint(2, 4))]
    shown = "\n".join(lines)
    chore = _Chore(
        "write_file",
        f"Create the file {path} (its folder does not exist yet) containing exactly these {len(lines)} lines:\n"
        f"```\n{shown}\n```",
    )
    chore.steps += [f"mkdir -p {_q(folder)}", "printf '%s\\n' " + " ".join(_q(line) for line in lines) + f" > {_q(path)}"]
    chore.checks.append(_file(path, _text(lines)))
    return chore


_EXTENSIONS = ("log", "txt", "csv", "md", "json", "cfg", "dat", "tmp", "bak", "ini")


def _mixed_files(
    rng: random.Random, names: _Names, folder: str, ext: str, count: int, others: int
) -> tuple[dict[str, str], dict[str, str]]:
    """({path: content} with extension ``ext``, {path: content} of ``others`` files with other
    extensions) in ``folder``."""
    matching = {f"{folder}/{names.fresh()}.{ext}": _text([names.words(2, 4)]) for _ in range(count)}
    other_exts = [e for e in _EXTENSIONS if e != ext]
    rest = {f"{folder}/{names.fresh()}.{rng.choice(other_exts)}": _text([names.words(2, 4)]) for _ in range(others)}
    return matching, rest


def _move_by_ext(rng: random.Random, names: _Names) -> _Chore:
    src, dst = names.fresh(), names.fresh()
    ext = rng.choice(_EXTENSIONS)
    moving, staying = _mixed_files(rng, names, src, ext, rng.randint(2, 4), rng.randint(1, 3))
    chore = _Chore(
        "move_by_ext",
        f"Move every .{ext} file in {src}/ into a new directory {dst}/; leave the other files in {src}/.",
        files={**moving, **staying},
    )
    chore.steps += [f"mkdir -p {_q(dst)}", f"mv {_q(src)}/*.{ext} {_q(dst)}/"]
    for path, content in moving.items():
        chore.checks += [_file(f"{dst}/{path.split('/', 1)[1]}", content), _absent(path)]
    chore.checks += [_kept(path, content) for path, content in staying.items()]
    return chore


_RENAMES = (("txt", "md"), ("htm", "html"), ("jpeg", "jpg"), ("yml", "yaml"), ("log", "old"), ("text", "txt"))


def _rename_ext(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    old, new = rng.choice(_RENAMES)
    renamed = {f"{folder}/{names.fresh()}.{old}": _text([names.words(2, 4)]) for _ in range(rng.randint(2, 4))}
    others = {
        f"{folder}/{names.fresh()}.{rng.choice(('csv', 'cfg', 'dat'))}": _text([names.words(2, 4)])
        for _ in range(rng.randint(1, 2))
    }
    chore = _Chore(
        "rename_ext",
        f"In {folder}/, rename every file ending in .{old} so that it ends in .{new} instead, keeping its base "
        f"name (x.{old} becomes x.{new}); leave the other files alone.",
        files={**renamed, **others},
    )
    chore.steps.append(f'for f in {_q(folder)}/*.{old}; do mv "$f" "${{f%.{old}}}.{new}"; done')
    for path, content in renamed.items():
        chore.checks += [_file(path[: -len(old)] + new, content), _absent(path)]
    chore.checks += [_kept(path, content) for path, content in others.items()]
    return chore


def _make_executable(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    script = f"{folder}/{names.fresh()}.sh"
    out_name = f"{names.fresh()}.txt"
    line = f"{names.words(1, 3)} {rng.randint(1, 999)}"
    body = (
        "#!/bin/bash\n"
        f"# writes {out_name} next to this script\n"
        'cd "$(dirname "$0")"\n'
        f"echo {_q(line)} > {out_name}\n"
    )
    chore = _Chore("make_executable", f"Make the script {script} executable.", files={script: body})
    chore.steps.append(f"chmod +x {_q(script)}")
    chore.checks += [_mode(script, 0o100, mask=0o100), _kept(script, body)]
    if rng.random() < 0.6:
        out = f"{folder}/{out_name}"
        chore.text += f" Then run it: it writes {out}."
        chore.steps.append(f"./{script}")
        chore.checks.append(_file(out, _text([line])))
    return chore


_TARGET_MODES = (0o600, 0o640, 0o400, 0o444, 0o700, 0o750, 0o755, 0o644, 0o660)
_INITIAL_MODES = (0o644, 0o664, 0o666, 0o755)


def _set_mode(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    targets: dict[str, int] = {}
    chore = _Chore("set_mode", "")
    for _ in range(rng.randint(1, 2)):
        path = f"{folder}/{names.fresh()}.{rng.choice(('key', 'pem', 'conf', 'sh', 'db'))}"
        initial = rng.choice(_INITIAL_MODES)
        target = rng.choice([m for m in _TARGET_MODES if m != initial])
        chore.files[path] = _text([names.words(2, 4)])
        chore.modes[path] = initial
        targets[path] = target
    parts = [f"of {path} to {target:03o}" for path, target in targets.items()]
    chore.text = f"Set the permissions (octal, as chmod takes them) {_english_list(parts)}."
    for path, target in targets.items():
        chore.steps.append(f"chmod {target:03o} {_q(path)}")
        chore.checks += [_mode(path, target), _kept(path, chore.files[path])]
    return chore


def _count(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    path = f"{folder}/{names.fresh()}.txt"
    out = f"{names.fresh()}.txt"
    kind = rng.choice(("lines", "words", "matching"))
    if kind == "matching":
        needle = names.fresh()
        lines = [names.words(1, 4, avoid=[needle]) for _ in range(rng.randint(5, 14))]
        hits = rng.sample(range(len(lines)), rng.randint(1, max(1, len(lines) // 2)))
        for i in hits:
            words = lines[i].split()
            words.insert(rng.randint(0, len(words)), needle)
            lines[i] = " ".join(words)
        value = sum(needle in line for line in lines)
        text = f"Write the number of lines of {path} that contain the word {needle} to {out} (just the number)."
        step = f"grep -c {_q(needle)} {_q(path)} > {_q(out)}"
    else:
        lines = [names.words(1, 6) for _ in range(rng.randint(3, 18))]
        value = len(lines) if kind == "lines" else sum(len(line.split()) for line in lines)
        text = f"Write the number of {kind} in {path} to {out} (just the number)."
        step = f"wc -{'l' if kind == 'lines' else 'w'} < {_q(path)} > {_q(out)}"
    chore = _Chore("count", text, files={path: _text(lines)}, steps=[step], checks=[_number(out, value)])
    return chore


def _sort_lines(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    path = f"{folder}/{names.fresh()}.txt"
    out = f"{folder}/{names.fresh()}.txt"
    how = rng.choice(("alpha", "unique", "reverse", "numeric"))
    if how == "numeric":
        # Mixed digit counts, so alphabetical order ("100" < "9") is wrong here.
        values = rng.sample(range(1, 10), 2) + rng.sample(range(10, 100), 2) + rng.sample(range(100, 10_000), rng.randint(0, 6))
        lines = [str(v) for v in values]
        wanted = sorted(lines, key=int)
        text, flags = "sorted by numeric value, smallest first", "-n "
    else:
        lines = [names.fresh() for _ in range(rng.randint(4, 10))]  # distinct, so shuffling changes the order
        if how == "unique":
            lines += rng.sample(lines, rng.randint(1, 3))
            rng.shuffle(lines)
            wanted, text, flags = sorted(set(lines)), "sorted alphabetically, without duplicate lines", "-u "
        elif how == "reverse":
            wanted, text, flags = sorted(lines, reverse=True), "sorted in reverse alphabetical order", "-r "
        else:
            wanted, text, flags = sorted(lines), "sorted alphabetically", ""
    while lines == wanted:  # already in order: the chore would be a plain copy
        rng.shuffle(lines)
    chore = _Chore("sort_lines", f"Write the lines of {path}, {text}, to {out}.", files={path: _text(lines)})
    chore.steps.append(f"sort {flags}{_q(path)} > {_q(out)}")
    chore.checks.append(_file(out, _text(wanted)))
    return chore


_LEVELS = ("ERROR", "WARN", "INFO", "DEBUG")


def _grep_lines(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    log = f"{folder}/{names.fresh()}.log"
    level = rng.choice(_LEVELS)
    components = [names.word() for _ in range(3)]
    seconds = sorted(rng.sample(range(8 * 3600, 18 * 3600), rng.randint(6, 14)))  # a day's log, in order
    lines = [
        f"{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d} {rng.choice(_LEVELS)} {rng.choice(components)}: {names.words(2, 5)}"
        for t in seconds
    ]
    for i in rng.sample(range(len(lines)), 2):  # at least two matches: grep never exits 1 here
        parts = lines[i].split(" ", 2)
        lines[i] = f"{parts[0]} {level} {parts[2]}"
    matching = [line for line in lines if f" {level} " in line]
    out = f"{names.fresh()}.txt"
    chore = _Chore(
        "grep_lines", f"Write the lines of {log} that contain {level} to {out}, in their original order.",
        files={log: _text(lines)},
    )
    chore.steps.append(f"grep {level} {_q(log)} > {_q(out)}")
    chore.checks.append(_file(out, _text(matching)))
    if rng.random() < 0.5:
        count = f"{names.fresh()}.txt"
        chore.text += f" Then write the number of those lines to {count} (just the number)."
        chore.steps.append(f"wc -l < {_q(out)} > {_q(count)}")
        chore.checks.append(_number(count, len(matching)))
    return chore


def _replace_word(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    path = f"{folder}/{names.fresh()}.txt"
    old, new = names.fresh(), names.fresh()
    lines = [names.words(2, 6, avoid=[old, new]).split() for _ in range(rng.randint(3, 6))]
    for _ in range(rng.randint(2, 5)):
        line = rng.choice(lines)
        line.insert(rng.randint(0, len(line)), old)
    before = _text([" ".join(line) for line in lines])
    chore = _Chore(
        "replace_word",
        f"In {path}, replace every occurrence of the word {old} with {new} (edit the file in place).",
        files={path: before},
    )
    chore.steps.append(f"sed -i 's/{old}/{new}/g' {_q(path)}")
    chore.checks.append(_file(path, before.replace(old, new)))
    return chore


def _concat(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    parts = {
        f"{folder}/{names.fresh()}.part": _text([names.words(2, 5) for _ in range(rng.randint(1, 3))])
        for _ in range(rng.randint(2, 4))
    }
    order = list(parts)
    rng.shuffle(order)
    out = f"{folder}/{names.fresh()}.txt"
    chore = _Chore(
        "concat", f"Concatenate {_english_list(order)}, in this order, into {out}.", files=dict(sorted(parts.items()))
    )
    chore.steps.append("cat " + " ".join(_q(p) for p in order) + f" > {_q(out)}")
    chore.checks.append(_file(out, "".join(parts[p] for p in order)))
    if rng.random() < 0.5:
        chore.text += " Then delete those parts."
        chore.steps.append("rm " + " ".join(_q(p) for p in order))
        chore.checks += [_absent(p) for p in order]
    return chore


def _delete_ext(rng: random.Random, names: _Names) -> _Chore:
    root = names.fresh()
    folders = [root, f"{root}/{names.fresh()}", f"{root}/{names.fresh()}/{names.fresh()}"]
    ext = rng.choice(("tmp", "bak", "swp", "orig", "cache"))
    doomed: dict[str, str] = {}
    kept: dict[str, str] = {}
    for folder in folders:
        for _ in range(rng.randint(0, 2)):
            doomed[f"{folder}/{names.fresh()}.{ext}"] = _text([names.words(1, 3)])
        for _ in range(rng.randint(0, 2)):
            kept[f"{folder}/{names.fresh()}.{rng.choice(('txt', 'csv', 'md'))}"] = _text([names.words(1, 3)])
    if not doomed:
        doomed[f"{folders[-1]}/{names.fresh()}.{ext}"] = _text([names.words(1, 3)])
    if not kept:
        kept[f"{root}/{names.fresh()}.txt"] = _text([names.words(1, 3)])
    chore = _Chore(
        "delete_ext",
        f"Delete every .{ext} file anywhere under {root}/ (subdirectories included); keep all the other files.",
        files=dict(sorted({**doomed, **kept}.items())),
    )
    chore.steps.append(f"find {_q(root)} -type f -name '*.{ext}' -delete")
    chore.checks += [_absent(p) for p in doomed] + [_kept(p, c) for p, c in kept.items()]
    return chore


def _archive(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    files = {f"{folder}/{names.fresh()}.txt": _text([names.words(2, 5)]) for _ in range(rng.randint(2, 3))}
    if rng.random() < 0.5:
        files[f"{folder}/{names.fresh()}/{names.fresh()}.txt"] = _text([names.words(2, 5)])
    archive = f"{folder}.tar.gz"
    chore = _Chore(
        "archive",
        f"Pack the folder {folder}/ into a gzip-compressed tar archive {archive} whose members are the {folder}/... paths.",
        files=files,
    )
    chore.steps.append(f"tar -czf {_q(archive)} {_q(folder)}")
    chore.checks.append({"kind": "tar_gz", "path": archive, "members": dict(files)})
    if rng.random() < 0.5:
        chore.text += f" Then delete the folder {folder}/."
        chore.steps.append(f"rm -r {_q(folder)}")
        chore.checks.append(_absent(folder))
    return chore


_COLUMNS = ("quantity", "price", "weight", "minutes", "points", "visits", "stock")


def _csv_total(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    csv = f"{folder}/{names.fresh()}.csv"
    columns = ["name", *rng.sample(_COLUMNS, rng.randint(2, 3))]
    rows = [[names.word(), *(str(rng.randint(1, 999)) for _ in columns[1:])] for _ in range(rng.randint(4, 12))]
    index = rng.randint(1, len(columns) - 1)
    total = sum(int(row[index]) for row in rows)
    steps = []
    if rng.random() < 0.5:
        out_folder = names.fresh()
        out = f"{out_folder}/total.txt"
        where = f"{out}, just the number (the folder {out_folder}/ does not exist yet)"
        steps.append(f"mkdir -p {_q(out_folder)}")
    else:
        out = f"{names.fresh()}.txt"
        where = f"{out}, just the number"
    chore = _Chore(
        "csv_total",
        f"Write the sum of the {columns[index]} column of {csv} (a CSV file with a header line) to {where}.",
        files={csv: _text([",".join(columns)] + [",".join(row) for row in rows])},
    )
    steps.append(f"echo $(( $(tail -n +2 {_q(csv)} | cut -d, -f{index + 1} | paste -sd+ -) )) > {_q(out)}")
    chore.steps = steps
    chore.checks.append(_number(out, total))
    return chore


def _head_tail(rng: random.Random, names: _Names) -> _Chore:
    folder = names.fresh()
    path = f"{folder}/{names.fresh()}.txt"
    out = f"{folder}/{names.fresh()}.txt"
    lines = [f"{i + 1} {names.words(1, 4)}" for i in range(rng.randint(6, 20))]
    n = rng.randint(1, len(lines) - 2)
    first = rng.random() < 0.5
    which = f"{'first' if first else 'last'} {n} lines" if n > 1 else f"{'first' if first else 'last'} line"
    chore = _Chore("head_tail", f"Write the {which} of {path} to {out}.", files={path: _text(lines)})
    chore.steps.append(f"{'head' if first else 'tail'} -n {n} {_q(path)} > {_q(out)}")
    chore.checks.append(_file(out, _text(lines[:n] if first else lines[-n:])))
    return chore


#: Family name -> generator of one chore.
FAMILIES: dict[str, Callable[[random.Random, _Names], _Chore]] = {
    "make_dirs": _make_dirs,
    "write_file": _write_file,
    "move_by_ext": _move_by_ext,
    "rename_ext": _rename_ext,
    "make_executable": _make_executable,
    "set_mode": _set_mode,
    "count": _count,
    "sort_lines": _sort_lines,
    "grep_lines": _grep_lines,
    "replace_word": _replace_word,
    "concat": _concat,
    "delete_ext": _delete_ext,
    "archive": _archive,
    "csv_total": _csv_total,
    "head_tail": _head_tail,
}


def generate_task(rng: random.Random, families: Sequence[str], num_chores: int) -> dict[str, Any]:
    """One task's data: ``num_chores`` chores of distinct families (drawn from ``families``), their
    prompt, initial files and modes, reference commands (``steps``) and checks."""
    if num_chores < 1:
        raise ValueError(f"num_chores must be >= 1, got {num_chores}")
    names = _Names(rng)
    if num_chores <= len(families):
        picked = rng.sample(list(families), num_chores)
    else:  # fewer families than chores: repeat some (fresh names keep the chores apart)
        picked = [rng.choice(families) for _ in range(num_chores)]
    chores = [FAMILIES[family](rng, names) for family in picked]
    if len(chores) == 1:
        prompt = chores[0].text
    else:
        prompt = "Do these chores:\n" + "\n".join(f"{i + 1}. {c.text}" for i, c in enumerate(chores))
    files: dict[str, str] = {}
    modes: dict[str, int] = {}
    for chore in chores:
        files.update(chore.files)
        modes.update(chore.modes)
    return {
        "prompt": prompt,
        "families": picked,
        "files": dict(sorted(files.items())),
        "modes": modes,
        "steps": [step for chore in chores for step in chore.steps],
        "checks": [check for chore in chores for check in chore.checks],
    }


# --- verification (on the host, from the work dir's listing) ------------------------------------------


@dataclass(frozen=True)
class CheckOutcome:
    """One goal check: did it pass, and a short description (why it failed)."""

    passed: bool
    detail: str


def _tar_members(data: bytes) -> dict[str, bytes] | str:
    """{member path: content} of the regular files in a gzip-compressed tar, or why it cannot be
    read: decompressed in memory to a cap, member headers read one by one, each member's real size
    checked against the archive before its bytes are taken, sparse members refused
    (:func:`~tracegym.envs.hostfs.read_tar_gz`); nothing is extracted to disk."""
    return read_tar_gz(data, max_bytes=_MAX_TAR_BYTES)


def _same_text(content: bytes, text: str) -> bool:
    """Equal up to the final newline (``echo`` and ``printf`` without it both count)."""
    return content.rstrip(b"\n") == text.encode().rstrip(b"\n")


def _check(entries: Mapping[str, FileEntry], check: Mapping[str, Any]) -> CheckOutcome:
    kind, path = check["kind"], check["path"]
    entry = entries.get(path)
    if kind == "absent":
        return CheckOutcome(entry is None, f"{path} is absent" if entry is None else f"{path} should not exist")
    if entry is None:
        return CheckOutcome(False, f"{path} is missing")
    if kind == "dir":
        ok = entry.kind == "dir"
        return CheckOutcome(ok, f"{path} is a directory" if ok else f"{path} is a {entry.kind}, not a directory")
    if entry.kind != "file":  # a symlink never counts, wherever it points
        return CheckOutcome(False, f"{path} is a {entry.kind}, not a regular file")
    if kind == "mode":
        ok = entry.mode & check["mask"] == check["mode"]
        wanted = "" if ok else f", expected {check['mode']:03o} in the bits {check['mask']:03o}"
        return CheckOutcome(ok, f"{path} has mode {entry.mode:03o}{wanted}")
    if entry.content is None:
        return CheckOutcome(False, f"{path} is too large to check")
    if kind == "file":
        ok = _same_text(entry.content, check["text"])
        return CheckOutcome(ok, f"{path} has the expected content" if ok else f"{path} has other content")
    if kind == "number":
        ok = entry.content.decode(errors="replace").strip() == str(check["value"])
        return CheckOutcome(ok, f"{path} holds {check['value']}" if ok else f"{path} does not hold just the expected number")
    if kind == "tar_gz":
        members = _tar_members(entry.content)
        if isinstance(members, str):
            return CheckOutcome(False, f"{path} {members}")
        wanted: Mapping[str, str] = check["members"]
        wrong = sorted(name for name, text in wanted.items() if name not in members or not _same_text(members[name], text))
        ok = not wrong
        return CheckOutcome(ok, f"{path} holds the folder" if ok else f"{path} lacks or differs in {', '.join(wrong[:3])}")
    raise ValueError(f"unknown check kind {kind!r}")


def verify_work_dir(entries: Sequence[FileEntry], checks: Sequence[Mapping[str, Any]]) -> list[CheckOutcome]:
    """Each check of a task against a work dir's listing (``Sandbox.list_files``): regular files
    and directories only count as such when they are not symlinks."""
    by_path = {entry.path: entry for entry in entries}
    return [_check(by_path, check) for check in checks]


def _checked_paths(checks: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The files whose content a check reads (the host reads no other)."""
    return frozenset(c["path"] for c in checks if c["kind"] in ("file", "number", "tar_gz"))


def verify_sandbox(sandbox: Sandbox, checks: Sequence[Mapping[str, Any]]) -> list[CheckOutcome]:
    """Check a sandbox's work dir, bounded (:data:`_CHECK_LIMITS`); a work dir past a bound fails
    every check with the bound's name ("the work dir holds more than 5,000 entries"), never raises."""
    wanted = _checked_paths(checks)
    try:
        entries = sandbox.list_files(read_limit=_READ_LIMIT, read=wanted.__contains__, limits=_CHECK_LIMITS)
    except TreeLimitError as exc:
        return _all_failed(checks, exc.reason)
    except OSError as exc:
        return _all_failed(checks, f"the work dir could not be read ({exc.strerror or exc})")
    return verify_work_dir(entries, checks)


def _verify(sandbox: Sandbox, session: ShellSession | None, checks: Sequence[Mapping[str, Any]]) -> list[CheckOutcome]:
    """The end-of-episode check (on its own thread, with its own references: a check that runs
    past its limit finishes on what it started with, whatever the episode did since)."""
    # Stop every process first: a background job must not change files while they are read.
    if session is not None:
        session.close()
    sandbox.kill_all()
    return verify_sandbox(sandbox, checks)


def _all_failed(checks: Sequence[Mapping[str, Any]], reason: str) -> list[CheckOutcome]:
    return [CheckOutcome(False, f"not checked: {reason}") for _ in checks]


async def _off_loop(
    fn: Callable[[], Any], timeout: float, name: str, on_late: Callable[[Any], None] | None = None
) -> Any:
    """Run blocking ``fn`` on a daemon thread of its own, awaiting it at most ``timeout`` seconds
    (asyncio.TimeoutError then; the thread finishes on its own, bounded by what it does, and
    ``on_late`` gets a result that comes after the caller gave up)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)
        elif ok and on_late is not None:
            on_late(value)

    def work() -> None:
        try:
            outcome = (True, fn())
        except BaseException as exc:  # handed to the awaiting episode
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=work, name=f"tracegym-terminal-{name}", daemon=True).start()
    return await asyncio.wait_for(asyncio.shield(future), timeout)


def score(checks: Sequence[Mapping[str, Any]], outcomes: Sequence[CheckOutcome], mode: RewardMode) -> float:
    """The reward of a verified work dir. ``all``: 1 iff every check passed. ``fraction``: the share of
    goal checks passed, or 0 when a guard failed (a file that had to be kept was lost or changed), so
    that neither doing nothing (guards hold from the start) nor wiping the work dir (absent-file goals
    hold then) earns credit."""
    if all(o.passed for o in outcomes):
        return 1.0
    if mode == "all":
        return 0.0
    if any(not o.passed for c, o in zip(checks, outcomes) if c.get("guard")):
        return 0.0
    goals = [o.passed for c, o in zip(checks, outcomes) if not c.get("guard")]
    return sum(goals) / len(goals) if goals else 0.0


# --- options -----------------------------------------------------------------------------------------


def _parse_families(families: Sequence[str] | str | None) -> tuple[str, ...]:
    if families is None:
        return tuple(FAMILIES)
    chosen = [f.strip() for f in families.split(",")] if isinstance(families, str) else list(families)
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown or not chosen:
        raise ValueError(f"unknown task families {unknown or chosen!r}; choose from {', '.join(FAMILIES)}")
    return tuple(dict.fromkeys(chosen))


_PERSISTENT_NOTE = (
    "The shell session persists between calls: the current directory, variables, files and background "
    "processes carry over, so you can work step by step."
)
_STATELESS_NOTE = (
    "Every call starts a fresh shell on a fresh copy of the task's initial files: nothing carries over "
    "between calls, and only what your last call leaves in the work dir is checked. Do the whole task in "
    "one command, joining the steps with &&."
)


def system_prompt(stateless: bool, wall_s: float) -> str:
    """The system prompt of either mode (they differ only in the note on what persists)."""
    return (
        "You do file-system chores in a Linux shell. The `run` tool runs one bash command and returns its "
        "output (stdout and stderr) and its exit status, e.g. run(command=\"mkdir -p out && sort names.txt > "
        f"out/names.txt\"). A command may run for at most {wall_s:g} s. The shell starts in the work dir (also "
        "$HOME); every path in the task is relative to it. Available: bash, coreutils, grep, sed, find, tar, "
        "gzip and python3 (standard library); there is no network. "
        + (_STATELESS_NOTE if stateless else _PERSISTENT_NOTE)
        + " When the work dir is in the requested state, reply with <answer>done</answer>: that ends the "
        "episode and the files are checked."
    )


# --- the env -----------------------------------------------------------------------------------------


class TerminalEnv(ToolEnv):
    """File-system chores in a sandboxed shell, verified on the final state of the work dir."""

    name = "terminal"
    description = "Generated file-system chores in a sandboxed bash shell (persistent or stateless); reward from the final work dir."
    reward_range = (0.0, 1.0)
    default_max_tool_output_chars = 4_000  # a screenful or two: enough for ls/cat of task files

    def __init__(
        self,
        stateless: bool = False,
        isolation: Isolation = "bwrap",
        families: Sequence[str] | str | None = None,
        chores: int | Sequence[int] | str = (1, 2),
        reward: RewardMode = "all",
        wall_s: float = 10.0,
        mem_mb: int = 512,
        disk_mb: int = 64,
        cpu_budget_s: float = 60.0,
        max_turns: int | None = None,
        test_fraction: float = 0.2,
        max_tool_output_chars: int | None = None,
    ) -> None:
        if isolation not in ("bwrap", "unsafe_local"):
            raise ValueError(f"isolation must be 'bwrap' or 'unsafe_local', got {isolation!r}")
        if reward not in ("all", "fraction"):
            raise ValueError(f"reward must be 'all' or 'fraction', got {reward!r}")
        if not 0.0 < wall_s <= MAX_WALL_S:
            raise ValueError(f"wall_s must be in (0, {MAX_WALL_S:g}], got {wall_s}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        if not cpu_budget_s > 0:
            raise ValueError(f"cpu_budget_s must be > 0, got {cpu_budget_s}")
        self.min_chores, self.max_chores = parse_int_range(chores, "chores", 1, 5)
        self.families = _parse_families(families)
        # Fail closed now, not at the first episode: a run configured for isolation must not start
        # (and load a model) on a machine that cannot give it.
        if isolation == "bwrap":
            reason = bwrap_unavailable_reason()
            if reason is not None:
                raise SandboxUnavailable(
                    f"env 'terminal' cannot isolate the agent's shell: {reason}. Install bubblewrap, or set the "
                    "option isolation: unsafe_local to run commands unisolated on a machine you own (never for "
                    "untrusted models)"
                )
        self.stateless = bool(stateless)
        self.isolation: Isolation = isolation
        self.reward_mode: RewardMode = reward
        self.test_fraction = test_fraction
        # cpu_budget_s: every process of the episode together, between calls too (a background
        # burner the agent left running counts).
        self.limits = SandboxLimits(
            wall_s=float(wall_s), cpu_s=max(10, math.ceil(wall_s)), mem_mb=mem_mb, disk_mb=disk_mb,
            cpu_budget_s=float(cpu_budget_s),
        )
        # Up to 3 commands per chore, the answer, and room for a few mistakes.
        super().__init__(
            max_turns=max_turns if max_turns is not None else 4 * self.max_chores + 4,
            max_tool_output_chars=max_tool_output_chars,
        )
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None
        self.session: ShellSession | None = None
        # Every command of an episode runs on this one thread, off the event loop and in order (the
        # sandbox starts its processes from a long-lived thread of its own, so which thread calls
        # the shell does not matter for its lifetime).
        self._worker: ThreadPoolExecutor | None = None
        # Reference commands run so far, in order (the expert's progress): a command counts when it
        # is the next reference command, so other commands in between do not confuse the expert.
        self.expert_progress = 0

    def _begin_episode(self) -> None:
        super()._begin_episode()
        # Reported in every step's info with ToolEnv's counters.
        self.counters.update(command_timeouts=0, shell_restarts=0)

    # -- tasks --

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        low, high = self.min_chores, self.max_chores
        return distinct_tasks(
            split, n, random.Random(f"terminal/{seed}/{','.join(self.families)}/{low}/{high}"),
            lambda rng: self._with_reference_calls(generate_task(rng, self.families, rng.randint(low, high))),
            lambda data: data["prompt"], "term", self.test_fraction,
        )

    def _expert_commands(self, steps: Sequence[str]) -> list[str]:
        return [" && ".join(steps)] if self.stateless else list(steps)

    def _with_reference_calls(self, data: dict[str, Any]) -> dict[str, Any]:
        data["reference_calls"] = [{"name": "run", "arguments": {"command": c}} for c in self._expert_commands(data["steps"])]
        return data

    # -- episodes --

    def _initial_files(self) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
        """(files written with 0o644, {mode: files} written with another mode)."""
        assert self.task is not None
        modes: dict[str, int] = self.task.data.get("modes", {})
        plain = {p: c for p, c in self.task.data["files"].items() if modes.get(p, 0o644) == 0o644}
        special: dict[int, dict[str, str]] = {}
        for path, mode in modes.items():
            if mode != 0o644:
                special.setdefault(mode, {})[path] = self.task.data["files"][path]
        return plain, special

    def _write_initial_files(self, sandbox: Sandbox) -> None:
        plain, special = self._initial_files()
        sandbox.reset_files(plain)
        for mode, files in special.items():
            sandbox.write_files(files, mode=mode)

    async def reset(self, task: Task) -> list[Message]:
        await self._close_sandbox_off_loop()
        self.task = task
        self.expert_progress = 0

        def build() -> Sandbox:
            box = Sandbox(self.limits, isolation=self.isolation)
            try:
                self._write_initial_files(box)
            except BaseException:
                box.close()
                raise
            return box

        # Off the event loop: creating a sandbox mounts, writes files and may sweep what a crashed
        # run left; none of it may stall the other episodes.
        sandbox = await _off_loop(build, _CLOSE_WAIT_S + 20.0, "reset", on_late=lambda box: box.close())
        self.sandbox = sandbox
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracegym-terminal")
        # The session's bash starts lazily, at the first command.
        self.session = None if self.stateless else sandbox.shell()
        return [
            Message(role="system", content=system_prompt(self.stateless, self.limits.wall_s)),
            Message(role="user", content=task.data["prompt"]),
        ]

    @tool(timeout=_TOOL_TIMEOUT_S)
    async def run(self, command: str) -> str:
        """Run a bash command in the work dir and return its output and exit status.

        Args:
            command: A bash command line, e.g. "ls -l" or "mkdir -p out && sort a.txt > out/a.txt".
        """
        if self.sandbox is None or self._worker is None:
            raise RuntimeError("no sandbox: the episode has not started or has ended")
        assert self.task is not None
        reference = self._expert_commands(self.task.data["steps"])
        if self.stateless:  # every call starts over: only a last call that was the reference counts
            self.expert_progress = int(command == reference[0])
        elif self.expert_progress < len(reference) and command == reference[self.expert_progress]:
            self.expert_progress += 1
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._run_command, command)

    def _run_command(self, command: str) -> str:
        """One command in the sandbox (on the episode's worker thread)."""
        assert self.sandbox is not None
        if self.stateless:
            self._write_initial_files(self.sandbox)
            # eval keeps the command's own line numbers in syntax errors; exec merges stderr in order.
            result = self.sandbox.run(["bash", "-c", 'exec 2>&1; eval "$1"', "bash", command])
            note = ""
        else:
            assert self.session is not None
            result = self.session.run(command)
            note = (
                "; the shell was stopped: a new one starts at the next command, on the same files, in the work dir, "
                "without your variables or background processes"
                if result.killed not in (None, "shell_exited", "cpu_budget") else ""
            )
            self.counters["shell_restarts"] = self.session.restarts
        if result.timed_out:
            self.counters["command_timeouts"] += 1
        return _format_output(result) + f"[{result.describe()}{note}]"

    async def on_text(self, message: Message) -> StepResult:
        """Any message without tool calls ends the episode; the work dir decides the reward. The
        check runs on a thread of its own (never on the event loop) and fails, with reward 0 and
        the reason, when it runs past ``_CHECK_TIMEOUT_S``."""
        assert self.task is not None and self.sandbox is not None
        sandbox, session, checks = self.sandbox, self.session, self.task.data["checks"]
        try:
            outcomes = await _off_loop(lambda: _verify(sandbox, session, checks), _CHECK_TIMEOUT_S, "check")
        except asyncio.TimeoutError:
            outcomes = _all_failed(self.task.data["checks"], f"the check ran past its {_CHECK_TIMEOUT_S:g} s limit")
        passed = sum(o.passed for o in outcomes)
        total = len(outcomes)
        solved = passed == total
        reward = score(self.task.data["checks"], outcomes, self.reward_mode)
        return StepResult(
            terminated=True, reward=reward,
            info={
                "success": int(solved), "checks_passed": passed, "checks_total": total,
                "failed_checks": [o.detail for o in outcomes if not o.passed][:5],
            },
        )


    async def step(self, message: Message, parse_errors: Sequence[str] = ()) -> StepResult:
        result = await super().step(message, parse_errors)
        if result.terminated or result.truncated:
            await self._close_sandbox_off_loop()  # verified already (on_text); nothing of the episode is kept
        return result

    def expert_action(self) -> Message:
        if self.task is None:
            raise RuntimeError("expert_action called before reset")
        commands = self._expert_commands(self.task.data["steps"])
        if self.expert_progress < len(commands):
            command = commands[self.expert_progress]
            call = ToolCall(name="run", arguments={"command": command}, id=f"call_{self.expert_progress}")
            return Message(role="assistant", tool_calls=(call,))
        return Message(role="assistant", content="<answer>done</answer>")

    # -- resources --

    def branch_refusal(self) -> str | None:
        return (
            "its state is a live shell session and a work dir on disk inside a sandbox, which a snapshot of "
            "Python data cannot capture or restore"
        )

    def _close_sandbox(self) -> None:
        sandbox, self.sandbox, self.session = self.sandbox, None, None
        worker, self._worker = self._worker, None
        if sandbox is not None:
            sandbox.close()
        if worker is not None:
            worker.shutdown(wait=False)

    async def _close_sandbox_off_loop(self) -> None:
        """:meth:`_close_sandbox` on a thread: killing the processes and removing a hostile work dir
        never stall the event loop; past ``_CLOSE_WAIT_S`` the episode goes on and the close
        finishes in the background (it is bounded)."""
        if self.sandbox is None and self._worker is None:
            return
        sandbox, self.sandbox, self.session = self.sandbox, None, None
        worker, self._worker = self._worker, None

        def close() -> None:
            if sandbox is not None:
                sandbox.close()
            if worker is not None:
                worker.shutdown(wait=False)

        try:
            await _off_loop(close, _CLOSE_WAIT_S, "close")
        except asyncio.TimeoutError:
            pass

    def close(self) -> None:
        """Kill the episode's processes and remove its work dir (idempotent)."""
        self._close_sandbox()


def _format_output(result: SandboxResult) -> str:
    """The command's output with a newline before the status line, and a note when the sandbox
    dropped part of it."""
    text = result.stdout + (result.stderr or "")
    if result.stdout_truncated or result.stderr_truncated:
        text += "\n...[more output was dropped]"
    return text + "\n" if text and not text.endswith("\n") else text


