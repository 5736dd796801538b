"""The token layer: chat templates <-> token ids, tool-call parsing, loss masks.

``get_renderer(name, tokenizer)`` returns a ``Renderer`` for a template name ("smollm2", "hermes",
"qwen3", "llama3", "llama3.1", "gemma3", "deepseek_v3", "gpt_oss") or for a model name ("smollm2-135m", "tiny-random" ->
"smollm2"; Qwen3 names -> "qwen3", other Qwen names -> "hermes"; Llama names -> "llama3", a folder
holding Meta's Llama 3.1 template -> "llama3.1"; Gemma 3 names -> "gemma3"; DeepSeek-V3 names, or a
folder whose template writes ``<｜tool▁calls▁begin｜>``, -> "deepseek_v3"; GPT-OSS names -> "gpt_oss",
the harmony format). A plugin adds its own
with ``register_renderer``.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

from tracegym.render.base import (
    UNTRUSTED_CLOSE,
    UNTRUSTED_OPEN,
    UNTRUSTED_TOOL_OUTPUT_MODES,
    BuildStats,
    Renderer,
    UntrustedToolOutput,
)
from tracegym.render.chatml import ChatMLRenderer
from tracegym.render.deepseek_v3 import DeepSeekV3Renderer
from tracegym.render.gemma3 import Gemma3Renderer
from tracegym.render.gpt_oss import GptOssRenderer
from tracegym.render.hermes import HermesRenderer, hermes_chat_template
from tracegym.render.llama3 import Llama3Renderer, llama3_chat_template
from tracegym.render.llama3_1 import Llama31Renderer
from tracegym.render.qwen3 import Qwen3Renderer
from tracegym.render.smollm2 import SmolLM2Renderer

RENDERERS: dict[str, type[Renderer]] = {
    "smollm2": SmolLM2Renderer,
    "hermes": HermesRenderer,
    "qwen3": Qwen3Renderer,
    "llama3": Llama3Renderer,
    "llama3.1": Llama31Renderer,
    "gemma3": Gemma3Renderer,
    "deepseek_v3": DeepSeekV3Renderer,
    "gpt_oss": GptOssRenderer,
}

# Model names (lower case) -> renderer name.
MODEL_RENDERERS: dict[str, str] = {
    "smollm2-135m": "smollm2",
    "tiny-random": "smollm2",
}

# Substrings of a model name or path that pick a renderer when the name is not listed above.
# First match wins: "qwen3" before "qwen".
_FAMILY_HINTS: tuple[tuple[str, str], ...] = (
    ("qwen3", "qwen3"),
    ("qwen", "hermes"),
    ("hermes", "hermes"),
    ("smollm", "smollm2"),
    ("llama-3", "llama3"),
    ("llama3", "llama3"),
    ("gemma-3", "gemma3"),
    ("gemma3", "gemma3"),
    ("deepseek-v3", "deepseek_v3"),
    ("deepseek_v3", "deepseek_v3"),
    ("gpt-oss", "gpt_oss"),
    ("gpt_oss", "gpt_oss"),
)


def register_renderer(name: str, cls: type[Renderer]) -> None:
    """Add a renderer class under ``name`` (third-party chat-template families)."""
    RENDERERS[name] = cls


def _saved_renderer(folder: str) -> str | None:
    """The ``renderer`` recorded in a saved folder's ``tracegym.json`` (None when absent or unreadable);
    ValueError when it names a renderer that is not registered (a plugin's, not loaded)."""
    info_path = os.path.join(folder, "tracegym.json")
    if not os.path.isfile(info_path):
        return None
    try:
        with open(info_path, encoding="utf-8") as f:
            recorded = json.load(f).get("renderer")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(recorded, str):
        return None
    recorded = MODEL_RENDERERS.get(recorded.lower(), recorded)
    if recorded not in RENDERERS:
        raise ValueError(f"{info_path}: key 'renderer' names {recorded!r}, which is not registered (a plugin "
                         f"renderer? load its file with --plugin); known renderers: {', '.join(sorted(RENDERERS))}")
    return recorded


def renderer_name_for(name_or_tokenizer_name: str, tokenizer: Any = None) -> str:
    """Renderer name for a renderer name, a known model name, or a model path."""
    key = name_or_tokenizer_name.strip()
    if key in RENDERERS:
        return key
    lowered = key.lower()
    if lowered in MODEL_RENDERERS:
        return MODEL_RENDERERS[lowered]
    saved = _saved_renderer(key)
    if saved is not None:  # a folder tracegym saved says which renderer it was trained with
        return saved
    template = getattr(tokenizer, "chat_template", None)
    if os.path.isdir(key) and isinstance(template, str) and "<|start_header_id|>" in template \
            and "Environment: ipython" in template:
        return "llama3.1"  # Meta's own Llama 3.1 template, whatever the folder is called
    base = os.path.basename(lowered.rstrip("/"))
    for hint, renderer in _FAMILY_HINTS:
        if hint in base:
            return renderer
    # A local folder of an unknown model: a ChatML template that knows tools is Hermes-style.
    # (Only for folders: a mistyped renderer name is an error, not a silent guess.)
    if os.path.isdir(key) and isinstance(template, str) and "<｜tool▁calls▁begin｜>" in template:
        return "deepseek_v3"
    if os.path.isdir(key) and isinstance(template, str) and "<start_of_turn>" in template:
        return "gemma3"
    if os.path.isdir(key) and isinstance(template, str) and "<|start_header_id|>" in template:
        return "llama3"
    if os.path.isdir(key) and isinstance(template, str) and "<|im_start|>" in template:
        if "<tool_call>" in template:
            return "qwen3" if "</think>" in template else "hermes"
        return "smollm2"
    known = sorted(RENDERERS) + sorted(MODEL_RENDERERS)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"no renderer for {key!r}{hint}; known renderers: {', '.join(sorted(RENDERERS))}")


def get_renderer(
    name_or_tokenizer_name: str, tokenizer: Any, *, untrusted_tool_output: UntrustedToolOutput = "none"
) -> Renderer:
    """A renderer bound to ``tokenizer``, chosen by template name or model name.
    ``untrusted_tool_output``: how tool results are shown (``tracegym.render.base.UntrustedToolOutput``)."""
    cls = RENDERERS[renderer_name_for(name_or_tokenizer_name, tokenizer)]
    if untrusted_tool_output == "none":  # a third-party renderer class need not know the option
        return cls(tokenizer)
    return cls(tokenizer, untrusted_tool_output=untrusted_tool_output)  # type: ignore[call-arg]


__all__ = [
    "BuildStats",
    "ChatMLRenderer",
    "DeepSeekV3Renderer",
    "HermesRenderer",
    "Gemma3Renderer",
    "GptOssRenderer",
    "Llama31Renderer",
    "Llama3Renderer",
    "MODEL_RENDERERS",
    "Qwen3Renderer",
    "RENDERERS",
    "Renderer",
    "SmolLM2Renderer",
    "UNTRUSTED_CLOSE",
    "UNTRUSTED_OPEN",
    "UNTRUSTED_TOOL_OUTPUT_MODES",
    "UntrustedToolOutput",
    "get_renderer",
    "hermes_chat_template",
    "llama3_chat_template",
    "register_renderer",
    "renderer_name_for",
]
