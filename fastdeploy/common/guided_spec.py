"""What a request constrains its output to: the value the engine, worker and compile service share.

A `GuidedSpec` is a small, hashable, msgpack-able value: the API server builds it, the
engine ships it to the worker, and the compile service uses it as its dedup key.
"""

from __future__ import annotations

import json

import msgspec

__all__ = ["GUIDED_KINDS", "GuidedSpec", "choice_ebnf", "spec_param"]

GUIDED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")



class GuidedSpec(msgspec.Struct, array_like=True, frozen=True):
    """One output constraint.

    kind: one of GUIDED_KINDS.
    value: compact JSON text of the schema ("json_schema"), "" ("json_object"), the regex
        ("regex"), a JSON list of the choice strings ("choice"), EBNF text ("grammar"), or
        the structural tag as JSON in xgrammar's `{"type": "structural_tag", "format": ...}`
        form ("structural_tag"; the legacy structures/triggers form is converted on parse).
    disable_any_whitespace: JSON without whitespace outside strings (json_schema,
        json_object); None until the engine fills in the server's default.
    best_effort: the request accepts a grammar looser than its schema where no backend
        enforces every keyword (otherwise such a schema is refused).
    backend: "xgrammar" or "llguidance"; "" until the engine picks one (select.py).
    """

    kind: str
    value: str
    disable_any_whitespace: bool | None = None
    best_effort: bool = False
    backend: str = ""


def choice_ebnf(choices: list[str]) -> str:
    """EBNF matching exactly one of `choices`. JSON string literals are valid EBNF literals,
    which escapes quotes, backslashes and control characters without regex pitfalls."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def spec_param(spec: GuidedSpec) -> str:
    """The request field an error about `spec` should name."""
    return {
        "json_schema": "response_format",
        "json_object": "response_format",
        "regex": "guided_regex",
        "choice": "guided_choice",
        "grammar": "guided_grammar",
        "structural_tag": "structural_tag",
    }.get(spec.kind, "response_format")
