"""The think-style reasoning parser: text split (whole and streamed), token-level end detection."""

import pytest

from fastdeploy.reasoning import EndMarkerDetector, ThinkReasoningParser, get_reasoning_parser, reasoning_parser_names

OPEN_PROMPT = "<|im_start|>assistant\n"
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def parser(embedded_tokenizer):
    return ThinkReasoningParser(embedded_tokenizer)


def test_registry():
    assert "think" in reasoning_parser_names()
    assert get_reasoning_parser("think") is ThinkReasoningParser
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("output, expected", [
    ("<think>\nsky is blue\n</think>yes", ("\nsky is blue\n", "yes")),
    ("  <think>a</think>\n\nb", ("a", "\n\nb")),
    ("the template opened it</think>{}", ("the template opened it", "{}")),
    ("still thinking <thi", ("still thinking <thi", None)),
    ("a </think> b </think> c", ("a ", " b </think> c")),
    ("</think>only content", (None, "only content")),
])
def test_split(parser, output, expected):
    assert parser.split(OPEN_PROMPT, output) == expected


def test_prompt_that_closed_thinking_gives_all_content(parser):
    assert parser.split(CLOSED_PROMPT, "x </think> y") == (None, "x </think> y")
    assert not parser.prompt_closes_reasoning(OPEN_PROMPT)


@pytest.mark.parametrize("output", [
    "<think>\nIce is cold.\n</think>yes",
    "Ice is cold.</think>no more",
    "<b>not a start marker</b></think>x",
    "never ends </thin",
])
def test_streamed_split_equals_whole_split_for_every_cut(parser, output):
    """Any split of the text into deltas (here: every pair of cut points) gives the same result,
    and no delta ever shows part of a marker."""
    whole = parser.split(OPEN_PROMPT, output)
    for i in range(len(output) + 1):
        for j in range(i, len(output) + 1):
            splitter = parser.splitter(OPEN_PROMPT)
            parts = [splitter.feed(d) for d in (output[:i], output[i:j], output[j:])] + [splitter.finish()]
            reasoning = "".join(r for r, _ in parts)
            content = "".join(c for _, c in parts)
            assert (reasoning or None, content or None) == whole, (i, j)
            for r, _ in parts[:-1]:  # before the end, a possible marker beginning is held back
                assert not any(r.endswith("</think>"[:n]) for n in range(1, len("</think>"))), (i, j, r)


def test_end_marker_tokens_and_prompt_ids(parser):
    tok = parser.tokenizer
    assert tok.decode(parser.end_token_ids) == "</think>"
    assert len(parser.end_token_ids) > 1  # a plain BPE vocabulary: the marker spans several tokens
    assert parser.prompt_ids_close_reasoning(tok.encode(CLOSED_PROMPT, add_special_tokens=False))
    assert not parser.prompt_ids_close_reasoning(tok.encode(OPEN_PROMPT + "</think> later", add_special_tokens=False))


def test_detector_fires_once_on_the_token_that_completes_the_marker(parser):
    ids = parser.tokenizer.encode("Ice is cold.\n</think>yes </think>", add_special_tokens=False)
    detector = parser.end_detector()
    fired = [i for i, t in enumerate(ids) if detector.feed(t)]
    end = ids.index(parser.end_token_ids[-1])
    assert fired == [end]
    assert ids[end - len(parser.end_token_ids) + 1: end + 1] == parser.end_token_ids


def test_detector_needs_the_whole_sequence_in_order():
    detector = EndMarkerDetector([5, 6, 7])
    assert [detector.feed(t) for t in [5, 6, 5, 6, 7, 5, 6, 7]] == [False, False, False, False, True, False, False,
                                                                   False]
    with pytest.raises(ValueError):
        EndMarkerDetector([])
