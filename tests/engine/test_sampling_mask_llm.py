"""Sampling mask and processed logprobs through the offline engine."""

from __future__ import annotations

import math

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.sampling_params import ParameterError


@pytest.fixture(scope="module")
def mask_llm() -> LLM:
    return LLM(enable_keep_sampling_mask=True, logprobs_mode="processed_logprobs")


def test_processed_logprobs_renormalise_over_the_kept_set(mask_llm):
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=8, logprobs=8, seed=0, ignore_eos=True)
    out = mask_llm.generate("The weather today is", params)[0].outputs[0]
    assert len(out.sampling_mask) == len(out.token_ids) == len(out.logprobs) == 8
    for mask, entry in zip(out.sampling_mask, out.logprobs):
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
