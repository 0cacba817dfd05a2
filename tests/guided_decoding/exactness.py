"""Is a backend's grammar for a schema ever looser than the schema? Text-level checks, no compile.

`accepts` runs a grammar over a whole text: xgrammar's uncompiled Grammar through its
testing matcher, llguidance's grammar through an LLMatcher fed the text's tokens (it
matches bytes, so any tokenization of the text is judged the same). `audit` takes the
JSONSchemaBench instances of one schema: every instance that `jsonschema` calls invalid
must be refused by the grammar of the backend `auto` picks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema

from fastdeploy.common.errors import ParameterError
from fastdeploy.entrypoints.openai.guided_request import guided_spec_from_request
from fastdeploy.model_executor.guided_decoding import (
    GuidedSpec,
    llguidance_backend,
    resolve_guided_spec,
    xgrammar_backend,
)


def accepts(spec: GuidedSpec, text: str, llg_tokenizer) -> bool:
    """Whether the grammar of `spec` on `spec.backend` admits exactly `text`."""
    if spec.backend == "xgrammar":
        from xgrammar.testing import _is_grammar_accept_string

        return _is_grammar_accept_string(xgrammar_backend.parse(spec), text)
    import llguidance as llg

    matcher = llg.LLMatcher(llg_tokenizer, llguidance_backend.parse(spec), log_level=0)
    tokens = llg_tokenizer.tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def schema_validity(schema: dict, instance) -> bool | None:
    """jsonschema's verdict under the schema's own draft; None when it cannot judge."""
    try:
        cls = jsonschema.validators.validator_for(schema)
        return cls(schema).is_valid(instance)
    except Exception:  # unresolvable $ref, a pattern Python's re rejects, ...
        return None


@dataclass
class Audit:
    name: str
    backend: str | None = None  # what auto picked; None: refused
    refusal: str = ""
    invalid_accepted: list[int] = field(default_factory=list)  # instance indexes: under-constraint
    valid_rejected: list[int] = field(default_factory=list)  # over-constraint (allowed)
    judged: int = 0


def audit(path: Path, llg_tokenizer, setting: str = "auto") -> Audit:
    data = json.loads(path.read_text())
    schema = data["schema"]
    result = Audit(path.name)
    try:
        spec = resolve_guided_spec(guided_spec_from_request({"guided_json": schema}), setting)
    except ParameterError as e:
        result.refusal = str(e)
        return result
    result.backend = spec.backend
    for i, test in enumerate(data["tests"]):
        valid = schema_validity(schema, test["data"])
        if valid is None:
            continue
        result.judged += 1
        ok = accepts(spec, json.dumps(test["data"]), llg_tokenizer)
        if ok and not valid:
            result.invalid_accepted.append(i)
        elif valid and not ok:
            result.valid_rejected.append(i)
    return result
