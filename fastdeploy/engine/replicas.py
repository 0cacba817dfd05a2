"""Data parallelism: N engine replicas behind one client, routed by load.

Each replica is a whole engine (its own engine core, worker processes and KV pool) reached
through its own `AsyncEngineClient`. `ReplicaSet` offers the API server the same surface as
one client. A request goes to a live replica where it gets a batch slot soonest: one with
fewer requests in flight than --max-num-seqs starts it at once, and a full one when the
request ahead of it there ends (a request sent to a full replica while another has a free
slot waits a whole answer's length, and at the end of a load one replica then runs that tail
while the other idles). Among those, the one with the fewest outstanding tokens (prompt tokens
not yet computed plus tokens still to generate); among replicas within one request's size of
that minimum, one that recently served the same prompt start is preferred, since its prefix
cache holds it. A replica whose engine dies is seen by its client within a poll
(100 ms); its in-flight requests that have streamed nothing yet are sent to another replica,
the others end with an error, and the replica is started again in the background while the
rest keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import logging
from array import array
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.limits import EngineLimits
from fastdeploy.common.request import EngineRequest, RequestDelta
from fastdeploy.common.spec_decode_stats import SpecDecodeStats
from fastdeploy.engine.engine_client import (
    AsyncEngineClient,
    EngineAddresses,
    EngineDeadError,
    EngineStats,
    LocalEngine,
    attached_client,
)

if TYPE_CHECKING:
    from fastdeploy.engine.ray_engine import ReplicaPlacement

logger = logging.getLogger(__name__)

AFFINITY_TOKENS = 64  # the prompt start that keys prefix affinity
AFFINITY_ENTRIES = 4096  # remembered prompt starts (least recently used dropped)
RESTART_DELAY_S = 1.0
DATA_PARALLEL_BACKENDS = ("mp", "ray")


def affinity_key(prompt_token_ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", prompt_token_ids[:AFFINITY_TOKENS]).tobytes(), digest_size=8).digest()


def prompt_key(prompt_token_ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", prompt_token_ids).tobytes(), digest_size=16).digest()


@dataclass
class RetiredCounts:
    """What the earlier clients of a restarted replica counted (totals since start)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decode: SpecDecodeStats | None = None

    def keep(self, client: AsyncEngineClient) -> None:
        self.prefix_cache_queries += client.prefix_cache_queries
        self.prefix_cache_hits += client.prefix_cache_hits
        if client.spec_decode is not None:
            self.spec_decode = SpecDecodeStats.total([self.spec_decode, client.spec_decode])


@dataclass
class Replica:
    index: int
    client: AsyncEngineClient
    # request id -> tokens it still costs this replica (see `ReplicaSet._cost`)
    outstanding: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    restarting: bool = False
    retired: RetiredCounts = field(default_factory=RetiredCounts)

    @property
    def live(self) -> bool:
        return self.client.healthy and not self.restarting

    @property
    def load(self) -> int:
        return sum(self.outstanding.values())


def replica_devices(config: EngineConfig, index: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of replica `index` on one host: its tensor-parallel group's GPUs."""
    if not config.device.startswith("cuda"):
        return None
    tp = config.tensor_parallel_size
    return ",".join(str(index * tp + r) for r in range(tp))


class ReplicaSet:
    """N replicas of the engine; the API server's client when --data-parallel-size > 1."""

    def __init__(self, config: EngineConfig, size: int, backend: str = "mp", ray_address: str | None = None,
                 attached: list[EngineAddresses] | None = None) -> None:
        """`backend`: "mp" runs the replicas as local processes (on CUDA, replica i on GPUs
        i*tp .. i*tp+tp-1); "ray" places each in a Ray placement-group bundle, on the cluster at
        `ray_address` (or RAY_ADDRESS), or on a local Ray started for it. `attached`: the
        replicas' engines were started by another process (a server's launcher, which also ends
        the server when one exits): connect to them, and restart none."""
        if size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {size}")
        if backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(f"unknown --data-parallel-backend {backend!r}; expected one of {DATA_PARALLEL_BACKENDS}")
        if attached is not None and len(attached) != size:
            raise ValueError(f"{size} replicas, but {len(attached)} engines to attach to")
        self.config = config
        self.backend = backend
        self.ray_address = ray_address
        self.attached = attached
        self._placement: ReplicaPlacement | None = None  # ray: the replicas' placement group, made in start()
        self.replicas = [Replica(i, self._make_client(i)) for i in range(size)]
        self._affinity: OrderedDict[bytes, int] = OrderedDict()
        self._assigned: dict[str, int] = {}  # live request id -> the replica serving it
        self._in_flight: dict[bytes, tuple[int, int]] = {}  # whole prompt -> (replica, requests in flight)
        self._monitor: asyncio.Task | None = None
        self._stopping = False

    def _make_client(self, index: int) -> AsyncEngineClient:
        if self.attached is not None:
            return attached_client(self.config, self.attached[index])
        if self.backend == "ray":
            from fastdeploy.engine.ray_engine import RayEngine

            def launch(c: EngineConfig) -> RayEngine:
                assert self._placement is not None, "start() places the replicas first"
                return RayEngine(c, self._placement, index)

            return AsyncEngineClient(self.config, launch=launch)
        devices = replica_devices(self.config, index)
        return AsyncEngineClient(self.config, launch=lambda c: LocalEngine(c, visible_devices=devices))

    async def start(self) -> None:
        if self.backend == "ray" and self.attached is None:
            from fastdeploy.engine.ray_engine import ReplicaPlacement, connect_ray

            await asyncio.to_thread(connect_ray, self.ray_address)
            self._placement = await asyncio.to_thread(ReplicaPlacement, self.config, len(self.replicas))
        await asyncio.gather(*(r.client.start() for r in self.replicas))
        if self.attached is None:  # attached engines: their launcher ends the server when one exits
            self._monitor = asyncio.create_task(self._watch())

    # The API server's view: one engine.

    @property
    def limits(self) -> EngineLimits | None:
        return next((r.client.limits for r in self.replicas if r.client.limits is not None), None)

    @property
    def healthy(self) -> bool:
        return any(r.live for r in self.replicas)

    @property
    def degraded(self) -> bool:
        return not all(r.live for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        if self.healthy:
            return None
        return "; ".join(f"replica {r.index}: {r.client.dead_reason or 'restarting'}" for r in self.replicas)

    @property
    def num_running(self) -> int:
        return sum(r.client.num_running for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.client.num_waiting for r in self.replicas)

    @property
    def kv_usage(self) -> float:
        return sum(r.client.kv_usage for r in self.replicas) / len(self.replicas)

    # Counters are totals since the server started: a restarted replica's client starts from
    # zero, so what its predecessors counted is kept in `Replica.retired`.

    def engine_stats(self) -> list[tuple[int | None, EngineStats, bool]]:
        out: list[tuple[int | None, EngineStats, bool]] = []
        for r in self.replicas:
            c, old = r.client, r.retired
            spec = SpecDecodeStats.total([c.spec_decode, old.spec_decode]) if self.config.speculative else None
            out.append((r.index, EngineStats(c.num_running, c.num_waiting, c.kv_usage,
                                             c.prefix_cache_queries + old.prefix_cache_queries,
                                             c.prefix_cache_hits + old.prefix_cache_hits, spec), r.live))
        return out

    def replica_of(self, request_id: str) -> int | None:
        return self._assigned.get(request_id)

    # Routing.

    @staticmethod
    def _cost(request: EngineRequest) -> int:
        return len(request.prompt_token_ids) + (request.params.max_tokens or 0)

    def slot_wait(self, replica: Replica) -> int:
        """Tokens a new request would wait for a batch slot on `replica`: none while fewer
        requests than --max-num-seqs are in flight there; else the tokens left of the in-flight
        request whose end frees its slot (the requests already waiting take the earlier ones)."""
        ahead = len(replica.outstanding) - self.config.scheduler.max_num_seqs
        if ahead < 0:
            return 0
        return heapq.nsmallest(ahead + 1, replica.outstanding.values())[-1]

    def pick(self, request: EngineRequest, exclude: frozenset[int] = frozenset()) -> Replica:
        live = [r for r in self.replicas if r.live and r.index not in exclude]
        if not live:
            raise EngineDeadError(self.dead_reason or "no live replica")
        # The same prompt in flight (the samples of an n > 1 request) goes where it is: the
        # group shares its blocks there; groups, not samples, are what the load balances.
        group = self._in_flight.get(prompt_key(request.prompt_token_ids))
        chosen = next((r for r in live if group is not None and r.index == group[0]), None)
        key = affinity_key(request.prompt_token_ids)
        if chosen is None:
            waits = {r.index: self.slot_wait(r) for r in live}
            soonest = min(waits.values())
            ready = [r for r in live if waits[r.index] == soonest]
            least = min(r.load for r in ready)
            preferred = self._affinity.get(key)
            chosen = next((r for r in ready if r.index == preferred and r.load <= least + self._cost(request)), None)
            if chosen is None:
                chosen = min(ready, key=lambda r: (r.load, r.index))
        self._affinity[key] = chosen.index
        self._affinity.move_to_end(key)
        if len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return chosen

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestDelta, None]:
        tried: set[int] = set()
        while True:
            replica = self.pick(request, frozenset(tried))
            tried.add(replica.index)
            replica.outstanding[request.request_id] = self._cost(request)
            self._assigned[request.request_id] = replica.index
            whole = prompt_key(request.prompt_token_ids)
            self._in_flight[whole] = (replica.index, self._in_flight.get(whole, (replica.index, 0))[1] + 1)
            first = True
            try:
                async with contextlib.aclosing(replica.client.generate(request)) as deltas:
                    async for delta in deltas:
                        if first and delta.finish_reason == "error" and not replica.client.healthy:
                            break  # the replica died before this request got anything: another takes it
                        # Its prompt is computed once the first delta is out; then each token counts.
                        replica.outstanding[request.request_id] -= len(delta.token_ids) + (
                            len(request.prompt_token_ids) if first else 0)
                        first = False
                        yield delta
                    else:
                        return
            except EngineDeadError:
                if not first:
                    raise
            finally:
                replica.outstanding.pop(request.request_id, None)
                self._assigned.pop(request.request_id, None)
                index, count = self._in_flight.pop(whole)
                if count > 1:
                    self._in_flight[whole] = (index, count - 1)
            logger.warning("replica %d is down; request %s goes to another replica", replica.index,
                           request.request_id)

    # Faults.

    async def _watch(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.2)
            for replica in self.replicas:
                if not replica.restarting and replica.client.dead_reason is not None:
                    replica.restarting = True
                    asyncio.create_task(self._restart(replica))

    async def _restart(self, replica: Replica) -> None:
        logger.error("replica %d is down (%s); starting it again", replica.index, replica.client.dead_reason)
        replica.retired.keep(replica.client)
        with contextlib.suppress(Exception):
            await replica.client.shutdown()
        while not self._stopping:
            client = self._make_client(replica.index)
            try:
                await client.start()
            except Exception as exc:  # noqa: BLE001 - a failed start is retried, never fatal to the server
                logger.error("replica %d failed to start: %s", replica.index, exc)
                with contextlib.suppress(Exception):
                    await client.shutdown()
                await asyncio.sleep(RESTART_DELAY_S)
                continue
            replica.client = client
            replica.restarts += 1
            replica.restarting = False
            logger.info("replica %d is serving again (restart %d)", replica.index, replica.restarts)
            return

    async def shutdown(self) -> None:
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
        await asyncio.gather(*(r.client.shutdown() for r in self.replicas), return_exceptions=True)
        if self._placement is not None:
            self._placement.remove()
