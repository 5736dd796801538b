"""``tracegym renderers``: list the chat-template renderers, or check one against a model's own template.

    tracegym renderers                                   # the registered renderers
    tracegym renderers check path/to/model_folder        # the renderer the folder gets, checked
    tracegym renderers check runs/sft/final --renderer hermes
    tracegym renderers check my_model --plugin my_renderer.py --renderer mine

``check`` loads the folder's tokenizer and chat template (a model folder, a saved checkpoint or a
known model name), picks the renderer (``--renderer``, else the one ``tracegym`` would use for that
folder) and runs the conformance suite (``tracegym.render.conformance``): golden ids over built-in
conversations, the extension property, ``continue_prompt``, tool-call round trips, stop tokens.
It prints one PASS/FAIL/SKIP row per check, a FAIL with the first differing token as text, and
exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import os
import sys

from tracegym.commands._config import add_plugin_argument

NAME = "renderers"
HELP = "List chat-template renderers, or check one against a model folder's own chat template."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["list", "check"], default="list", help="what to do (default: list)")
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL_OR_DIR",
                        help="check: a model folder (tokenizer files and a chat template), a checkpoint or a known model name")
    parser.add_argument("--renderer", default=None, help="check: the renderer to check (default: the folder's own)")
    add_plugin_argument(parser)


def _list() -> int:
    from tracegym.render import RENDERERS

    for name, cls in sorted(RENDERERS.items()):
        doc = (cls.__doc__ or "").strip().split("\n")[0]
        print(f"{name:<12} {doc}")
    return 0


def _tokenizer_of(model: str):
    """The tokenizer of a known model, a model or checkpoint folder, or a folder of tokenizer files alone."""
    from tracegym.models import load_tokenizer

    folder = os.path.expanduser(model)
    model_files = ("config.json", "adapter_config.json")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json")
    if os.path.isdir(folder) and not any(os.path.isfile(os.path.join(folder, f)) for f in model_files) \
            and any(os.path.isfile(os.path.join(folder, f)) for f in tokenizer_files):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return load_tokenizer(model)


def _load(model: str, renderer_name: str | None):
    """The renderer to check, bound to the tokenizer of ``model``. Raises UsageError."""
    from tracegym.commands._policy import UsageError
    from tracegym.render import get_renderer

    try:
        tokenizer = _tokenizer_of(model)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{model}: no tokenizer could be loaded: {' '.join(str(exc).split())}") from exc
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        raise UsageError(f"{model}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                         "or chat_template.jinja)")
    try:
        return get_renderer(renderer_name or model, tokenizer)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _check(model: str | None, renderer_name: str | None) -> int:
    from tracegym.render.conformance import format_table, run_conformance, template_knows_tools

    if not model:
        print("usage: tracegym renderers check MODEL_OR_DIR [--renderer NAME] [--plugin FILE]", file=sys.stderr)
        return 2
    renderer = _load(model, renderer_name)
    where = "folder" if os.path.isdir(model) else "model"
    tools = "renders tools" if template_knows_tools(renderer.tokenizer) else "knows no tools (tool parts written as text)"
    print(f"renderer {renderer.name!r} ({type(renderer).__name__}) against the chat template of {where} {model}: "
          f"the template {tools}")
    results = run_conformance(renderer)
    print(format_table(results))
    return 1 if any(r.status == "FAIL" for r in results) else 0


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list()
    return _check(args.model, args.renderer)
