"""Two data-parallel replicas on a host with two GPUs: each replica's engine runs on its own GPU
(both GPUs' free memory drops while they serve), with either backend, and every answer is the
greedy answer of one engine started alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.engine.engine_client import AsyncEngineClient
from fastdeploy.engine.replicas import ReplicaSet
from tests.gpu.test_ray_gpu import _answer, _request
from tests.random_qwen2 import save_random_qwen2

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

# A replica's engine and worker hold a CUDA context and the model on their GPU: hundreds of MiB.
MIN_USED_BYTES = 200 * 1024 * 1024


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_two_replicas_use_both_gpus_and_answer_as_one_engine(tmp_path, monkeypatch, backend: str) -> None:
    if backend == "ray":
        ray = pytest.importorskip("ray")
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = save_random_qwen2(tmp_path / "qwen2", vocab_size=256)
    config = EngineConfig(model=model, device="cuda", dtype="float32", guided_decoding_backend="off",
                          cache=CacheConfig(block_size=16, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256))
    prompts = [[5 + i, 9, 17, 33, 2 * i + 1] * (i + 1) for i in range(8)]

    async def alone() -> list[tuple[list[int], list[float]]]:
        client = AsyncEngineClient(config)
        await client.start()
        try:
            return list(await asyncio.gather(*(_answer(client.generate, _request(i, p))
                                               for i, p in enumerate(prompts))))
        finally:
            await client.shutdown()

    def free_bytes() -> list[int]:
        return [torch.cuda.mem_get_info(i)[0] for i in range(2)]

    async def two_replicas() -> tuple[list[tuple[list[int], list[float]]], list[int]]:
        replicas = ReplicaSet(config, 2, backend=backend)
        await replicas.start()
        try:
            answers = await asyncio.gather(*(_answer(replicas.generate, _request(i, p))
                                             for i, p in enumerate(prompts)))
            return list(answers), free_bytes()
        finally:
            await replicas.shutdown()
            if backend == "ray":
                ray.shutdown()

    before = free_bytes()  # first: an engine that just stopped may not have given its memory back yet
    expected = asyncio.run(alone())
    answers, during = asyncio.run(two_replicas())
    used = [b - d for b, d in zip(before, during, strict=True)]
    assert all(u >= MIN_USED_BYTES for u in used), f"bytes taken on each GPU while serving: {used}"
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(answers, expected, strict=True):
        assert tokens == want_tokens
        # Each replica batches its share of the prompts, so the matrix products run at other row
        # counts than in the single engine (cuBLAS may pick other kernels): float32 rounding only.
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)
