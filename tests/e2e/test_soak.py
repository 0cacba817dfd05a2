"""A short soak (benchmarks/soak.py): mixed-feature streams with hang-ups mid-stream, three rounds."""

from __future__ import annotations

from benchmarks.soak import KINDS, make_specs, soak
from tests.e2e.conftest import SPEC_API_KEY


def test_short_soak_loses_nothing(spec_server):
    """Sampling masks, logprobs, a JSON schema, stop strings and n = 2 under n-gram speculation, more
    streams than --max-num-seqs, every fifth client hanging up: each request read to its end completes,
    the server drains, greedy texts equal each request alone, memory stays level over the last rounds."""
    specs = make_specs(3 * len(KINDS), disconnect=0.2, max_tokens=12)
    assert {s.kind for s in specs} == set(KINDS) and sum(s.hang_up_after is not None for s in specs) == 3
    report = soak(spec_server.base_url, SPEC_API_KEY, spec_server.proc.pid, specs, rounds=3)
    print(report.rounds)
    assert report.ok, "\n".join(report.failures[:20])
    assert all(r["hung_up"] == 3 and r["completed"] == len(specs) - 3 for r in report.rounds), report.rounds
