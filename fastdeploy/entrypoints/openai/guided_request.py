"""OpenAI / vLLM request fields → the `GuidedSpec` a request constrains its output to.

Parsing only: nothing is compiled here (see guided_decoding/select.py for that).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from fastdeploy.common.errors import ParameterError
from fastdeploy.common.guided_spec import GuidedSpec

__all__ = ["guided_spec_from_request"]

# Request fields that each select one form of guided decoding; at most one may be set.
_GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag")


def _dumps(obj: Any) -> str:
    # Compact but order-preserving: property order in a schema is the generation order.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _json_value(value: Any, param: str, what: str) -> Any:
    """A JSON object given inline (dict) or as JSON text (str) → the object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ParameterError(f"`{param}` is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise ParameterError(f"`{param}` must be a {what} (a JSON object), got {type(value).__name__}", param)
    return value


def _schema_spec(schema: Any, param: str) -> GuidedSpec:
    # A boolean schema is legal JSON Schema, but `true` is "any JSON" and `false` matches nothing.
    if schema is True:
        return GuidedSpec("json_object", "")
    return GuidedSpec("json_schema", _dumps(_json_value(schema, param, "JSON schema")))


def _structural_tag_spec(tag: Any, param: str) -> GuidedSpec:
    tag = _json_value(tag, param, "structural tag")
    if "format" not in tag and "structures" in tag:
        # vLLM's legacy form: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}.
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not isinstance(triggers, list):
            raise ParameterError(f"`{param}`: `structures` and `triggers` must be lists", param)
        import xgrammar as xgr  # lazy: keeps the API server's import light

        try:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"]) for s in structures]
            tag = json.loads(xgr.StructuralTag.from_legacy_structural_tag(items, triggers).model_dump_json())
        except Exception as e:  # KeyError, TypeError, pydantic.ValidationError
            raise ParameterError(f"`{param}`: invalid structural tag structures: {e}", param) from None
    return GuidedSpec("structural_tag", _dumps(tag))


def _from_response_format(rf: Any) -> GuidedSpec | None:
    param = "response_format"
    if not isinstance(rf, dict):
        raise ParameterError("`response_format` must be an object", param)
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GuidedSpec("json_object", "")
    if kind == "json_schema":
        js, js_param = rf.get("json_schema"), "response_format.json_schema"
        if not isinstance(js, dict):
            raise ParameterError("`response_format.json_schema` must be an object", js_param)
        if "name" in js and not isinstance(js["name"], str):
            raise ParameterError("`response_format.json_schema.name` must be a string", js_param)
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise ParameterError("`response_format.json_schema.strict` must be a boolean", js_param)
        # OpenAI makes `schema` optional; without one, any JSON object is the only sane reading.
        if js.get("schema") is None:
            return GuidedSpec("json_object", "")
        return _schema_spec(js["schema"], "response_format.json_schema.schema")
    if kind == "structural_tag":
        # vLLM accepts the structural tag itself as the response_format object.
        return _structural_tag_spec(dict(rf), param)
    raise ParameterError(
        f"`response_format.type` must be one of 'text', 'json_object', 'json_schema', 'structural_tag'; got {kind!r}",
        param,
    )


def guided_spec_from_request(body: dict, *, disable_any_whitespace: bool | None = None,
                             best_effort: bool = False) -> GuidedSpec | None:
    """The output constraint a request body asks for, or None.

    Reads `response_format`, `guided_json`, `guided_regex`, `guided_choice`,
    `guided_grammar` and `structural_tag`; a field set to null counts as absent.
    Raises ParameterError (param = the offending field) when two forms are given or a
    value has the wrong type. Does not compile anything: see select.validate_guided_spec.
    disable_any_whitespace / best_effort: the request's options, carried by the spec.
    """
    spec = _spec_from_fields(body)
    if spec is None:
        return None
    return msgspec.structs.replace(spec, disable_any_whitespace=disable_any_whitespace, best_effort=best_effort)


def _spec_from_fields(body: dict) -> GuidedSpec | None:
    given = [f for f in _GUIDED_FIELDS if body.get(f) is not None]
    # {"type": "text"} is the OpenAI way of saying "no constraint"; it does not conflict.
    rf = body.get("response_format")
    if "response_format" in given and isinstance(rf, dict) and rf.get("type") in (None, "text"):
        given.remove("response_format")
        if not given:
            _from_response_format(rf)  # still type-check it
    if len(given) > 1:
        raise ParameterError(
            f"only one of {', '.join('`' + f + '`' for f in _GUIDED_FIELDS)} may be set; got {given[0]} and {given[1]}",
            given[1],
        )
    if not given:
        return None
    field = given[0]
    value = body[field]
    if field == "response_format":
        return _from_response_format(value)
    if field == "guided_json":
        return _schema_spec(value, field)
    if field == "guided_regex":
        if not isinstance(value, str):
            raise ParameterError(f"`guided_regex` must be a string, got {type(value).__name__}", field)
        return GuidedSpec("regex", value)
    if field == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ParameterError("`guided_choice` must be a list of strings", field)
        return GuidedSpec("choice", _dumps(value))
    if field == "guided_grammar":
        if not isinstance(value, str):
            raise ParameterError(f"`guided_grammar` must be an EBNF string, got {type(value).__name__}", field)
        return GuidedSpec("grammar", value)
    return _structural_tag_spec(value, field)  # structural_tag
