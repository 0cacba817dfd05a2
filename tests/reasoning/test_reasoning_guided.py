"""Offline: with a reasoning parser, guided decoding starts after the end-of-thinking marker."""

import json

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.common.guided_spec import GuidedSpec
from fastdeploy.reasoning import ThinkReasoningParser
from tests.reasoning.fewshot import CHOICES, CLOSED_PROMPT, COMPLETION_PROMPT

CHOICE = GuidedSpec("choice", json.dumps(CHOICES))


def greedy(guided=None, max_tokens=24):
    return SamplingParams(temperature=0, max_tokens=max_tokens, guided=guided)


@pytest.fixture(scope="module", params=[None, "ngram"])
def llm(request):
    spec = None if request.param is None else {"method": "ngram", "num_speculative_tokens": 4,
                                               "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return LLM(reasoning_parser="think", max_model_len=512, speculative_config=spec)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_constraint_starts_after_the_marker(llm, backend):
    parser = ThinkReasoningParser(llm.tokenizer)
    choice = GuidedSpec(CHOICE.kind, CHOICE.value, backend=backend)
    free, constrained = (llm.generate(COMPLETION_PROMPT, greedy(g))[0].outputs[0] for g in (None, choice))
    marker = parser.end_token_ids
    end = next(i + len(marker) for i in range(len(constrained.token_ids))
               if constrained.token_ids[i:i + len(marker)] == marker)
    # Before and through the marker nothing was masked: the same tokens as without a grammar.
    assert constrained.token_ids[:end] == free.token_ids[:end]
    reasoning, content = parser.split("", constrained.text)
    assert reasoning == "Ice is cold.\n"
    assert content in CHOICES  # unconstrained, the model answers "yes"
    assert free.text.startswith("Ice is cold.\n</think>yes")
    assert constrained.finish_reason == "stop"


def test_prompt_that_closed_thinking_is_constrained_from_the_first_token(llm):
    out = llm.generate(CLOSED_PROMPT, greedy(CHOICE))[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop"


def test_without_a_marker_the_output_stays_unconstrained(llm):
    prompt = "The capital of France is"
    free, constrained = (llm.generate(prompt, greedy(g, max_tokens=8))[0].outputs[0] for g in (None, CHOICE))
    assert constrained.token_ids == free.token_ids
    assert constrained.finish_reason == "length"
