"""The paged decode attention kernel's tile settings on a GPU: tile width, warps and pipeline stages.

    python benchmarks/attention_tiles.py [--shapes 256x165 256x512 64x165 1x165] [--name attention_tiles]

The Triton decode kernel (`fastdeploy/model_executor/layers/triton_attention.py`) runs one
program per (row, KV head) and streams the row's keys in tiles of BLOCK_N tokens. For each
shape (rows x context tokens; the 8B shape's 32 query and 8 KV heads of 128 dims, bf16, 16-token
blocks scattered over the cache) every combination of BLOCK_N (32, 64, 128), warps (2, 4, 8) and
stages (1, 2, 3) is timed as 20 launches in one CUDA graph (best of 5 replays), next to the
kernel's own settings, with the K/V bytes it reads per second and its largest difference from
the kernel as shipped. Needs CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402
from fastdeploy.model_executor.layers import triton_attention as ta  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SHIPPED = (ta._BLOCK_N, ta._DECODE_WARPS, ta._DECODE_STAGES)  # paged_decode_attention's tile width, warps, stages


def time_shape(rows: int, context: int) -> list[dict[str, Any]]:
    dev = "cuda"
    blocks_per_row = -(-context // BLOCK_SIZE)
    num_blocks = rows * blocks_per_row + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks - 1, device=dev)[: rows * blocks_per_row].int().view(rows, blocks_per_row)
    lens = torch.full((rows,), context, device=dev, dtype=torch.int32)
    q = torch.randn(rows, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k, v = ta._kv_views(k_cache, v_cache)
    scale = HEAD_DIM ** -0.5
    shipped = torch.empty_like(q)
    ta.paged_decode_attention(q, k_cache, v_cache, tables.contiguous(), lens, scale, shipped)

    def launch(block_n: int, warps: int, stages: int, out: torch.Tensor) -> None:
        ta._paged_decode_kernel[(rows, KV_HEADS)](
            q, k, v, out, tables, lens, rows, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), tables.stride(0), scale,
            HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM, GROUP=HEADS // KV_HEADS, KV_BLOCK=BLOCK_SIZE,
            BLOCK_M=ta._DECODE_BLOCK_M, BLOCK_N=block_n, TILE=ta._DECODE_BLOCK_M // (HEADS // KV_HEADS),
            TABLE_CHUNK=ta._TABLE_CHUNK, PRECISION="tf32", num_warps=warps, num_stages=stages)

    kv_bytes = rows * context * KV_HEADS * HEAD_DIM * 2 * 2
    rows_out = []
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
        out = torch.empty_like(q)
        launch(block_n, warps, stages, out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                launch(block_n, warps, stages, out)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 20)
        ms = min(times)
        rows_out.append({"rows": rows, "context": context, "block_n": block_n, "warps": warps, "stages": stages,
                         "shipped": (block_n, warps, stages) == SHIPPED, "us": round(ms * 1e3, 2),
                         "kv_tb_s": round(kv_bytes / ms / 1e9, 3),
                         "max_diff": float((out.float() - shipped.float()).abs().max())})
    return rows_out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["256x165", "256x512", "64x165", "1x165"],
                   help="rows x context tokens")
    p.add_argument("--name", default="attention_tiles", help="result file stem")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_tiles.py needs CUDA")
    info = machine_info()
    print_machine(info)
    rows: list[dict[str, Any]] = []
    for shape in args.shapes:
        n, context = (int(x) for x in shape.split("x"))
        these = sorted(time_shape(n, context), key=lambda r: r["us"])
        rows += these
        shown = these[:5] + [r for r in these[5:] if r["shipped"]]
        print_table(shown, ["rows", "context", "block_n", "warps", "stages", "shipped", "us", "kv_tb_s", "max_diff"])
    path = write_json(args.name, {"machine": info, "shapes": args.shapes, "rows": rows})
    plt = pyplot()
    fig, axes = plt.subplots(1, len(args.shapes), figsize=(4.5 * len(args.shapes), 3.4), squeeze=False)
    for ax, shape in zip(axes[0], args.shapes, strict=True):
        n, context = (int(x) for x in shape.split("x"))
        these = sorted((r for r in rows if r["rows"] == n and r["context"] == context), key=lambda r: r["us"])
        ax.bar(range(len(these)), [r["us"] for r in these],
               color=["tab:orange" if r["shipped"] else "tab:blue" for r in these])
        ax.set_title(f"{shape}: us a launch (orange: shipped)", fontsize=9)
        ax.set_xlabel("the 27 settings, fastest first", fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path(args.name), dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
