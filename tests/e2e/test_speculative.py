"""Speculative decoding through the real server and the `openai` client."""

from __future__ import annotations

import pytest

from tests.e2e.server import RunningServer

RECORD = '{"name": "Alice Smith", "age": 30, "city": "Paris", "tags": ["admin", "editor"], "active": true}'


def test_streamed_speculative_run_matches_whole_response_and_reports_acceptance(spec_server, client):
    spec_client = spec_server.openai_client()
    messages = [{"role": "user", "content": f"Repeat this JSON exactly: {RECORD}"}]
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=48, logprobs=True,
                  top_logprobs=2)
    whole = spec_client.chat.completions.create(**kwargs)
    # The plain server (no speculation) gives the same greedy text and logprobs.
    plain = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == plain.choices[0].message.content
    for a, b in zip(whole.choices[0].logprobs.content, plain.choices[0].logprobs.content, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)

    # Streamed: several tokens may arrive in one chunk; the masks stay aligned with the tokens.
    text, entries, masks = "", 0, 0
    for chunk in spec_client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None:
            entries += len(choice.logprobs.content)
        extra = choice.model_extra or {}
        masks += len(extra.get("sampling_mask") or [])
    assert text == whole.choices[0].message.content
    assert entries == masks == whole.usage.completion_tokens

    metrics = spec_server.metrics()
    assert metrics["fastdeploy_spec_decode_num_draft_tokens_total"] > 0
    assert metrics["fastdeploy_spec_decode_num_accepted_tokens_total"] > 0
    assert 0 < metrics["fastdeploy_spec_decode_draft_acceptance_rate"] <= 1
    assert metrics["fastdeploy_spec_decode_mean_accepted_length"] > 1
    # Steps by how they ran: every kind is a share of the steps; these requests prefilled and verified.
    steps = metrics["fastdeploy_spec_decode_num_steps_total"]
    assert 0 < metrics["fastdeploy_spec_decode_num_verify_steps_total"] <= steps
    assert 0 < metrics["fastdeploy_spec_decode_num_steps_with_prefill_total"] <= steps
    assert 0 <= metrics["fastdeploy_spec_decode_num_steps_sent_ahead_total"] <= steps


@pytest.mark.parametrize("spec_server_name", ["mtp_server", "ngram_ahead_server"])
def test_steps_sent_ahead_with_drafts_match_the_plain_server(spec_server_name, request, client):
    """MTP's and n-gram's verify steps and drafts go out ahead of the running step (asynchronous
    scheduling; drafts made on the device): through the server the greedy text and logprobs are
    the plain server's, whole and streamed, with one sampling mask per token."""
    spec_server = request.getfixturevalue(spec_server_name)
    spec_client = spec_server.openai_client()
    messages = [{"role": "user", "content": f"Repeat this JSON exactly: {RECORD}"}]
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=40, logprobs=True,
                  top_logprobs=2)
    plain = client.chat.completions.create(**kwargs)
    for _ in range(2):  # the draft policy tries its caps on the first answers
        whole = spec_client.chat.completions.create(**kwargs)
        assert whole.choices[0].message.content == plain.choices[0].message.content
        for a, b in zip(whole.choices[0].logprobs.content, plain.choices[0].logprobs.content, strict=True):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    text, masks = "", 0
    for chunk in spec_client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        masks += len((choice.model_extra or {}).get("sampling_mask") or [])
    assert text == plain.choices[0].message.content and masks == plain.usage.completion_tokens
    assert spec_server.metrics()["fastdeploy_spec_decode_num_draft_tokens_total"] > 0


def test_invalid_speculative_config_fails_at_start():
    with pytest.raises(RuntimeError):
        RunningServer("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}')


def test_speculative_masks_are_the_same_sets_as_bitmaps(spec_server):
    """Accepted drafts arrive several to a delta; their bitmaps cut and align like the id lists."""
    import base64

    import numpy as np

    spec_client = spec_server.openai_client()
    messages = [{"role": "user", "content": f"Repeat this JSON exactly: {RECORD}"}]
    runs = {}
    for fmt in ("ids", "bitmap"):
        chunks = [ch.model_dump() for c in spec_client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=messages, temperature=0.7, seed=7, max_tokens=40, stream=True,
            extra_body={"top_k": 30, "return_token_ids": True, "sampling_mask_format": fmt}) for ch in c.choices]
        runs[fmt] = ([t for c in chunks for t in (c.get("token_ids") or [])],
                     [m for c in chunks for m in (c.get("sampling_mask") or [])])
    tokens, masks = runs["ids"]
    assert len(masks) == len(tokens) > 0
    bm_tokens, bitmaps = runs["bitmap"]
    assert bm_tokens == tokens
    decoded = [np.flatnonzero(np.unpackbits(np.frombuffer(base64.b64decode(b), np.uint8), bitorder="little"))
               .tolist() for b in bitmaps]
    assert decoded == masks
    assert all(t in m and len(m) <= 30 for t, m in zip(tokens, masks, strict=True))
