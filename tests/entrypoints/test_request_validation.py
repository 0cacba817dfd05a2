"""Properties of the API server's request checks, over generated input (no server, no model)."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fastdeploy.common.errors import ParameterError
from fastdeploy.common.ipc import make_ipc_dir
from fastdeploy.common.limits import EngineLimits
from fastdeploy.entrypoints.openai.body_guard import deeper_than, json_error
from fastdeploy.entrypoints.openai.errors import APIError, validation_message
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy.entrypoints.openai.request_limits import INT64_MAX, INT64_MIN
from fastdeploy.entrypoints.openai.validation import check_context, external_ref

SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
# Text as clients send it: any character, and UTF-16 surrogates alone or in pairs (escaped in JSON).
texts = st.text(alphabet=st.characters(exclude_categories=()) | st.sampled_from(["\ud800", "\udfff", "\ud83d"]))
unicode_texts = st.text(alphabet=st.characters(exclude_categories=("Cs",)))

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) \
    | st.floats(allow_nan=False, allow_infinity=False) | unicode_texts
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(unicode_texts.filter(lambda k: len(k) <= 8), inner, max_size=4),
                           max_leaves=40)


def depth(value: Any) -> int:
    """Reference: nesting depth of objects and arrays, recursively."""
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


@SETTINGS
@given(json_values, st.integers(1, 8))
def test_depth_check_agrees_with_the_recursive_definition(value, limit):
    assert deeper_than(value, limit) == (depth(value) > limit)
    body = json.dumps(value).encode()
    error = json_error(body, limit)
    assert (error is None) == (depth(value) <= limit)
    if error is not None:
        assert error.status == 400 and error.code == "json_too_deep"


def lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


@SETTINGS
@given(texts)
def test_strings_pass_the_body_check_exactly_when_they_are_unicode(text):
    """json.dumps escapes surrogates as \\udxxx; a pair decodes to one character, a lone one to no
    character at all, which the strict parser refuses (the tokenizer raised on it: a 500)."""
    body = json.dumps({"prompt": text}).encode()
    error = json_error(body, 64)
    assert (error is not None) == lone_surrogate(json.loads(body)["prompt"])
    if error is not None:
        assert error.status == 400 and "JSON" in error.message


@SETTINGS
@given(st.binary(max_size=64))
def test_arbitrary_bytes_are_json_or_a_400(raw):
    error = json_error(raw, 64)
    assert error is None or (error.status == 400 and error.message)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_a_body_in_another_unicode_encoding_is_named_so(encoding):
    """The parser calls such bytes "surrogates not allowed" (or an unexpected character): the 400
    says what is wrong with them instead."""
    error = json_error(json.dumps({"prompt": "Hi there"}).encode(encoding), 64)
    assert error is not None and error.status == 400
    assert "UTF-16 or UTF-32" in error.message and "must be UTF-8" in error.message
    assert "surrogate" not in error.message


def test_a_latin1_body_is_named_not_utf8():
    error = json_error('{"prompt": "café"}'.encode("latin-1"), 64)
    assert error is not None
    assert "not UTF-8 (invalid byte at offset 15)" in error.message and "surrogate" not in error.message


FIELDS = ["prompt", "messages", "n", "best_of", "seed", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "logprobs", "top_logprobs", "stop", "stop_token_ids", "logit_bias",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "sampling_mask_format", "response_format",
          "guided_json", "guided_regex", "guided_choice"]
interesting_ints = st.sampled_from([0, 1, -1, 16, 17, INT64_MAX, INT64_MAX + 1, INT64_MIN, INT64_MIN - 1, 2**64,
                                    2**100]) | st.integers()
field_values = json_values | interesting_ints | st.lists(interesting_ints, max_size=3) \
    | st.dictionaries(st.sampled_from(["0", "1", "-1", "abc", "99999999999999999999", "type"]),
                      json_scalars | st.sampled_from(["json_object", "text", "xml"]), max_size=3)
bodies = st.fixed_dictionaries({"prompt": st.just("Hi") | field_values},
                              optional={f: field_values for f in FIELDS if f != "prompt"})


@SETTINGS
@given(bodies, st.sampled_from([CompletionRequest, ChatCompletionRequest]))
def test_any_body_is_accepted_and_encodable_or_refused_naming_a_field(body, model):
    """What pydantic accepts either maps to parameters the engine's msgpack can carry, or fails
    with ParameterError (a 400); what it refuses has a message and names a field of the body.
    (A seed beyond 64 bits used to pass here and fail in the encoder: a 500.)"""
    if model is ChatCompletionRequest:
        body = {**body, "messages": body.get("messages", [{"role": "user", "content": "Hi"}])}
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(include_url=False))
        assert message and (param is None or param in body), (message, param)
        return
    try:
        params = request.to_sampling_params()
    except ParameterError:
        return
    for i in range(params.n):
        msgspec.msgpack.encode(params.for_choice(i))


LIMITS = EngineLimits(max_model_len=1024, vocab_size=49152, max_logprobs=20, enable_keep_sampling_mask=False,
                      kv_capacity_tokens=32768)


@SETTINGS
@given(st.integers(0, 3000), st.none() | st.integers(1, 2**63))
def test_context_check_refuses_exactly_what_cannot_fit(num_prompt, max_tokens):
    fits = max_tokens is None or num_prompt + max_tokens <= LIMITS.max_model_len
    try:
        check_context(num_prompt, max_tokens, LIMITS, "max_tokens", "messages")
    except APIError as exc:
        assert not fits and 0 < num_prompt < LIMITS.max_model_len
        assert exc.status == 400 and exc.param == "max_tokens" and exc.code == "context_length_exceeded"
        assert f"{LIMITS.max_model_len} tokens" in exc.message and f"{num_prompt + max_tokens} tokens" in exc.message
        assert f"{num_prompt} in the messages, {max_tokens} in the completion" in exc.message
    else:
        # A prompt with no room at all is left to EngineLimits.validate, which names the prompt.
        assert fits or not 0 < num_prompt < LIMITS.max_model_len


refs = st.sampled_from(["#/$defs/a", "#", "file:///etc/passwd", "http://h/s.json", "s.json#/x", "", "//h/x"])
schemas = st.recursive(st.fixed_dictionaries({"type": st.just("string")})
                       | st.builds(lambda r: {"$ref": r}, refs),
                       lambda inner: st.builds(lambda props: {"type": "object", "properties": props},
                                               st.dictionaries(st.text(max_size=4), inner, max_size=3))
                       | st.builds(lambda items: {"anyOf": items}, st.lists(inner, max_size=3)), max_leaves=12)


def refs_in(schema: Any) -> list[str]:
    if isinstance(schema, dict):
        own = [schema["$ref"]] if isinstance(schema.get("$ref"), str) else []
        return own + [r for v in schema.values() for r in refs_in(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in refs_in(v)]
    return []


@SETTINGS
@given(schemas)
def test_external_refs_are_found_wherever_they_are(schema):
    outside = [r for r in refs_in(schema) if not r.startswith("#")]
    found = external_ref(schema)
    assert (found is None) == (not outside)
    assert found is None or found in outside
    # The same schema given as JSON text, as response_format.json_schema.schema may be.
    assert (external_ref({"type": "json_schema", "json_schema": {"schema": json.dumps(schema)}}) is None) \
        == (not outside)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_ipc_directory_is_private_whatever_the_umask(umask):
    old = os.umask(umask)
    try:
        path = make_ipc_dir()
    finally:
        os.umask(old)
    try:
        info = os.stat(path)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    finally:
        os.rmdir(path)


@pytest.mark.parametrize("field, value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                          ("tool_choice", "required"), ("functions", [{"name": "f"}]),
                                          ("modalities", ["text", "audio"]), ("suffix", "x"), ("echo", True),
                                          ("min_tokens", 4), ("max_token", 8), ("chat_template_kwargs", {})])
def test_a_field_the_server_does_not_implement_is_refused_by_name(field, value):
    """Never silently ignored: an OpenAI field it does not implement, an engine extension it does
    not have, a misspelt field (completions take `echo`; chat does not)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], field: value}
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    assert validation_message(caught.value.errors(include_url=False)) == (
        f"request argument `{field}` is not supported by this server", field)


def test_fields_that_ask_nothing_of_the_output_are_taken():
    body = {"messages": [{"role": "user", "content": "Hi"}], "store": False, "metadata": {"a": "b"},
            "service_tier": "auto", "parallel_tool_calls": True, "tools": [], "tool_choice": "none",
            "modalities": ["text"], "user": "u"}
    assert ChatCompletionRequest.model_validate(body).to_sampling_params().n == 1


@pytest.mark.parametrize(("field", "value"), [("store", "yes"), ("metadata", {"a": 1}), ("metadata", ["a"]),
                                              ("metadata", {str(i): "v" for i in range(17)}),
                                              ("metadata", {"k" * 65: "v"}), ("service_tier", "fastest"),
                                              ("prediction", "text"), ("prediction", {"type": "image"}),
                                              ("parallel_tool_calls", 1), ("user", 7)])
def test_bookkeeping_fields_of_the_wrong_type_are_refused(field, value):
    """Taken and unused, but typed as OpenAI types them: a client's wrong type is a 400 here too."""
    body = {"messages": [{"role": "user", "content": "Hi"}], field: value}
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    assert validation_message(caught.value.errors(include_url=False))[1] == field


def test_a_prediction_of_content_is_taken():
    body = {"messages": [{"role": "user", "content": "Hi"}], "store": None,
            "prediction": {"type": "content", "content": [{"type": "text", "text": "Hello"}]}}
    assert ChatCompletionRequest.model_validate(body).to_sampling_params().n == 1


@pytest.mark.parametrize("key", ["01", "00001", "+1", "1.0", " 1", "x", "", "1" * 20])
def test_a_logit_bias_key_is_a_token_id_written_plainly(key):
    """"01" and "1" would be one token twice (with two biases)."""
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": "Hi", "logit_bias": {key: 1.0}})
    message, param = validation_message(caught.value.errors(include_url=False))
    assert param == "logit_bias"
    assert repr(key) in message


def test_logit_bias_keys_zero_and_plain_numbers_are_taken():
    params = CompletionRequest.model_validate({"prompt": "Hi", "logit_bias": {"0": 1.5, "12": -3}}).to_sampling_params()
    assert params.logit_bias == {0: 1.5, 12: -3.0}


@pytest.mark.parametrize("prompt", [[True, 2], [1.0, 2], [[3, False]]])
def test_token_ids_are_json_integers(prompt):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": prompt})


@pytest.mark.parametrize("body", [[1, 2], "prompt", b'{"prompt": "Hi"}', 3])
def test_a_body_that_is_no_json_object_says_so(body):
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate(body)
    message, param = validation_message(caught.value.errors(include_url=False))
    assert message == "the request body must be a JSON object, sent as Content-Type: application/json"
    assert param is None


@pytest.mark.parametrize("field, value", [("max_tokens", "2"), ("max_tokens", 2.0), ("n", True), ("seed", "7"),
                                          ("temperature", True), ("top_p", "0.5"), ("stream", "true"),
                                          ("ignore_eos", 1), ("logprobs", "yes"), ("logit_bias", {"1": "2"}),
                                          ("stop_token_ids", [True]), ("stream_options", {"include_usage": "yes"})])
def test_json_types_are_taken_as_they_are(field, value):
    """A string is no number, a boolean no integer, "yes" or 1 no boolean: each is a 400 naming the
    field (they were coerced: `"stream": "true"` streamed, `"n": true` asked for one choice)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], field: value}
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    assert validation_message(caught.value.errors(include_url=False))[1] == field


@pytest.mark.parametrize("body, path", [
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"messages": [{"role": "user", "contnet": "Hi"}]}, "messages.0.contnet"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]}]},
     "messages.0.content.0.cache_control"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.1.tool_calls"),
    ({"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, "messages.0.refusal"),
])
def test_a_key_the_server_does_not_know_inside_an_object_is_refused_by_name(body, path):
    """Not only at the top level: a misspelt message key left an empty message, an assistant turn's
    tool calls were dropped by the chat template unseen."""
    body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    assert validation_message(caught.value.errors(include_url=False)) == (
        f"request argument `{path}` is not supported by this server", path.split(".")[0])


def test_message_fields_that_ask_nothing_are_taken():
    messages = [{"role": "user", "content": "Hi", "name": "ann"},
                {"role": "assistant", "content": "Hello", "tool_calls": [], "refusal": None, "audio": None,
                 "function_call": None},
                {"role": "tool", "content": "42", "tool_call_id": "call-1"}]
    request = ChatCompletionRequest.model_validate({"messages": messages})
    assert [m.template_fields() for m in request.messages] == [
        {"role": "user", "content": "Hi", "name": "ann"}, {"role": "assistant", "content": "Hello"},
        {"role": "tool", "content": "42"}]


def test_completions_echo_true_is_refused():
    """It was taken and ignored: the completion came without the prompt it asked for."""
    assert not CompletionRequest.model_validate({"prompt": "Hi", "echo": False}).echo
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": "Hi", "echo": True})
    message, param = validation_message(caught.value.errors(include_url=False))
    assert param == "echo" and "not supported" in message


@pytest.mark.parametrize("model, body", [(ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}]}),
                                         (CompletionRequest, {"prompt": "Hi"})])
def test_stream_options_without_a_stream_are_refused(model, body):
    """As OpenAI: `stream_options` asks for what only a stream has (they were taken and ignored)."""
    for stream in (False, None):
        request = model.model_validate({**body, "stream_options": {"include_usage": True},
                                        **({"stream": stream} if stream is not None else {})})
        with pytest.raises(ParameterError) as caught:
            request.to_sampling_params()
        assert caught.value.param == "stream_options"
    model.model_validate({**body, "stream": True, "stream_options": {"include_usage": True}}).to_sampling_params()
    model.model_validate({**body, "stream_options": None}).to_sampling_params()
