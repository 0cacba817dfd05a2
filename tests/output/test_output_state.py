"""RequestOutputState and CompletionOutput over long generations: stop strings found wherever
they fall (across deltas, inside a multi-token delta, after thousands of characters), text never
emitted past them, and the accumulated output equal to the whole decode."""

from __future__ import annotations

import random

import pytest

from fastdeploy.common.request import RequestDelta
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.output.detokenizer import TokenTexts
from fastdeploy.output.output_processor import CompletionOutput, RequestOutputState

WORDS = "the engine streams tokens while a step runs and stops at the marker END or at STOP now".split()


def _feed(tokenizer, ids: list[int], params: SamplingParams, seed: int) -> tuple[CompletionOutput, list[str]]:
    """Deltas of 1-4 tokens (speculative steps bring several), the last one finishing on length."""
    state = RequestOutputState(params, tokenizer, TokenTexts(tokenizer))
    output = CompletionOutput()
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(ids) and not state.finished:
        n = rng.randint(1, 4)
        last = i + n >= len(ids)
        chunk = state.update(RequestDelta("r", ids[i:i + n], finish_reason="length" if last else None))
        output.add(chunk)
        chunks.append(chunk.text)
        i += n
    return output, chunks


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_long_generations_where_they_first_occur(embedded_tokenizer, include):
    tok = embedded_tokenizer
    rng = random.Random(0)
    for seed in range(6):
        # Some thousands of characters before the first stop string, so the kept tail moves on
        # many times before the stop is found.
        text = " ".join(rng.choice(WORDS[:-4]) for _ in range(400 + 150 * seed))
        text += " " + rng.choice(["END", "STOP now"]) + " " + " ".join(rng.choice(WORDS) for _ in range(30))
        ids = tok.encode(text, add_special_tokens=False)
        whole = tok.decode(ids)
        stops = ["END", "STOP now", "never in the text"]
        first = min((whole.find(s), s) for s in stops if s in whole)
        expected = whole[:first[0] + (len(first[1]) if include else 0)]
        output, chunks = _feed(tok, ids, SamplingParams(stop=stops, include_stop_str_in_output=include), seed)
        assert output.finish_reason == "stop" and output.stop_reason == first[1]
        assert output.text == "".join(chunks) == expected
        # The tokens kept are those up to the one that completed the stop string.
        assert tok.decode(output.token_ids).startswith(expected)
        assert len(output.token_ids) < len(ids)


def test_without_stop_strings_the_output_is_the_whole_decode(embedded_tokenizer):
    tok = embedded_tokenizer
    rng = random.Random(1)
    text = " ".join(rng.choice(WORDS) for _ in range(3000))
    ids = tok.encode(text, add_special_tokens=False)
    output, _ = _feed(tok, ids, SamplingParams(), 7)
    assert output.finish_reason == "length"
    assert output.token_ids == ids and output.text == tok.decode(ids)
