"""Tensor-parallel process group of the worker processes (one per GPU), through torch.distributed.

Model tensors go through the group's backend (NCCL on CUDA, gloo on CPU); the step
plan that rank 0 hands the other ranks goes through a separate gloo group on the CPU,
so control messages never touch device memory. Without `init_tensor_parallel` the
size is 1 and every collective here is a no-op.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class TensorParallelState:
    rank: int = 0
    size: int = 1
    cpu_group: dist.ProcessGroup | None = None


_STATE = TensorParallelState()


def init_tensor_parallel(rank: int, size: int, init_file: str, device: torch.device,
                         timeout_s: float = 600.0) -> None:
    """Join the group of `size` worker processes that share `init_file` (a path on local disk)."""
    global _STATE
    if size == 1:
        _STATE = TensorParallelState()
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    _STATE = TensorParallelState(rank, size, cpu_group)


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (the partial outputs of a row-parallel layer)."""
    if _STATE.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard along the last dimension (vocabulary-parallel logits)."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def all_reduce_min(value: int) -> int:
    """The smallest of an integer over ranks (e.g. KV blocks every rank can hold)."""
    if _STATE.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.cpu_group)
    return int(t.item())


def broadcast_bytes(payload: bytes | None) -> bytes:
    """Rank 0 sends `payload`; every rank returns it (control messages, over the CPU group)."""
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=_STATE.cpu_group)
    if _STATE.rank == 0:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if buf.numel():
        dist.broadcast(buf, src=0, group=_STATE.cpu_group)
    return buf.numpy().tobytes()


def destroy_tensor_parallel(timeout_s: float = 30.0) -> None:
    """Leave the group. Every rank must call this after rank 0's stop message: NCCL tears a
    communicator down collectively, so a rank that exits without it blocks the others' exit.
    The wait is bounded: a peer that died already cannot hold this process forever."""
    global _STATE
    if dist.is_initialized():
        start = time.monotonic()
        done = threading.Thread(target=dist.destroy_process_group, daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            logger.warning("tensor-parallel group teardown did not finish within %.0f s; leaving it", timeout_s)
        else:
            logger.info("rank %d left the tensor-parallel group in %.2f s", _STATE.rank, time.monotonic() - start)
    _STATE = TensorParallelState()
