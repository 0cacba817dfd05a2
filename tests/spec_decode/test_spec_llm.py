"""Speculative decoding through the offline engine: same tokens, logprobs and masks as without it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.common.guided_spec import GuidedSpec

# Fixed drafts: these tests are about what verification returns, so every step must draft; the
# adaptive policy (tests/scheduler/test_draft_policy.py) may measure that drafting does not pay
# on this machine and stop.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
         "adaptive": False}
RECORD = '{"name": "Alice Smith", "age": 30, "city": "Paris", "tags": ["admin", "editor"], "active": true}'
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = [
    [{"role": "user", "content": f"Repeat this JSON exactly: {RECORD}"}],
    [{"role": "user", "content": f"Rewrite this code with type hints:\n{CODE}"}],
    [{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": f"Copy the following text: {CODE}"}],
    [{"role": "user", "content": "List three colours, then list them again in reverse order."}],
    [{"role": "user", "content": "Explain what a hash map is in two sentences."}],
]


@pytest.fixture(scope="module")
def base() -> LLM:
    return LLM(max_num_seqs=16, enable_keep_sampling_mask=True)


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM(max_num_seqs=16, enable_keep_sampling_mask=True, speculative_config=NGRAM)


def test_greedy_tokens_and_logprobs_equal_non_speculative(base, spec):
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=5)
    before = spec.engine.spec_stats.num_accepted_draft_tokens
    expected = base.chat(PROMPTS, params)
    got = spec.chat(PROMPTS, params)
    assert spec.engine.spec_stats.num_accepted_draft_tokens - before > 20, "no drafts were accepted"
    for e, g in zip(expected, got, strict=True):
        e, g = e.outputs[0], g.outputs[0]
        assert g.token_ids == e.token_ids
        assert g.finish_reason == e.finish_reason
        for le, lg in zip(e.logprobs, g.logprobs, strict=True):
            assert lg.logprob == pytest.approx(le.logprob, abs=1e-4)
            assert [t.token_id for t in lg.top_logprobs] == [t.token_id for t in le.top_logprobs]
            for te, tg in zip(le.top_logprobs, lg.top_logprobs, strict=True):
                assert tg.logprob == pytest.approx(te.logprob, abs=1e-4)
        assert g.sampling_mask == [[t] for t in g.token_ids]  # greedy: the argmax


def test_stops_inside_an_accepted_run(base, spec):
    prompt = PROMPTS[0]
    full = base.chat(prompt, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    # max_tokens, a stop token and a stop string that all fall inside drafted runs.
    for params in (
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full.token_ids[12]]),
        SamplingParams(temperature=0, max_tokens=40, stop=['"city"']),
    ):
        e = base.chat(prompt, params)[0].outputs[0]
        g = spec.chat(prompt, params)[0].outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (e.token_ids, e.text, e.finish_reason,
                                                                         e.stop_reason)
        assert len(g.sampling_mask) == len(g.token_ids)


def test_sampled_masks_and_top_logprobs_are_the_targets_at_each_position(base, spec):
    """With top-k/top-p sampling, each accepted token's mask, logZ and top_logprobs equal what the
    non-speculative engine reports at the same prefix (they do not depend on the draw)."""
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=24, logprobs=3, seed=7)
    before = spec.engine.spec_stats.num_accepted_draft_tokens
    out = spec.chat(PROMPTS[1], params)[0]
    assert spec.engine.spec_stats.num_accepted_draft_tokens > before, "no drafts were accepted"
    g = out.outputs[0]
    prefixes = [out.prompt_token_ids + g.token_ids[:i] for i in range(len(g.token_ids))]
    single = base.generate(prefixes, SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=1,
                                                    logprobs=3))
    for i, ref in enumerate(single):
        r = ref.outputs[0]
        assert g.token_ids[i] in g.sampling_mask[i]
        assert g.sampling_mask[i] == r.sampling_mask[0]
        assert g.sampling_logz[i] == pytest.approx(r.sampling_logz[0], abs=1e-5)
        assert [t.token_id for t in g.logprobs[i].top_logprobs] == [t.token_id for t in r.logprobs[0].top_logprobs]
        for tg, tr in zip(g.logprobs[i].top_logprobs, r.logprobs[0].top_logprobs, strict=True):
            assert tg.logprob == pytest.approx(tr.logprob, abs=1e-4)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}}, "active": {"type": "boolean"}},
    "required": ["name", "age", "city"],
}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_guided_json_with_drafts_equals_guided_json_without(base, spec, backend):
    """Drafts are cut where the grammar rejects them and rolled back when verification does."""
    params = SamplingParams(temperature=0, max_tokens=80,
                            guided=GuidedSpec("json_schema", json.dumps(SCHEMA), backend=backend))
    before = spec.engine.spec_stats.num_accepted_draft_tokens
    e = base.chat(PROMPTS[0], params)[0].outputs[0]
    g = spec.chat(PROMPTS[0], params)[0].outputs[0]
    assert spec.engine.spec_stats.num_accepted_draft_tokens > before, "no drafts were accepted"
    assert g.token_ids == e.token_ids and g.finish_reason == "stop"
    jsonschema.validate(json.loads(g.text), SCHEMA)


def test_bad_speculative_config_is_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="method"):
        LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def test_mtp_with_tensor_parallelism_is_refused_before_anything_starts():
    """Only rank 0 drafts, and the MTP module's passes run collectives every rank must join: the
    combination is refused with its reason, offline and by the server (a usage error), before a
    worker starts; a config made without EngineArgs is refused by the worker before the group
    forms. n-gram speculation under tensor parallelism is still accepted."""
    from fastdeploy.common.config import EngineConfig
    from fastdeploy.common.speculative_config import parse_speculative_config
    from fastdeploy.engine.args import EngineArgs
    from fastdeploy.entrypoints.openai.api_server import build_app, make_parser
    from fastdeploy.worker.tp_startup import start_tensor_parallel

    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    message = r"MTP speculative decoding does not work with --tensor-parallel-size > 1 \(only rank 0 drafts"
    with pytest.raises(ValueError, match=message):
        LLM(tensor_parallel_size=2, speculative_config=mtp)
    with pytest.raises(SystemExit, match=message):
        build_app(make_parser().parse_args(["--tensor-parallel-size", "2", "--speculative-config", json.dumps(mtp)]))
    config = EngineConfig(tensor_parallel_size=2, speculative=parse_speculative_config(mtp))
    with pytest.raises(ValueError, match=message):
        start_tensor_parallel(config, 0, "unused-rendezvous-file")
    ngram = EngineArgs(tensor_parallel_size=2, speculative_config=NGRAM).create_engine_config()
    assert ngram.speculative is not None and ngram.speculative.method == "ngram"
    assert EngineArgs(speculative_config=mtp).create_engine_config().speculative.method == "mtp"  # one rank
    assert "refused with MTP speculation" in " ".join(make_parser().format_help().split())
