"""`sampling_mask` / `sampling_logz` through the real server, stream and non-stream."""

from __future__ import annotations

import asyncio
import base64
import math

import httpx
import numpy as np
import orjson
import pytest

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Write a line about the sea."}]


@pytest.fixture(scope="module")
def mask_server(server_launcher):
    """`--enable-keep-sampling-mask` (its arguments: conftest.py, SERVERS)."""
    yield from server_launcher.serve("mask_server")


@pytest.fixture(scope="module")
def mask_client(mask_server):
    return mask_server.openai_client()


def check_aligned(masks, logz, token_ids, max_size=None, greedy=False, untruncated=False):
    assert len(masks) == len(logz) == len(token_ids) > 0
    for mask, z, token in zip(masks, logz, token_ids, strict=True):
        if untruncated:
            assert mask is None and z == 0.0
            continue
        assert mask == sorted(set(mask)) and token in mask
        assert z <= 1e-6 and math.isfinite(z)
        if greedy:
            assert mask == [token]
        if max_size is not None:
            assert len(mask) <= max_size


def test_chat_non_stream_n2(mask_client):
    resp = mask_client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0.8, top_p=0.9, max_tokens=12, n=2, seed=5,
        extra_body={"top_k": 20, "return_token_ids": True})
    for choice in resp.choices:
        c = choice.model_dump()
        check_aligned(c["sampling_mask"], c["sampling_logz"], c["token_ids"], max_size=20)


def test_chat_stream_masks_align_with_each_delta(mask_client):
    stream = mask_client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=1.0, max_tokens=10, stream=True,
        extra_body={"min_p": 0.05, "return_token_ids": True})
    masks, logz, tokens = [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            c = choice.model_dump()
            if c.get("token_ids"):
                assert len(c["sampling_mask"]) == len(c["token_ids"])
                masks += c["sampling_mask"]
                logz += c["sampling_logz"]
                tokens += c["token_ids"]
    check_aligned(masks, logz, tokens)


def test_completions_greedy_and_untruncated(mask_client):
    greedy = mask_client.completions.create(model=MODEL, prompt="The sea is", temperature=0, max_tokens=6,
                                            extra_body={"return_token_ids": True}).choices[0].model_dump()
    check_aligned(greedy["sampling_mask"], greedy["sampling_logz"], greedy["token_ids"], greedy=True)
    plain = mask_client.completions.create(model=MODEL, prompt="The sea is", temperature=1.0, max_tokens=6,
                                           extra_body={"return_token_ids": True}).choices[0].model_dump()
    check_aligned(plain["sampling_mask"], plain["sampling_logz"], plain["token_ids"], untruncated=True)
    streamed = list(mask_client.completions.create(model=MODEL, prompt="The sea is", temperature=0.7, top_p=0.5,
                                                   max_tokens=6, stream=True,
                                                   extra_body={"return_token_ids": True}))
    masks = [m for c in streamed for ch in c.choices for m in (ch.model_dump().get("sampling_mask") or [])]
    tokens = [t for c in streamed for ch in c.choices for t in (ch.model_dump().get("token_ids") or [])]
    logz = [z for c in streamed for ch in c.choices for z in (ch.model_dump().get("sampling_logz") or [])]
    check_aligned(masks, logz, tokens)


def test_mixed_batch_with_opt_out_and_different_lengths(mask_server):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{mask_server.base_url}/v1", api_key="unused", timeout=120,
                                max_retries=0)

    async def one(i: int):
        opt_out = i % 3 == 0
        resp = await client.completions.create(
            model=MODEL, prompt=f"Item {i}:", temperature=0.9, max_tokens=3 + 2 * i, seed=i,
            extra_body={"top_k": 8, "ignore_eos": True, "return_token_ids": True,
                        "return_sampling_mask": not opt_out})
        return opt_out, resp.choices[0].model_dump()

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))

    for i, (opt_out, choice) in enumerate(asyncio.run(main())):
        assert len(choice["token_ids"]) == 3 + 2 * i
        if opt_out:
            assert "sampling_mask" not in choice or choice["sampling_mask"] is None
        else:
            check_aligned(choice["sampling_mask"], choice["sampling_logz"], choice["token_ids"], max_size=8)


VOCAB = 49152  # the embedded model's logits width


def bitmap_ids(text: str) -> list[int]:
    """The kept ids of a bitmap entry, decoded as docs/sampling.md shows."""
    raw = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8)
    assert len(raw) == (VOCAB + 7) // 8
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()


def decoded(masks: list) -> list:
    return [m if m is None or isinstance(m, list) else bitmap_ids(m) for m in masks]


@pytest.mark.parametrize("stream", [False, True])
def test_bitmap_and_ids_give_the_same_tokens_and_sets_completions(mask_client, stream):
    results = {}
    for fmt in ("ids", "bitmap"):
        kwargs = dict(model=MODEL, prompt="The sea is", temperature=1.2, top_p=0.95, max_tokens=8, seed=11,
                      extra_body={"return_token_ids": True, "sampling_mask_format": fmt, "ignore_eos": True})
        if stream:
            chunks = [ch.model_dump() for c in mask_client.completions.create(stream=True, **kwargs)
                      for ch in c.choices]
            results[fmt] = ([t for c in chunks for t in (c.get("token_ids") or [])],
                            [m for c in chunks for m in (c.get("sampling_mask") or [])],
                            [z for c in chunks for z in (c.get("sampling_logz") or [])])
        else:
            c = mask_client.completions.create(**kwargs).choices[0].model_dump()
            results[fmt] = (c["token_ids"], c["sampling_mask"], c["sampling_logz"])
    (ids_tokens, ids_masks, ids_logz), (bm_tokens, bm_masks, bm_logz) = results["ids"], results["bitmap"]
    assert bm_tokens == ids_tokens and bm_logz == ids_logz
    assert all(isinstance(m, str) for m in bm_masks)
    assert decoded(bm_masks) == ids_masks
    check_aligned(decoded(bm_masks), bm_logz, bm_tokens)
    assert max(len(m) for m in ids_masks) > 1000  # large sets, where the bitmap is the smaller form


def test_bitmap_and_ids_give_the_same_sets_chat_stream_with_json_mode(mask_client):
    """Guided decoding with masks: each set lies inside the grammar's allowed tokens in both forms."""
    results = {}
    for fmt in ("ids", "bitmap"):
        chunks = [ch.model_dump() for c in mask_client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0.9, max_tokens=10, seed=3, stream=True,
            response_format={"type": "json_object"},
            extra_body={"top_k": 40, "return_token_ids": True, "sampling_mask_format": fmt}) for ch in c.choices]
        results[fmt] = ([t for c in chunks for t in (c.get("token_ids") or [])],
                        [m for c in chunks for m in (c.get("sampling_mask") or [])])
    assert results["bitmap"][0] == results["ids"][0]
    assert decoded(results["bitmap"][1]) == results["ids"][1]
    assert all(len(m) <= 40 for m in results["ids"][1])


def test_untruncated_guided_masks_are_not_null_chat_stream(mask_client):
    """Without truncation under a JSON schema the draw's support is the grammar's allowed set:
    every token's mask holds it (never null, never the whole vocabulary) with logZ 0, in both
    forms."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    results = {}
    for fmt in ("ids", "bitmap"):
        chunks = [ch.model_dump() for c in mask_client.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=1.0, max_tokens=24, seed=5, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            extra_body={"return_token_ids": True, "sampling_mask_format": fmt}) for ch in c.choices]
        results[fmt] = ([t for c in chunks for t in (c.get("token_ids") or [])],
                        [m for c in chunks for m in (c.get("sampling_mask") or [])],
                        [z for c in chunks for z in (c.get("sampling_logz") or [])])
    tokens, masks, logz = results["ids"]
    assert results["bitmap"][0] == tokens and decoded(results["bitmap"][1]) == masks
    check_aligned(masks, logz, tokens)
    assert all(z == 0.0 for z in logz) and all(len(m) < 49152 for m in masks)
    assert max(len(m) for m in masks) > 1000  # inside the string: most of the vocabulary


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
])
@pytest.mark.parametrize("value", ["bits", "IDS", 3, ""])
def test_unknown_sampling_mask_format_is_a_400(mask_server, path, body, value):
    resp = httpx.post(mask_server.base_url + path, json={**body, "sampling_mask_format": value}, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "sampling_mask_format" and error["type"] == "invalid_request_error"


def _streamed_choices(server, path: str, body: dict) -> dict[int, dict]:
    """Per choice index: token ids, masks, logZ, text and finish reason of the SSE answer."""
    choices: dict[int, dict] = {}
    with httpx.stream("POST", f"{server.base_url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in orjson.loads(line[6:])["choices"]:
                got = choices.setdefault(c["index"], {"token_ids": [], "sampling_mask": [], "sampling_logz": [],
                                                      "text": "", "finish_reason": None})
                got["token_ids"] += c.get("token_ids") or []
                got["sampling_mask"] += c.get("sampling_mask") or []
                got["sampling_logz"] += c.get("sampling_logz") or []
                got["text"] += c["text"] if "text" in c else (c["delta"].get("content") or "")
                got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
    return choices


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_long_bitmap_answer_goes_out_while_it_runs_and_equals_the_stream(mask_server, path):
    """Past one block of bitmap JSON (1 MB: 128 tokens at this vocabulary) a non-streaming body
    is sent while the request runs (chunked, no length known ahead); its choices hold what the
    same seeded request streams: tokens, text, every bitmap, logZ (to float32's last place)."""
    n = 2 if path == "/v1/completions" else 1
    body = {"model": MODEL, "temperature": 1.5, "top_p": 0.99, "max_tokens": 150, "n": n, "seed": 3,
            "ignore_eos": True, "return_token_ids": True, "sampling_mask_format": "bitmap"}
    body.update({"prompt": "The sea is"} if path == "/v1/completions" else {"messages": CHAT})
    r = httpx.post(f"{mask_server.base_url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.headers
    full = r.json()
    streamed = _streamed_choices(mask_server, path, body)
    assert [c["index"] for c in full["choices"]] == list(range(n))
    assert full["usage"]["completion_tokens"] == 150 * n
    for choice in full["choices"]:
        want = streamed[choice["index"]]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert choice["token_ids"] == want["token_ids"] and len(want["token_ids"]) == 150
        assert choice["sampling_mask"] == want["sampling_mask"]
        # The second request's prefill may read the first one's cached prompt blocks: logZ
        # can differ in float32's last place.
        assert np.allclose(choice["sampling_logz"], want["sampling_logz"], rtol=1e-6, atol=1e-7)
        assert (text, choice["finish_reason"]) == (want["text"], want["finish_reason"])
        check_aligned(decoded(choice["sampling_mask"]), choice["sampling_logz"], choice["token_ids"])
