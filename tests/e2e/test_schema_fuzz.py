"""Requests generated from the server's own OpenAPI schema (schemathesis + hypothesis), sent to the real
server: bodies that fit the schema and bodies that break it. No answer is a 5xx, every 4xx is in
OpenAI's error shape, and the server is healthy and idle afterwards."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.e2e.conftest import API_KEY

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# Enough to meet every field in several shapes, few enough for a 2-core CI machine: a valid body
# runs the model, so valid cases generate at most MAX_TOKENS tokens per choice.
EXAMPLES = {schemathesis.GenerationMode.POSITIVE: 60, schemathesis.GenerationMode.NEGATIVE: 120}
MAX_TOKENS = 3
# Events a stream may send: a choice's tokens and its finish, for every choice a body may ask for.
MAX_STREAM_EVENTS = 100_000


@pytest.fixture(scope="module")
def log_start(server) -> int:
    """Where the server's log stood before the fuzz."""
    return len(server.log_text())


@pytest.fixture(scope="module")
def api_schema(server, log_start):
    schema = schemathesis.openapi.from_dict(httpx.get(f"{server.base_url}/openapi.json", timeout=10).json())
    # Read each stream to its end, so the check below sees it: schemathesis stops reading after 20
    # events by default (since 4.3x), and a body of several choices sends more than that.
    if hasattr(schema.config, "max_stream_events"):
        schema.config.max_stream_events = MAX_STREAM_EVENTS
    return schema


@pytest.fixture(scope="module")
def tally():
    """Status codes of every generated request, printed at the end (run with -s to see them)."""
    counts: Counter = Counter()
    yield counts
    print(f"\nschema fuzz: {sum(counts.values())} requests, by status: {dict(sorted(counts.items()))}")


def shorten(body: object) -> None:
    """Keep generation short where the body may run the model; every other value stays as generated."""
    if not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens"):
        if type(body.get(field)) is int and body[field] > MAX_TOKENS:
            body[field] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS


def sent(response) -> str:
    return repr(response.request.body)[:2000]


def check_response(response) -> None:
    """No 5xx; a 4xx in OpenAI's shape; a stream that ends with [DONE] and no internal error.
    (A body outside the schema may still be served: pydantic reads "5" as 5 for an integer.)"""
    status = response.status_code
    assert status < 500, (status, response.content[:2000], sent(response))
    if status >= 400:
        body = json.loads(response.content)
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], body
    elif (response.headers.get("content-type") or [""])[0].startswith("text/event-stream"):  # header: its values
        text = response.content.decode()
        assert text.rstrip().endswith("data: [DONE]") and '"server_error"' not in text, (text[-1000:], sent(response))


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=str)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generated_requests_get_no_5xx_and_errors_in_shape(server, api_schema, tally, path, mode):
    strategy = api_schema[path]["POST"].as_strategy(generation_mode=mode)

    @settings(max_examples=EXAMPLES[mode], deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case):
        shorten(case.body)
        response = case.call(base_url=server.base_url, headers=HEADERS, timeout=120)
        tally[response.status_code] += 1
        check_response(response)

    run()


def test_server_is_healthy_and_idle_after_the_fuzz(server, api_schema, log_start):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    deadline = time.monotonic() + 15
    while True:
        m = server.metrics()
        idle = m["fastdeploy_num_requests_running"] == 0 and m["fastdeploy_kv_cache_usage_ratio"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, m
    # Nothing went wrong quietly either: no process of the server logged a traceback.
    log = server.log_text()[log_start:]
    assert "Traceback" not in log, log[log.find("Traceback") - 2000:][:6000]
