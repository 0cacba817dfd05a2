"""Which JSON Schema keywords each grammar backend enforces, and where a schema uses one it does not.

A backend that ignores a keyword compiles a grammar *looser* than the schema: the output
passes the grammar and fails the schema. This module walks a schema (schema_walk.py: every
subschema, local `$ref` targets included) and reports each such use as a `Gap`, per
backend, so the server can pick a backend that enforces the whole schema or refuse it by name.

The tables err on the strict side. A keyword counts as enforced only where tests show
the backend rejecting what the schema rejects (tests/guided_decoding/test_coverage.py);
a backend may be *stricter* than the schema (xgrammar's strict mode forbids unlisted
properties, llguidance fixes the property order), never looser. Keywords outside
`CONSTRAINTS` (title, description, format, vendor extensions ...) only annotate
and are ignored.

Measured on xgrammar 0.2.8 (strict_mode) and llguidance 1.9.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastdeploy.model_executor.guided_decoding.schema_walk import (
    deref,
    disjoint,
    is_remote,
    json_type,
    literal_values,
    types_of,
    walk,
    widen,
)

__all__ = ["BACKEND_NAMES", "CONSTRAINTS", "Gap", "schema_gaps"]

BACKEND_NAMES = ("xgrammar", "llguidance")

# Every keyword of drafts 3 to 2020-12 that constrains an instance. `format` is an
# annotation since 2019-09 (both backends enforce some formats: stricter, never looser).
CONSTRAINTS = frozenset({
    "type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
    "$ref", "$dynamicRef", "$recursiveRef", "disallow", "extends",
    "multipleOf", "divisibleBy", "maximum", "minimum", "exclusiveMaximum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern",
    "items", "prefixItems", "additionalItems", "maxItems", "minItems", "uniqueItems",
    "contains", "minContains", "maxContains", "unevaluatedItems",
    "maxProperties", "minProperties", "required", "properties", "patternProperties",
    "additionalProperties", "dependencies", "dependentRequired", "dependentSchemas",
    "propertyNames", "unevaluatedProperties",
})

# Keywords that apply to one instance type only; the JSON type they belong to.
_TYPE_OF = {
    **dict.fromkeys(("multipleOf", "maximum", "minimum", "exclusiveMaximum", "exclusiveMinimum"), "number"),
    **dict.fromkeys(("maxLength", "minLength", "pattern"), "string"),
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "maxItems", "minItems", "uniqueItems", "contains",
                     "minContains", "maxContains", "unevaluatedItems"), "array"),
    **dict.fromkeys(("maxProperties", "minProperties", "required", "properties", "patternProperties",
                     "additionalProperties", "dependencies", "dependentRequired", "dependentSchemas",
                     "propertyNames", "unevaluatedProperties"), "object"),
}

_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref")


@dataclass(frozen=True)
class Gap:
    """One use of a keyword that a backend would not enforce."""

    keyword: str
    path: str | None  # JSON pointer of the schema object that uses it; "" is the root; None: unknown
    why: str = ""  # the condition that makes this use unenforced, when the keyword is enforced elsewhere

    def __str__(self) -> str:
        where = f"`{self.keyword}`" if self.path is None else f"`{self.keyword}` at {self.path or '/'}"
        return f"{where} ({self.why})" if self.why else where


def _generated_types(doc: Any, branch: Any) -> set[str] | None:
    """The JSON types xgrammar can generate for `branch`, when it tells (None: any)."""
    branch = deref(doc, branch)
    types = types_of(branch)
    if types is None and isinstance(branch, dict) and isinstance(branch.get("properties"), dict):
        return {"object"}
    return types


def _branches_within(doc: Any, node: dict, comb: str, types: set[str]) -> bool:
    branches = [{"$ref": node["$ref"]}] if comb == "$ref" else node.get(comb)
    if not isinstance(branches, list) or not branches:
        return False
    allowed = widen(types)
    for b in branches:
        bt = _generated_types(doc, b)
        if bt is None or not bt <= allowed:
            return False
    return True


def _oneof_is_anyof(doc: Any, branches: list) -> bool:
    """oneOf equals anyOf when no two branches can match the same instance."""
    resolved = [deref(doc, b) for b in branches]
    return all(disjoint(resolved[i], resolved[j]) for i in range(len(resolved)) for j in range(i + 1, len(resolved)))


# -- xgrammar --------------------------------------------------------------------------

# Ignored by xgrammar 0.2.8: the grammar admits what the keyword forbids.
_XGRAMMAR_NEVER = frozenset({
    "not", "if", "then", "else", "contains", "minContains", "maxContains", "unevaluatedItems",
    "unevaluatedProperties", "dependentSchemas", "$dynamicRef", "$recursiveRef", "disallow", "extends",
    "divisibleBy",
})

# In strict mode xgrammar generates the listed properties only (patternProperties add none,
# propertyNames and dependencies are ignored), so these hold when the listed names satisfy them.
_NAME_RULES = ("patternProperties", "propertyNames", "dependencies", "dependentRequired")


def _closed(node: dict) -> bool:
    """xgrammar (strict mode) generates no property that `properties` does not list."""
    return node.get("additionalProperties", False) is False


def _matches(pattern: Any, name: str) -> bool | None:
    try:
        return re.search(pattern, name) is not None
    except (re.error, TypeError):
        return None


def _name_ok(rule: Any, name: str) -> bool:
    """`name` satisfies a propertyNames schema made of the keywords checked here (else False)."""
    if rule is True or rule == {}:
        return True
    if not isinstance(rule, dict) or set(rule) - {"pattern", "minLength", "maxLength", "enum", "const", "type",
                                                     "description", "title"}:
        return False
    return (rule.get("type", "string") == "string"
            and ("pattern" not in rule or _matches(rule["pattern"], name) is True)
            and len(name) >= rule.get("minLength", 0) and len(name) <= rule.get("maxLength", len(name))
            and ("enum" not in rule or name in rule["enum"]) and ("const" not in rule or name == rule["const"]))


def _name_rule_gap(node: dict, keyword: str) -> str | None:
    """Why `keyword` (one of _NAME_RULES) is not enforced here, or None when the listed properties
    satisfy it and nothing else can be generated."""
    listed = node.get("properties")
    listed = listed if isinstance(listed, dict) else {}
    if not _closed(node):
        return "beside additional properties"
    value = node[keyword]
    if keyword == "patternProperties":
        if not isinstance(value, dict):
            return "malformed"
        for pattern in value:
            hits = [_matches(pattern, name) for name in listed]
            if None in hits or any(hits):
                return "a listed property matches the pattern"
        return None
    if keyword == "propertyNames":
        return None if all(_name_ok(value, name) for name in listed) else "a listed name may break it"
    # dependencies / dependentRequired: a listed, optional trigger could appear without its dependants.
    required = node.get("required")
    required = required if isinstance(required, list) else []
    if not isinstance(value, dict):
        return "malformed"
    for trigger, needs in value.items():
        if trigger not in listed:
            continue  # never generated
        if not isinstance(needs, list) or any(n not in required for n in needs):
            return "a listed property's dependants are optional"
    return None


# Characters a JSON string writes escaped. xgrammar puts a `pattern`'s literal characters into
# the string's grammar as they are: a literal quote closes the string early, a backslash starts an
# escape (`a\\b` lets `"a\b"` through: "a" and a backspace), a tab is a raw control character.
# Its character classes and `.` leave these characters out instead (stricter: allowed).
_JSON_ESCAPED = frozenset({ord('"'), ord("\\"), *range(0x20)})
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
# The `format`s xgrammar generates a grammar for; beside one, it drops minLength / maxLength.
_XGRAMMAR_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer",
})


def _pattern_has_escaped_literal(pattern: str) -> bool:
    """Whether `pattern` has a literal character (outside any class) that JSON writes escaped; a
    pattern Python's parser cannot read counts as having one (erring strict)."""
    if '"' not in pattern and "\\" not in pattern and all(ord(c) >= 0x20 for c in pattern):
        return False
    try:
        # ECMA-262 and Python regexes agree on literals and escapes; `re._parser` is the parser
        # `re.compile` itself uses (no public API gives the parsed tree).
        tree = re._parser.parse(pattern)  # type: ignore[attr-defined]
    except (re.error, OverflowError, RecursionError, AttributeError):  # AttributeError: a Python without it
        return True
    stack = [tree]
    while stack:
        for op, arg in stack.pop():
            name = str(op)
            if name == "LITERAL" and arg in _JSON_ESCAPED:
                return True
            if name == "SUBPATTERN":
                stack.append(arg[3])
            elif name == "BRANCH":
                stack.extend(arg[1])
            elif name in _REPEATS:
                stack.append(arg[2])
            elif name in ("ASSERT", "ASSERT_NOT"):
                stack.append(arg[1])
            elif name == "ATOMIC_GROUP":
                stack.append(arg)
            elif name == "GROUPREF_EXISTS":
                stack.extend(branch for branch in arg[1:] if branch is not None)
    return False


def _xgrammar_gaps(doc: Any, node: dict, path: str) -> list[Gap]:
    keys = [k for k in node if k in CONSTRAINTS]
    gaps = [Gap(k, path) for k in keys if k in _XGRAMMAR_NEVER]
    types = types_of({"type": node["type"]}) if "type" in node else None
    if types is None and isinstance(node.get("properties"), dict):
        types = {"object"}  # xgrammar generates an object for `properties` without `type`

    def gap(keyword: str, why: str) -> None:
        if all(g.keyword != keyword for g in gaps):
            gaps.append(Gap(keyword, path, why))

    # Beside a combinator or $ref, xgrammar compiles the combinator alone and drops the rest;
    # a dropped `type` is harmless when every branch admits only types it allows.
    for comb in _COMBINATORS:
        if comb in node:
            for k in keys:
                if k == comb or (k == "type" and types is not None and _branches_within(doc, node, comb, types)):
                    continue
                gap(k, f"beside `{comb}`")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        gap("allOf", "more than one branch")
    if isinstance(node.get("oneOf"), list) and not _oneof_is_anyof(doc, node["oneOf"]):
        gap("oneOf", "branches not provably disjoint")
    if is_remote(node):
        gap("$ref", "not a local reference")
    # Beside enum/const only `type` is kept, and it does not filter the listed values.
    for lit in ("enum", "const"):
        if lit in node:
            for k in keys:
                if k not in ("enum", "const", "type"):
                    gap(k, f"beside `{lit}`")
            values = literal_values(node) or []
            if types is not None and any(not ({json_type(v)} & widen(types)) for v in values):
                gap(lit, "a value outside `type`")
    for k in keys:
        if k in _NAME_RULES:
            why = _name_rule_gap(node, k)
            if why is not None:
                gap(k, why)
    for k in keys:
        owner = _TYPE_OF.get(k)
        if owner is None or k in _XGRAMMAR_NEVER:
            continue
        # A type-specific keyword is dropped when the schema does not say it is of that type
        # (`properties` alone is honoured: it makes xgrammar generate an object).
        admits = {"number", "integer"} if owner == "number" else {owner}
        if k != "properties" and (types is None or not types & admits):
            gap(k, "without a matching `type`")
    if "required" in node:
        required, listed = node["required"], node.get("properties")
        listed = listed if isinstance(listed, dict) else {}
        if not isinstance(required, list) or any(not isinstance(n, str) or n not in listed for n in required):
            gap("required", "names a property that `properties` does not list")
    if "pattern" in node:
        for k in ("minLength", "maxLength"):
            if k in node:
                gap(k, "beside `pattern`")
        if isinstance(node["pattern"], str) and _pattern_has_escaped_literal(node["pattern"]):
            gap("pattern", "a literal quote, backslash or control character (written unescaped)")
    elif node.get("format") in _XGRAMMAR_FORMATS:
        for k in ("minLength", "maxLength"):
            if k in node:
                gap(k, "beside `format`")
    if "multipleOf" in node and (types is None or types - {"integer"} or not isinstance(node["multipleOf"], int)):
        gap("multipleOf", "only integer multiples of an integer type are enforced")
    elif "multipleOf" in node and node["multipleOf"] != 1:
        # With a bound on one side only, xgrammar keeps the range and drops the multiple.
        low = "minimum" in node or "exclusiveMinimum" in node
        high = "maximum" in node or "exclusiveMaximum" in node
        if low != high:
            gap("multipleOf", "beside a range bounded on one side")
    for k in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(k), bool):
            gap(k, "draft-4 boolean form")
    max_items = node.get("maxItems")
    if node.get("uniqueItems") is True and not (isinstance(max_items, int) and max_items <= 1):
        gap("uniqueItems", "")
    if isinstance(node.get("items"), list):
        gap("items", "draft-4 array form")
    return gaps


# -- llguidance ------------------------------------------------------------------------

# Implemented by llguidance's JSON compiler, which refuses (rather than approximates) the
# cases it cannot intersect (allOf), prove disjoint (oneOf) or bound (min/maxProperties):
# those refusals come from llguidance itself, see llguidance_backend.
_LLGUIDANCE_ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
    "multipleOf", "maximum", "minimum", "exclusiveMaximum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern",
    "items", "prefixItems", "additionalItems", "maxItems", "minItems",
    "maxProperties", "minProperties", "required", "properties", "patternProperties", "additionalProperties",
})


def _llguidance_gaps(doc: Any, node: dict, path: str) -> list[Gap]:
    gaps = [Gap(k, path) for k in node if k in CONSTRAINTS and k not in _LLGUIDANCE_ENFORCED]
    if is_remote(node):
        gaps.append(Gap("$ref", path, "not a local reference"))
    return gaps


_RULES: dict[str, Callable[[Any, dict, str], list[Gap]]] = {
    "xgrammar": _xgrammar_gaps,
    "llguidance": _llguidance_gaps,
}


def schema_gaps(schema: Any, backend: str) -> list[Gap]:
    """Every use in `schema` of a keyword `backend` would not enforce, root first.

    `schema` is the parsed JSON schema (dict or bool). Empty list: the backend's grammar
    admits only instances the schema admits.
    """
    rule = _RULES[backend]
    gaps: list[Gap] = []
    for path, node in sorted(walk(schema), key=lambda pn: (pn[0].count("/"), pn[0])):
        gaps.extend(rule(schema, node, path))
    return gaps
