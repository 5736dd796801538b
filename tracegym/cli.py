"""The ``tracegym`` command line. Subcommands live in ``tracegym/commands/``, one module each.

Commands that take an env or a recipe have a repeatable ``--plugin MODULE``: before such a command
runs, the installed ``tracegym.algos`` entry points and the ``--plugin`` modules are imported
(``tracegym.plugins``), so the names they register are known to the command's checks.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import tracegym.commands as _commands


def _command_modules() -> list:
    modules = []
    for info in sorted(pkgutil.iter_modules(_commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        modules.append(importlib.import_module(f"tracegym.commands.{info.name}"))
    return modules


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracegym", description="Train LLM agents in verifiable multi-turn environments.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    if hasattr(args, "plugin"):
        from tracegym.commands._config import load_cli_plugins
        from tracegym.plugins import PluginError

        try:
            load_cli_plugins(args)
        except PluginError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
