"""The real server on loopback, driven by the real `openai` client."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, MODEL

CHAT = [{"role": "user", "content": "Name three fruits."}]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    head = httpx.head(f"{server.base_url}/health")  # what some load balancers send
    assert head.status_code == 200 and head.content == b""


def test_each_serving_process_freezes_its_start_up_heap(server, client):
    """A full garbage collection walking the start-up heap stalled decode steps for ~250 ms."""
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    log = server.log_text()
    if not log:
        pytest.skip("the server's log goes to the console (FASTDEPLOY_TEST_LOG)")
    frozen = {m[1]: int(m[2]) for m in re.finditer(r"(api server|engine|worker): (\d+) start-up objects frozen", log)}
    assert set(frozen) == {"api server", "engine", "worker"}, log[-2000:]
    # The worker holds the model and its tokenizer tables: far more than a bare interpreter's ~20k.
    assert frozen["worker"] > 50_000 and min(frozen.values()) > 10_000, frozen


def test_chat_non_stream_with_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12, logprobs=True,
                                          top_logprobs=3)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(tops[0])
    assert "".join(e.token for e in content) == choice.message.content
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_stream_and_non_stream_with_logprobs(client):
    full = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8,
                                     logprobs=2)
    choice = full.choices[0]
    assert len(choice.logprobs.tokens) == full.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(len(t) == 2 for t in choice.logprobs.top_logprobs)
    streamed = list(client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                              max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text


def test_completions_token_id_prompt_and_return_token_ids(client):
    resp = client.completions.create(model=MODEL, prompt=[504, 3575, 282], temperature=0, max_tokens=5,
                                     extra_body={"return_token_ids": True})
    choice = resp.choices[0].model_dump()
    assert choice["prompt_token_ids"] == [504, 3575, 282]
    assert len(choice["token_ids"]) == resp.usage.completion_tokens
    assert resp.usage.prompt_tokens == 3


def test_n_and_seed_reproducibility(client):
    kwargs = dict(model=MODEL, messages=CHAT, temperature=1.0, top_p=0.95, max_tokens=16, n=2, seed=1234)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.choices[0].message.content != first.choices[1].message.content


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=24,
                                     extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    cut = client.completions.create(model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=24,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=24,
                                     stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    streamed = client.completions.create(model=MODEL, prompt="Count: one, two, three,", temperature=0,
                                         max_tokens=24, stop=[stop], stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_concurrent_greedy_streams_equal_each_alone(client, async_client):
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]

    def alone(p: str) -> str:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], temperature=0,
                                           max_tokens=16)
        return r.choices[0].message.content

    async def streamed(p: str) -> str:
        stream = await async_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=16, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_together() -> list[str]:
        return await asyncio.gather(*(streamed(p) for p in prompts))

    together = asyncio.run(all_together())
    assert together == [alone(p) for p in prompts]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"return_sampling_mask": True}, "return_sampling_mask"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(server, body, param):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": CHAT, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_prompt_over_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello " * 1500, max_tokens=4)
    assert info.value.body["param"] == "prompt"


def test_malformed_json_unknown_model_and_auth(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    for auth in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=auth, json={"messages": CHAT})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def wait_until_idle(server, timeout_s: float = 10) -> dict:
    """The server's metrics once no request runs and no KV block is held, or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = m["fastdeploy_kv_cache_usage_ratio"] == 0 and m["fastdeploy_num_requests_running"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_client_disconnect_aborts_and_frees_kv(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Tell me a long story.", "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metrics()["fastdeploy_kv_cache_usage_ratio"] > 0
    m = wait_until_idle(server)
    assert (m["fastdeploy_kv_cache_usage_ratio"], m["fastdeploy_num_requests_running"]) == (0, 0)
    assert m['fastdeploy_requests_total{finish_reason="abort"}'] >= 1


def test_a_client_that_stops_reading_then_leaves_is_aborted(server):
    """The server's writes back up (the client reads nothing) before the client closes: the
    stream is aborted when it goes, not when its generator is garbage-collected."""
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 1000, "stream": True, "ignore_eos": True,
                       "logprobs": 20}).encode()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer %s\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                  % (API_KEY.encode(), len(body), body))
        time.sleep(4)
        assert server.metrics()["fastdeploy_num_requests_running"] == 1
    m = wait_until_idle(server)
    assert (m["fastdeploy_kv_cache_usage_ratio"], m["fastdeploy_num_requests_running"]) == (0, 0)


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, client):
    """The second request with a long shared prefix finds it cached (/metrics counts tokens),
    and its greedy answer is the first one's."""
    prompt = "Here is a list of the planets and their moons, in order from the sun. " * 8
    before = server.metrics()
    answers = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
               for _ in range(2)]
    after = server.metrics()
    hits = after["fastdeploy_prefix_cache_hits_total"] - before.get("fastdeploy_prefix_cache_hits_total", 0)
    queries = after["fastdeploy_prefix_cache_queries_total"] - before.get("fastdeploy_prefix_cache_queries_total", 0)
    assert answers[0] == answers[1]
    assert hits >= 96 and queries >= 2 * hits - 16  # the second lookup finds what the first one stored
