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
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from typing import Any, Callable, Union

from tracegym.envs.base import Env

__all__ = [
    "BUILTIN_ENVS",
    "ENTRY_POINT_GROUP",
    "EnvLoadError",
    "UnknownEnvError",
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
    "frozenlake": "tracegym.environments.gridworld:FrozenLakeEnv",
    "sokoban": "tracegym.environments.gridworld:SokobanEnv",
    "search": "tracegym.environments.search:SearchEnv",
    "service": "tracegym.environments.service:ServiceEnv",
}

_registered: dict[str, Factory] = {}


class UnknownEnvError(ValueError):
    """``make`` got a name nobody registered."""


class EnvLoadError(ImportError):
    """The module behind an env name failed to import (a missing optional dependency, a bug)."""


def register(name: str, factory: Factory, *, overwrite: bool = False) -> None:
    """Register ``factory`` (an ``Env`` class, a callable returning an ``Env``, or a
    ``"module:attribute"`` path) under ``name``. Re-registering a name raises unless ``overwrite``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"env name must be a non-empty string, got {name!r}")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise TypeError(f"factory for {name!r} must be callable or a 'module:attribute' string, got {factory!r}")
    if name in _registered and not overwrite:
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
    raise UnknownEnvError(f"unknown env {name!r}; registered envs: {', '.join(list_envs())}")


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


def make(name: str, **options: Any) -> Env:
    """A fresh instance of env ``name`` built with ``options`` (each call returns a new instance,
    so concurrent episodes never share state)."""
    factory = env_factory(name)
    allowed = _allowed_options(factory)
    if allowed is not None:
        bad = [key for key in options if key not in allowed]
        if bad:
            raise TypeError(
                f"env {name!r} has no option {', '.join(repr(b) for b in bad)}; "
                f"allowed options: {', '.join(allowed) or 'none'}"
            )
    try:
        env = factory(**options)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"env {name!r}: {exc}") from exc
    if not isinstance(env, Env):
        raise TypeError(f"env {name!r}: factory returned {type(env).__name__}, not a tracegym Env")
    return env
