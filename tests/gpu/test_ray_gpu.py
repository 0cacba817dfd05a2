"""One data-parallel replica placed by Ray on a GPU: its placement group holds the GPU while it
serves, and its greedy answers are those of the same engine started without Ray."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fastdeploy.engine.replicas import ReplicaSet
from tests.gpu.replica_checks import Answer, answers, answers_alone, prompts, small_cuda_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_ray_placed_replica_holds_the_gpu_and_answers_as_without_ray(tmp_path, monkeypatch) -> None:
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = small_cuda_config(tmp_path)
    batch = prompts(6)

    async def with_ray() -> tuple[list[Answer], float, float]:
        replicas = ReplicaSet(config, 1, backend="ray")
        await replicas.start()
        try:
            got = await answers(replicas.generate, batch)
            return got, ray.cluster_resources().get("GPU", 0.0), ray.available_resources().get("GPU", 0.0)
        finally:
            await replicas.shutdown()
            ray.shutdown()

    expected = asyncio.run(answers_alone(config, batch))
    got, gpus, free_gpus = asyncio.run(with_ray())
    assert gpus >= 1 and free_gpus == gpus - 1  # the replica's bundle holds one GPU while it serves
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-5, rtol=0)
