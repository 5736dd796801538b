"""Token ids -> text: the incremental detokenizer that finds stop strings and feeds streaming, and the
text and bytes of single tokens for log-prob entries."""

from __future__ import annotations

import math
from typing import Any

NEG_INF_LOGPROB = -9999.0  # what JSON carries for a token outside the sampling distribution
TOKEN_ID_PREFIX = "token_id:"  # vLLM's token text under ``return_tokens_as_token_ids``


def finite(value: float) -> float:
    """``value``, or ``NEG_INF_LOGPROB`` for -inf (JSON has no infinity)."""
    return value if math.isfinite(value) else NEG_INF_LOGPROB


class Decoder:
    """Incremental detokenizer for one choice (worker thread): text so far, stop strings.

    The text is built from the tokens before any stop-id token; an incomplete UTF-8 sequence at the
    end is held back until its next byte arrives."""

    def __init__(self, tokenizer: Any, stop_ids: frozenset[int], stops: tuple[str, ...],
                 stop_after: tuple[str, ...], need_text: bool):
        self.tokenizer, self.stop_ids, self.stops, self.stop_after = tokenizer, stop_ids, stops, stop_after
        self.need_text = need_text or bool(stops) or bool(stop_after)
        self.tokens: list[int] = []
        self.text = ""
        self.cut_text: str | None = None  # the text before the first stop string, once one is hit
        self._prefix = 0
        self._read = 0
        self._searched = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> bool:
        """Append ``token``; True when a stop string (or ``stop_after`` text) ends the choice."""
        self.tokens.append(token)
        if token in self.stop_ids or not self.need_text or self.cut_text is not None:
            return False
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
        start = self._searched
        self._searched = len(self.text)
        for stop in self.stops:
            # only where the new text could complete a match
            at = self.text.find(stop, max(0, start - len(stop) + 1))
            if at >= 0 and (self.cut_text is None or at < len(self.cut_text)):
                self.cut_text = self.text[:at]
        if self.cut_text is not None:
            return True
        return any(s in self.text[max(0, start - len(s) + 1):] for s in self.stop_after)


def byte_level_table() -> dict[str, int]:
    """The printable-character alphabet byte-level BPE tokenizers write bytes in: printable Latin-1
    bytes stand for themselves, the others are shifted to code points 256 and up, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    table: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


class TokenText:
    """Token id -> (text, UTF-8 bytes) for log-prob entries, cached.

    The bytes come from the byte-level BPE piece when there is one: a token that is half of a
    multi-byte character has no text of its own, but its bytes are exact."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.table = byte_level_table()
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token)
        if hit is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and piece and all(ch in self.table for ch in piece):
                raw = [self.table[ch] for ch in piece]
            else:
                raw = list(text.encode("utf-8"))
            hit = self.cache[token] = (text, raw)
        return hit
