"""Parsing guided-decoding request fields into a GuidedSpec, and validating it."""

from __future__ import annotations

import json

import msgspec
import pytest

from fastdeploy.common.errors import ParameterError
from fastdeploy.entrypoints.openai.guided_request import guided_spec_from_request
from fastdeploy.model_executor.guided_decoding import GuidedSpec, validate_guided_spec

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
NEW_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<f>"],
        "tags": [{"begin": "<f>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</f>"}],
    },
}
LEGACY_TAG = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}


@pytest.mark.parametrize(
    "body, kind",
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True}}}, "json_object"),
        ({"response_format": dict(NEW_TAG)}, "structural_tag"),
        ({"guided_json": SCHEMA}, "json_schema"),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema"),
        ({"guided_regex": r"\d{3}-[a-z]+"}, "regex"),
        ({"guided_choice": ["yes", "no"]}, "choice"),
        ({"guided_grammar": 'root ::= "a" | "b"'}, "grammar"),
        ({"structural_tag": NEW_TAG}, "structural_tag"),
        ({"structural_tag": json.dumps(NEW_TAG)}, "structural_tag"),
        ({"structural_tag": LEGACY_TAG}, "structural_tag"),
    ],
)
def test_every_form_parses_and_validates(body, kind):
    spec = guided_spec_from_request(body)
    assert spec is not None and spec.kind == kind
    validate_guided_spec(spec)
    # Travels engine -> worker as msgpack.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=GuidedSpec) == spec


def test_no_constraint():
    assert guided_spec_from_request({}) is None
    assert guided_spec_from_request({"response_format": {"type": "text"}, "guided_json": None}) is None
    # "text" is not a second form.
    assert guided_spec_from_request({"response_format": {"type": "text"}, "guided_regex": "a+"}).kind == "regex"


def test_schema_keeps_property_order_and_is_compact():
    spec = guided_spec_from_request({"guided_json": SCHEMA})
    assert spec.value == json.dumps(SCHEMA, separators=(",", ":"))
    # Same schema, same spec: the compile cache / dedup key.
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    assert guided_spec_from_request(body) == spec
    assert hash(spec) == hash(GuidedSpec("json_schema", spec.value))


def test_legacy_structural_tag_is_converted():
    spec = guided_spec_from_request({"structural_tag": LEGACY_TAG})
    assert "format" in json.loads(spec.value)


def _err(body) -> ParameterError:
    with pytest.raises(ParameterError) as ei:
        spec = guided_spec_from_request(body)
        validate_guided_spec(spec)
    return ei.value


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_grammar": "root ::= x", "structural_tag": NEW_TAG}, "structural_tag"),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1, 2]}, "guided_json"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_grammar": {"root": "x"}}, "guided_grammar"),
        ({"structural_tag": 7}, "structural_tag"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"strict": "yes", "schema": {}}}},
         "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 1}}},
         "response_format.json_schema.schema"),
    ],
)
def test_shape_errors_name_the_field(body, param):
    assert _err(body).param == param


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"guided_json": {"type": "foo"}}, "response_format", "Unsupported type"),
        ({"guided_json": {"$ref": "#/definitions/missing"}}, "response_format", "JSON schema"),
        ({"guided_json": {"type": "string", "pattern": "(("}}, "response_format", "parenthesis"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format",
         "nope"),
        ({"guided_regex": "(("}, "guided_regex", "parenthesis is not closed"),
        ({"guided_regex": "[a-"}, "guided_regex", "Unclosed"),
        ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "EBNF"),
        ({"guided_grammar": "start ::= \"a\""}, "guided_grammar", "root"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "not defined"),
        ({"guided_choice": []}, "guided_choice", "empty"),
        ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}}, "structural_tag", "nope"),
        ({"structural_tag": {"structures": [{"begin": "<f>"}], "triggers": ["<f>"]}}, "structural_tag", "structures"),
    ],
)
def test_invalid_content_is_a_parameter_error(body, param, words):
    e = _err(body)
    assert e.param == param
    assert words in str(e)
    assert "/project/cpp" not in str(e)  # xgrammar's source location is stripped


def test_validation_is_cheap():
    import time

    spec = guided_spec_from_request({"guided_json": SCHEMA})
    t = time.perf_counter()
    for _ in range(20):
        validate_guided_spec(spec)
    assert (time.perf_counter() - t) / 20 < 0.05


def test_resolution_fills_the_whitespace_default_and_keeps_a_pinned_backend():
    from fastdeploy.entrypoints.openai.guided_request import guided_spec_from_request
    from fastdeploy.model_executor.guided_decoding import resolve_guided_spec

    spec = guided_spec_from_request({"guided_json": SCHEMA})
    assert resolve_guided_spec(spec, "auto", disable_any_whitespace=True).disable_any_whitespace is True
    own = guided_spec_from_request({"guided_json": SCHEMA}, disable_any_whitespace=False)
    assert resolve_guided_spec(own, "auto", disable_any_whitespace=True).disable_any_whitespace is False
    resolved = resolve_guided_spec(spec, "auto")
    assert resolved.backend == "xgrammar" and resolve_guided_spec(resolved, "auto") == resolved  # idempotent
    pinned = msgspec.structs.replace(spec, backend="llguidance")
    assert resolve_guided_spec(pinned, "auto").backend == "llguidance"
    with pytest.raises(ParameterError, match="runs on xgrammar, not llguidance"):
        resolve_guided_spec(pinned, "xgrammar")
    with pytest.raises(ParameterError, match="unknown grammar backend"):
        resolve_guided_spec(msgspec.structs.replace(spec, backend="other"), "auto")
    with pytest.raises(ParameterError, match="disabled on this server"):
        resolve_guided_spec(spec, "off")


def test_cli_flags_reach_the_engine_config():
    import argparse

    from fastdeploy.engine.args import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    config = EngineArgs.from_cli_args(parser.parse_args([])).create_engine_config()
    assert config.guided_decoding_backend == "auto" and not config.guided_decoding_disable_any_whitespace
    args = parser.parse_args(["--guided-decoding-backend", "llguidance", "--guided-decoding-disable-any-whitespace"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.guided_decoding_backend == "llguidance" and config.guided_decoding_disable_any_whitespace
