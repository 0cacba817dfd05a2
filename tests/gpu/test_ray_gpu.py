"""One data-parallel replica placed by Ray on a GPU: its placement group holds the GPU while it
serves, and its greedy answers are those of the same engine started without Ray."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.common.request import EngineRequest
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.engine.engine_client import AsyncEngineClient
from fastdeploy.engine.replicas import ReplicaSet
from tests.random_qwen2 import save_random_qwen2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _request(i: int, prompt: list[int]) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    return EngineRequest(f"r{i}", prompt, params)


async def _answer(generate, request: EngineRequest) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    logprobs: list[float] = []
    async for delta in generate(request):
        assert delta.error is None, delta.error
        tokens += delta.token_ids
        logprobs += [row[0] for row in delta.logprobs or []]
    return tokens, logprobs


def test_a_ray_placed_replica_holds_the_gpu_and_answers_as_without_ray(tmp_path, monkeypatch) -> None:
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = save_random_qwen2(tmp_path / "qwen2", vocab_size=256)
    config = EngineConfig(model=model, device="cuda", dtype="float32", guided_decoding_backend="off",
                          cache=CacheConfig(block_size=16, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256))
    prompts = [[5 + i, 9, 17, 33, 2 * i + 1] * (i + 1) for i in range(6)]

    async def without_ray() -> list[tuple[list[int], list[float]]]:
        client = AsyncEngineClient(config)
        await client.start()
        try:
            answers = await asyncio.gather(*(_answer(client.generate, _request(i, p)) for i, p in enumerate(prompts)))
            return list(answers)
        finally:
            await client.shutdown()

    async def with_ray() -> tuple[list[tuple[list[int], list[float]]], float, float]:
        replicas = ReplicaSet(config, 1, backend="ray")
        await replicas.start()
        try:
            answers = await asyncio.gather(*(_answer(replicas.generate, _request(i, p)) for i, p in enumerate(prompts)))
            return list(answers), ray.cluster_resources().get("GPU", 0.0), ray.available_resources().get("GPU", 0.0)
        finally:
            await replicas.shutdown()
            ray.shutdown()

    expected = asyncio.run(without_ray())
    answers, gpus, free_gpus = asyncio.run(with_ray())
    assert gpus >= 1 and free_gpus == gpus - 1  # the replica's bundle holds one GPU while it serves
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(answers, expected, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-5, rtol=0)
