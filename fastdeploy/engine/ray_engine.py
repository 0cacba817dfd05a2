"""Data-parallel replicas placed by Ray: each replica's engine runs under a Ray actor.

`connect_ray` joins the cluster named by `--ray-address` or `RAY_ADDRESS` (`ray start --head` on
one node, `ray start --address HEAD:6379` on the others), or starts a local Ray without one.
`ReplicaPlacement` reserves one placement-group bundle per replica (its tensor-parallel GPUs
and a CPU), so Ray puts each replica on a node that has them. In its bundle an `EngineHost`
actor starts the engine process (which starts its workers beside it, over ipc) and binds the
engine's request and output sockets on the node's address over TCP, where the API server
connects. The engine exits when its actor does; the actor's `wait_exit` call returns when the
engine process ends, which is how the API server sees a replica die.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import socket as pysocket
from typing import Any

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.ipc import make_ipc_dir
from fastdeploy.engine.engine_launch import run_engine_process

STARTUP_TIMEOUT_S = 600.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("--data-parallel-backend ray needs Ray: pip install ray") from exc
    return ray


def connect_ray(address: str | None) -> None:
    """Join the cluster at `address` (or RAY_ADDRESS); start a local Ray when neither is set."""
    ray = _ray()
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # A local Ray only holds the replicas' actors: a small object store, no dashboard.
        ray.init(include_dashboard=False, object_store_memory=128 * 1024 * 1024, log_to_driver=False)


class EngineHost:
    """Runs inside a Ray actor: one replica's engine process on the actor's node."""

    def __init__(self, config: EngineConfig) -> None:
        ray = _ray()
        self.ipc_dir = make_ipc_dir()
        host = ray.util.get_node_ip_address()
        self.addresses = tuple(f"tcp://{host}:{_free_port()}" for _ in range(2))
        spawn = multiprocessing.get_context("spawn")
        # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs; the engine and workers inherit it.
        self.process = spawn.Process(target=run_engine_process,
                                     args=(config, self.ipc_dir, os.getpid(), *self.addresses),
                                     name="fastdeploy-engine")
        self.process.start()

    def endpoints(self) -> tuple[str, str, int | None]:
        return self.addresses[0], self.addresses[1], self.process.pid

    def wait_exit(self) -> int | None:
        self.process.join()
        return self.process.exitcode

    def stop(self, timeout_s: float) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout_s)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _free_port() -> int:
    with pysocket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ReplicaPlacement:
    """One placement-group bundle per replica: its GPUs (tensor-parallel size) and one CPU."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group

        self.gpus = config.tensor_parallel_size if config.device.startswith("cuda") else 0
        bundle = {"CPU": 1, **({"GPU": self.gpus} if self.gpus else {})}
        self.group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
        ray.get(self.group.ready(), timeout=STARTUP_TIMEOUT_S)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


class RayEngine:
    """`EngineHandle` of an engine hosted by a Ray actor in replica `index`'s bundle."""

    def __init__(self, config: EngineConfig, placement: ReplicaPlacement, index: int) -> None:
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement.group, placement_group_bundle_index=index)
        # Two calls at once: `wait_exit` blocks for the engine's life while `stop` can still come.
        actor_class = ray.remote(num_cpus=1, num_gpus=placement.gpus, max_concurrency=2)(EngineHost)
        self.actor = actor_class.options(scheduling_strategy=strategy).remote(config)
        self.in_address, self.out_address, remote_pid = ray.get(self.actor.endpoints.remote(),
                                                                timeout=STARTUP_TIMEOUT_S)
        # Only meaningful on this host; a replica on another node has its pid there.
        self.pid = remote_pid if self.in_address.startswith(f"tcp://{ray.util.get_node_ip_address()}:") else None
        self._exit = self.actor.wait_exit.remote()

    def alive(self) -> bool:
        ready, _ = _ray().wait([self._exit], timeout=0)
        return not ready  # the engine process ended, or the actor (or its node) died

    async def stop(self, timeout_s: float) -> None:
        ray = _ray()
        try:
            await asyncio.to_thread(ray.get, self.actor.stop.remote(timeout_s), timeout=2 * timeout_s + 5)
        except Exception:  # noqa: BLE001 - the actor may already be gone; it is killed below either way
            pass
        ray.kill(self.actor)
