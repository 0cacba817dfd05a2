"""Sampling mask and processed logprobs through the offline engine."""

from __future__ import annotations

import math

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.common.sampling_params import ParameterError


@pytest.fixture(scope="module")
def mask_llm() -> LLM:
    return LLM(enable_keep_sampling_mask=True, logprobs_mode="processed_logprobs")


def test_processed_logprobs_renormalise_over_the_kept_set(mask_llm):
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=8, logprobs=8, seed=0, ignore_eos=True)
    out = mask_llm.generate("The weather today is", params)[0].outputs[0]
    assert len(out.sampling_mask) == len(out.token_ids) == len(out.logprobs) == 8
    for mask, entry in zip(out.sampling_mask, out.logprobs, strict=True):
        assert entry.token_id in mask and len(mask) <= 5
        kept = [t for t in entry.top_logprobs if t.logprob > -math.inf]
        assert sorted(t.token_id for t in kept) == mask
        assert math.log(sum(math.exp(t.logprob) for t in kept)) == pytest.approx(0.0, abs=1e-5)


def test_flag_required(llm):
    with pytest.raises(ParameterError) as info:
        llm.generate("hi", SamplingParams(return_sampling_mask=True))
    assert info.value.param == "return_sampling_mask"
    assert "--enable-keep-sampling-mask" in str(info.value)


def test_mask_opt_out_per_request(mask_llm):
    outs = mask_llm.generate(["a", "b"], [SamplingParams(top_p=0.8, max_tokens=4, return_sampling_mask=False),
                                          SamplingParams(top_p=0.8, max_tokens=4)])
    assert outs[0].outputs[0].sampling_mask is None
    assert len(outs[1].outputs[0].sampling_mask) == len(outs[1].outputs[0].token_ids)


@pytest.mark.parametrize("top_p, mask_format", [(0.95, "ids"), (1.0, "ids"), (1.0, "bitmap")])
def test_masks_lie_inside_the_grammar_and_logprobs_come_along(mask_llm, top_p, mask_format):
    """With structured output, each kept set is a subset of the tokens the grammar allowed;
    without truncation it is exactly that set (the draw's support), and logZ is 0."""
    import json

    import numpy as np

    from fastdeploy.common.guided_spec import GuidedSpec
    from fastdeploy.model_executor.guided_decoding.compiler import GrammarCompileService
    from fastdeploy.model_executor.guided_decoding.matcher import GuidedState, fill_bitmasks
    from fastdeploy.model_executor.layers.sample.ops import unpack_token_bitmask

    spec = GuidedSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"},
                                          "note": {"type": "string", "maxLength": 12}},
         "required": ["colour", "n", "note"]}))
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=60, seed=11, logprobs=3, guided=spec,
                            sampling_mask_format=mask_format)
    out = mask_llm.chat([{"role": "user", "content": "A colour, a number and a note as JSON."}],
                        params)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    assert len(out.sampling_mask) == len(out.token_ids) == len(out.logprobs) == len(out.sampling_logz)

    config = mask_llm.engine.executor.runner.model_config
    service = GrammarCompileService.from_tokenizer(mask_llm.tokenizer, config.vocab_size,
                                                   stop_token_ids=list(config.eos_token_ids))
    state = GuidedState(service.compile(spec))
    sizes = []
    for token, mask, logz in zip(out.token_ids, out.sampling_mask, out.sampling_logz, strict=True):
        allowed = unpack_token_bitmask(fill_bitmasks([state], config.vocab_size), config.vocab_size)[0]
        if mask_format == "bitmap":
            mask = np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")).tolist()
        assert mask and token in mask
        assert bool(allowed[mask].all()), "a kept token was outside the grammar"
        if top_p == 1.0:
            assert mask == allowed.nonzero().squeeze(1).tolist() and logz == 0.0
        sizes.append(len(mask))
        assert state.accept(token)
    service.shutdown()
    if top_p == 1.0:  # the string's characters: most of the vocabulary, short of all of it
        assert max(sizes) > config.vocab_size // 2


def test_bitmap_format_offline_gives_the_same_tokens_and_sets(mask_llm):
    import numpy as np

    outs = {}
    for fmt in ("ids", "bitmap"):
        params = SamplingParams(temperature=1.3, top_p=0.97, max_tokens=6, seed=4, ignore_eos=True,
                                sampling_mask_format=fmt)
        outs[fmt] = mask_llm.generate("Once upon a time", params)[0].outputs[0]
    ids, bitmap = outs["ids"], outs["bitmap"]
    assert bitmap.token_ids == ids.token_ids and bitmap.sampling_logz == ids.sampling_logz
    width = (mask_llm.engine.executor.runner.model_config.vocab_size + 7) // 8
    for raw, want in zip(bitmap.sampling_mask, ids.sampling_mask, strict=True):
        assert isinstance(raw, bytes) and len(raw) == width
        assert np.flatnonzero(np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")).tolist() == want


def test_unknown_mask_format_offline_is_refused(mask_llm):
    with pytest.raises(ParameterError) as info:
        mask_llm.generate("hi", SamplingParams(sampling_mask_format="bits"))
    assert info.value.param == "sampling_mask_format"
