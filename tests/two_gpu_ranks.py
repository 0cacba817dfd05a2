"""Two GPU ranks in one tensor-parallel group on the symmetric-memory path: each runs the same
body and hands back a dict of CPU tensors."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

RankBody = Callable[[int, torch.device], dict]


def results_of_two_gpu_ranks(body: RankBody) -> list[dict]:
    """`body(rank, device)` run on GPUs 0 and 1, joined as tensor-parallel ranks; each rank's dict.
    `body` must be a module-level function (the ranks are spawned processes)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(body, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in (0, 1)]


def _rank(rank: int, body: RankBody, init_file: str, out_dir: str) -> None:
    from fastdeploy.distributed import parallel_state

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    parallel_state.init_tensor_parallel(rank, 2, init_file, device)
    try:
        assert parallel_state._STATE.symmetric is not None, "the symmetric-memory path was not set up"
        torch.save(body(rank, device), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_tensor_parallel()
