"""The grading harness of the ``code`` env: runs *inside* the sandbox, and ``encode_value`` on both sides.

The host writes this file into the sandbox as ``harness.py`` next to ``submission.py`` (the
model's code) and ``tests.json`` (the hidden tests' inputs, never their expected outputs), and
runs ``python3 -I harness.py`` with a fresh random nonce on stdin. The harness:

1. keeps a private copy of the stdout pipe and points fds 1 and 2 at ``/dev/null``, so nothing
   the submission prints (a fake result line, megabytes of debug output) reaches the grader;
2. executes ``submission.py`` as module ``submission`` (a ``__main__`` block does not run) and
   looks up the function under test;
3. calls it on each test's inputs (a fresh copy each time) under a per-test timer, and writes one
   line per test, ``<nonce> {"test": i, "status": ..., "value": ...}``, as soon as it has it, so
   a run killed at the wall limit still reports the tests done before;
4. stops at the first test that runs past its time (an endless loop would spend the whole wall
   limit again on every remaining test).

The host keeps only lines carrying the nonce and compares each ``value`` with the expected value
it computed itself: the expected outputs never enter the sandbox, so printing "all tests passed",
exiting with status 0 or forging result lines earns nothing; only correct return values do.

``encode_value`` turns a Python value into a canonical JSON form that keeps the distinctions a
Python test would make (a tuple is not a list, a dict with int keys is not one with str keys); the
host encodes its expected values with the same function. Standard library only, Python 3.11 (the
sandbox's ``/usr/bin/python3``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from typing import Any

#: Keys that mark a tagged JSON object (a value JSON has no plain form for).
TAGS = ("__tuple__", "__set__", "__dict__", "__float__", "__other__")
#: Deepest nesting encoded; deeper (or cyclic) values are reported as unencodable.
MAX_DEPTH = 64
#: Longest result line written per test; a larger return value is reported as ``too_large``.
MAX_RECORD_CHARS = 4000


def _sort_key(encoded: Any) -> str:
    return json.dumps(encoded, sort_keys=True)


def encode_value(value: Any, depth: int = 0) -> Any:
    """``value`` as canonical JSON data: None, bool, int, str and finite floats as themselves,
    lists as lists, dicts with str keys as objects; tuples, sets, other dicts and non-finite floats
    as one-key tagged objects (``{"__tuple__": [...]}``); anything else as ``{"__other__": type}``,
    which equals no expected value. ValueError for nesting deeper than ``MAX_DEPTH``."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels (or cyclic)")
    # Subclasses of str, int and float become the plain type through the base class's own method,
    # never through an override the submission wrote (a __str__ that lies, a __int__ that loops).
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        plain = float.__float__(value)
        return plain if math.isfinite(plain) else {"__float__": repr(plain)}
    if isinstance(value, list):
        return [encode_value(item, depth + 1) for item in value]
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(item, depth + 1) for item in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": sorted((encode_value(item, depth + 1) for item in value), key=_sort_key)}
    if isinstance(value, dict):
        plain = all(type(key) is str for key in value) and not (len(value) == 1 and next(iter(value)) in TAGS)
        if plain:
            return {key: encode_value(item, depth + 1) for key, item in value.items()}
        pairs = [[encode_value(key, depth + 1), encode_value(item, depth + 1)] for key, item in value.items()]
        return {"__dict__": sorted(pairs, key=_sort_key)}
    return {"__other__": type(value).__name__}


class TestTimeout(BaseException):
    """Raised by the per-test timer (a BaseException, so ``except Exception`` in the code under
    test does not swallow it)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise TestTimeout()


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an exception raised by the submission (a SyntaxError's message names
    the line), cut to 300 characters."""
    try:
        text = str(exc)
    except BaseException:  # a broken __str__ of the submission's own exception
        text = ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text[:300]


def _timed(timeout_s: float) -> None:
    signal.setitimer(signal.ITIMER_REAL, timeout_s)


def _untimed() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    nonce = sys.stdin.readline().strip()
    with open("tests.json", encoding="utf-8") as handle:
        config = json.load(handle)
    with open("submission.py", encoding="utf-8", errors="replace") as handle:
        source = handle.read()
    function_name: str = config["function"]
    tests: list[list[Any]] = config["tests"]
    timeout_s = float(config["test_timeout_s"])

    # Results go to a private copy of the pipe; the submission's prints go nowhere.
    results = os.dup(1)
    sink = os.open(os.devnull, os.O_WRONLY)
    os.dup2(sink, 1)
    os.dup2(sink, 2)

    def emit(record: dict[str, Any]) -> None:
        os.write(results, f"{nonce} {json.dumps(record)}\n".encode())

    signal.signal(signal.SIGALRM, _on_alarm)
    namespace: dict[str, Any] = {"__name__": "submission", "__builtins__": __builtins__}
    try:
        _timed(timeout_s)
        exec(compile(source, "submission.py", "exec"), namespace)
        _untimed()
    except TestTimeout:
        emit({"stage": "define", "status": "timeout"})
        return
    except BaseException as exc:  # SystemExit included: exiting early is a failed definition
        _untimed()
        emit({"stage": "define", "status": "error", "error": _describe(exc)})
        return
    function = namespace.get(function_name)
    if function is None or not callable(function):
        emit({"stage": "define", "status": "missing"})
        return
    emit({"stage": "define", "status": "ok"})

    for index, arguments in enumerate(tests):
        fresh = json.loads(json.dumps(arguments))  # the function may mutate its inputs
        try:
            _timed(timeout_s)
            value = function(*fresh)
            line = json.dumps({"test": index, "status": "ok", "value": encode_value(value)})
            _untimed()
        except TestTimeout:
            emit({"test": index, "status": "timeout"})
            break
        except BaseException as exc:
            _untimed()
            emit({"test": index, "status": "error", "error": _describe(exc)})
            continue
        if len(line) > MAX_RECORD_CHARS:
            emit({"test": index, "status": "too_large"})
        else:
            os.write(results, f"{nonce} {line}\n".encode())
    emit({"stage": "end"})


if __name__ == "__main__":
    main()
    # Leave at once: a thread the submission started, or an atexit hook it registered, must not
    # keep the run going until the wall limit once the results are out.
    os._exit(0)
