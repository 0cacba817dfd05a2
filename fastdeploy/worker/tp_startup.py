"""Joining the tensor-parallel group, and the plan rank 0 broadcasts to the other ranks each step."""

from __future__ import annotations

import msgspec
import torch

from fastdeploy.common.config import EngineConfig
from fastdeploy.common.step_input import ChunkInput
from fastdeploy.distributed.parallel_state import broadcast_bytes, init_tensor_parallel, tp_rank, tp_size


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
        if config.speculative is not None and config.speculative.method == "mtp":
            raise ValueError("MTP speculation does not support --tensor-parallel-size > 1 yet")
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        init_tensor_parallel(rank, tp, dist_init_file, device, custom_all_reduce=not config.disable_custom_all_reduce)
    return device


class PlanChannel:
    """Rank 0 -> the other ranks: the forward passes they take part in, one plan per step."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ForwardPlan)

    def send(self, chunks: list[ChunkInput], drafts: dict[int, list[int]]) -> None:
        if tp_size() > 1:
            broadcast_bytes(self._encoder.encode(ForwardPlan(chunks, drafts)))

    def receive(self) -> ForwardPlan | None:
        """Ranks > 0: the next step's plan; None when rank 0 says stop."""
        payload = broadcast_bytes(None)
        return self._decoder.decode(payload) if payload else None

    def release_followers(self) -> None:
        """Rank 0: end the other ranks' `receive` loops."""
        if tp_size() > 1 and tp_rank() == 0:
            broadcast_bytes(b"")
