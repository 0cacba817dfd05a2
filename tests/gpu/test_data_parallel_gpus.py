"""Two data-parallel replicas on a host with two GPUs: each replica's engine runs on its own GPU
(both GPUs' free memory drops while they serve), with either backend, and every answer is the
greedy answer of one engine started alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fastdeploy.engine.replicas import ReplicaSet
from tests.gpu.replica_checks import Answer, answers, answers_alone, prompts, small_cuda_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

# A replica's engine and worker hold a CUDA context and the model on their GPU: hundreds of MiB.
MIN_USED_BYTES = 200 * 1024 * 1024


def _free_bytes() -> list[int]:
    return [torch.cuda.mem_get_info(i)[0] for i in range(2)]


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_two_replicas_use_both_gpus_and_answer_as_one_engine(tmp_path, monkeypatch, backend: str) -> None:
    if backend == "ray":
        ray = pytest.importorskip("ray")
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = small_cuda_config(tmp_path)
    batch = prompts(8)

    async def two_replicas() -> tuple[list[Answer], list[int]]:
        replicas = ReplicaSet(config, 2, backend=backend)
        await replicas.start()
        try:
            return await answers(replicas.generate, batch), _free_bytes()
        finally:
            await replicas.shutdown()
            if backend == "ray":
                ray.shutdown()

    before = _free_bytes()  # first: an engine that just stopped may not have given its memory back yet
    expected = asyncio.run(answers_alone(config, batch))
    got, during = asyncio.run(two_replicas())
    used = [b - d for b, d in zip(before, during, strict=True)]
    assert all(u >= MIN_USED_BYTES for u in used), f"bytes taken on each GPU while serving: {used}"
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        # Each replica batches its share of the prompts, so the matrix products run at other row
        # counts than in the single engine (cuBLAS may pick other kernels): float32 rounding only.
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)
