"""The llguidance backend: GuidedSpec → llguidance grammar, and its LLMatcher.

llguidance computes token masks lazily from a byte-level lexer and an Earley parser, so a
"compile" is cheap: it validates the grammar and builds one template matcher, which each
sequence deep-copies. Its JSON-schema compiler refuses keywords it cannot enforce rather
than ignoring them (see coverage.py for the table).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import llguidance as llg
import torch

from fastdeploy.common.guided_spec import GuidedSpec
from fastdeploy.model_executor.guided_decoding.backend import CompiledGrammar, TokenMatcher, allow_only

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the type stub only

__all__ = ["LLGuidanceBackend", "parse", "refused_keyword"]

# llguidance's own refusals of a schema: (pattern, keyword (None: the captured one), why).
_REFUSALS = (
    (re.compile(r'Unimplemented keys: \["([^"]+)"'), None, ""),
    (re.compile(r"oneOf constraints are not supported"), "oneOf", "branches not provably disjoint"),
    (re.compile(r"min/maxProperties only supported"), "minProperties", "beside optional properties"),
    (re.compile(r"Unknown format"), "format", "unknown format"),
    (re.compile(r"allOf"), "allOf", "branches it cannot intersect"),
)


def refused_keyword(message: str) -> tuple[str, str] | None:
    """(keyword, why) when an llguidance error refuses a schema keyword (not a syntax error)."""
    for pattern, keyword, why in _REFUSALS:
        m = pattern.search(message)
        if m:
            return keyword or m.group(1), why
    return None


def _json_options(spec: GuidedSpec) -> JsonCompileOptions:
    # Overrides win over a schema's own "x-guidance" options, so a schema cannot switch
    # on lenient mode (which ignores keywords) unless the request asked for best effort.
    return {
        "whitespace_flexible": not spec.disable_any_whitespace,
        "item_separator": ",",
        "key_separator": ":",
        "lenient": spec.best_effort,
        "coerce_one_of": spec.best_effort,
    }


def _lark_literal(text: str) -> str:
    # A JSON string literal is a valid Lark string literal (quotes, backslashes, controls escaped).
    return json.dumps(text, ensure_ascii=False)


def grammar_text(spec: GuidedSpec) -> str:
    """The llguidance grammar for `spec`, unchecked. Raises ValueError for a kind or
    syntax llguidance cannot take."""
    kind, value = spec.kind, spec.value
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(value, overrides=_json_options(spec))
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type":"object"}', overrides=_json_options(spec))
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        choices = json.loads(value)
        if not choices:
            raise ValueError("`guided_choice` must not be empty")
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_literal(c) for c in choices))
    if kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return llg.LLMatcher.grammar_from_lark(any_to_lark(value))
        except Exception as e:  # GbnfToLarkError and friends
            raise ValueError(f"EBNF grammar: {e}") from None
    if kind == "structural_tag":
        raise ValueError("structural tags need the xgrammar backend")
    raise ValueError(f"unknown guided decoding kind {kind!r}")


def _first_line(message: str) -> str:
    """llguidance's message without its source excerpt: the first line, plus the "error:" line
    of a regex parse error."""
    lines = [line.strip() for line in message.strip().splitlines()]
    if not lines:
        return "invalid grammar"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{lines[0].rstrip(':')}: {detail[len('error:'):].strip()}" if detail else lines[0]


def parse(spec: GuidedSpec) -> str:
    """The validated grammar text (no tokenizer needed). Raises ValueError with llguidance's message."""
    grammar = grammar_text(spec)
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(_first_line(error))
    return grammar


class _Matcher:
    """llguidance.LLMatcher behind the TokenMatcher interface.

    LLMatcher enters a permanent error state on a rejected token, so tokens are offered
    with try_consume_tokens, which leaves the state alone when it refuses. A stop token is
    not fed to it (a matcher that has nothing left to match refuses it there): it is
    accepted here when the match is complete, and ends the sequence ("terminated").
    """

    def __init__(self, template: llg.LLMatcher, stop_token_ids: list[int]) -> None:
        self._m = template.deep_copy()
        self._stop = frozenset(stop_token_ids)
        self._stop_list = list(stop_token_ids)
        self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            allow_only(bitmask, row, self._stop_list)
            return
        words = bitmask.shape[-1]
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * bitmask.stride(0) * 4, words * 4)
        if self._m.is_error():
            # A parser limit was hit computing the mask: the stop token sampled from this row is
            # then refused by accept(), which fails this request (never a silent, cut-off "stop").
            allow_only(bitmask, row, self._stop_list)

    def accept(self, token_id: int) -> bool:
        if self._terminated or self._m.is_error():
            return False
        if token_id in self._stop:
            self._terminated = self._m.is_accepting()
            return self._terminated
        return self._m.try_consume_tokens([token_id]) == 1

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._terminated:
            self._terminated = False  # the stop token, always the last one, is undone here
            num_tokens -= 1
        if num_tokens > 0 and not self._m.rollback(num_tokens):
            raise ValueError(f"llguidance could not roll back {num_tokens} tokens: {self._m.get_error()}")

    def reset(self) -> None:
        self._m.reset()
        self._terminated = False

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        return not self._terminated and self._m.is_accepting()


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: llg.LLTokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.vocab_size
        self.stop_token_ids: list[int] = list(tokenizer.eos_tokens)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, stop_token_ids: list[int] | None = None,
                       **_ignored) -> LLGuidanceBackend:
        """vocab_size: the model's logits width (default len(tokenizer)); stop_token_ids: tokens
        that end a constrained output (default the tokenizer's eos)."""
        import llguidance.hf

        eos = list(stop_token_ids) if stop_token_ids else tokenizer.eos_token_id
        return cls(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size or len(tokenizer), eos_token=eos))

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        grammar = grammar_text(spec)
        # Builds the lexer and parser tables (drops the GIL); log_level 0: a rejected token
        # is an answer here, not a warning.
        template = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(_first_line(template.get_error()))
        return CompiledGrammar(self, spec, template, len(grammar))

    def matcher(self, compiled: CompiledGrammar) -> _Matcher:
        return _Matcher(compiled.handle, self.stop_token_ids)

    def fill_rows(self, matchers: list[TokenMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        for m, row in zip(matchers, rows, strict=True):
            m.fill_bitmask(bitmask, row)
