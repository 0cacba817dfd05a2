"""Schema-constrained generation through the real engine and the embedded SmolLM2: what finishes
validates against its schema (jsonschema), on llguidance as on xgrammar, and compact output has
no whitespace outside strings."""

from __future__ import annotations

import json

import jsonschema
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.common.errors import ParameterError
from fastdeploy.entrypoints.openai.guided_request import guided_spec_from_request
from fastdeploy.model_executor.guided_decoding import GuidedSpec
from tests.guided_decoding.jsb import JSB_DIR
from tests.guided_decoding.test_coverage import KNOWN

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=16, max_model_len=1024)


def whitespace_outside_strings(text: str) -> bool:
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return True
    return False


def ask(schema: dict) -> list[dict]:
    return [{"role": "user", "content": f"Reply with one JSON value for this schema:\n{json.dumps(schema)[:1200]}"}]


def llguidance_schemas(n: int) -> list[tuple[str, dict]]:
    """The n smallest JSONSchemaBench schemas that `auto` gives to llguidance (xgrammar would not
    enforce them), plus the issue's cases llguidance enforces."""
    from fastdeploy.model_executor.guided_decoding import resolve_guided_spec

    picked = []
    for path in sorted(JSB_DIR.glob("*.json"), key=lambda p: p.stat().st_size):
        schema = json.loads(path.read_text())["schema"]
        try:
            if resolve_guided_spec(guided_spec_from_request({"guided_json": schema}), "auto").backend == "llguidance":
                picked.append((path.stem, schema))
        except ParameterError:
            continue
    known = [(name, KNOWN[name][0]) for name in ("required not in properties", "allOf with enum")]
    return picked[:n] + known


@pytest.mark.skipif(not JSB_DIR.is_dir(), reason=f"{JSB_DIR} not present")
def test_llguidance_outputs_validate(llm):
    cases = llguidance_schemas(3)
    specs = [GuidedSpec("json_schema", json.dumps(schema)) for _, schema in cases]
    params = [SamplingParams(temperature=0.6, top_p=0.95, seed=i, max_tokens=128, guided=spec)
              for i, spec in enumerate(specs)]
    outs = llm.chat([ask(schema) for _, schema in cases], params)
    finished = 0
    for (name, schema), out in zip(cases, outs, strict=True):
        o = out.outputs[0]
        if o.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(o.text), schema)  # raises on an invalid output
        else:
            assert o.finish_reason == "length", (name, o.finish_reason)
    print(f"\nllguidance: {finished}/{len(cases)} finished, all valid")
    assert finished >= 2


def test_compact_json_has_no_whitespace_outside_strings(llm):
    """Both backends, a schema and JSON-object mode; the whitespace the default admits is
    tested token by token in test_matcher.py."""
    params = [SamplingParams(temperature=0.6, seed=3, max_tokens=64,
                             guided=GuidedSpec(kind, value, disable_any_whitespace=True, backend=backend))
              for kind, value in (("json_schema", json.dumps(PERSON)), ("json_object", ""))
              for backend in ("xgrammar", "llguidance")]
    outs = llm.chat([ask(PERSON)] * len(params), params)
    finished = 0
    for p, out in zip(params, outs, strict=True):
        o = out.outputs[0]
        assert not whitespace_outside_strings(o.text), (p.guided.backend, o.text)
        if o.finish_reason == "stop":
            finished += 1
            value = json.loads(o.text)
            if p.guided.kind == "json_schema":
                jsonschema.validate(value, PERSON)
    assert finished >= 2


def test_offline_refusal_names_the_keyword(llm):
    spec = GuidedSpec("json_schema", json.dumps(KNOWN["not"][0]))
    with pytest.raises(ParameterError, match="`not`"):
        llm.chat(ask({}), SamplingParams(max_tokens=8, guided=spec))
