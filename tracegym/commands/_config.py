"""Config loading shared by the config-driven commands (``sft``, ``rl``, ``demo``), and the
``--plugin`` flag of every command that takes an env or a recipe.

Order of a config-driven command: read the raw YAML, import its ``plugins:`` (a ``plugins=[...]``
override replaces them) and the ``--plugin`` modules, then validate the config: names the plugins
register (envs, losses, estimators) are valid there.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

PLUGIN_HELP = ("import a module that registers envs or algorithms before anything else: a module name "
               "(importable from the current directory) or a path to a .py file; repeatable")


def add_plugin_argument(parser: argparse.ArgumentParser) -> None:
    """``--plugin MODULE`` (repeatable) on ``parser``; ``tracegym.cli`` imports them before the command runs."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE", help=PLUGIN_HELP)


def add_config_arguments(
    parser: argparse.ArgumentParser, overrides_help: str, config_help: str = "run config (YAML, see examples/)",
    config_required: bool = True, resume: bool = True,
) -> None:
    """The arguments of a config-driven command: ``--config``, ``KEY=VALUE`` overrides, ``--resume``, ``--print-config``, ``--plugin``."""
    parser.add_argument("--config", "-c", required=config_required, metavar="FILE", help=config_help)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help)
    if resume:
        parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_plugin_argument(parser)


def load_cli_plugins(args: argparse.Namespace) -> None:
    """Import the installed ``tracegym.algos`` entry points and the ``--plugin`` modules of ``args``
    (relative to the current directory). Raises ``tracegym.plugins.PluginError``."""
    from tracegym.plugins import load_entry_points, load_plugins

    load_entry_points()
    load_plugins(getattr(args, "plugin", None) or [])


def check_env_config(name: Any, options: Any, name_key: str = "env.name", options_key: str = "env.options") -> list[str]:
    """Problems (config-error lines naming the keys) of env ``name`` with ``options``; [] when fine.
    Nothing is built: ``tracegym.envs.registry.check_env_options`` reads the factory's signature."""
    from tracegym.envs.registry import EnvOptionError, UnknownEnvError, check_env_options

    if not isinstance(options, Mapping):
        return [f"bad value for '{options_key}': expected a mapping of option names to values, got {options!r}"]
    try:
        check_env_options(name, options)
    except UnknownEnvError as exc:
        return [f"bad value for '{name_key}': {exc}"]
    except EnvOptionError as exc:
        return [f"bad value for '{options_key}': {exc}"]
    except ImportError as exc:  # EnvLoadError: the env's module is broken
        return [f"bad value for '{name_key}': {exc}"]
    return []


def _raw_plugins(cls: type, args: argparse.Namespace) -> list[tuple[str, Path]]:
    """``(plugin, base_dir)`` of the config file's ``plugins:`` (relative to the file's folder), or
    of a ``plugins=[...]`` override (relative to the current directory) when given. Malformed
    input is left to ``load_config`` to report."""
    import yaml

    from tracegym.config import ConfigError, parse_overrides

    found: Any = None
    base = Path.cwd()
    path = getattr(args, "config", None)
    if path and Path(path).is_file():
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except Exception:  # noqa: BLE001 - load_config reports bad YAML with the file name
            raw = None
        if isinstance(raw, dict) and "plugins" in raw:
            found, base = raw["plugins"], Path(path).resolve().parent
    try:
        for key, value, _ in parse_overrides(getattr(args, "overrides", None) or []):
            if key == ("plugins",):
                found, base = value, Path.cwd()
    except ConfigError:
        pass
    if isinstance(found, str):
        found = [found]
    if not isinstance(found, list) or not all(isinstance(item, str) for item in found):
        return []  # validation names the bad value
    return [(item, base) for item in found]


def load_for_command(cls: type, args: argparse.Namespace, check: Callable[[Any], None] | None = None) -> Any | int:
    """``cls`` from ``--config`` + ``KEY=VALUE`` overrides, or an exit code.

    Plugins first: the installed ``tracegym.algos`` entry points, the config's ``plugins:`` (or a
    ``plugins=[...]`` override) and ``--plugin``; the resolved config records all of them (``.py``
    paths made absolute) so that its dump in the run folder reproduces the run.
    A bad config prints every problem (bad key, nearest valid key, allowed values) and gives 2;
    ``--print-config`` prints the resolved config and gives 0. ``check`` may raise ``ConfigError``
    for sections validated outside ``cls`` (e.g. ``policy_loss``, the env and its options).
    """
    import yaml

    from tracegym.config import ConfigError, load_config
    from tracegym.plugins import PluginError, load_entry_points, load_plugins, resolve_plugin

    plugins = _raw_plugins(cls, args) + [(item, Path.cwd()) for item in getattr(args, "plugin", None) or []]
    try:
        load_entry_points()
        for item, base in plugins:
            load_plugins([item], base_dir=base)
    except PluginError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(cls, args.config, args.overrides)
        if check is not None:
            check(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "plugins" in getattr(cls, "model_fields", {}):
        recorded = list(dict.fromkeys(resolve_plugin(item, base) for item, base in plugins))
        cfg = cfg.model_copy(update={"plugins": recorded})
    if getattr(args, "print_config", False):
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    return cfg


def train_from_config(cls: type, args: argparse.Namespace, recipe: str, check: Callable[[Any], None] | None = None) -> Any | int:
    """Run ``recipe`` (``"module:function"``, imported only once the config is valid) on the config
    ``load_for_command`` gives, with ``--resume``: the run's result, or an exit code (2: bad config,
    0: ``--print-config``, 1: a missing or existing path, or a bad value, printed)."""
    cfg = load_for_command(cls, args, check=check)
    if isinstance(cfg, int):
        return cfg
    module, _, name = recipe.partition(":")
    train = getattr(importlib.import_module(module), name)
    try:
        return train(cfg, resume=args.resume)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def print_done(recipe: str, result: Any, keys: tuple[str, ...], digits: int = 3) -> int:
    """The one closing line of a training command: steps, the last logged ``keys``, where things are."""
    last = result.history[-1] if result.history else {}
    shown = ", ".join(f"{k} {last[k]:.{digits}f}" for k in keys if k in last)
    print(f"{recipe} done: {result.step} steps{', ' + shown if shown else ''}; model in {result.final_dir}; "
          f"metrics in {result.run_dir / 'metrics.jsonl'}")
    return 0
