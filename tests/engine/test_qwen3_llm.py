"""The engine's features on Qwen3 and Qwen3-MoE: sampling mask, logprobs, n-gram speculation, structured output.

Tiny random checkpoints saved by transformers with the embedded model's tokenizer beside them
(its 49,152-token vocabulary), run through the offline engine like the embedded model is.
"""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.common.guided_spec import GuidedSpec
from tests.random_hf_models import save_random_hf_model

VOCAB = 49152
MODELS = {
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True}),
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}  # fmt: skip
PROMPTS = ["one two three one two three one two", "The capital of France is", "def f(x):\n    return x"]


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory, embedded_tokenizer) -> str:
    kind, overrides = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_random_hf_model(path, kind, VOCAB, **overrides)
    embedded_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, enable_keep_sampling_mask=True, max_num_seqs=8)


def test_sampling_mask_and_logprobs(llm) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=12, logprobs=3, seed=1, ignore_eos=True)
    for out in llm.generate(PROMPTS, params):
        o = out.outputs[0]
        assert len(o.token_ids) == len(o.sampling_mask) == len(o.logprobs) == len(o.sampling_logz) == 12
        for token, mask, entry, logz in zip(o.token_ids, o.sampling_mask, o.logprobs, o.sampling_logz, strict=True):
            assert token in mask and len(mask) <= 20 and mask == sorted(mask)
            assert entry.token_id == token and entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert logz <= 1e-6 and math.isfinite(logz)


def test_ngram_speculation_keeps_tokens_and_logprobs(llm, model_dir) -> None:
    spec = LLM(model_dir, enable_keep_sampling_mask=True, max_num_seqs=8, speculative_config=NGRAM)
    prompt = llm.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    # A random model seldom repeats itself; a bias towards the prompt's own tokens makes it, so the
    # proposer finds n-grams to draft from (the bias is part of both runs' target distribution).
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True,
                            logit_bias={t: 8.0 for t in prompt})
    expected = llm.generate(PROMPTS, params)
    got = spec.generate(PROMPTS, params)
    assert spec.engine.spec_stats.num_accepted_draft_tokens > 0, "no drafts were accepted"
    for e, g in zip(expected, got, strict=True):
        e, g = e.outputs[0], g.outputs[0]
        assert g.token_ids == e.token_ids
        for le, lg in zip(e.logprobs, g.logprobs, strict=True):
            assert lg.logprob == pytest.approx(le.logprob, abs=1e-4)
            assert [t.token_id for t in lg.top_logprobs] == [t.token_id for t in le.top_logprobs]
        assert g.sampling_mask == [[t] for t in g.token_ids]  # greedy: the argmax


def test_structured_output(llm) -> None:
    # Without whitespace: a random model would otherwise fill its budget with the blanks JSON allows.
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA), disable_any_whitespace=True)
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, guided=spec)
    for out in llm.generate(PROMPTS, params):
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
