"""Host-device synchronisations per decode step on CUDA: the packed frame's copy and nothing else.

The embedded model on CUDA (bf16, CUDA graphs), 8 chat prompts x 24 tokens, counted with
PyTorch's sync debug mode around every `ModelRunner.execute` (`tests/gpu/sync_count.py`).
Prefill steps may synchronise more (their row gathers are built on the host); steady decode
steps must not.
"""

from __future__ import annotations

import collections
import gc

import pytest
import torch

from fastdeploy import LLM
from fastdeploy.common.sampling_params import SamplingParams
from tests.gpu.sync_count import count_step_syncs, steady_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
           "Why is the sky blue?", "What is 12 times 13?", "Name a large animal.", "Say hello.", "Count to five."]


# Function scope: each engine is gone before the next one sizes its KV cache from the GPU's
# free memory (two module-scoped engines would both live until the module ends).
@pytest.fixture
def llm():
    engine = LLM(guided_decoding_backend="off", device="cuda", max_num_seqs=8)
    yield engine
    engine.engine.shutdown()  # its CUDA graphs and caches go now, not whenever the last reference does
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def _decode_syncs(llm: LLM, params: SamplingParams):
    runner = llm.engine.executor.runner
    with count_step_syncs(runner) as steps:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outputs)
    # A prompt admitted a step before the others (one that waited for a shared prefix, or a
    # chunked prefill) also finishes a step earlier, so the batch may thin out at the end:
    # count the steps that hold every prompt.
    decode = [s for s in steady_decode(steps) if s.batch == len(PROMPTS)]
    assert len(decode) >= params.max_tokens // 2, "the batch should decode together"
    return decode


def _report(steps) -> str:
    sources = collections.Counter(src for s in steps for src in s.sources)
    return f"{len(steps)} decode steps, synchronising calls PyTorch saw: {dict(sources)}"


def test_greedy_decode_step_synchronises_once(llm):
    steps = _decode_syncs(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert all(s.total == 1 for s in steps), _report(steps)


def test_top_p_logprobs_decode_step_synchronises_once(llm):
    """Seeded top-p rows: the kept-set kernel's unsettled rows are found in the frame, not by a read."""
    params = SamplingParams(temperature=0.8, top_p=0.9, logprobs=5, max_tokens=24, ignore_eos=True, seed=7)
    steps = _decode_syncs(llm, params)
    assert all(s.total == 1 for s in steps), _report(steps)


@pytest.fixture
def llm_with_masks():
    engine = LLM(guided_decoding_backend="off", device="cuda", max_num_seqs=8, enable_keep_sampling_mask=True)
    yield engine
    engine.engine.shutdown()  # its CUDA graphs and caches go now, not whenever the last reference does
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def test_sampling_mask_decode_step_synchronises_once(llm_with_masks):
    """The CSR's ids go into a buffer sized from the shapes, so no read sizes them; the ids
    follow the frame's head without a second wait inside the step."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3)
    steps = _decode_syncs(llm_with_masks, params)
    assert all(s.total == 1 for s in steps), _report(steps)


def test_bitmap_mask_decode_step_synchronises_once(llm_with_masks):
    """Bitmaps are packed on the device with no host-made tensor, and their copy is queued ahead
    of the frame's head, so the head's wait is still the step's only one."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3,
                            sampling_mask_format="bitmap")
    steps = _decode_syncs(llm_with_masks, params)
    assert all(s.total == 1 for s in steps), _report(steps)


class _FixedCap:
    """A draft policy that drafts the same number every step."""

    def __init__(self, cap: int) -> None:
        self.k = cap

    def cap(self, num_rows: int) -> int:
        return self.k

    def observe(self, *args, **kwargs) -> None:
        pass

    def describe(self) -> str:
        return f"fixed {self.k}"


@pytest.mark.parametrize("spec", [{"method": "mtp", "num_speculative_tokens": 2},
                                  {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3}], ids=["mtp", "ngram"])
def test_verify_steps_sent_ahead_synchronise_once(spec):
    """A verify step sent ahead (its accept counts, the next step's placement and drafts, all on
    the device) waits for the GPU only for its frame: a wait inside its launch would stall the
    host behind the step still running and undo the overlap."""
    engine = LLM(guided_decoding_backend="off", device="cuda", max_num_seqs=8, speculative_config=spec)
    try:
        engine.engine.draft_policy = _FixedCap(2)
        runner = engine.engine.executor.runner
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        with count_step_syncs(runner) as steps:
            engine.chat([[{"role": "user", "content": f"Repeat exactly: {p} {p}"}] for p in PROMPTS], params)
        verifying = [s for s in steps if s.batch and s.verifies][2:]
        assert len(verifying) >= 8, f"{len(steps)} steps, {len(verifying)} verifying"
        assert all(s.total == 1 for s in verifying), _report(verifying)
    finally:
        engine.engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
