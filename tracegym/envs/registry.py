"""Environments by name: ``register(name, factory)``, ``make(name, **options)``, ``list_envs()``.

Three sources of names, looked up in this order:

1. ``register(name, factory)`` calls (a class or any callable returning an ``Env``, or a
   ``"module:attribute"`` string imported on first use);
2. the built-in environments, imported lazily by module path so that listing names never imports
   an environment (and a broken one cannot break the others);
3. third-party plugins: installed packages declare an entry point in the group ``"tracegym.envs"``,
   e.g. in their ``pyproject.toml``::

       [project.entry-points."tracegym.envs"]
       mytask = "mypkg.envs:MyTaskEnv"

A plain module that calls ``register`` at import time works too: the commands import it with
``--plugin my_env.py`` or the config key ``plugins:`` (``tracegym.plugins``). Importing it twice
(as a file and as a module) registers the same definition again, which is not an error.

``check_env_options(name, options)`` validates a name and its options from the factory's signature
(unknown or missing options, values that do not match the annotations) without building the env,
so the commands reject a bad config before any model loads.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
from typing import Any, Callable, Mapping, Union

from tracegym.envs.base import Env

__all__ = [
    "BUILTIN_ENVS",
    "ENTRY_POINT_GROUP",
    "EnvLoadError",
    "EnvOptionError",
    "UnknownEnvError",
    "check_env_options",
    "env_factory",
    "list_envs",
    "make",
    "register",
    "unregister",
]

ENTRY_POINT_GROUP = "tracegym.envs"

Factory = Union[Callable[..., Env], str]

# Built-ins by "module:attribute"; nothing is imported until an env is made.
BUILTIN_ENVS: dict[str, str] = {
    "calculator": "tracegym.environments.calculator:CalculatorEnv",
    "calc_proposer": "tracegym.environments.calc_proposer:CalcProposerEnv",
    "calc_relay": "tracegym.environments.calc_relay:CalcRelayEnv",
    "code": "tracegym.environments.code:CodeEnv",
    "frozenlake": "tracegym.environments.gridworld:FrozenLakeEnv",
    "logic_grid": "tracegym.environments.logic_grid:LogicGridEnv",
    "logic_grid_solo": "tracegym.environments.logic_grid:LogicGridSoloEnv",
    "sokoban": "tracegym.environments.gridworld:SokobanEnv",
    "search": "tracegym.environments.search:SearchEnv",
    "service": "tracegym.environments.service:ServiceEnv",
    "terminal": "tracegym.environments.terminal:TerminalEnv",
    "vault": "tracegym.environments.vault:VaultEnv",
    "web": "tracegym.environments.web:WebEnv",
}

_registered: dict[str, Factory] = {}


class UnknownEnvError(ValueError):
    """``make`` got a name nobody registered."""


class EnvLoadError(ImportError):
    """The module behind an env name failed to import (a missing optional dependency, a bug)."""


class EnvOptionError(TypeError, ValueError):
    """Options an env does not take (unknown, missing or of the wrong type). A ``TypeError``, as
    for a bad keyword argument, and a ``ValueError``, as for any bad config value."""


def _same_definition(a: Any, b: Any) -> bool:
    """The same factory, or the same definition imported again (a module imported twice, or as a
    file and as a package module): same qualified name and line, in the same module or file."""
    if a is b or (isinstance(a, str) and a == b):
        return True
    if isinstance(a, str) or isinstance(b, str):
        return False

    def key(f: Any) -> tuple:
        code = getattr(f, "__code__", None)
        return (getattr(f, "__qualname__", None), getattr(code, "co_firstlineno", None), isinstance(f, type))

    if key(a)[0] is None or key(a) != key(b):
        return False
    if getattr(a, "__module__", None) is not None and a.__module__ == getattr(b, "__module__", None):
        return True
    try:
        source = inspect.getsourcefile(a)
        return source is not None and source == inspect.getsourcefile(b)
    except (TypeError, OSError):
        return False


def register(name: str, factory: Factory, *, overwrite: bool = False) -> None:
    """Register ``factory`` (an ``Env`` class, a callable returning an ``Env``, or a
    ``"module:attribute"`` path) under ``name``. Registering another factory under a taken name
    raises unless ``overwrite``; registering the same definition again (a module imported twice)
    replaces it quietly."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"env name must be a non-empty string, got {name!r}")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise TypeError(f"factory for {name!r} must be callable or a 'module:attribute' string, got {factory!r}")
    if name in _registered and not overwrite and not _same_definition(_registered[name], factory):
        raise ValueError(f"env {name!r} is already registered; pass overwrite=True to replace it")
    _registered[name] = factory


def unregister(name: str) -> None:
    """Remove a name added with :func:`register` (built-ins and plugins cannot be removed)."""
    _registered.pop(name, None)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def list_envs() -> list[str]:
    """Every env name known: registered, built-in and installed plugins, sorted."""
    return sorted(set(_registered) | set(BUILTIN_ENVS) | set(_entry_points()))


def _import_path(path: str, name: str) -> Callable[..., Env]:
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise EnvLoadError(f"env {name!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    try:
        obj: Any = module
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise EnvLoadError(f"env {name!r}: module {module_name!r} has no attribute {attribute!r}") from exc
    return obj


def env_factory(name: str) -> Callable[..., Env]:
    """The callable that builds env ``name`` (importing its module if needed)."""
    if name in _registered:
        factory = _registered[name]
        return _import_path(factory, name) if isinstance(factory, str) else factory
    if name in BUILTIN_ENVS:
        return _import_path(BUILTIN_ENVS[name], name)
    entry_points = _entry_points()
    if name in entry_points:
        try:
            return entry_points[name].load()
        except Exception as exc:
            raise EnvLoadError(
                f"env {name!r}: plugin entry point {entry_points[name].value!r} failed to load: {type(exc).__name__}: {exc}"
            ) from exc
    raise UnknownEnvError(unknown_env_message(name))


def unknown_env_message(name: str) -> str:
    """``unknown env 'x'; did you mean 'y'? registered envs: ...`` (and how to add one)."""
    names = list_envs()
    near = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]!r}?" if near else ";"
    return (f"unknown env {name!r}{hint} registered envs: {', '.join(names)} "
            "(add one with --plugin MODULE, the config key plugins:, or the entry-point group tracegym.envs)")


def _allowed_options(factory: Callable[..., Env]) -> list[str] | None:
    """Keyword options ``factory`` accepts, or None when it takes ``**kwargs`` (anything goes)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    names = []
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.append(p.name)
    return names


def _unknown_options_message(name: str, bad: list[str], allowed: list[str]) -> str:
    message = f"env {name!r} has no option {', '.join(repr(b) for b in bad)}"
    near = difflib.get_close_matches(bad[0], allowed, n=1, cutoff=0.6) if len(bad) == 1 else []
    if near:
        message += f" (did you mean {near[0]!r}?)"
    return f"{message}; allowed options: {', '.join(allowed) or 'none'}"


def _option_annotations(factory: Callable[..., Env]) -> dict[str, Any]:
    """Resolved annotations of the factory's parameters ({} when they cannot be resolved)."""
    target = factory.__init__ if isinstance(factory, type) else factory  # type: ignore[misc]
    try:
        return dict(inspect.get_annotations(target, eval_str=True))
    except Exception:  # noqa: BLE001 - unresolvable names: no type checks, names still checked
        return {}


def _type_problem(annotation: Any, value: Any) -> str | None:
    """Why ``value`` does not fit ``annotation`` (pydantic, lax mode), or None (fits, or the
    annotation is not one pydantic can check)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return None
    from pydantic import TypeAdapter, ValidationError

    try:
        adapter = TypeAdapter(annotation)
    except Exception:  # noqa: BLE001 - an arbitrary class, a forward reference: not checked
        return None
    try:
        adapter.validate_python(value)
    except ValidationError as exc:
        return " or ".join(dict.fromkeys(e["msg"] for e in exc.errors()))
    except Exception:  # noqa: BLE001 - a validator that cannot run on this value: leave it to the env
        return None
    return None


def check_env_options(name: str, options: Mapping[str, Any] | None = None) -> None:
    """Check that env ``name`` exists and takes ``options``, without building it.

    Imports the env's module (not the env) and reads its factory's signature: unknown options (with
    the nearest one and the allowed ones), required options left out, and values that do not match
    the parameter's annotation raise ``EnvOptionError``; an unknown name raises ``UnknownEnvError``
    naming the nearest registered one; a module that fails to import raises ``EnvLoadError``.
    Ranges and other checks inside the constructor are still up to ``make``.
    """
    options = dict(options or {})
    bad_keys = [k for k in options if not isinstance(k, str)]
    if bad_keys:
        raise EnvOptionError(f"env {name!r}: option names must be strings, got {bad_keys!r}")
    factory = env_factory(name)
    _memory_config(name, options.pop("memory", None))
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return  # no signature to read: make() will tell
    allowed = _allowed_options(factory)
    if allowed is not None:
        bad = [key for key in options if key not in allowed]
        if bad:
            raise EnvOptionError(_unknown_options_message(name, bad, allowed))
    missing = [
        p.name for p in parameters
        if p.default is inspect.Parameter.empty and p.name not in options
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    if missing:
        raise EnvOptionError(f"env {name!r} needs option {', '.join(repr(m) for m in missing)}")
    annotations = _option_annotations(factory)
    problems = []
    for key, value in options.items():
        if key in annotations:
            problem = _type_problem(annotations[key], value)
            if problem:
                problems.append(f"option {key!r}={value!r}: {problem}")
    if problems:
        raise EnvOptionError(f"env {name!r}: bad value for " + "; ".join(problems))


def make(name: str, **options: Any) -> Env:
    """A fresh instance of env ``name`` built with ``options`` (each call returns a new instance,
    so concurrent episodes never share state)."""
    factory = env_factory(name)
    memory = _memory_config(name, options.pop("memory", None))  # an option every env takes (envs/memory.py)
    allowed = _allowed_options(factory)
    if allowed is not None:
        bad = [key for key in options if key not in allowed]
        if bad:
            raise EnvOptionError(_unknown_options_message(name, bad, allowed))
    try:
        env = factory(**options)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"env {name!r}: {exc}") from exc
    from tracegym.envs.team import TeamEnv

    if not isinstance(env, (Env, TeamEnv)):
        raise TypeError(f"env {name!r}: factory returned {type(env).__name__}, not a tracegym Env or TeamEnv")
    if memory is not None:
        from tracegym.envs.memory import MemoryEnv

        if not isinstance(env, Env):
            raise EnvOptionError(f"env {name!r}: the memory option is for single-agent envs")
        try:
            env = MemoryEnv(env, memory)
        except ValueError as exc:
            raise EnvOptionError(str(exc)) from exc
    return env


def _memory_config(name: str, value: Any) -> Any:
    """The ``memory`` option as a ``MemoryConfig`` (None when absent); one line naming it otherwise."""
    if value is None or value is False:
        return None
    from pydantic import ValidationError

    from tracegym.envs.memory import MemoryConfig

    try:
        return MemoryConfig.model_validate({} if value is True else value)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'memory'}: {e['msg']}" for e in exc.errors())
        raise EnvOptionError(f"env {name!r}: option 'memory': {problems}") from None
