"""``tracegym export``: take a trained model or the training data elsewhere.

``tracegym export --merge SOURCE --out FOLDER``: a trained model as one plain Hugging Face folder.
SOURCE is a run folder (``runs/x``: its ``final/`` is used), a LoRA adapter folder or a model folder
written by tracegym. The adapter is merged into its base model's weights; the folder gets
safetensors weights, a config.json that transformers 4.x and 5 read the same, the tokenizer with the
renderer's tool-aware chat template (``chat_template.jinja``) and ``tracegym.json``. Plain
``transformers`` and vLLM load it with no tracegym installed.

``tracegym export --examples TRAJECTORIES --out FILE.parquet``: the trajectories rendered into
training examples (``input_ids``, ``loss_mask``, ``weights``, ``advantages``, ``logprobs``) in the
Parquet schema of ``tracegym.data.parquet``, for trainers other than tracegym's own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "export"
HELP = ("Write a trained model as a merged Hugging Face folder (--merge), or trajectories as training "
        "examples in Parquet (--examples), for other tools.")

EXAMPLES_HELP = (
    "render the trajectories in TRAJECTORIES into training examples and write them to --out as Parquet. "
    "TRAJECTORIES is a .jsonl or .parquet trajectory file, or a folder: an RL run (its "
    "rollouts/step_*.jsonl, in step order) or a rollout/eval output (its trajectories.jsonl). "
    "Columns: input_ids, loss_mask (1 on generated tokens), weights (1.0 on generated tokens), "
    "advantages (the episode reward, Trajectory.reward, on every generated token: the raw reward, "
    "not a group-normalised advantage, which the trajectories do not record), logprobs (the "
    "engine's, 0.0 where unknown), has_logprobs, source"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="RUN_OR_ADAPTER_DIR", nargs="?", default=None,
                        help="with --merge: a run folder (its final/ is used), a LoRA adapter folder, or a model folder")
    parser.add_argument("--merge", action="store_true",
                        help="merge the LoRA adapter into the base weights and write one model folder")
    parser.add_argument("--examples", metavar="TRAJECTORIES", default=None, help=EXAMPLES_HELP)
    parser.add_argument("--out", required=True, metavar="PATH",
                        help="--merge: the folder to write; --examples: the .parquet file to write "
                             "(neither may exist, unless --force)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="--merge: dtype of the written weights (default float32, as trained here)")
    parser.add_argument("--model", default=None,
                        help="--examples: the model whose tokenizer and renderer build the examples (default: "
                             "the one the trajectories name, else smollm2-135m); only the tokenizer is loaded")
    parser.add_argument("--renderer", default=None, help="--examples: renderer name (default: the model's)")
    parser.add_argument("--force", action="store_true", help="replace --out when it exists")


def _error(message: object) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.merge and args.examples is not None:
        return _error("--merge and --examples are mutually exclusive: export a model or training examples, not both")
    if args.examples is not None:
        if args.source is not None:
            return _error(f"--examples takes the trajectories itself; drop the extra argument {args.source!r}")
        return _export_examples(args)
    if not args.merge:
        return _error("say what to export: --merge (a trained model as one folder) or --examples "
                      "(trajectories as training examples in Parquet); an adapter folder written by "
                      "tracegym is already loadable by peft on its base model (see docs/token-layer.md)")
    if args.source is None:
        return _error("--merge needs the run or adapter folder: tracegym export --merge RUN_OR_ADAPTER_DIR --out FOLDER")
    from tracegym.models import UnknownModelError
    from tracegym.train.checkpoint import export_merged

    try:
        result = export_merged(args.source, args.out, dtype=args.dtype, overwrite=args.force)
    except (FileNotFoundError, FileExistsError, UnknownModelError, ValueError) as exc:
        return _error(exc)
    except RuntimeError as exc:  # the written folder did not reload to the same logits: nothing was kept
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"exported {result['source']} -> {result['out']}")
    print(f"  base model: {result['base_model']}  (adapter merged: {'yes' if result['merged'] else 'no'})")
    print(f"  chat template: renderer {result['renderer']} (tools included)")
    print(f"  reloaded with plain transformers: max |logit diff| {result['max_abs_logit_diff']:.2e}")
    print("  load it with: AutoModelForCausalLM.from_pretrained(FOLDER), AutoTokenizer.from_pretrained(FOLDER)")
    return 0


# --- --examples -------------------------------------------------------------------------------


def trajectory_files(source: str | Path) -> list[Path]:
    """The trajectory files ``--examples`` reads for SOURCE (see ``EXAMPLES_HELP``)."""
    source = Path(source)
    if source.is_file():
        if source.suffix not in (".jsonl", ".parquet"):
            raise ValueError(f"{source} is neither a .jsonl nor a .parquet trajectory file")
        return [source]
    if source.is_dir():
        # rollouts/step_000012.jsonl: zero-padded step numbers, so the name order is the step order
        steps = sorted((source / "rollouts").glob("*.jsonl"))
        if steps:
            return steps
        if (source / "trajectories.jsonl").is_file():
            return [source / "trajectories.jsonl"]
        raise FileNotFoundError(f"{source} has neither rollouts/*.jsonl (an RL run with save_rollouts) "
                                "nor trajectories.jsonl (a rollout or eval output)")
    raise FileNotFoundError(f"no such file or folder: {source}")


def _read_trajectories(files: list[Path], several: bool) -> list:
    from tracegym.trajectory_view import load_records

    trajectories = []
    for path in files:
        if several and path.stat().st_size == 0:
            continue  # an RL step whose file was opened but got no episode yet
        loaded = load_records(path)
        if loaded.kind != "trajectory":
            raise ValueError(f"{path} holds training examples, not trajectories")
        if loaded.skipped_lines:  # torn lines of a crash: dropped, but never silently
            print(f"warning: {path}: skipped {loaded.skipped_lines} unreadable lines", file=sys.stderr)
        trajectories.extend(loaded.records)
    return trajectories


def _export_examples(args: argparse.Namespace) -> int:
    from tracegym.data.parquet import write_examples_parquet
    from tracegym.models import UnknownModelError, load_tokenizer
    from tracegym.render import get_renderer
    from tracegym.trajectory_view import tokenizer_name_from

    out = Path(args.out)
    if out.suffix != ".parquet":
        return _error(f"--out {out} must name a .parquet file")
    if out.is_dir():
        return _error(f"{out} is a folder; --examples writes one .parquet file")
    if out.exists() and not args.force:
        return _error(f"{out} exists; pass --force to replace it")
    try:
        files = trajectory_files(args.examples)
        trajectories = _read_trajectories(files, several=len(files) > 1)
    except (OSError, ValueError) as exc:
        return _error(exc)
    if not trajectories:
        return _error(f"{args.examples} holds no trajectories")

    model = args.model or tokenizer_name_from(trajectories) or "smollm2-135m"
    try:
        renderer = get_renderer(args.renderer or model, load_tokenizer(model))
    except (UnknownModelError, OSError, ValueError) as exc:
        return _error(exc)

    examples = []
    for trajectory in trajectories:
        # The trajectories record no advantage, so the episode reward stands in (see EXAMPLES_HELP).
        examples.extend(renderer.build_examples(trajectory, weight=1.0, advantage=trajectory.reward))
    if not examples:
        return _error(f"the {len(trajectories)} trajectories have no assistant turns: no training examples")
    try:
        written = write_examples_parquet(examples, out)
    except (OSError, ValueError) as exc:
        return _error(exc)
    tokens = sum(len(ex) for ex in examples)
    trained = sum(sum(ex.loss_mask) for ex in examples)
    print(f"wrote {written} examples ({tokens} tokens, {trained} trained) from {len(trajectories)} trajectories "
          f"in {len(files)} file{'s' if len(files) != 1 else ''} -> {out}")
    print(f"  renderer: {type(renderer).__name__} of {model}; advantages: the episode reward")
    print(f"  load it with: datasets.load_dataset('parquet', data_files='{out}', split='train')")
    return 0
