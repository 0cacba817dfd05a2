import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fastdeploy.spec_decode.ngram_proposer import NgramProposer
from fastdeploy.spec_decode.verification import accepted_counts


def _ids(text: str) -> np.ndarray:
    return np.array([ord(c) for c in text], dtype=np.int64)


def test_longest_suffix_wins_and_latest_match_is_used():
    proposer = NgramProposer(min_n=1, max_n=3)
    # Suffix "abc" occurs twice earlier; the latest occurrence continues with "Y".
    assert proposer.propose(_ids("abcX..abcY..abc"), 2) == [ord("Y"), ord(".")]
    # Only a 1-token suffix "q" matches (no "zq" anywhere before).
    assert proposer.propose(_ids("qR..zq"), 3) == [ord("R"), ord("."), ord(".")]


def test_no_match_or_no_room_proposes_nothing():
    proposer = NgramProposer(min_n=2, max_n=4)
    assert proposer.propose(_ids("abcdefg"), 4) == []
    assert proposer.propose(_ids("abab"), 0) == []
    assert proposer.propose(_ids("a"), 3) == []


def test_draft_stops_at_the_end_of_the_context():
    # The match's continuation runs into the end of the context: fewer drafts than asked.
    assert NgramProposer(2, 2).propose(_ids("xyzxy"), 5) == [ord("z"), ord("x"), ord("y")]


def _scan_every_window(context: np.ndarray, min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The rule written out: for each suffix length, longest first, compare it with every
    earlier window of that length; the latest match's continuation."""
    length = len(context)
    if max_drafts <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = np.flatnonzero((sliding_window_view(context[: length - 1], n) == context[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return context[start: start + max_drafts].tolist()
    return []


def test_lookup_equals_a_scan_of_every_window():
    rng = np.random.default_rng(0)
    for _ in range(5000):
        context = rng.integers(0, int(rng.choice([2, 3, 5, 50])), int(rng.integers(1, 60)))
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 7))
        k = int(rng.integers(0, 6))
        assert NgramProposer(min_n, max_n).propose(context, k) == _scan_every_window(context, min_n, max_n, k), \
            (context.tolist(), min_n, max_n, k)


def test_accepted_counts_prefix_plus_one():
    drafts = [[5, 6, 7], [], [1, 2]]
    sampled = [5, 6, 9, 3,  # first two drafts match, the third slot corrects
               4,  # no draft: one token
               1, 2, 8]  # all drafts match: bonus token
    assert accepted_counts(sampled, drafts) == [3, 1, 3]
    assert accepted_counts([0, 6], [[5]]) == [1]
