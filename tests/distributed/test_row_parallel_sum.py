"""Row-parallel products summed over 2 GPUs inside the norm that follows (`row_parallel_linear` +
`sum_add_rms_norm`, the symmetric-memory path of a decoder layer): both ranks get the same bits,
equal to a float64 reference; eager, replayed from a CUDA graph with the two slots alternating
as in a layer (once with one rank's work late), one slot twice in a row, and for a product too
large for a slot (summed by the all-reduce instead)."""

from __future__ import annotations

import pytest
import torch

from tests.two_gpu_ranks import results_of_two_gpu_ranks

IN_FEATURES = 1024  # this rank's share of the input channels
HIDDEN = 4096
ROWS = (4, 96, 1024, 1100)  # 32 KiB ... 8 MiB (a whole slot) of bf16, and one over a slot
EPS = 1e-5


def _operands(rank: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return (torch.randn(rows, IN_FEATURES, generator=g),
            torch.randn(HIDDEN, IN_FEATURES, generator=g) / IN_FEATURES**0.5)


def _shared(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream and the norm's weight, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 10 + 9)
    return torch.randn(rows, HIDDEN, generator=g), 1 + 0.1 * torch.randn(HIDDEN, generator=g)


def _reference(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    bf16 = torch.bfloat16
    total = torch.zeros(rows, HIDDEN, dtype=torch.float64)
    for rank in (0, 1):
        x, w = _operands(rank, rows, seed)
        total += (x.to(bf16).double() @ w.to(bf16).double().T).to(bf16).double()  # each product in bf16
    residual, weight = _shared(rows, seed=1)  # both sub-blocks add to the same residual here
    summed = (total.to(bf16).double() + residual.to(bf16).double()).to(bf16).double()
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + EPS) * weight.to(bf16).double()
    return normed, summed


def _layer_like(x0, w0, x1, w1, residual, norm_weight, slots=(0, 1)):
    """Two sub-blocks as a decoder layer runs them: slot 0, its norm, slot 1, its norm."""
    from fastdeploy.distributed.parallel_state import PendingSum, row_parallel_linear, sum_add_rms_norm
    from fastdeploy.model_executor.layers.triton_fused import add_rms_norm

    outs = []
    for slot, (x, w) in zip(slots, ((x0, w0), (x1, w1)), strict=True):
        product = row_parallel_linear(x, w, slot)
        if isinstance(product, PendingSum):
            outs.append(sum_add_rms_norm(product, residual, norm_weight, EPS))
        else:
            outs.append(add_rms_norm(product, residual, norm_weight, EPS))
    return outs


def _layers(rank: int, device: torch.device) -> dict:
    from fastdeploy.distributed import parallel_state
    from fastdeploy.distributed.parallel_state import PendingSum, row_parallel_linear

    bf16 = torch.bfloat16
    results = {}
    for rows in ROWS:
        fits = isinstance(row_parallel_linear(torch.zeros(rows, IN_FEATURES, device=device, dtype=bf16),
                                              torch.zeros(HIDDEN, IN_FEATURES, device=device, dtype=bf16), 0),
                          PendingSum)
        assert fits == (rows * HIDDEN * 2 <= parallel_state.SYMMETRIC_BUFFER_BYTES)
        residual, norm_weight = (t.to(device, bf16) for t in _shared(rows, seed=1))
        a = [t.to(device, bf16) for t in _operands(rank, rows, seed=1)]
        b = [t.to(device, bf16) for t in _operands(rank, rows, seed=2)]
        eager = _layer_like(*a, *b, residual, norm_weight)  # seed 1 in slot 0, seed 2 in slot 1
        results[f"eager_{rows}"] = [t.cpu() for pair in eager for t in pair]
        if not fits:
            continue  # summed by the all-reduce, which other tests replay from graphs

        static = [torch.zeros_like(t) for t in (*a, *b)]
        _layer_like(*static, residual, norm_weight)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _layer_like(*static, residual, norm_weight)
        # Seeds swapped, back, swapped again with rank 1 late: rank 0 must wait for its product
        # (its slot still holds the previous replay's).
        for replay, (first, second) in enumerate(((b, a), (a, b), (b, a))):
            for dst, src in zip(static, (*first, *second), strict=True):
                dst.copy_(src)
            if replay == 2 and rank == 1:
                torch.cuda._sleep(100_000_000)  # ~50 ms on an H100
            graph.replay()
            torch.cuda.synchronize()
            results[f"graph_{rows}_{replay}"] = [t.cpu() for pair in captured for t in pair]
        del graph, captured
        torch.cuda.synchronize()
    # One slot twice in a row, back to back many times (a peer may still read the last message).
    rows = 96
    residual, norm_weight = (t.to(device, bf16) for t in _shared(rows, seed=1))
    a = [t.to(device, bf16) for t in _operands(rank, rows, seed=1)]
    b = [t.to(device, bf16) for t in _operands(rank, rows, seed=2)]
    for repeat in range(50):
        same = _layer_like(*a, *b, residual, norm_weight, slots=(0, 0))
        results[f"same_{rows}_{repeat}"] = [t.cpu() for pair in same for t in pair]
    return results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_row_parallel_products_summed_in_the_norm_over_two_gpus():
    ranks = results_of_two_gpu_ranks(_layers)
    for key, got in ranks[0].items():
        for mine, theirs in zip(got, ranks[1][key], strict=True):
            assert torch.equal(mine, theirs), f"{key}: the ranks disagree"
        rows = int(key.split("_")[1])
        seeds = (2, 1) if key.startswith("graph") and key.endswith(("_0", "_2")) else (1, 2)
        for (normed, summed), seed in zip((got[:2], got[2:]), seeds, strict=True):
            ref_normed, ref_summed = _reference(rows, seed)
            torch.testing.assert_close(summed.double(), ref_summed, atol=3e-2, rtol=2e-2)
            torch.testing.assert_close(normed.double(), ref_normed, atol=3e-2, rtol=2e-2)
