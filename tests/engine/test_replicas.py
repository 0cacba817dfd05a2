"""Data-parallel replicas behind one client: real engine and worker processes of a small random
Qwen2 on CPU, driven the way the API server drives them. A replica's death and restart behind
the server (mp backend) are in tests/e2e/test_data_parallel.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.common.request import EngineRequest
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.engine.engine_client import AsyncEngineClient
from fastdeploy.engine.replicas import ReplicaSet, prompt_key, replica_devices
from tests.random_qwen2 import save_random_qwen2


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    model = save_random_qwen2(tmp_path_factory.mktemp("qwen2_dp"), vocab_size=256)
    return EngineConfig(model=model, device="cpu", dtype="float32", guided_decoding_backend="off",
                        cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=128))


async def _collect(replicas: ReplicaSet, request: EngineRequest) -> list[int]:
    tokens: list[int] = []
    async for delta in replicas.generate(request):
        assert delta.error is None, delta.error
        tokens += delta.token_ids
    return tokens


def _request(i: int, prompt: list[int], max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def test_replicas_share_the_load_and_answer_as_one_engine(config):
    async def main():
        single = AsyncEngineClient(config)
        replicas = ReplicaSet(config, 2)
        await asyncio.gather(single.start(), replicas.start())
        try:
            prompts = [[5 + i, 9, 17, 33, 2 * i + 1] for i in range(6)]
            alone = []
            for i, p in enumerate(prompts):
                alone.append([t for d in [d async for d in single.generate(_request(100 + i, p))] for t in d.token_ids])
            served = {}
            original_pick = replicas.pick

            def recording_pick(request, exclude=frozenset()):
                chosen = original_pick(request, exclude)
                served[request.request_id] = chosen.index
                return chosen

            replicas.pick = recording_pick
            together = await asyncio.gather(*(_collect(replicas, _request(i, p)) for i, p in enumerate(prompts)))
            return alone, together, served, replicas.limits
        finally:
            await asyncio.gather(single.shutdown(), replicas.shutdown())

    alone, together, served, limits = asyncio.run(main())
    assert together == alone  # greedy: each replica gives what one engine gives
    assert sorted(set(served.values())) == [0, 1]  # least outstanding tokens spreads them
    assert limits is not None


def test_prefix_affinity_keeps_a_prompt_on_its_replica_unless_it_is_busier(config):
    replicas = ReplicaSet(config, 2)  # not started: routing only
    for r in replicas.replicas:
        r.client.limits = object()  # marks the client healthy without an engine
    shared = list(range(10, 90))
    first = replicas.pick(_request(0, shared + [1]))
    first.outstanding["busy"] = 50  # within one request's size of the other: affinity holds
    assert replicas.pick(_request(1, shared + [2])) is first
    first.outstanding["busy"] = 10_000  # far busier: the load decides
    assert replicas.pick(_request(2, shared + [3])) is not first


def _routing_only(config: EngineConfig) -> ReplicaSet:
    replicas = ReplicaSet(config, 2)  # not started: routing only
    for r in replicas.replicas:
        r.client.limits = object()  # marks the client healthy without an engine
    return replicas


def test_a_request_goes_where_a_batch_slot_is_free_before_where_fewer_tokens_are_left(config):
    replicas = _routing_only(config)
    full, free = replicas.replicas
    slots = config.scheduler.max_num_seqs
    full.outstanding.update({f"a{i}": 5 for i in range(slots)})  # every slot taken, few tokens left
    free.outstanding.update({f"b{i}": 200 for i in range(3)})  # far more tokens left, slots free
    assert full.load < free.load
    assert replicas.slot_wait(full) == 5 and replicas.slot_wait(free) == 0
    assert replicas.pick(_request(0, [1, 2, 3])) is free


def test_with_every_slot_taken_a_request_goes_where_one_frees_first(config):
    replicas = _routing_only(config)
    first, second = replicas.replicas
    slots = config.scheduler.max_num_seqs
    first.outstanding.update({f"a{i}": 100 for i in range(slots)})
    # More tokens in all, but one of its requests ends after 10 and a waiting one is ahead of
    # the new request: the new one gets the slot freed second, after 40 tokens.
    second.outstanding.update({"b0": 10, "b1": 40, **{f"b{i}": 500 for i in range(2, slots + 1)}})
    assert replicas.slot_wait(first) == 100 and replicas.slot_wait(second) == 40
    assert replicas.pick(_request(0, [1, 2, 3])) is second


def test_each_cuda_replica_sees_its_own_gpus(config):
    import dataclasses
    cuda = dataclasses.replace(config, device="cuda", tensor_parallel_size=2)
    assert [replica_devices(cuda, i) for i in range(3)] == ["0,1", "2,3", "4,5"]
    assert replica_devices(config, 1) is None


def test_ray_places_the_replicas_and_restarts_a_dead_one(config, monkeypatch):
    """The real Ray, started locally: each replica's engine runs under an actor in its own
    placement-group bundle and is reached over TCP; a killed engine is replaced."""
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    async def main():
        replicas = ReplicaSet(config, 2, backend="ray")
        await replicas.start()
        try:
            addresses = [r.client.engine.in_address for r in replicas.replicas]
            first = await asyncio.gather(*(_collect(replicas, _request(i, [4, 5, 6 + i])) for i in range(4)))
            victim = replicas.replicas[1]
            os.kill(victim.client.engine.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            while victim.client.dead_reason is None:
                await asyncio.sleep(0.05)
            seen_s = time.monotonic() - killed_at
            during = await _collect(replicas, _request(10, [4, 5, 6]))
            deadline = time.monotonic() + 120
            while (victim.restarts == 0 or victim.restarting) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            after = await asyncio.gather(*(_collect(replicas, _request(20 + i, [4, 5, 6 + i])) for i in range(4)))
            return addresses, first, seen_s, during, victim.restarts, after
        finally:
            await replicas.shutdown()
            import ray
            ray.shutdown()

    addresses, first, seen_s, during, restarts, after = asyncio.run(main())
    assert all(a.startswith("tcp://") for a in addresses) and len(set(addresses)) == 2
    assert seen_s < 5.0 and during == first[0] and restarts == 1
    assert after == first  # greedy, the same prompts: the restarted replica answers as before


def test_the_samples_of_one_prompt_stay_together(config):
    replicas = ReplicaSet(config, 2)  # not started: routing only
    for r in replicas.replicas:
        r.client.limits = object()
    prompt = list(range(5, 40))
    group = []
    for i in range(8):  # an n = 8 request: eight requests of one prompt, all in flight
        chosen = replicas.pick(_request(i, prompt, max_tokens=64))
        chosen.outstanding[f"r{i}"] = 100
        replicas._in_flight[prompt_key(prompt)] = (chosen.index, i + 1)
        group.append(chosen.index)
    assert len(set(group)) == 1
    other = replicas.pick(_request(9, list(range(100, 140))))  # another prompt balances the load
    assert other.index != group[0]


def _report_devices(queue) -> None:
    queue.put(os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_engines_started_at_once_each_get_their_own_devices() -> None:
    """Replicas start their engines from one thread each, at the same moment; the environment
    each spawned process copies must still hold its own devices, not another thread's."""
    import multiprocessing
    import threading

    from fastdeploy.engine.engine_client import cuda_visible_devices

    spawn = multiprocessing.get_context("spawn")
    outside = os.environ.get("CUDA_VISIBLE_DEVICES")
    queues = {devices: spawn.Queue() for devices in ("0", "1", "2,3")}
    barrier = threading.Barrier(len(queues))

    def start(devices: str) -> None:
        process = spawn.Process(target=_report_devices, args=(queues[devices],))
        barrier.wait()
        with cuda_visible_devices(devices):
            process.start()
        process.join(60)

    threads = [threading.Thread(target=start, args=(d,)) for d in queues]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert {devices: q.get(timeout=5) for devices, q in queues.items()} == {d: d for d in queues}
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == outside
