"""Benchmark of the search env's corpus and BM25 index at several corpus sizes.

    .venv/bin/python bench/search_index.py                 # 2k, 20k, 100k documents
    .venv/bin/python bench/search_index.py --sizes 2000 20000

Prints one row per size: corpus generation time, index build time (tokenise + BM25), time to load
the saved index from the disk cache, median query latency (top-5 search over entity names and
multi-word queries) and the peak RSS of the process. Each size runs in its own subprocess so the
peak RSS belongs to that size alone. The index cache goes to a temporary folder (deleted after)
unless ``--cache-dir`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def measure(size: int, seed: int, queries: int) -> dict[str, float]:
    """Runs in the child process (TRACEGYM_CACHE already points at the cache folder)."""
    from tracegym.environments import search
    from tracegym.environments.corpus import generate_corpus

    t0 = time.perf_counter()
    corpus = generate_corpus(size, seed)
    generation_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    retriever = search._build_index(corpus)
    build_s = time.perf_counter() - t0

    folder = search.index_dir(seed, size)
    t0 = time.perf_counter()
    search._save_index_atomically(retriever, folder, corpus)
    save_s = time.perf_counter() - t0
    del retriever

    t0 = time.perf_counter()
    loaded = search._load_index(folder, corpus)
    load_s = time.perf_counter() - t0
    assert loaded is not None, "the saved index did not load"
    backend = search.SearchBackend(corpus, loaded, loaded_from_cache=True)

    rng = random.Random(0)
    texts = []
    for entity in rng.sample(corpus.entities, queries):
        texts.append(entity.name)
        texts.append(f"{entity.name.split()[0]} founded river city")
    backend.search(texts[0])  # warm-up
    latencies = []
    hits_at_1 = 0
    for i, text in enumerate(texts):
        t0 = time.perf_counter()
        hits = backend.search(text)
        latencies.append(time.perf_counter() - t0)
        if i % 2 == 0:
            hits_at_1 += int(bool(hits) and hits[0].title == text)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "size": size,
        "generation_s": generation_s,
        "build_s": build_s,
        "save_s": save_s,
        "load_s": load_s,
        "query_ms_median": 1000 * statistics.median(latencies),
        "name_top1": hits_at_1 / queries,
        "peak_rss_mib": peak_kib / 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000, 100000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queries", type=int, default=100, help="entities sampled; 2 queries each")
    parser.add_argument("--cache-dir", default=None, help="keep the indexes here (default: a temp folder)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()

    if args.one is not None:
        print(json.dumps(measure(args.one, args.seed, args.queries)))
        return 0

    rows = []
    with tempfile.TemporaryDirectory(prefix="tg_search_bench_") as tmp:
        env = {**os.environ, "TRACEGYM_CACHE": args.cache_dir or tmp, "OMP_NUM_THREADS": "1"}
        for size in args.sizes:
            out = subprocess.run(
                [sys.executable, __file__, "--one", str(size), "--seed", str(args.seed), "--queries", str(args.queries)],
                env=env, capture_output=True, text=True, check=False,
            )
            if out.returncode != 0:
                print(f"size {size} failed:\n{out.stderr}", file=sys.stderr)
                return 1
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))

    header = f"{'docs':>8} {'generate s':>10} {'build s':>8} {'save s':>7} {'load s':>7} {'query ms (median)':>18} {'name top-1':>10} {'peak RSS MiB':>12}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['size']:>8} {r['generation_s']:>10.2f} {r['build_s']:>8.2f} {r['save_s']:>7.2f} {r['load_s']:>7.2f} "
              f"{r['query_ms_median']:>18.2f} {r['name_top1']:>10.0%} {r['peak_rss_mib']:>12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
