"""Never a grammar looser than the schema: the keyword tables, the backend choice and the refusal.

Grammars are judged on whole texts without compiling (tests/guided_decoding/exactness.py):
an instance `jsonschema` calls invalid must be refused by the grammar of every backend the
tables call exact for that schema.
"""

from __future__ import annotations

import json
import random

import pytest

from fastdeploy.common.errors import ParameterError
from fastdeploy.entrypoints.openai.guided_request import guided_spec_from_request
from fastdeploy.model_executor.guided_decoding import (
    GuidedSpec,
    resolve_guided_spec,
    schema_gaps,
)
from tests.guided_decoding.exactness import accepts, audit, schema_validity
from tests.guided_decoding.jsb import JSB_DIR


@pytest.fixture(scope="module")
def llg_tokenizer(backends):
    return backends["llguidance"].tokenizer


def pinned(schema: dict, backend: str) -> GuidedSpec:
    """The spec compiled on `backend` whatever the tables say (to show what it would let through)."""
    return GuidedSpec("json_schema", json.dumps(schema), disable_any_whitespace=False, backend=backend)


# The silent under-constraints of xgrammar: (schema, an invalid instance its grammar admits,
# a valid instance, what `auto` does: a backend name or the keyword of the 400).
KNOWN = {
    "required not in properties": (
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
        {"a": "x"}, {"a": "x", "b": 1}, "llguidance"),
    "oneOf overlapping": (
        {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, 1, 2.5, "oneOf"),
    "allOf with enum": (
        {"allOf": [{"type": "string", "enum": ["a", "b", "c"]}, {"enum": ["b", "c", "d"]}]}, "a", "b", "llguidance"),
    "not": (
        {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, {"a": "x"}, {"a": 1}, "not"),
    "contains": (
        {"type": "array", "items": {"type": "integer"}, "contains": {"type": "integer", "minimum": 5}},
        [1, 2], [1, 7], "contains"),
}


@pytest.mark.parametrize("case", list(KNOWN))
def test_known_under_constraints_are_refused_or_enforced(case, llg_tokenizer):
    schema, invalid, valid, outcome = KNOWN[case]
    assert schema_validity(schema, invalid) is False and schema_validity(schema, valid) is True
    # The gap is real: xgrammar's grammar admits the invalid instance, and the table says so.
    assert accepts(pinned(schema, "xgrammar"), json.dumps(invalid), llg_tokenizer)
    assert schema_gaps(schema, "xgrammar")
    spec = guided_spec_from_request({"guided_json": schema})
    if outcome in ("xgrammar", "llguidance"):
        chosen = resolve_guided_spec(spec, "auto")
        assert chosen.backend == outcome
        assert not accepts(chosen, json.dumps(invalid), llg_tokenizer)
        assert accepts(chosen, json.dumps(valid), llg_tokenizer)
        with pytest.raises(ParameterError, match=f"keyword `{schema_gaps(schema, 'xgrammar')[0].keyword}`"):
            resolve_guided_spec(spec, "xgrammar")
    else:
        with pytest.raises(ParameterError) as e:
            resolve_guided_spec(spec, "auto")
        assert e.value.param == "response_format"
        assert f"keyword `{outcome}` cannot be enforced" in str(e.value)
        assert "xgrammar" in str(e.value) and "llguidance" in str(e.value) and "guided_best_effort" in str(e.value)


def test_best_effort_is_an_explicit_opt_in():
    schema = KNOWN["not"][0]
    with pytest.raises(ParameterError):
        resolve_guided_spec(guided_spec_from_request({"guided_json": schema}), "auto")
    spec = resolve_guided_spec(guided_spec_from_request({"guided_json": schema}, best_effort=True), "auto")
    assert spec.best_effort and spec.backend in ("xgrammar", "llguidance")
    # A schema cannot opt itself in through llguidance's own options.
    sneaky = dict(schema, **{"x-guidance": {"lenient": True}})
    with pytest.raises(ParameterError, match="`not`"):
        resolve_guided_spec(guided_spec_from_request({"guided_json": sneaky}), "llguidance")


# Uses of keywords xgrammar 0.2.8 drops (the tables must list them), with an invalid
# instance its grammar admits.
XGRAMMAR_LOOSE = [
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 5}, 3, "minimum"),
    ({"$ref": "#/$defs/a", "maximum": 5, "$defs": {"a": {"type": "integer"}}}, 9, "maximum"),
    ({"type": "number", "multipleOf": 0.5}, 0.3, "multipleOf"),
    ({"type": "integer", "multipleOf": 5, "minimum": 0}, 7, "multipleOf"),
    ({"type": "integer", "multipleOf": 10, "exclusiveMaximum": 6}, -7, "multipleOf"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "aa", "minLength"),
    ({"type": "string", "format": "hostname", "minLength": 3}, "ab", "minLength"),
    ({"type": "string", "format": "date", "maxLength": 9}, "2020-01-02", "maxLength"),
    ({"type": "integer", "enum": [1, "x"]}, "x", "enum"),
    ({"minimum": 3}, 1, "minimum"),
    ({"required": ["a"]}, {}, "required"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {"a": {}},
      "dependencies": {"a": ["b"]}}, {"a": 1}, "dependencies"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], "uniqueItems"),
    ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, 5, "allOf"),
    ({"type": "object", "properties": {"ab": {"type": "string"}}, "patternProperties": {"^a": {"type": "integer"}}},
     {"ab": "s"}, "patternProperties"),
    ({"type": "object", "properties": {"b": {"type": "integer"}}, "propertyNames": {"pattern": "^a"}}, {"b": 1},
     "propertyNames"),
    ({"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": "#/$defs/a", "maxItems": 1,
      "$defs": {"a": {"type": "array", "items": {"type": "integer"}}}}, [1, 2], "maxItems"),
]


@pytest.mark.parametrize("schema, invalid, keyword", XGRAMMAR_LOOSE)
def test_xgrammar_table_lists_what_xgrammar_drops(schema, invalid, keyword, llg_tokenizer):
    assert schema_validity(schema, invalid) is False
    assert accepts(pinned(schema, "xgrammar"), json.dumps(invalid), llg_tokenizer), "xgrammar now enforces this"
    assert keyword in {g.keyword for g in schema_gaps(schema, "xgrammar")}


# Schemas both tables call exact, with instances on both sides of the line.
EXACT = [
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 9}},
      "required": ["a"], "additionalProperties": False}, [{"a": 1}, {"a": 0}, {"a": 10}, {}, {"a": 1.5}]),
    ({"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 1, "maxItems": 2},
     [["a"], [], ["a", "b", "c"], ["abc"], [1]]),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, [1, None, "1", 1.5]),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "y"}, "n": {"type": "integer"}},
                 "required": ["k", "n"]}]},
     [{"k": "x"}, {"k": "y", "n": 1}, {"k": "z"}, {"k": "y"}]),
    ({"$ref": "#/definitions/p", "definitions": {"p": {"type": "string", "enum": ["r", "g"]}}}, ["r", "b", 1]),
    ({"type": "integer", "multipleOf": 3}, [3, 4, 0]),
    ({"type": ["string", "null"], "minLength": 2}, ["ab", "a", None]),
]


@pytest.mark.parametrize("schema, instances", EXACT)
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_exact_means_every_invalid_instance_is_refused(schema, instances, backend, llg_tokenizer):
    assert schema_gaps(schema, backend) == []
    spec = resolve_guided_spec(guided_spec_from_request({"guided_json": schema}), backend)
    for instance in instances:
        if accepts(spec, json.dumps(instance), llg_tokenizer):
            assert schema_validity(schema, instance), f"{backend} admitted invalid {instance!r}"


# Exact on xgrammar because its strict mode generates only the listed properties, or because
# the schema's draft ignores what xgrammar drops; llguidance refuses some of these keywords.
XGRAMMAR_EXACT = [
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "patternProperties": {"^a": {"type": "integer"}}},
     [{"x": 1}, {"x": "1"}, {"ab": "s"}]),
    ({"type": "object", "properties": {"ab": {"type": "integer"}}, "propertyNames": {"pattern": "^a", "maxLength": 3}},
     [{"ab": 1}, {"b": 1}, {"abcd": 1}]),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["b"],
      "dependencies": {"a": ["b"], "zz": ["q"]}}, [{"a": 1, "b": 2}, {"a": 1}, {"b": 1}]),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "$ref": "#/definitions/a", "maxItems": 1,
      "definitions": {"a": {"type": "array", "items": {"type": "integer"}}}}, [[1, 2], ["x"]]),
    ({"type": "object", "oneOf": [{"properties": {"k": {"const": 1}}, "required": ["k"]},
                                  {"properties": {"k": {"const": 2}, "n": {"type": "string"}},
                                   "required": ["k", "n"]}]},
     [{"k": 1}, {"k": 2, "n": "x"}, {"k": 2}, 1, "s"]),
    ({"oneOf": [{"type": "object", "properties": {"status": {"type": "string", "pattern": "^fail$"}},
                 "required": ["status"]},
                {"type": "object", "properties": {"status": {"type": "string", "pattern": "^error$"},
                                                  "code": {"type": "integer"}}, "required": ["status", "code"]}]},
     [{"status": "fail"}, {"status": "error", "code": 1}, {"status": "error"}, {"status": "ok"}]),
]


@pytest.mark.parametrize("schema, instances", XGRAMMAR_EXACT)
def test_xgrammar_exact_by_strict_mode_or_draft(schema, instances, llg_tokenizer):
    assert schema_gaps(schema, "xgrammar") == []
    spec = resolve_guided_spec(guided_spec_from_request({"guided_json": schema}), "auto")
    assert spec.backend == "xgrammar"
    for instance in instances:
        if accepts(spec, json.dumps(instance), llg_tokenizer):
            assert schema_validity(schema, instance), f"xgrammar admitted invalid {instance!r}"


def test_structural_tag_schemas_are_checked():
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
        {"begin": "<f>", "content": {"type": "json_schema", "json_schema": KNOWN["not"][0]}, "end": "</f>"}]}}
    with pytest.raises(ParameterError, match="`not`") as e:
        resolve_guided_spec(guided_spec_from_request({"structural_tag": tag}), "auto")
    assert e.value.param == "structural_tag"


@pytest.mark.skipif(not JSB_DIR.is_dir(), reason=f"{JSB_DIR} not present")
def test_jsonschemabench_is_enforced_or_refused(llg_tokenizer):
    """Each of the 230 schemas is either given to a backend whose grammar refuses every
    instance `jsonschema` calls invalid, or refused naming a keyword.

    Measured here (xgrammar 0.2.8, llguidance 1.9.1): auto gives 184 to xgrammar and 8 to
    llguidance and refuses 38 (not 15, propertyNames 5, uniqueItems 5, oneOf 4, dependencies 3,
    minProperties 2, contains 2, if 1, patternProperties 1); xgrammar alone refuses 46,
    llguidance alone 48.
    """
    paths = sorted(JSB_DIR.glob("*.json"))
    results = [audit(p, llg_tokenizer) for p in paths]
    under = [(r.name, r.backend, r.invalid_accepted) for r in results if r.invalid_accepted]
    assert not under, f"grammars looser than their schema: {under}"
    refused = [r for r in results if r.backend is None]
    for r in refused:
        assert "cannot be enforced" in r.refusal or "invalid JSON schema" in r.refusal, r.refusal
    picked = {b: sum(r.backend == b for r in results) for b in ("xgrammar", "llguidance")}
    judged = sum(r.judged for r in results)
    over = sum(len(r.valid_rejected) for r in results)
    print(f"\nauto: {picked} refused {len(refused)}; {judged} instances judged, 0 invalid admitted, "
          f"{over} valid refused (stricter than the schema)")
    # auto refuses no more than either backend alone: each schema it refuses, both refuse.
    for r in refused:
        for backend in ("xgrammar", "llguidance"):
            assert audit(JSB_DIR / r.name, llg_tokenizer, backend).backend is None, (r.name, backend)
    assert len(results) == 230 and picked["xgrammar"] >= 180 and len(refused) <= 38


# Patterns with a literal that a JSON string writes escaped: (pattern, text xgrammar's grammar
# admits although it is no JSON string of a matching value, the same value written as JSON).
UNESCAPED_LITERALS = [
    ('^"[a-z]+"$', '""ab""', json.dumps('"ab"')),  # the quote closes the string early: not JSON
    ("^\\x22$", '"""', json.dumps('"')),
    ("^a\\\\b$", '"a\\b"', json.dumps("a\\b")),  # JSON's \b: "a" and a backspace, not a\b
    ("^\\t$", '"\t"', json.dumps("\t")),  # a raw tab: no JSON string
]


@pytest.mark.parametrize(("pattern", "unescaped", "escaped"), UNESCAPED_LITERALS)
def test_a_pattern_literal_that_json_escapes_goes_to_a_backend_that_escapes_it(pattern, unescaped, escaped,
                                                                              llg_tokenizer):
    schema = {"type": "object", "properties": {"q": {"type": "string", "pattern": pattern}}, "required": ["q"]}
    wrap = '{{"q": {}}}'.format
    assert schema_validity(schema, json.loads(wrap(escaped))) is True
    # The gap is real: xgrammar admits the unescaped text and refuses the escaped one.
    assert accepts(pinned(schema, "xgrammar"), wrap(unescaped), llg_tokenizer)
    assert not accepts(pinned(schema, "xgrammar"), wrap(escaped), llg_tokenizer)
    assert [g.keyword for g in schema_gaps(schema, "xgrammar")] == ["pattern"]
    chosen = resolve_guided_spec(guided_spec_from_request({"guided_json": schema}), "auto")
    assert chosen.backend == "llguidance"
    assert accepts(chosen, wrap(escaped), llg_tokenizer)
    assert not accepts(chosen, wrap(unescaped), llg_tokenizer)


@pytest.mark.parametrize("pattern", ["^.{3}$", "^[^x]{2}$", '^[a"]+$', "^[ -~]{1,3}$", "^[a-z\\n]+$", "^\\W$",
                                     "^\\d{3}-\\d{4}$", "^[A-Z]{2}-[0-9]{3}$"])
def test_classes_and_dots_stay_on_xgrammar_which_leaves_the_escaped_characters_out(pattern, llg_tokenizer):
    """Stricter, never looser: xgrammar's classes admit no quote, backslash or control character."""
    schema = {"type": "string", "pattern": pattern}
    assert schema_gaps(schema, "xgrammar") == []
    spec = pinned(schema, "xgrammar")
    for raw in ('"', "\\", "\t", "\x01"):
        assert not any(accepts(spec, '"' + raw * n + '"', llg_tokenizer) for n in (1, 2, 3))


def _number_texts(rng: random.Random) -> list[str]:
    texts = {"0", "-0", "0.0", "1e2", "1E+2", "5e-1", "0.5", "-1.5", "10", "1000000000000000000000"}
    for _ in range(40):
        kind = rng.random()
        if kind < 0.4:
            texts.add(str(rng.randint(-2000, 2000)))
        elif kind < 0.75:
            texts.add(repr(round(rng.uniform(-60, 60), rng.randint(0, 4))))
        else:
            texts.add(f"{rng.randint(-9, 9)}.{rng.randint(0, 999)}e{rng.randint(-3, 3)}")
    return sorted(texts)


def test_numeric_keywords_are_never_looser_on_the_backend_auto_picks(llg_tokenizer):
    """Random combinations of the numeric keywords (fixed seed), each against random numbers:
    what the chosen backend's grammar admits, `jsonschema` accepts (or the schema is refused)."""
    rng = random.Random(0)
    judged = 0
    for _ in range(150):
        schema: dict = {"type": rng.choice(["integer", "number"])}
        for keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            if rng.random() < 0.4:
                bounds = [rng.randint(-50, 50), round(rng.uniform(-10, 10), rng.randint(0, 3))]
                schema[keyword] = rng.choice([1, 2, 3, 5, 10, 0.5, 0.25] if keyword == "multipleOf" else bounds)
        try:
            spec = resolve_guided_spec(guided_spec_from_request({"guided_json": schema}), "auto")
        except ParameterError:
            continue  # refused: an empty range, or no backend enforces it
        for text in _number_texts(rng):
            if accepts(spec, text, llg_tokenizer):
                judged += 1
                assert schema_validity(schema, json.loads(text)) is not False, (spec.backend, schema, text)
    assert judged > 500


# Characters a JSON string writes escaped or as several bytes, beside plain ones.
_STRING_ALPHABET = ["a", "b", "Z", "0", "9", " ", "-", "_", '"', "\\", "\n", "é", "中", "😀", ".", "@"]
_PATTERNS = ["^[a-z]+$", "[0-9]", "^a", "b$", "^.{2,4}$", "^[^0-9]*$", "^(ab|cd)+$", "^\\w+$", "^\\S*$",
             "^[a-z]{2}[0-9]{1,2}$", "x?y*", "^$", "^[\\u00e0-\\u00ff]+$", "^\\d{2,}$", '^"[a-z]*"$', "^a\\\\b$"]
_FORMATS = ["email", "date", "uuid", "ipv4", "date-time", "uri", "hostname", "int32"]


def test_string_keywords_are_never_looser_on_the_backend_auto_picks(llg_tokenizer):
    """Random lengths, patterns and formats (fixed seed) against random strings, written with and
    without `\\u` escapes: what the chosen grammar admits, `jsonschema` accepts."""
    rng = random.Random(2)
    judged = 0
    for _ in range(200):
        schema: dict = {"type": "string"}
        if rng.random() < 0.5:
            schema["minLength"] = rng.randint(0, 4)
        if rng.random() < 0.5:
            schema["maxLength"] = rng.randint(0, 6)
        if rng.random() < 0.4:
            schema["pattern"] = rng.choice(_PATTERNS)
        if rng.random() < 0.2:
            schema["format"] = rng.choice(_FORMATS)
        try:
            spec = resolve_guided_spec(guided_spec_from_request({"guided_json": schema}), "auto")
        except ParameterError:
            continue
        for _ in range(40):
            value = "".join(rng.choice(_STRING_ALPHABET) for _ in range(rng.randint(0, 8)))
            text = json.dumps(value, ensure_ascii=rng.random() < 0.5)
            if accepts(spec, text, llg_tokenizer):
                judged += 1
                assert schema_validity(schema, value) is not False, (spec.backend, schema, text)
    assert judged > 300


def test_array_and_object_keywords_are_never_looser_on_the_backend_auto_picks(llg_tokenizer):
    rng = random.Random(3)
    items = [{"type": "integer"}, {"type": "string"}, {}, {"type": "integer", "minimum": 0}, {"enum": [1, "a", None]}]
    values = [1, -2, "a", None, 3.5, [], {}]
    judged = 0
    for _ in range(200):
        if rng.random() < 0.5:
            schema: dict = {"type": "array"}
            if rng.random() < 0.7:
                schema["items"] = rng.choice(items)
            if rng.random() < 0.3:
                schema["prefixItems"] = [rng.choice(items) for _ in range(rng.randint(1, 2))]
            for keyword, top in (("minItems", 3), ("maxItems", 4)):
                if rng.random() < 0.5:
                    schema[keyword] = rng.randint(0, top)
            instances: list = [[rng.choice(values) for _ in range(rng.randint(0, 5))] for _ in range(30)]
        else:
            schema = {"type": "object"}
            props = {name: rng.choice(items) for name in rng.sample(["a", "b", "c"], rng.randint(0, 3))}
            if props or rng.random() < 0.5:
                schema["properties"] = props
            if props and rng.random() < 0.6:
                schema["required"] = rng.sample(list(props), rng.randint(1, len(props)))
            if rng.random() < 0.5:
                schema["additionalProperties"] = rng.choice([False, True, {"type": "integer"}])
            for keyword in ("minProperties", "maxProperties"):
                if rng.random() < 0.3:
                    schema[keyword] = rng.randint(0, 3)
            instances = [{k: rng.choice(values[:5]) for k in rng.sample(["a", "b", "c", "d"], rng.randint(0, 4))}
                         for _ in range(30)]
        try:
            spec = resolve_guided_spec(guided_spec_from_request({"guided_json": schema}), "auto")
        except ParameterError:
            continue
        for instance in instances:
            for text in (json.dumps(instance), json.dumps(instance, separators=(",", ":"))):
                if accepts(spec, text, llg_tokenizer):
                    judged += 1
                    assert schema_validity(schema, instance) is not False, (spec.backend, schema, text)
    assert judged > 300


@pytest.mark.parametrize(("regex", "matching", "other"), [
    (r"\p{L}{2,4}", ["héé", "中文", "ab"], ["a1", "a", "abcde", "é "]),
    (r"[0-9]+\P{L}", ["12-", "3 "], ["12a", "-"]),
])
def test_a_regex_only_llguidance_reads_goes_to_llguidance_and_holds_exactly(regex, matching, other, llg_tokenizer):
    """xgrammar's regex syntax has no Unicode property classes; llguidance's has them."""
    spec = resolve_guided_spec(guided_spec_from_request({"guided_regex": regex}), "auto")
    assert spec.backend == "llguidance"
    assert all(accepts(spec, text, llg_tokenizer) for text in matching)
    assert not any(accepts(spec, text, llg_tokenizer) for text in other)


def test_a_regex_neither_backend_reads_is_refused_with_xgrammars_reason():
    with pytest.raises(ParameterError, match="Lookbehind") as caught:
        resolve_guided_spec(guided_spec_from_request({"guided_regex": "(?<=a)b"}), "auto")
    assert caught.value.param == "guided_regex"
