"""Incremental detokenization and per-token text for logprobs."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import lru_cache
from typing import cast

from transformers import PreTrainedTokenizerBase


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


class TokenTexts:
    """Text and raw bytes of single tokens, cached, for OpenAI logprob entries."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = cast(str, self.tokenizer.decode([token_id]))  # one sequence of ids: one string
            self._text[token_id] = text
        return text

    def raw_bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            decoder = _byte_decoder()
            if piece is not None and all(ch in decoder for ch in piece):
                raw = [decoder[ch] for ch in piece]
            else:
                raw = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = raw
        return raw


# Text in which each pattern of the wrapper's clean-up of tokenization spaces occurs.
CLEAN_UP_PROBE = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're k"
# How each tokenizer's `decode` is reproduced: "rust", "rust+clean_up" or "wrapper". Decided once
# per tokenizer (a probe costs tens of microseconds, a request's detokenizer is made per choice);
# weak keys, and no value refers back to its tokenizer.
_DECODE_PATHS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, str] = weakref.WeakKeyDictionary()


def _decode_path(tokenizer: PreTrainedTokenizerBase) -> str:
    path = _DECODE_PATHS.get(tokenizer)
    if path is None:
        path = "wrapper"
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            probe = tokenizer.encode(CLEAN_UP_PROBE, add_special_tokens=False)
            expected = tokenizer.decode(probe, skip_special_tokens=True)
            raw = backend.decode(probe, True)
            clean_up = getattr(tokenizer, "clean_up_tokenization", None)
            if raw == expected:
                path = "rust"
            elif clean_up is not None and clean_up(raw) == expected:
                path = "rust+clean_up"
        _DECODE_PATHS[tokenizer] = path
    return path


def fast_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int], bool], str] | None:
    """The Rust tokenizer's own `decode(ids, skip_special_tokens)`, followed by the wrapper's
    clean-up of tokenization spaces where this tokenizer applies it (Llama 3's do; whether a
    BPE vocabulary's clean-up runs depends on the transformers version), where that gives the
    text `tokenizer.decode` gives on a probe that every clean-up pattern changes; else None.
    It skips the Python wrapper's argument conversion: half the cost of a streamed token's two
    decodes. Decided once per tokenizer: set its clean-up flags before its first use."""
    path = _decode_path(tokenizer)
    if path == "wrapper":
        return None
    backend = tokenizer.backend_tokenizer
    if path == "rust":
        return cast(Callable[[list[int], bool], str], backend.decode)
    clean_up = tokenizer.clean_up_tokenization

    def decode_and_clean_up(ids: list[int], skip_special_tokens: bool) -> str:
        return cast(str, clean_up(backend.decode(ids, skip_special_tokens)))

    return decode_and_clean_up


class IncrementalDetokenizer:
    """Decodes a growing token list, emitting only complete characters.

    Decoding a short window (prefix_offset..end) rather than the whole output keeps
    each step O(window) while still letting merges across token boundaries settle.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._fast = fast_decoder(tokenizer)
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids, self.skip_special_tokens)
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full_text[len(prefix_text):]
        return ""
