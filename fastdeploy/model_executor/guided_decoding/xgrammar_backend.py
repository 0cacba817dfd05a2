"""The xgrammar backend: GuidedSpec → xgrammar grammar, and its GrammarMatcher.

JSON schemas compile in xgrammar's strict mode (properties and items the schema does not
list are not generated). Which schema keywords xgrammar enforces is in coverage.py.
"""

from __future__ import annotations

import json
import os
import re
from typing import cast

import torch
import xgrammar as xgr

from fastdeploy.common.guided_spec import GuidedSpec, choice_ebnf
from fastdeploy.model_executor.guided_decoding.backend import CompiledGrammar, TokenMatcher, allow_only

__all__ = ["XGrammarBackend", "clean_error", "json_object_ebnf", "parse", "tokenizer_info_from_hf"]

COMPACT_SEPARATORS = (",", ":")


def clean_error(e: Exception) -> str:
    """xgrammar's C++ errors start with "[hh:mm:ss] /project/cpp/file.cc:123: "; keep the message."""
    msg = str(e).strip()
    msg = re.sub(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", msg)
    msg = msg.replace("Check failed: (error.empty()) is false: ", "")
    return msg.splitlines()[0] if msg else type(e).__name__


def json_object_ebnf(compact: bool) -> str:
    """Any JSON object; `compact`: no whitespace outside strings.

    Written out rather than xgrammar's builtin JSON grammar, which also admits a top-level
    array and always admits whitespace.
    """
    w = "" if compact else " ws"  # unambiguous: whitespace follows a token, never precedes one
    rules = [
        "root ::= object",
        'value ::= object | array | string | number | "true" | "false" | "null"',
        f'object ::= "{{"{w} (member ("," {w} member)*)? "}}"',
        f'member ::= string{w} ":"{w} value{w}',
        f'array ::= "["{w} (value{w} ("," {w} value{w})*)? "]"',
        r'string ::= "\"" char* "\""',
        r'char ::= [^\0-\x1f\"\\] | "\\" ([\"\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])',
        'number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?',
    ]
    if not compact:
        rules.append(r"ws ::= [ \n\t\r]*")
    return "\n".join(rules)


def _schema_options(spec: GuidedSpec) -> dict:
    if spec.disable_any_whitespace:
        return {"any_whitespace": False, "separators": COMPACT_SEPARATORS, "strict_mode": True}
    return {"any_whitespace": True, "strict_mode": True}


def parse(spec: GuidedSpec) -> xgr.Grammar:
    """The uncompiled grammar (no tokenizer; fast: the expensive part of a compile is the
    per-token mask cache). Raises ValueError with xgrammar's message for an invalid spec."""
    try:
        kind, value = spec.kind, spec.value
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(value, **_schema_options(spec))
        if kind == "json_object":
            return xgr.Grammar.from_ebnf(json_object_ebnf(bool(spec.disable_any_whitespace)))
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            choices = json.loads(value)
            if not choices:
                raise ValueError("`guided_choice` must not be empty")
            return xgr.Grammar.from_ebnf(choice_ebnf(choices))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value)
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(value)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError (and subclasses) for every parse error
        raise ValueError(clean_error(e)) from None
    raise ValueError(f"unknown guided decoding kind {kind!r}")


def tokenizer_info_from_hf(tokenizer, vocab_size: int | None = None, stop_token_ids: list[int] | None = None):
    """xgrammar.TokenizerInfo for a HF tokenizer.

    vocab_size: the model's logits width, which may exceed len(tokenizer) (padded embedding
        tables); ids past the tokenizer's are then never allowed. None = len(tokenizer).
    stop_token_ids: tokens that end a constrained output; None = the tokenizer's eos.
    """
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size if vocab_size is not None else len(tokenizer), stop_token_ids=stop_token_ids
    )


class _Matcher:
    """xgrammar.GrammarMatcher behind the TokenMatcher interface."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        # max_rollback_tokens: xgrammar 0.2.8 ignores it (rollback is always unlimited).
        self._m = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_terminated():  # xgrammar raises on a terminated matcher
            allow_only(bitmask, row, list(self._m.stop_token_ids))
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def xgrammar_matcher(self) -> xgr.GrammarMatcher:
        return self._m

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def reset(self) -> None:
        self._m.reset()

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def is_completed(self) -> bool:
        return self._m.is_completed()


class XGrammarBackend:
    """xgrammar's GrammarCompiler for one tokenizer; its own cache is off (the compile
    service caches compiled grammars of both backends)."""

    name = "xgrammar"

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, *, compiler_threads: int | None = None) -> None:
        """compiler_threads: xgrammar's own threads per compile (token-mask precomputation)."""
        self.tokenizer_info = tokenizer_info
        self.vocab_size: int = tokenizer_info.vocab_size
        self.stop_token_ids: list[int] = list(tokenizer_info.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=compiler_threads or min(8, os.cpu_count() or 1), cache_enabled=False
        )
        # One thread: a step's rows in one C++ loop (64 rows of a JSON schema: 0.35 ms against 0.50
        # one call per row on an H100 host); more threads cost more than they saved at these sizes.
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, stop_token_ids: list[int] | None = None,
                       **kwargs) -> XGrammarBackend:
        return cls(tokenizer_info_from_hf(tokenizer, vocab_size, stop_token_ids), **kwargs)

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        try:
            if spec.kind == "json_schema":
                handle = self._compiler.compile_json_schema(spec.value, **_schema_options(spec))
            else:
                handle = self._compiler.compile_grammar(parse(spec))
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(clean_error(e)) from None
        return CompiledGrammar(self, spec, handle, handle.memory_size_bytes)

    def matcher(self, compiled: CompiledGrammar) -> _Matcher:
        return _Matcher(compiled.handle, self.stop_token_ids)

    def fill_rows(self, matchers: list[TokenMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        live, live_rows = [], []
        for m, row in zip(matchers, rows, strict=True):
            if m.is_terminated():
                m.fill_bitmask(bitmask, row)  # its stop tokens only
            else:
                live.append(cast(_Matcher, m).xgrammar_matcher)
                live_rows.append(row)
        if live:
            self._batch.batch_fill_next_token_bitmask(live, bitmask, live_rows)
