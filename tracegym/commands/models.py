"""``tracegym models``: list the known models and the cache; ``build`` or ``verify`` the SmolLM2 cache."""

from __future__ import annotations

import argparse

NAME = "models"
HELP = "List known models and the model cache; `models build` de-quantises the embedded SmolLM2 once."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        default="list",
        choices=("list", "build", "verify"),
        help="list (default): names, cache folder and state; build: build the SmolLM2 cache now; "
        "verify: re-hash the cached files against the manifest",
    )
    parser.add_argument("--force", action="store_true", help="with build: rebuild even when a trusted cache exists")


def run(args: argparse.Namespace) -> int:
    from tracegym import models

    if args.action == "build":
        import time

        started = time.perf_counter()
        folder = models.build_smollm2_cache(force=args.force)
        status = models.cache_status()
        print(f"{models.DEFAULT_MODEL} cache: {folder} ({status.size_bytes / 2**20:.0f} MiB, "
              f"{time.perf_counter() - started:.1f} s)")
        return 0 if status.built else 1
    if args.action == "verify":
        problem = models.verify_cache()
        print(f"{models.DEFAULT_MODEL} cache {models.model_cache_path()}: {'ok' if problem is None else problem}")
        return 0 if problem is None else 1

    print("Known models:")
    width = max(len(name) for name in models.KNOWN_MODELS)
    for name in models.KNOWN_MODELS:
        print(f"  {name:<{width}}  {models.MODEL_DESCRIPTIONS[name]}")
    print(f"  {'<path>':<{width}}  any local folder in Hugging Face format, or a .gguf file")
    print(f"Cache folder: {models.cache_dir() / 'models'}  (set TRACEGYM_CACHE to move it)")
    status = models.cache_status()
    if status.built:
        state = f"built, {status.size_bytes / 2**20:.0f} MiB, {status.created}"
    elif status.problem == "not built":
        state = "not built (the first load builds it, about 15 s; or run `tracegym models build`)"
    else:
        state = f"not trusted: {status.problem} (the next load rebuilds it)"
    print(f"{models.DEFAULT_MODEL} cache: {state}")
    try:
        print(f"GGUF source: {models.smollm2_gguf_path()}")
    except FileNotFoundError as error:
        print(f"GGUF source: missing ({error})")
    return 0
