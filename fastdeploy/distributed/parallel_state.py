"""Tensor-parallel process group of the worker processes (one per GPU), through torch.distributed.

Model tensors go through the group's backend (NCCL on CUDA, gloo on CPU); small
control values (the KV pool every rank can hold) go through a separate gloo group on the
CPU, so they never touch device memory. Without `init_tensor_parallel` the
size is 1 and every collective here is a no-op.

On CUDA the row-parallel all-reduces of a decode step are small (a few KiB to a few MiB) and
NCCL's latency dominates them (about 12 us a call on two NVLink GPUs, two calls a layer).
`SymmetricAllReduce` runs them instead through PyTorch's symmetric memory: every rank's buffer
is mapped into its peers, and one kernel reads the peers' data directly (one-shot: each rank
reads every peer's whole message, for small ones; two-shot: each rank reduces its share, then
gathers the others' shares, for larger ones): 7-15 us a call on two H200s
(benchmarks/allreduce.py). Messages over its buffer, other dtypes and CPU tensors go to NCCL/gloo.

A row-parallel layer followed by a residual add and an RMSNorm (o_proj and down_proj of a
decoder layer) can skip the all-reduce: `row_parallel_linear` computes the rank's product
straight into its region of a symmetric-memory inbox and returns a `PendingSum`; the norm that
consumes it (`sum_add_rms_norm`) writes that product into every peer's inbox and waits for theirs
in the same kernel that sums, adds the residual and normalises (sum_norm_kernel.py: the data is
its own ready flag, no barrier). That saves, per call, the copies in and out, the all-reduce's
barriers and the separate norm kernel. Two inboxes alternate (attention and MLP).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

logger = logging.getLogger(__name__)


# The symmetric buffer's size: covers the decode steps of the bundled 8B shapes (hidden 4096,
# bf16: 1,024 rows); prefill chunks beyond it use NCCL, whose bandwidth wins there anyway.
# The buffer holds the all-reduce's region of this size, then the two `PendingSum` inboxes, each
# one region per rank (a rank's own region holds its product, the others what its peers sent).
SYMMETRIC_BUFFER_BYTES = 8 * 1024 * 1024
PENDING_SLOTS = 2
# Then two regions for this rank's vocabulary-parallel logits (float32 [rows, vocab / ranks]), which
# the sampling rank reads from every peer: 256 rows of the 8B vocabulary's half, with room to spare.
LOGITS_BUFFER_BYTES = 72 * 1024 * 1024
LOGITS_REGIONS = 2
# Up to this size one kernel reads every peer's whole message (fewest steps); above it the two-shot
# kernel splits the work so each rank reads only its share (measured crossover, 2 GPUs).
ONE_SHOT_MAX_BYTES = 256 * 1024
# What the symmetric-memory sums take (the all-reduce kernels and the norm's sum alike).
SUMMED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class SymmetricAllReduce:
    """Sum over the group through one symmetric-memory buffer, for CUDA tensors that fit it."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup, cpu_group: dist.ProcessGroup) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from fastdeploy.distributed.sum_norm_kernel import INBOX_FILL_INT16

        self.group_name = group.group_name
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.logits_start = (1 + PENDING_SLOTS * self.world) * SYMMETRIC_BUFFER_BYTES
        self.buffer = symm_mem.empty(self.logits_start + LOGITS_REGIONS * LOGITS_BUFFER_BYTES, dtype=torch.uint8,
                                     device=device)
        self._logits_calls = 0  # the same count on every rank: the calls are collective
        # The inbox of the last exchange, until a collective that orders the ranks (an all-reduce).
        self.last_slot: int | None = None
        self.handle = symm_mem.rendezvous(self.buffer, group)
        # Every rank's buffer address, for the kernel that writes into the peers' inboxes.
        self.buffers = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        # Inboxes start empty on every rank before any rank can send into them.
        self.buffer[SYMMETRIC_BUFFER_BYTES:self.logits_start].view(torch.int16).fill_(INBOX_FILL_INT16)
        torch.cuda.synchronize(device)
        dist.barrier(group=cpu_group)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.is_contiguous() and x.dtype in SUMMED_DTYPES
                and x.numel() * x.element_size() <= SYMMETRIC_BUFFER_BYTES)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        staged = self.buffer[:nbytes].view(x.dtype)
        if nbytes <= ONE_SHOT_MAX_BYTES:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x.view(-1), "sum", self.group_name).view_as(x)
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        # Back into x: the buffer is the next all-reduce's, and callers keep the result past it.
        return x.copy_(staged.view_as(x))

    def _inbox_start(self, index: int) -> int:
        """Byte offset of `PendingSum` inbox `index` (its first rank's region) in the buffer."""
        return (1 + index * self.world) * SYMMETRIC_BUFFER_BYTES

    def slot(self, index: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor | None:
        """This rank's region of `PendingSum` inbox `index` as a [rows, cols] tensor; None where it does not fit."""
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if dtype not in SUMMED_DTYPES or nbytes > SYMMETRIC_BUFFER_BYTES:
            return None
        start = self._inbox_start(index) + self.rank * SYMMETRIC_BUFFER_BYTES
        return self.buffer[start:start + nbytes].view(dtype).view(shape)

    def sum_add_rms_norm(self, pending: PendingSum, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from fastdeploy.distributed.sum_norm_kernel import exchange_sum_add_rms_norm

        if pending.slot == self.last_slot:
            # The same inbox twice with nothing between that waits for the peers: a peer may still be
            # reading this rank's last message there, so wait until every rank is past it.
            self.handle.barrier(channel=0)
        self.last_slot = pending.slot
        size = pending.partial.element_size()
        return exchange_sum_add_rms_norm(
            self.buffers, self.rank, self._inbox_start(pending.slot) // size, SYMMETRIC_BUFFER_BYTES // size,
            (pending.partial.shape[0], pending.partial.shape[1]), residual, weight, eps)

    def logits_slot(self, rows: int, cols: int) -> torch.Tensor | None:
        """This call's float32 logits region as [rows, cols]; None where it does not fit. The regions
        alternate by call: a rank writes one while rank 0 may still read the other (`gather_logits`)."""
        if rows * cols * 4 > LOGITS_BUFFER_BYTES:
            return None
        start = self.logits_start + (self._logits_calls % LOGITS_REGIONS) * LOGITS_BUFFER_BYTES
        return self.buffer[start:start + rows * cols * 4].view(torch.float32).view(rows, cols)

    def gather_logits(self, shard: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `logits_slot` side by side; other ranks: `shard` (their own columns)."""
        from fastdeploy.distributed.gather_kernel import gather_columns

        self._logits_calls += 1  # the next `logits_slot` is the other region
        # Every rank's product is in its region. A rank writes this region again two calls on,
        # after the next call's barrier, which rank 0 reaches only once this read is done.
        self.handle.barrier(channel=0)
        if self.rank != 0:
            return shard
        offset = (shard.data_ptr() - self.buffer.data_ptr()) // shard.element_size()  # the same on every rank
        return gather_columns(self.buffers, offset, (shard.shape[0], shard.shape[1]), shard.dtype)


@dataclass
class PendingSum:
    """This rank's partial product of a row-parallel layer, in its region of symmetric-memory inbox
    `slot`; the sum over ranks is taken by the norm that consumes it (`sum_add_rms_norm`)."""

    partial: torch.Tensor
    slot: int


@dataclass
class TensorParallelState:
    rank: int = 0
    size: int = 1
    cpu_group: dist.ProcessGroup | None = None
    symmetric: SymmetricAllReduce | None = None


_STATE = TensorParallelState()
# Symmetric-memory rendezvous this process has attempted (see `_symmetric_all_reduce`).
_RENDEZVOUS_ATTEMPTS = 0


def init_tensor_parallel(rank: int, size: int, init_file: str, device: torch.device,
                         timeout_s: float = 600.0, custom_all_reduce: bool = True) -> None:
    """Join the group of `size` worker processes that share `init_file` (a path on local disk).
    `custom_all_reduce`: on CUDA, small all-reduces through symmetric memory where it can be set up."""
    global _STATE
    if size == 1:
        _STATE = TensorParallelState()
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    assert cpu_group is not None, "this rank is in the group it made"
    symmetric = _symmetric_all_reduce(device, cpu_group) if backend == "nccl" and custom_all_reduce else None
    _STATE = TensorParallelState(rank, size, cpu_group, symmetric)


def _symmetric_all_reduce(device: torch.device, cpu_group: dist.ProcessGroup) -> SymmetricAllReduce | None:
    """The symmetric-memory all-reduce if every rank could set it up (peer access between all the
    GPUs, a PyTorch built with it), else None on every rank: the ranks must agree on the path."""
    world = dist.group.WORLD
    assert world is not None, "called after init_process_group"
    global _RENDEZVOUS_ATTEMPTS
    # PyTorch numbers a process's symmetric-memory rendezvous in the keys it exchanges, and no
    # teardown resets that count: a rank whose process set one up before (a second offline engine
    # in the same process) would wait forever on keys its fresh peers never write. The ranks
    # compare their counts first and take NCCL together when they differ.
    counts = torch.tensor([_RENDEZVOUS_ATTEMPTS, -_RENDEZVOUS_ATTEMPTS], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=cpu_group)
    if int(counts[0]) != -int(counts[1]):
        logger.warning("symmetric-memory all-reduce unavailable (a rank's process set one up before); using NCCL")
        return None
    _RENDEZVOUS_ATTEMPTS += 1
    try:
        symmetric: SymmetricAllReduce | None = SymmetricAllReduce(device, world, cpu_group)
    except Exception as exc:  # noqa: BLE001 - any failure to set it up means NCCL, said once in the log
        logger.warning("symmetric-memory all-reduce unavailable (%s: %s); using NCCL", type(exc).__name__, exc)
        symmetric = None
    ready = torch.tensor([1 if symmetric is not None else 0], dtype=torch.int64)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=cpu_group)
    if not int(ready.item()):
        return None
    logger.info("tensor-parallel all-reduces up to %d MiB through symmetric memory",
                SYMMETRIC_BUFFER_BYTES // (1024 * 1024))
    return symmetric


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (the partial outputs of a row-parallel layer); use the returned tensor."""
    if _STATE.size == 1:
        return x
    symmetric = _STATE.symmetric
    if symmetric is not None:
        symmetric.last_slot = None  # every rank passes an all-reduce only once all have reached it
        if symmetric.fits(x):
            return symmetric(x)
    dist.all_reduce(x)
    return x


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, slot: int) -> torch.Tensor | PendingSum:
    """`F.linear(x, weight)` summed over ranks (a row-parallel layer without bias): a `PendingSum`
    in symmetric-memory inbox `slot` (0 or 1; calls that alternate the two, or have an all-reduce
    between two of one slot, exchange without waiting; otherwise the exchange adds a barrier)
    where that path is set up and the product fits, else the summed tensor."""
    if _STATE.size == 1:
        return F.linear(x, weight)
    symmetric = _STATE.symmetric
    if symmetric is not None and x.is_cuda and x.dim() == 2:
        partial = symmetric.slot(slot, (x.shape[0], weight.shape[0]), x.dtype)
        if partial is not None:
            torch.matmul(x, weight.t(), out=partial)
            return PendingSum(partial, slot)
    return all_reduce(F.linear(x, weight))


def sum_add_rms_norm(pending: PendingSum, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s + residual), s + residual) for the sum s over ranks of `pending`."""
    assert _STATE.symmetric is not None, "a PendingSum exists only on the symmetric-memory path"
    return _STATE.symmetric.sum_add_rms_norm(pending, residual, weight, eps)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard along the last dimension (vocabulary-parallel logits)."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 `hidden @ weight.T` (the GEMM's float32 accumulators) for this rank's vocabulary
    rows `weight`, with every rank's columns side by side on rank 0, the rank that samples. Other
    ranks may get only their own columns back (through symmetric memory, where they fit)."""
    symmetric = _STATE.symmetric
    out = symmetric.logits_slot(hidden.shape[0], weight.shape[0]) if symmetric is not None else None
    if symmetric is None or out is None:
        return all_gather_last_dim(torch.mm(hidden, weight.t(), out_dtype=torch.float32))
    torch.mm(hidden, weight.t(), out_dtype=torch.float32, out=out)
    return symmetric.gather_logits(out)


def broadcast_from_first(x: torch.Tensor) -> None:
    """Rank 0's values of `x` on every rank, in place: the tokens of a step scheduled ahead, which
    only rank 0 sampled. On CUDA it is queued on the stream like the collectives around it."""
    if _STATE.size == 1:
        return
    dist.broadcast(x, src=0)


def all_reduce_min(value: int) -> int:
    """The smallest of an integer over ranks (e.g. KV blocks every rank can hold)."""
    if _STATE.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.cpu_group)
    return int(t.item())


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
