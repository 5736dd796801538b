"""User code that adds names to tracegym's registries: plugin modules and installed entry points.

Two ways in:

- ``load_plugins(["my_env", "plugins/my_loss.py"], base_dir)``: the modules a user names with
  ``--plugin MODULE`` or the config key ``plugins:``. An item is a module name (importable from
  ``base_dir`` or the current directory, both put on ``sys.path``) or the path of a ``.py`` file
  (relative to ``base_dir``, e.g. the folder of the config file). Importing the module runs its
  ``tracegym.envs.register(...)`` / ``@POLICY_LOSSES.register(...)`` calls.
- ``load_entry_points()``: every module that installed packages declare in the entry-point group
  ``tracegym.algos`` (``[project.entry-points."tracegym.algos"] myalgos = "mypkg.algos"``). Envs
  have their own group, ``tracegym.envs``, read lazily by name in ``tracegym.envs.registry``.

Loading the same plugin twice is a no-op. Any failure is one ``PluginError`` line naming the
plugin and the cause (file and line where the plugin's own code raised).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

__all__ = [
    "ALGOS_ENTRY_POINT_GROUP",
    "PluginError",
    "is_plugin_path",
    "load_entry_points",
    "load_plugins",
    "resolve_plugin",
]

ALGOS_ENTRY_POINT_GROUP = "tracegym.algos"

_loaded_files: dict[Path, ModuleType] = {}
_loaded_entry_points: dict[tuple[str, str], Any] = {}


class PluginError(ValueError):
    """A plugin module could not be found or imported; the message names it and the cause."""


def is_plugin_path(item: str) -> bool:
    """True when ``item`` names a file (``x.py``, ``dir/x``), False for a module name (``pkg.mod``)."""
    return item.endswith(".py") or "/" in item or os.sep in item


def resolve_plugin(item: str, base_dir: str | Path | None = None) -> str:
    """``item`` as it should be recorded: a file path made absolute against ``base_dir`` (default:
    the current directory), a module name unchanged."""
    if not is_plugin_path(item):
        return item
    path = Path(item).expanduser()
    if not path.is_absolute():
        path = Path(base_dir if base_dir is not None else Path.cwd()) / path
    return str(path.resolve())


def _where(exc: BaseException) -> str:
    """`` (at FILE:LINE)`` of the innermost frame outside the import machinery, or ''."""
    if isinstance(exc, SyntaxError):
        return ""  # its message already names the file and line
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    frames = [f for f in frames if Path(f.filename).resolve() != Path(__file__).resolve()]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}{_where(exc)}"


def _add_to_sys_path(folder: Path) -> None:
    entry = str(folder.resolve())
    if entry not in sys.path:
        sys.path.insert(0, entry)


def _load_file(item: str, path: Path) -> ModuleType:
    path = path.resolve()
    if path in _loaded_files:
        return _loaded_files[path]
    if not path.is_file():
        raise PluginError(f"plugin {item!r}: no such file {path}")
    if path.suffix != ".py":
        raise PluginError(f"plugin {item!r}: {path} is not a .py file")
    # The file's folder goes on sys.path so that it can import its neighbours.
    _add_to_sys_path(path.parent)
    name = path.stem
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) and Path(existing.__file__).resolve() == path:
        _loaded_files[path] = existing  # already imported under its own name
        return existing
    if not name.isidentifier() or existing is not None:  # a name taken by another module: a unique one
        stem = "".join(c if c.isalnum() else "_" for c in path.stem)
        name = f"tracegym_plugin_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin {item!r}: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise PluginError(f"plugin {item!r}: importing {path} failed: {_cause(exc)}") from exc
    _loaded_files[path] = module
    return module


def _load_module(item: str, base_dir: Path) -> ModuleType:
    if not all(part.isidentifier() for part in item.split(".")):
        raise PluginError(f"plugin {item!r}: not a module name (pkg.module) or a .py file path")
    if item in sys.modules:
        return sys.modules[item]
    _add_to_sys_path(Path.cwd())
    _add_to_sys_path(base_dir)
    try:
        return importlib.import_module(item)
    except ModuleNotFoundError as exc:
        if exc.name and (item == exc.name or item.startswith(exc.name + ".")):
            raise PluginError(
                f"plugin {item!r}: no module named {exc.name!r} (looked in {base_dir.resolve()} and on sys.path; "
                "name a file by its path, e.g. my_plugin.py)"
            ) from exc
        raise PluginError(f"plugin {item!r}: importing it failed: {_cause(exc)}") from exc
    except Exception as exc:
        raise PluginError(f"plugin {item!r}: importing it failed: {_cause(exc)}") from exc


def load_plugins(modules: Sequence[str], base_dir: str | Path | None = None) -> list[ModuleType]:
    """Import each plugin of ``modules`` (module names or ``.py`` paths, see the module doc) and
    return the modules, in order. ``base_dir`` (default: the current directory) is where relative
    paths start and is put on ``sys.path`` for module names. Raises ``PluginError``."""
    if isinstance(modules, str):
        modules = [modules]
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    loaded = []
    for item in modules:
        if not isinstance(item, str) or not item.strip():
            raise PluginError(f"plugin {item!r}: expected a module name or a .py file path")
        item = item.strip()
        if is_plugin_path(item):
            loaded.append(_load_file(item, Path(resolve_plugin(item, base))))
        else:
            loaded.append(_load_module(item, base))
    return loaded


def load_entry_points(group: str = ALGOS_ENTRY_POINT_GROUP) -> list[Any]:
    """Import every entry point of ``group`` declared by installed packages (each once per process;
    later calls only import new ones). Returns what the entry points loaded. Raises ``PluginError``."""
    loaded = []
    for ep in importlib.metadata.entry_points(group=group):
        key = (group, f"{ep.name}={ep.value}")
        if key not in _loaded_entry_points:
            try:
                _loaded_entry_points[key] = ep.load()
            except Exception as exc:
                dist = getattr(getattr(ep, "dist", None), "name", None)
                source = f" of package {dist!r}" if dist else ""
                raise PluginError(
                    f"plugin entry point {ep.name!r} = {ep.value!r}{source} (group {group!r}): "
                    f"importing it failed: {_cause(exc)}"
                ) from exc
        loaded.append(_loaded_entry_points[key])
    return loaded
