"""``tracegym export --merge SOURCE --out FOLDER``: a trained model as one plain Hugging Face folder.

SOURCE is a run folder (``runs/x``: its ``final/`` is used), a LoRA adapter folder or a model folder
written by tracegym. The adapter is merged into its base model's weights; the folder gets
safetensors weights, a config.json that transformers 4.x and 5 read the same, the tokenizer with the
renderer's tool-aware chat template (``chat_template.jinja``) and ``tracegym.json``. Plain
``transformers`` and vLLM load it with no tracegym installed.
"""

from __future__ import annotations

import argparse
import sys

NAME = "export"
HELP = "Write a trained model (run folder or LoRA adapter) as a merged Hugging Face folder other tools load."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="RUN_OR_ADAPTER_DIR",
                        help="a run folder (its final/ is used), a LoRA adapter folder, or a model folder")
    parser.add_argument("--merge", action="store_true",
                        help="merge the LoRA adapter into the base weights (required: the only export format)")
    parser.add_argument("--out", required=True, metavar="FOLDER", help="the folder to write (must not exist, unless --force)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the written weights (default float32, as trained here)")
    parser.add_argument("--force", action="store_true", help="replace FOLDER when it exists")


def _error(message: object) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if not args.merge:
        return _error("only merged exports exist so far: pass --merge (an adapter folder written by "
                      "tracegym is already loadable by peft on its base model; see docs/token-layer.md)")
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
