"""``tracegym report RUN_DIR``: one self-contained HTML page of a run (config, curves, evals, samples).

When RUN_DIR holds ``seed_<N>`` runs (``tracegym rl --seeds``, ``tracegym demo --seeds``), it also
writes ``seed_curves*.png`` there: each training curve as the mean over seeds with a min-max band
(``tracegym.eval.seeds.write_seed_curves``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

NAME = "report"
HELP = "Write RUN_DIR/report.html: config, training curves, evaluations and sample trajectories."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (e.g. runs/demo)")
    parser.add_argument(
        "--tokenizer",
        default="auto",
        help="tokenizer for the token view: a model name or path, 'auto' (the 'model' of RUN_DIR/config.yaml, "
        "if it loads) or 'none' (message text only). Default: auto",
    )
    parser.add_argument("--max-trajectories", type=int, default=12, help="trajectories shown per file (default 12)")
    parser.add_argument("--out", default=None, help="output file (default RUN_DIR/report.html)")


def _model_from_config(run_dir: Path) -> str | None:
    """The model named by the run's config.yaml: ``model: NAME`` or ``model: {name: NAME}``."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return None
    model: Any = config.get("model") if isinstance(config, dict) else None
    if isinstance(model, dict):
        model = model.get("name") or model.get("path") or model.get("name_or_path")
    return model if isinstance(model, str) and model else None


def run(args: argparse.Namespace) -> int:
    from tracegym.eval.report import build_report, decoder_from_tokenizer

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"error: run directory {run_dir} does not exist", file=sys.stderr)
        return 2
    if args.max_trajectories < 0:
        print("error: --max-trajectories must be >= 0", file=sys.stderr)
        return 2

    from tracegym.eval.seeds import write_seed_curves

    for path in write_seed_curves(run_dir):
        print(f"wrote {path}")
    decode = None
    name = args.tokenizer
    if name == "auto":
        name = _model_from_config(run_dir)
    if name and name != "none":
        try:
            from tracegym.models import load_tokenizer

            decode = decoder_from_tokenizer(load_tokenizer(name))
        except Exception as exc:  # any loading failure: the report still works, without tokens
            print(f"warning: tokenizer {name!r} did not load ({type(exc).__name__}: {exc}); showing message text only",
                  file=sys.stderr)
    try:
        path = build_report(run_dir, decode=decode, max_trajectories=args.max_trajectories, out=args.out)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
