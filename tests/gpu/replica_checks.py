"""What the replica GPU tests share: a small CUDA engine config, its prompts, and the greedy
answers (tokens and logprobs) of one engine started alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.common.request import EngineRequest
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.engine.engine_client import AsyncEngineClient
from tests.random_qwen2 import save_random_qwen2

Answer = tuple[list[int], list[float]]


def small_cuda_config(tmp_path: Path) -> EngineConfig:
    model = save_random_qwen2(tmp_path / "qwen2", vocab_size=256)
    return EngineConfig(model=model, device="cuda", dtype="float32", guided_decoding_backend="off",
                        cache=CacheConfig(block_size=16, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256))


def prompts(n: int) -> list[list[int]]:
    return [[5 + i, 9, 17, 33, 2 * i + 1] * (i + 1) for i in range(n)]


def request(i: int, prompt: list[int]) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    return EngineRequest(f"r{i}", prompt, params)


async def answer(generate: Callable[[EngineRequest], AsyncIterator], req: EngineRequest) -> Answer:
    tokens: list[int] = []
    logprobs: list[float] = []
    async for delta in generate(req):
        assert delta.error is None, delta.error
        tokens += delta.token_ids
        logprobs += [row[0] for row in delta.logprobs or []]
    return tokens, logprobs


async def answers(generate: Callable[[EngineRequest], AsyncIterator], batch: list[list[int]]) -> list[Answer]:
    return list(await asyncio.gather(*(answer(generate, request(i, p)) for i, p in enumerate(batch))))


async def answers_alone(config: EngineConfig, batch: list[list[int]]) -> list[Answer]:
    """The answers of one engine, started for them and stopped after."""
    client = AsyncEngineClient(config)
    await client.start()
    try:
        return await answers(client.generate, batch)
    finally:
        await client.shutdown()
