"""Walking a JSON schema: every subschema with its JSON pointer, local `$ref` resolution, and
what a subschema says about the JSON types it admits (used by coverage.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

__all__ = ["deref", "disjoint", "is_remote", "json_type", "literal_values", "resolve", "types_of", "walk", "widen"]

# Where subschemas live: {name: schema}, one schema, or [schema, ...].
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
# `propertyNames` is left out: its schema judges names, not generated values (coverage.py checks the names).
_SUB_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
            "unevaluatedItems", "unevaluatedProperties")
_SUB_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def resolve(doc: Any, ref: str) -> tuple[str, Any] | None:
    """A local `$ref` ("#", "#/a/b") → (pointer, schema); None when it is remote or dangling."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    pointer = ref[1:]
    node = doc
    for part in [p for p in pointer.split("/") if p] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return pointer, node


def is_remote(node: dict) -> bool:
    # A dangling local reference is not a gap but an invalid schema, which parsing reports.
    return "$ref" in node and not (isinstance(node["$ref"], str) and node["$ref"].startswith("#"))


def _subschemas(node: dict, path: str) -> Iterator[tuple[str, Any]]:
    for key in _SUB_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                if key == "dependencies" and not isinstance(sub, (dict, bool)):
                    continue  # draft-7 property dependencies: a list of names, not a schema
                yield f"{path}/{key}/{_escape(name)}", sub
    for key in _SUB_ONE:
        value = node.get(key)
        if isinstance(value, (dict, bool)):
            yield f"{path}/{key}", value
    for key in _SUB_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield f"{path}/{key}/{i}", sub


_REF_SIBLINGS_IGNORED = ("draft-03", "draft-04", "draft-06", "draft-07")


def _ignores_ref_siblings(doc: Any) -> bool:
    """Drafts 3 to 7 ignore every keyword beside `$ref`; later drafts apply them too."""
    declared = doc.get("$schema") if isinstance(doc, dict) else None
    return isinstance(declared, str) and any(d in declared for d in _REF_SIBLINGS_IGNORED)


def walk(doc: Any) -> Iterator[tuple[str, dict]]:
    """Every schema object reachable from the root, each once, with its JSON pointer. Under a
    draft that ignores the siblings of `$ref`, such an object is seen as its `$ref` alone."""
    seen: set[str] = set()
    stack: list[tuple[str, Any]] = [("", doc)]
    ref_only = _ignores_ref_siblings(doc)
    while stack:
        path, node = stack.pop()
        if path in seen or not isinstance(node, dict):
            continue
        seen.add(path)
        if ref_only and "$ref" in node:
            node = {"$ref": node["$ref"]}  # definitions beside it are reached through references
        yield path, node
        stack.extend(_subschemas(node, path))
        target = resolve(doc, node["$ref"]) if "$ref" in node else None
        if target is not None:
            stack.append(target)


def types_of(node: Any) -> set[str] | None:
    """The JSON types `node` admits when it says so (type, const, enum); None when it does not."""
    if not isinstance(node, dict):
        return None
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    values = [node["const"]] if "const" in node else node.get("enum")
    if isinstance(values, list):
        return {json_type(v) for v in values}
    return None


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names[type(value)]


def widen(types: set[str]) -> set[str]:
    # An integer is a number: "number" admits every integer.
    return types | {"integer"} if "number" in types else types


def literal_values(node: Any) -> list | None:
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    return node.get("enum") if isinstance(node.get("enum"), list) else None


_LITERAL_PATTERN = re.compile(r"\^([\w\- ]+)\$")


def _discriminator(node: Any) -> list | None:
    """The values a property schema allows when it lists them: const / enum, or a pattern
    that spells one word (`^fail$`)."""
    values = literal_values(node)
    if values is None and isinstance(node, dict) and isinstance(node.get("pattern"), str):
        m = _LITERAL_PATTERN.fullmatch(node["pattern"])
        values = [m.group(1)] if m else None
    return values


def disjoint(a: Any, b: Any) -> bool:
    """Provably no instance matches both `a` and `b`: their types differ, or a property that
    both require allows disjoint values (a discriminator)."""
    ta, tb = types_of(a), types_of(b)
    if ta is not None and tb is not None and not (widen(ta) & widen(tb)):
        return True
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    pa, pb = a.get("properties"), b.get("properties")
    ra, rb = a.get("required"), b.get("required")
    if not (isinstance(pa, dict) and isinstance(pb, dict) and isinstance(ra, list) and isinstance(rb, list)):
        return False
    both = {n for n in ra if isinstance(n, str)} & {n for n in rb if isinstance(n, str)}
    for name in both:
        va, vb = _discriminator(pa.get(name)), _discriminator(pb.get(name))
        if va is not None and vb is not None and not any(x == y and json_type(x) == json_type(y)
                                                         for x in va for y in vb):
            return True
    return False


def deref(doc: Any, node: Any) -> Any:
    """Follow a branch that is only a local `$ref` (bounded, so a cycle ends)."""
    for _ in range(16):
        if not (isinstance(node, dict) and "$ref" in node):
            return node
        target = resolve(doc, node["$ref"])
        if target is None:
            return node
        node = target[1]
    return node
