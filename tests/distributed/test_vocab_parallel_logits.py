"""Vocabulary-parallel logits over 2 GPUs (`vocab_parallel_logits`): rank 0 gets every rank's
columns side by side, equal to a float64 reference of the whole product, eagerly and replayed
from a CUDA graph (through symmetric memory), and for a product too large for its region
(through NCCL); the other rank gets at least its own columns."""

from __future__ import annotations

import pytest
import torch

from tests.two_gpu_ranks import results_of_two_gpu_ranks

HIDDEN = 512
VOCAB_SHARD = 8192  # each rank's vocabulary rows
ROWS = (1, 64, 2400)  # 32 KiB ... 75 MiB of float32 a rank: the last is over the region


def _operands(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states (the same on every rank) and the whole vocabulary's weight."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16),
            (torch.randn(2 * VOCAB_SHARD, HIDDEN, generator=g) / HIDDEN**0.5).to(torch.bfloat16))


def _logits(rank: int, device: torch.device) -> dict:
    from fastdeploy.distributed import parallel_state
    from fastdeploy.distributed.parallel_state import vocab_parallel_logits

    results = {}
    for rows in ROWS:
        hidden, weight = (t.to(device) for t in _operands(rows, seed=rows))
        shard = weight[rank * VOCAB_SHARD:(rank + 1) * VOCAB_SHARD]
        results[f"eager_{rows}"] = vocab_parallel_logits(hidden, shard).cpu()
        if rows * VOCAB_SHARD * 4 > parallel_state.LOGITS_BUFFER_BYTES:
            continue
        static = torch.zeros_like(hidden)
        vocab_parallel_logits(static, shard)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = vocab_parallel_logits(static, shard)
        static.copy_(hidden)
        if rank == 1:
            torch.cuda._sleep(100_000_000)  # ~50 ms late: rank 0 must wait for its columns
        graph.replay()
        torch.cuda.synchronize()
        results[f"graph_{rows}"] = captured.cpu()
        del graph, captured
    return results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_rank_zero_gets_the_whole_vocabularys_logits_over_two_gpus():
    ranks = results_of_two_gpu_ranks(_logits)
    assert set(ranks[0]) == {"eager_1", "graph_1", "eager_64", "graph_64", "eager_2400"}
    for key, logits in ranks[0].items():
        rows = int(key.split("_")[1])
        hidden, weight = _operands(rows, seed=rows)
        reference = hidden.double() @ weight.double().T
        assert logits.dtype == torch.float32 and logits.shape == reference.shape, key
        torch.testing.assert_close(logits.double(), reference, atol=1e-3, rtol=1e-3)
        # Rank 1 holds at least its own columns, at the end of whatever it got back.
        own = ranks[1][key][:, -VOCAB_SHARD:]
        torch.testing.assert_close(own.double(), reference[:, VOCAB_SHARD:], atol=1e-3, rtol=1e-3)
