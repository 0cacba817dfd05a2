"""Joining the tensor-parallel group, and the plan rank 0 broadcasts to the other ranks each step."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import msgspec
import torch
import zmq

from fastdeploy.common.config import EngineConfig, check_speculation_fits_ranks
from fastdeploy.common.ipc import endpoint, socket
from fastdeploy.common.step_input import ChunkInput
from fastdeploy.distributed.parallel_state import init_tensor_parallel, tp_rank, tp_size

# How long a tensor-parallel group's start-up waits for a rank (its rendezvous' timeout too).
GROUP_TIMEOUT_S = 600.0
# How often rank 0 looks for the other ranks' marks (a stat call each).
GATE_POLL_S = 0.05


class ForwardPlan(msgspec.Struct, array_like=True):
    """What rank 0 tells the other tensor-parallel ranks to compute this step."""

    chunks: list[ChunkInput]
    drafts: dict[int, list[int]]


def start_tensor_parallel(config: EngineConfig, rank: int, dist_init_file: str | None) -> torch.device:
    """The device of this rank, after joining its group of `config.tensor_parallel_size`
    processes (nothing to join for one)."""
    device = torch.device(config.device)
    tp = config.tensor_parallel_size
    if tp > 1:
        if dist_init_file is None:
            raise ValueError("a tensor-parallel group needs the file its ranks meet at")
        check_speculation_fits_ranks(config)  # an EngineConfig made without EngineArgs
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        init_tensor_parallel(rank, tp, dist_init_file, device, timeout_s=GROUP_TIMEOUT_S,
                             custom_all_reduce=not config.disable_custom_all_reduce)
    return device


class StartupGate:
    """Meeting points of a tensor-parallel group's start-up, outside its collectives.

    Each rank marks a point reached with a file beside the group's rendezvous file; rank 0 waits
    for every rank's mark, calling `check_ranks` between looks. A rank that dies before a point
    (a bad model directory, out of memory while loading) then ends rank 0's wait at once where
    the group's own rendezvous or first collective would hold it for the group's timeout. Rank 0
    of a worker process passes no check: the engine watches the ranks and stops it instead."""

    def __init__(self, rendezvous_file: str | None, rank: int, size: int,
                 check_ranks: Callable[[], None] | None = None, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self._file = rendezvous_file if size > 1 else None
        self._rank, self._size = rank, size
        self._check_ranks = check_ranks
        self._timeout_s = timeout_s

    def reach(self, point: str) -> None:
        """Mark `point` reached; rank 0 returns once every rank has marked it."""
        if self._file is None:
            return
        with open(self._mark(point, self._rank), "w"):
            pass
        if self._rank != 0:
            return
        deadline = time.monotonic() + self._timeout_s
        missing = list(range(1, self._size))
        while True:
            missing = [rank for rank in missing if not os.path.exists(self._mark(point, rank))]
            if not missing:
                return
            if self._check_ranks is not None:
                self._check_ranks()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks {missing} did not reach start-up point {point!r} "
                                   f"within {self._timeout_s:.0f} s")
            time.sleep(GATE_POLL_S)

    def _mark(self, point: str, rank: int) -> str:
        assert self._file is not None
        return f"{self._file}.{point}.{rank}"


class PlanChannel:
    """Rank 0 -> the other ranks: the forward passes they take part in, one plan per step.

    A ZMQ PUSH socket per follower (ipc, beside the group's rendezvous file): rank 0's send
    returns as soon as the plan is queued, so its step never waits on a follower's host loop
    (a gloo broadcast did: about 1 ms a step on two H200s). A follower blocks in `receive`
    until the next plan; its parent-watch thread ends it if the engine dies."""

    def __init__(self, rendezvous_file: str | None) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ForwardPlan)
        self._senders: list[zmq.Socket] = []
        self._receiver: zmq.Socket | None = None
        if tp_size() == 1 or rendezvous_file is None:
            return
        context: zmq.Context = zmq.Context.instance()
        if tp_rank() == 0:
            for rank in range(1, tp_size()):
                sender = socket(context, zmq.PUSH, _plan_address(rendezvous_file, rank), bind=True)
                sender.setsockopt(zmq.SNDTIMEO, PLAN_SEND_TIMEOUT_MS)
                sender.setsockopt(zmq.LINGER, PLAN_SEND_TIMEOUT_MS)  # the stop message still goes out on close
                self._senders.append(sender)
        else:
            self._receiver = socket(context, zmq.PULL, _plan_address(rendezvous_file, tp_rank()), bind=False)

    def send(self, chunks: list[ChunkInput], drafts: dict[int, list[int]]) -> None:
        if self._senders:
            self._send(self._encoder.encode(ForwardPlan(chunks, drafts)))

    def receive(self) -> ForwardPlan | None:
        """Ranks > 0: the next step's plan; None when rank 0 says stop."""
        assert self._receiver is not None, "only ranks > 0 of a group receive plans"
        payload = self._receiver.recv()
        return self._decoder.decode(payload) if payload else None

    def release_followers(self) -> None:
        """Rank 0: end the other ranks' `receive` loops."""
        self._send(b"")

    def close(self) -> None:
        for sock in [*self._senders, *([self._receiver] if self._receiver is not None else [])]:
            sock.close()
        self._senders, self._receiver = [], None

    def _send(self, payload: bytes) -> None:
        for sender in self._senders:
            try:
                sender.send(payload)
            except zmq.Again as exc:  # a follower that takes nothing for this long is gone or stuck
                raise RuntimeError(f"a tensor-parallel rank took no plan within {PLAN_SEND_TIMEOUT_MS} ms") from exc


# Rank 0 queues plans without waiting; only a follower that stopped taking them makes it wait this long.
PLAN_SEND_TIMEOUT_MS = 60_000


def _plan_address(rendezvous_file: str, rank: int) -> str:
    """Beside the rendezvous file, in the engine's private directory."""
    return endpoint(os.path.dirname(rendezvous_file), f"{os.path.basename(rendezvous_file)}.plans{rank}")
