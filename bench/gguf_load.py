"""The embedded SmolLM2's de-quantisation (the first load's slow step): transformers as it is,
which opens the GGUF file three times and builds gguf's tensor-name map once per module, against
``tracegym.models._gguf_read_once`` (one reader per file, one name map per architecture).

    python bench/gguf_load.py [--repeats 2]

Each row runs in a fresh process (imports outside the timing), the rows alternating, ``--repeats``
times each; the table gives the median, the ratio, each process's peak RSS, and whether the two
rows' weights and vocabularies are identical (a SHA-256 over every tensor and the vocabulary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import contextlib, hashlib, json, resource, sys, time
sys.path.insert(0, {repo!r})
import torch, transformers, gguf  # noqa: F401  imports outside the timing
import tracegym.models as models
if sys.argv[1] == "transformers":
    models._gguf_read_once = contextlib.nullcontext
started = time.perf_counter()
model, tokenizer = models._dequantize_gguf(models.smollm2_gguf_path())
seconds = time.perf_counter() - started
digest = hashlib.sha256()
for key, value in sorted(model.state_dict().items()):
    digest.update(key.encode()); digest.update(value.contiguous().numpy().tobytes())
digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
print(json.dumps({{"s": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "digest": digest.hexdigest()}}))
"""


def run(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO)), mode], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = {"transformers": [], "read once": []}
    for _ in range(args.repeats):
        rows["transformers"].append(run("transformers"))
        rows["read once"].append(run("read_once"))
    base = statistics.median(r["s"] for r in rows["transformers"])
    print(f"{'de-quantisation':<14} {'median s':>9} {'runs s':>14} {'x':>6} {'peak RSS MB':>12}")
    for name, runs in rows.items():
        median = statistics.median(r["s"] for r in runs)
        each = ", ".join(f"{r['s']:.1f}" for r in runs)
        print(f"{name:<14} {median:>9.1f} {each:>14} {base / median:>6.2f} {max(r['rss_mb'] for r in runs):>12.0f}")
    digests = {r["digest"] for runs in rows.values() for r in runs}
    print("identical weights and vocabulary:", "yes" if len(digests) == 1 else f"NO ({len(digests)} digests)")
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
