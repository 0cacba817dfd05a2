"""Decode-sized GEMMs of the 8B shape (whole and one tensor-parallel rank's half) on CUDA: cuBLAS
(through `torch.mm`, as the engine runs them) against a split-K Triton kernel over a grid of its
tile configs. The engine keeps cuBLAS: on an H100 the best Triton config per shape was within
+-5 % of it on most shapes and lost at 128 rows (docs/benchmarks.md, "Decode GEMMs").

The Triton kernel splits K among programs as well as N; each program writes its float32 partial
tile to a workspace, and the last program of a tile to finish (a per-tile counter) adds the
partials in split order and writes the result, so the sum is the same bits on every run, and
resets the counter (CUDA graphs replay it as is).

Device time per call from a CUDA graph of many calls, rotating through enough copies of the
weight that none is in L2 when it is read again; bandwidth = the weight's bytes over that time.
Each config's result is checked against a float64 product of the same bf16 inputs.

    python benchmarks/skinny_gemm.py [--rows 1 16 64 128]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.common import (  # noqa: E402
    copy_bandwidth,
    finish_bar_axis,
    machine_with_device,
    png_path,
    print_table,
    pyplot,
    write_json,
)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(
    X, W, Y, Partials, Counters, M, N, K, stride_x, stride_y, k_per_split,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_x + (k_start + rk)[None, :]
    w_ptrs = W + rn[:, None].to(tl.int64) * K + (k_start + rk)[None, :]
    for k in range(k_start, k_end, BK):
        k_ok = (k + rk) < k_end
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BK
        w_ptrs += BK
    out_mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        m_pad = tl.num_programs(2) * BM
        tile_at = rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(Partials + pid_k * m_pad * N + tile_at, acc, mask=out_mask)
        # Every thread's partial is stored before one thread counts the program in (release:
        # the last program to count sees every partial of the tile).
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(Counters + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BM, BN], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # Past L1 (".cg"): other programs wrote these partials.
                total += tl.load(Partials + s * m_pad * N + tile_at, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(Counters + tile, 0)


class SkinnyGemm:
    """Workspace and counters of one device; `__call__` computes `x @ weight.T` into `out`."""

    MAX_TILES = 1 << 16

    def __init__(self, device: torch.device, workspace_bytes: int = 64 << 20) -> None:
        self.partials = torch.empty(workspace_bytes // 4, dtype=torch.float32, device=device)
        self.counters = torch.zeros(self.MAX_TILES, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        assert weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
        if out is None:
            out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        block_m = max(16, triton.next_power_of_2(min(m, 64)))
        k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
        split_k = triton.cdiv(k, k_per_split)
        grid = (triton.cdiv(n, config.block_n), split_k, triton.cdiv(m, block_m))
        if split_k > 1:
            assert grid[0] * grid[2] <= self.MAX_TILES
            assert split_k * grid[2] * block_m * n <= self.partials.numel(), "the workspace holds every partial"
        _skinny_gemm_kernel[grid](
            x, weight, out, self.partials, self.counters, m, n, k, x.stride(0), out.stride(0), k_per_split,
            BM=block_m, BN=config.block_n, BK=config.block_k, SPLIT_K=split_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        return out


HIDDEN, INTERMEDIATE, Q_HEADS, KV_HEADS, HEAD = 4096, 14336, 32, 8, 128
# (name, N, K): the 8B decoder's four projections, whole (tp1) and one rank's of two (tp2).
SHAPES = [
    ("qkv tp1", (Q_HEADS + 2 * KV_HEADS) * HEAD, HIDDEN),
    ("o tp1", HIDDEN, Q_HEADS * HEAD),
    ("gate_up tp1", 2 * INTERMEDIATE, HIDDEN),
    ("down tp1", HIDDEN, INTERMEDIATE),
    ("qkv tp2", (Q_HEADS + 2 * KV_HEADS) * HEAD // 2, HIDDEN),
    ("o tp2", HIDDEN, Q_HEADS * HEAD // 2),
    ("gate_up tp2", INTERMEDIATE, HIDDEN),
    ("down tp2", HIDDEN, INTERMEDIATE // 2),
]
SMEM_BYTES = 220 * 1024


def configs() -> list[SkinnyConfig]:
    out = []
    for block_n, block_k, split_k, warps in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (4, 8)):
        # Shared memory for the pipelined x and w tiles at block_m 64 (the largest used).
        stages = 4
        while stages > 2 and stages * (64 + block_n) * block_k * 2 > SMEM_BYTES:
            stages -= 1
        out.append(SkinnyConfig(block_n, block_k, split_k, warps, stages))
    return out


def time_us(fn, copies: int, repeats: int = 3) -> float:
    """Device us per call: 4 x `copies` calls captured in one CUDA graph (no launch gaps), median of
    `repeats` replays."""
    calls = 4 * copies
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiled and loaded outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def rotating_call(gemm: SkinnyGemm | None, x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                  config: SkinnyConfig | None):
    """One product a call, each with the next copy of the weight; cuBLAS where `config` is None."""
    turn = itertools.count()

    def call() -> None:
        weight = weights[next(turn) % weights.shape[0]]
        if config is None:
            torch.mm(x, weight.T, out=out)
        else:
            assert gemm is not None
            gemm(x, weight, config, out=out)

    return call


def measure_shape(gemm: SkinnyGemm, name: str, n: int, k: int, rows: list[int], bandwidth: float) -> list[dict]:
    weight_bytes = n * k * 2
    copies = max(2, math.ceil((512 << 20) / weight_bytes))
    weights = torch.randn(copies, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    found = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        reference = x.double() @ weights[0].double().T
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cublas_us = time_us(rotating_call(None, x, weights, out, None), copies)
        cublas_err = (F.linear(x, weights[0]).double() - reference).abs().max().item()
        best: tuple[float, SkinnyConfig] | None = None
        for config in configs():
            try:
                got = gemm(x, weights[0], config)
            except Exception as e:  # a config the device cannot run (shared memory): skipped
                print(f"  {name} m={m} {config}: {type(e).__name__}")
                continue
            err = (got.double() - reference).abs().max().item()
            if err > 4 * cublas_err + 1e-2:
                raise AssertionError(f"{name} m={m} {config}: error {err} against cuBLAS's {cublas_err}")
            if not torch.equal(got, gemm(x, weights[0], config)):
                raise AssertionError(f"{name} m={m} {config}: two calls gave different bits")
            us = time_us(rotating_call(gemm, x, weights, out, config), copies)
            if best is None or us < best[0]:
                best = (us, config)
        assert best is not None
        found.append({"shape": name, "n": n, "k": k, "m": m, "weight_mb": weight_bytes / 1e6,
                      "cublas_us": cublas_us, "cublas_tb_s": weight_bytes / cublas_us / 1e6,
                      "cublas_max_error": cublas_err,
                      "triton_us": best[0], "triton_tb_s": weight_bytes / best[0] / 1e6,
                      "triton_over_cublas": cublas_us / best[0], "triton_config": best[1].__dict__,
                      "floor_us": weight_bytes / bandwidth * 1e6})
        print(f"{name:12s} m={m:4d} cublas {cublas_us:7.1f} us  triton {best[0]:7.1f} us  {best[1]}", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--shapes", nargs="+", default=[name for name, _, _ in SHAPES])
    parser.add_argument("--name", default="skinny_gemm")
    args = parser.parse_args()
    device = torch.device("cuda")
    info, device_name = machine_with_device(device, 8)
    bandwidth = copy_bandwidth("cuda", 1 << 30)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    gemm = SkinnyGemm(device)
    rows_out = []
    for name, n, k in SHAPES:
        if name in args.shapes:
            rows_out += measure_shape(gemm, name, n, k, args.rows, bandwidth)
            torch.cuda.empty_cache()
    print_table(rows_out, ["shape", "m", "weight_mb", "floor_us", "cublas_us", "cublas_tb_s", "triton_us",
                           "triton_tb_s", "triton_over_cublas"])
    path = write_json(args.name, {"benchmark": "skinny_gemm", "machine": info, "device": device_name,
                                  "copy_bandwidth_tb_s": bandwidth / 1e12, "rows": rows_out})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['shape']}\nm={r['m']}" for r in rows_out]
    xs = range(len(rows_out))
    ax.bar([i - 0.2 for i in xs], [r["cublas_tb_s"] for r in rows_out], 0.4, label="cuBLAS")
    ax.bar([i + 0.2 for i in xs], [r["triton_tb_s"] for r in rows_out], 0.4, label="split-K Triton (best config)")
    ax.set_xticks(list(xs), labels, fontsize=5, rotation=90)
    ax.axhline(bandwidth / 1e12, color="gray", lw=0.8, ls="--", label="copy bandwidth")
    finish_bar_axis(ax, "weight TB/s")
    fig.savefig(png_path(args.name), dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
