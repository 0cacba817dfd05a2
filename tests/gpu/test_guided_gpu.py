"""Structured output on CUDA: the bitmask rows come from reused page-locked buffers and reach the
sampler by a non-blocking copy, with steps pipelined (the default on CUDA), in turn, and verified
with n-gram drafts. Every way gives the same greedy texts, and the constrained ones hold the schema.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from fastdeploy import LLM
from fastdeploy.common.guided_spec import GuidedSpec
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.model_executor.guided_decoding.matcher import PinnedBitmasks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                                       "age": {"type": "integer"}},
                                     "required": ["name", "age"], "additionalProperties": False},
          "minItems": 3, "maxItems": 3}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
         "adaptive": False}


def _texts(**kwargs) -> list[str]:
    """Twelve greedy chats, every other one under SCHEMA, all in one batch."""
    llm = LLM(device="cuda", max_num_seqs=16, num_kv_blocks=1024, **kwargs)
    prompts = [[{"role": "user", "content": f"List three people, request {i}. Answer with JSON."}] for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=96,
                             guided=GuidedSpec("json_schema", json.dumps(SCHEMA)) if i % 2 == 0 else None)
              for i in range(12)]
    try:
        return [o.outputs[0].text for o in llm.chat(prompts, params)]
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_pipelined_in_turn_and_verified_steps_give_the_same_valid_json() -> None:
    pipelined = _texts()
    assert pipelined == _texts(async_scheduling="off")
    assert pipelined == _texts(speculative_config=NGRAM)
    for text in pipelined[0::2]:
        people = json.loads(text)
        assert len(people) == 3 and all(set(p) == {"name", "age"} and isinstance(p["age"], int) for p in people)


def test_pinned_bitmasks_alternate_and_grow() -> None:
    ring = PinnedBitmasks(49_152)
    a, b, c = ring.take(4), ring.take(4), ring.take(4)
    assert a.is_pinned() and a.shape == (4, 1_536) and a.dtype == torch.int32
    assert a.data_ptr() != b.data_ptr() and a.data_ptr() == c.data_ptr()
    big = ring.take(9)
    assert big.shape[0] == 9 and big.is_pinned()
