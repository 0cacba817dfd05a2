"""GrammarCompileService: async submit/poll, dedup and cache, failures, timeouts, cancel; each
test that takes `compile_service` or `grammar_backend` runs on both backends."""

from __future__ import annotations

import time

import pytest

from fastdeploy.model_executor.guided_decoding import GrammarCompileService, GuidedSpec

# ~0.5 s cold on this machine: long enough to observe, short enough for a unit test.
SLOW = GuidedSpec("regex", "[a-z]{1,200}")


def wait_all(service: GrammarCompileService, keys: set[int], timeout: float = 60.0):
    ready, failed = {}, {}
    deadline = time.monotonic() + timeout
    while set(ready) | set(failed) != keys:
        assert time.monotonic() < deadline, "compile service hung"
        r, f = service.poll()
        ready.update(r)
        failed.update(f)
        time.sleep(0.005)
    return ready, failed


def test_submit_poll_and_failures(compile_service):
    compile_service.submit(1, GuidedSpec("regex", "[0-9]+"))
    compile_service.submit(2, GuidedSpec("regex", "(("))
    compile_service.submit(3, GuidedSpec("choice", "[]"))
    ready, failed = wait_all(compile_service, {1, 2, 3})
    assert set(ready) == {1}
    words = {"xgrammar": "parenthesis is not closed", "llguidance": "unclosed group"}[compile_service.default_backend]
    assert words in failed[2] and "/project" not in failed[2]
    assert "empty" in failed[3]
    assert compile_service.poll() == ({}, {})  # each key is reported once
    assert compile_service.num_pending == 0


def test_identical_specs_compile_once(grammar_backend):
    service = GrammarCompileService(grammar_backend, max_workers=2, timeout_s=60)
    try:
        t = time.perf_counter()
        service.compile(SLOW)
        cold = time.perf_counter() - t
        assert service.cache_size_bytes() > 0
        t = time.perf_counter()
        service.compile(SLOW)
        cached = time.perf_counter() - t
        print(f"cold {cold * 1e3:.1f} ms, cached {cached * 1e3:.3f} ms")
        assert cached < max(cold / 20, 0.002), "second compile of the same spec did not hit the cache"

        # In flight at the same time: one job, both keys get the same compiled grammar.
        spec = GuidedSpec("regex", "[a-z0-9]{1,150}")
        service.submit(10, spec)
        service.submit(11, spec)
        assert len(service._jobs) == 1
        ready, failed = wait_all(service, {10, 11})
        assert not failed and ready[10] is ready[11]
    finally:
        service.shutdown()


def test_timeout_is_reported_and_poll_does_not_block(backends):
    # xgrammar: its compile of this regex takes far longer than the timeout (about 150 ms on an idle
    # 2-core machine; llguidance's does not). No other test compiles it, so no cache holds it.
    service = GrammarCompileService(backends["xgrammar"], max_workers=1, timeout_s=0.02)
    try:
        service.submit(1, GuidedSpec("regex", "[a-y]{1,240}"))
        worst = 0.0
        deadline = time.monotonic() + 30
        failed = {}
        while not failed:
            assert time.monotonic() < deadline
            t = time.perf_counter()
            ready, failed = service.poll()
            worst = max(worst, time.perf_counter() - t)
            assert not ready
            time.sleep(0.002)
        assert failed == {1: "grammar compilation timed out after 0.02 s"}
        assert worst < 0.05, "poll blocked on a running compile"
        # The same spec resubmitted while the abandoned compile still runs fails at once.
        if service.num_abandoned:
            service.submit(2, GuidedSpec("regex", "[a-y]{1,240}"))
            _, failed = service.poll()
            assert 2 in failed
    finally:
        service.shutdown()


def test_cancel(compile_service):
    # Occupy both workers, then cancel a queued compile: it never reports.
    compile_service.submit(1, GuidedSpec("regex", "[b-y]{1,190}"))
    compile_service.submit(2, GuidedSpec("regex", "[c-x]{1,180}"))
    compile_service.submit(3, GuidedSpec("regex", "[d-w]{1,170}"))
    compile_service.cancel(3)
    compile_service.cancel(99)  # unknown key: no-op
    ready, failed = wait_all(compile_service, {1, 2})
    assert set(ready) == {1, 2} and not failed
    time.sleep(0.05)
    assert compile_service.poll() == ({}, {})
    assert compile_service.num_pending == 0


@pytest.mark.parametrize("kind", ["json_object", "grammar", "structural_tag"])
def test_every_kind_compiles(compile_service, kind):
    if kind == "structural_tag" and compile_service.default_backend == "llguidance":
        pytest.skip("structural tags compile on xgrammar only")
    value = {
        "json_object": "",
        "grammar": 'root ::= "a"+',
        "structural_tag": '{"type":"structural_tag","format":{"type":"const_string","value":"hi"}}',
    }[kind]
    compile_service.submit(5, GuidedSpec(kind, value))
    ready, failed = wait_all(compile_service, {5})
    assert 5 in ready, failed


def test_specs_compile_on_the_backend_they_name(backends):
    """One service, both backends: each spec compiles on the backend pinned in it, and the
    cache keeps them apart."""
    service = GrammarCompileService([backends["xgrammar"], backends["llguidance"]], timeout_s=60)
    try:
        spec = GuidedSpec("regex", "[a-c]{2,5}")
        x = service.compile(spec)  # "" = the first backend given
        lg = service.compile(GuidedSpec("regex", "[a-c]{2,5}", backend="llguidance"))
        assert x.backend.name == "xgrammar" and lg.backend.name == "llguidance"
        assert service.compile(GuidedSpec("regex", "[a-c]{2,5}", backend="xgrammar")) is x
        with pytest.raises(ValueError, match="structural tags need the xgrammar backend"):
            service.compile(GuidedSpec("structural_tag", "{}", backend="llguidance"))
    finally:
        service.shutdown()
    only_x = GrammarCompileService(backends["xgrammar"])
    only_x.submit(1, GuidedSpec("regex", "a", backend="llguidance"))
    _, failed = wait_all(only_x, {1})
    assert "not enabled" in failed[1]
    only_x.shutdown()
