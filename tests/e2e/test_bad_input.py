"""Every class of malformed request gets a quick 4xx in OpenAI's error shape; none reaches the engine
or disturbs it. The server is the shared one: --max-model-len 1024, the embedded 49,152-token vocabulary."""

from __future__ import annotations

import json
import os
import socket
import stat
import time

import httpx
import psutil
import pytest

from fastdeploy.entrypoints.openai.request_limits import DEFAULT_MAX_BODY_BYTES, INT64_MAX, INT64_MIN
from tests.e2e.conftest import API_KEY

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "Hi"}]
CONTEXT = 1024
VOCAB = 49152


def post(server, path: str, body: dict | bytes, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base_url}{path}", headers=HEADERS, content=content, timeout=timeout)


def assert_error(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    """The response is `status` in OpenAI's shape; returns the error object."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    return error


def completion(server, **fields) -> httpx.Response:
    return post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, **fields})


def chat(server, **fields) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **fields})


@pytest.mark.parametrize("prompt", [[], "", [""], [[]], [[1], []], [1, "a"], [-1], [VOCAB], [2**70], [[5], [VOCAB]],
                                    [[1.5]], {"text": "x"}, None])
def test_bad_prompt_shapes_are_400(server, prompt):
    assert_error(completion(server, prompt=prompt), param="prompt")


@pytest.mark.parametrize("prompt", ["Hi", ["Hi", "there"], [1, 2, 3], [[1, 2], [VOCAB - 1]]])
def test_every_prompt_shape_is_served(server, prompt):
    r = completion(server, prompt=prompt)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == (len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int)
                                        else 1)


def test_strings_that_are_not_unicode_are_400(server):
    """A lone UTF-16 surrogate is valid JSON escaping but no character: the tokenizer raised on it."""
    lone = b'"\\ud800"'
    for path, body in [("/v1/completions", b'{"prompt": %s}' % lone),
                       ("/v1/completions", b'{"prompt": ["ok", %s]}' % lone),
                       ("/v1/completions", b'{"prompt": "Hi", "stop": [%s]}' % lone),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": %s}]}' % lone),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}')]:
        error = assert_error(post(server, path, body))
        assert "JSON" in error["message"]
    # A surrogate pair is one character and fine.
    assert completion(server, prompt="smile \ud83d\ude00").status_code == 200


@pytest.mark.parametrize("field, value", [("seed", 2**64), ("seed", INT64_MAX + 1), ("seed", INT64_MIN - 1),
                                          ("n", 0), ("n", 17), ("n", 2**70), ("best_of", 0), ("best_of", 17),
                                          ("best_of", 2), ("top_k", -2), ("top_k", VOCAB + 1), ("top_k", 2**40),
                                          ("logprobs", -1), ("logprobs", 21), ("logprobs", 2**70),
                                          ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2**70),
                                          ("stop_token_ids", [VOCAB]), ("stop_token_ids", [-1]),
                                          ("stop_token_ids", [2**64]), ("temperature", -0.5), ("top_p", 0),
                                          ("min_p", 1.5), ("repetition_penalty", 0), ("frequency_penalty", 3)])
def test_integer_and_float_ranges_are_400(server, field, value):
    assert_error(completion(server, **{field: value}), param=field)


@pytest.mark.parametrize("field, value", [("top_logprobs", -1), ("top_logprobs", 21), ("top_logprobs", 2**70)])
def test_top_logprobs_range_is_400(server, field, value):
    assert_error(chat(server, logprobs=True, **{field: value}), param=field)


def test_extreme_in_range_values_are_served(server):
    """The ends of every range, and floats near the ends of float32, run without a fault."""
    for fields in [{"seed": INT64_MAX, "n": 2}, {"seed": INT64_MIN}, {"top_k": VOCAB}, {"top_k": -1},
                   {"temperature": 1e-40}, {"temperature": 1e30}, {"top_p": 1e-40}, {"min_p": 1e-40},
                   {"min_p": 1.0}, {"repetition_penalty": 1e-40}, {"repetition_penalty": 1e30},
                   {"presence_penalty": -2, "frequency_penalty": 2}, {"logit_bias": {"0": 100, "1": -100}},
                   {"n": 16, "max_tokens": 2}, {"stop_token_ids": [0, VOCAB - 1]}]:
        r = completion(server, **fields)
        assert r.status_code == 200, (fields, r.text)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_max_tokens_beyond_the_context_is_a_quick_400_with_both_numbers(server):
    started = time.monotonic()
    error = assert_error(completion(server, prompt="Hi", max_tokens=1_000_000_000), param="max_tokens")
    assert time.monotonic() - started < 5
    assert error["code"] == "context_length_exceeded"
    assert str(CONTEXT) in error["message"] and "1000000000 in the completion" in error["message"]
    error = assert_error(chat(server, max_completion_tokens=CONTEXT), param="max_completion_tokens")
    assert f"{CONTEXT} in the completion" in error["message"] and "in the messages" in error["message"]
    # Exactly full is served (token 0 forced and made a stop token, so it ends at once), one more is not.
    prompt, ends_at_once = [1, 2, 3], {"logit_bias": {"0": 100}, "stop_token_ids": [0]}
    r = completion(server, prompt=prompt, max_tokens=CONTEXT - 3, **ends_at_once)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
    assert_error(completion(server, prompt=prompt, max_tokens=CONTEXT - 2, **ends_at_once), param="max_tokens")
    # A prompt that fills the context alone is named as the culprit.
    assert_error(completion(server, prompt=[1] * CONTEXT), param="prompt")


@pytest.mark.parametrize("logit_bias", [{"abc": 1}, {"-1": 1}, {"1.5": 1}, {" 1": 1}, {str(VOCAB): 1},
                                        {"99999999999999999999": 1}, {"1": 101}, {"1": "high"},
                                        {str(i): 1 for i in range(1025)}])
def test_bad_logit_bias_is_400(server, logit_bias):
    assert_error(completion(server, logit_bias=logit_bias), param="logit_bias")


@pytest.mark.parametrize("stop", [["x"] * 17, "x" * 513, ["ok", "x" * 513], [1], {"a": 1}])
def test_bad_stop_is_400(server, stop):
    assert_error(completion(server, stop=stop), param="stop")


def test_choices_per_request_are_bounded(server):
    assert_error(completion(server, prompt=["a"] * 257), param="prompt")
    assert_error(completion(server, prompt=["a"] * 32, n=16), param="n")


@pytest.mark.parametrize("field, value", [("sampling_mask_format", "png"), ("sampling_mask_format", 1),
                                          ("response_format", {"type": "xml"}), ("response_format", "json"),
                                          ("response_format", {"type": "json_schema", "json_schema": 5})])
def test_unknown_formats_are_400(server, field, value):
    error = assert_error(chat(server, **{field: value}))
    assert error["param"].startswith(field)


def test_body_size_limit_is_413(server):
    # The shared server runs with the default limit (8 MiB); a body one byte over it is refused.
    head, tail = b'{"prompt": "', b'", "max_tokens": 1}'
    body = head + b"a" * (DEFAULT_MAX_BODY_BYTES + 1 - len(head) - len(tail)) + tail
    error = assert_error(post(server, "/v1/completions", body), status=413)
    assert error["code"] == "request_too_large" and str(DEFAULT_MAX_BODY_BYTES) in error["message"]
    # Far beyond it, the declared length is enough: the answer comes before the body is sent.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{" % (2**40))
        assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")


def test_json_that_is_not_strict_or_too_deep_is_400(server):
    deep = b'{"prompt": "Hi", "response_format": ' + b'{"a": ' * 70 + b"1" + b"}" * 70 + b"}"
    error = assert_error(post(server, "/v1/completions", deep))
    assert error["code"] == "json_too_deep"
    assert_error(post(server, "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
    for raw in [b'{"prompt": "Hi", "temperature": NaN}', b'{"prompt": "Hi", "temperature": Infinity}',
                b'{"prompt": "Hi",}', b'{not json', b"[]", b'"Hi"', b"null"]:
        assert_error(post(server, "/v1/completions", raw))
    # 1e999 is JSON's grammar but no double: refused with the rest.
    assert_error(post(server, "/v1/completions", b'{"prompt": "Hi", "temperature": 1e999}'))


def test_nothing_in_a_request_reads_a_file_or_a_url(server):
    for url in ["file:///etc/passwd", "http://127.0.0.1:1/x.png", "data:image/png;base64,AAAA"]:
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        error = assert_error(chat(server, messages=[{"role": "user", "content": content}]), param="messages")
        assert "image_url" in error["message"]
    for ref in ["file:///etc/passwd", "http://127.0.0.1:1/schema.json", "other.json#/a"]:
        schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        assert_error(chat(server, response_format=rf), param="response_format")
        assert_error(chat(server, guided_json=json.dumps(schema)), param="guided_json")
        rf_text = {"type": "json_schema", "json_schema": {"name": "x", "schema": json.dumps(schema)}}
        assert_error(chat(server, response_format=rf_text), param="response_format")
    local = {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}}
    assert chat(server, guided_json=local, max_tokens=4).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_no_token_can_start_is_a_400(server, stream):
    """No token of the embedded vocabulary starts with byte 0xF1: the constraint allows nothing.
    Streamed too: the status waits for the first step (it was a 200 holding an error event)."""
    r = chat(server, guided_regex="\U00040000", temperature=0, max_tokens=3, stream=stream)
    assert_error(r, status=400)
    assert "no token of the model's vocabulary" in r.json()["error"]["message"]


def test_routes_and_methods_answer_in_the_error_shape(server):
    assert_error(httpx.get(f"{server.base_url}/v1/nothing-here", headers=HEADERS), status=404)
    assert_error(httpx.get(f"{server.base_url}/v1/completions", headers=HEADERS), status=405)
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi"}, headers={"Authorization": "Bearer x"})
    assert_error(r, status=401)


def test_the_server_is_healthy_and_serving_after_bad_input(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    r = completion(server, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_ipc_sockets_are_in_a_private_directory(server):
    """Other local users cannot reach the engine's sockets: their directory is 0700 and ours."""
    paths = [c.laddr for p in server.descendants() for c in p.net_connections(kind="unix")
             if isinstance(c.laddr, str) and c.laddr]
    assert paths, "no bound unix socket found"
    for directory in {os.path.dirname(p) for p in paths}:
        mode = os.stat(directory)
        assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid(), (directory, oct(mode.st_mode))
    assert psutil.Process(server.proc.pid).is_running()
