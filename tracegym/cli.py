"""The ``tracegym`` command line. Subcommands live in ``tracegym/commands/``, one module each.

Commands that take an env or a recipe have a repeatable ``--plugin MODULE``: before such a command
runs, the installed ``tracegym.algos`` entry points and the ``--plugin`` modules are imported
(``tracegym.plugins``), so the names they register are known to the command's checks.

Errors are one line on stderr, never a traceback: ``error: ...`` with exit code 2 for usage errors
(bad arguments, an unknown env, model, option or config key) and 1 for other expected failures (a
missing file, a corrupt checkpoint, an engine that cannot start). Anything else is a bug: one line
naming the exception, with the hint to rerun with ``--debug`` (anywhere on the command line, or
``TRACEGYM_DEBUG=1``), which shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import warnings

import tracegym.commands as _commands


def _command_modules() -> list:
    modules = []
    for info in sorted(pkgutil.iter_modules(_commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        modules.append(importlib.import_module(f"tracegym.commands.{info.name}"))
    return modules


def package_version() -> str:
    """The installed distribution's version (the source tree's ``__version__`` when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tracegym")
    except PackageNotFoundError:
        from tracegym import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracegym", description="Train LLM agents in verifiable multi-turn environments.")
    parser.add_argument("--version", action="version", version=f"tracegym {package_version()}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also TRACEGYM_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


# Exception types that mean "the command was used wrongly" (exit code 2), by module: a module that
# was never imported cannot have raised its error, so nothing is imported here to check.
_USAGE_ERRORS = (
    ("tracegym.commands._policy", "UsageError"),
    ("tracegym.config", "ConfigError"),
    ("tracegym.plugins", "PluginError"),
    ("tracegym.models", "UnknownModelError"),
    ("tracegym.envs.registry", "UnknownEnvError"),
    ("tracegym.envs.registry", "EnvOptionError"),
)
# Failures a user can meet without a bug in tracegym (exit code 1, no hint): files, bad data,
# engines and servers, optional dependencies, env checks, bad values.
_EXPECTED_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, ImportError, TimeoutError, AssertionError)
_EXPECTED_RUNTIME_ERRORS = (
    ("tracegym.models", "CacheBuildError"),
    ("tracegym.train.checkpoint", "CorruptCheckpointError"),
    ("tracegym.engines.openai", "OpenAIEngineError"),
    ("tracegym.envs.mcp", "MCPError"),
)


def _loaded_types(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    found = []
    for module_name, attr in names:
        module = sys.modules.get(module_name)
        cls = getattr(module, attr, None) if module is not None else None
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def error_exit_code(exc: BaseException) -> tuple[int, str]:
    """``(exit code, the line to print)`` for an exception that ended a command."""
    if isinstance(exc, _loaded_types(_USAGE_ERRORS)):
        return 2, f"error: {_one_line(exc)}"
    if isinstance(exc, _EXPECTED_ERRORS + _loaded_types(_EXPECTED_RUNTIME_ERRORS)):
        return 1, f"error: {_one_line(exc)}"
    return 1, (
        f"error: unexpected {type(exc).__name__}: {_one_line(exc)} "
        "(a bug in tracegym or a plugin; rerun with --debug for the traceback)"
    )


def hide_dependency_future_warnings() -> None:
    """Hide the ``FutureWarning``s that transformers and peft raise about their own coming API
    changes: a user of the CLI can do nothing about them, and they bury the progress lines.
    Matched by the module the warning is attributed to; tracegym's own warnings and every other
    category still show."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)(\.|$)")
    # peft saving an adapter whose base is a tracegym model name (``smollm2-135m``), not a hub id it
    # could look up: the vocabulary is unchanged (LoRA never resizes it), so the warning says nothing
    warnings.filterwarnings("ignore", message="Could not find a config file in", category=UserWarning,
                            module=r"peft(\.|$)")


def main(argv: list[str] | None = None) -> int:
    from tracegym.memory import limit_malloc_arenas

    limit_malloc_arenas()  # first: before torch starts its threads
    hide_dependency_future_warnings()  # before any command imports transformers
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug anywhere on the line (before or after the subcommand); "--" ends the options.
    head = argv[: argv.index("--")] if "--" in argv else argv
    debug = "--debug" in head or os.environ.get("TRACEGYM_DEBUG", "") not in ("", "0")
    if "--debug" in head:
        argv.remove("--debug")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        if hasattr(args, "plugin"):
            from tracegym.commands._config import load_cli_plugins

            load_cli_plugins(args)
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place a command's error becomes its exit code
        if debug:
            raise
        code, line = error_exit_code(exc)
        print(line, file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
