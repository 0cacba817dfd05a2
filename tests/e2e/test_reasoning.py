"""`--reasoning-parser think` through the real server and the `openai` client.

The embedded model is not a reasoning model; a few-shot chat makes it think in `<think>`
tags deterministically (greedy), so the split and the late start of constraints are
checked on real generations.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.e2e.conftest import MODEL
from tests.reasoning.fewshot import CHAT_MESSAGES, CHOICES

ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": CHOICES}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def reasoning_server(server_launcher):
    """`--reasoning-parser think` (its arguments: conftest.py, SERVERS)."""
    yield from server_launcher.serve("reasoning_server")


@pytest.fixture(scope="module")
def reasoning_client(reasoning_server):
    return reasoning_server.openai_client()


def chat(client, **extra):
    return client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, temperature=0, max_tokens=40,
                                          extra_body={"return_token_ids": True, **extra})


def test_split_and_constraint_after_the_marker(reasoning_client):
    free = chat(reasoning_client).choices[0]
    constrained = chat(reasoning_client, guided_choice=CHOICES).choices[0]
    # Unconstrained, the model thinks, closes the tag and answers "no".
    assert free.message.reasoning_content == "\nIce is cold.\n"
    assert free.message.content == "no"
    assert constrained.message.reasoning_content == free.message.reasoning_content
    assert constrained.message.content in CHOICES
    assert constrained.finish_reason == "stop"
    # Every token up to the marker is the unconstrained one: no mask before the marker.
    thinking = len(free.token_ids) - 2  # "no" and eos follow the marker
    assert constrained.token_ids[:thinking] == free.token_ids[:thinking]


def test_streamed_split_with_a_json_schema(reasoning_client):
    stream = reasoning_client.chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, temperature=0, max_tokens=60, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
    reasoning, content, finish = [], [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
        assert not (reasoning[-1] and "</" in reasoning[-1])  # the marker never leaks into a delta
    assert "".join(reasoning) == "\nIce is cold.\n"
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(content)), ANSWER)
