"""All-reduce latency at decode sizes on 2 GPUs of one host: NCCL against PyTorch's
symmetric-memory one-shot and two-shot kernels (peer-to-peer loads over NVLink, no multicast).

    python benchmarks/allreduce.py                     # 2 GPUs, bf16 rows of 4096 (8B shape)

Each method runs as a tensor-parallel decode step runs it: --calls all-reduces (two per layer)
captured in one CUDA graph and replayed; microseconds per call are the replay's wall time / calls,
median of --reps replays. Every method's sum is checked against NCCL's before it is timed.
Writes benchmarks/results/allreduce.json and a PNG.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json  # noqa: E402


def graph_us_per_call(fn: Callable[[], object], calls: int, reps: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def nccl_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def methods(rows: int, hidden: int, device: torch.device) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    buffer = symm_mem.empty(rows * hidden, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buffer, group_name)

    def one_shot(x: torch.Tensor) -> torch.Tensor:
        buffer.copy_(x.view(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", group_name).view_as(x)

    def one_shot_copy(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.symm_mem.one_shot_all_reduce_copy(buffer, x.view(-1), "sum", group_name).view_as(x)

    def two_shot(x: torch.Tensor) -> torch.Tensor:
        buffer.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(buffer, "sum", group_name)
        return buffer.view_as(x)

    return {"nccl": nccl_all_reduce, "symm_one_shot": one_shot, "symm_one_shot_copy": one_shot_copy,
            "symm_two_shot": two_shot}


def worker(rank: int, world: int, init_file: str, args: argparse.Namespace, out_file: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=device)
    results = []
    for rows in args.rows:
        shape = (rows, args.hidden)
        gen = torch.Generator(device=device).manual_seed(rank * 1000 + rows)
        source = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        expected = source.clone()
        dist.all_reduce(expected)
        try:
            table = methods(rows, args.hidden, device)
        except Exception as exc:  # noqa: BLE001 - no symmetric memory here: NCCL alone
            print(f"symmetric memory unavailable: {exc}", flush=True)
            table = {"nccl": nccl_all_reduce}
        for name, fn in table.items():
            row = {"method": name, "rows": rows, "bytes": rows * args.hidden * 2}
            try:
                got = fn(source.clone())
                torch.cuda.synchronize()
                row["max_abs_err"] = float((got.float() - expected.float()).abs().max())
                work = source.clone()
                row["us_per_call"] = graph_us_per_call(lambda w=work, f=fn: f(w), args.calls, args.reps)
            except Exception as exc:  # noqa: BLE001 - an unsupported method is a result here
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            results.append(row)
            dist.barrier()
    if rank == 0:
        import json

        with open(out_file, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256], help="tokens in the step")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=64, help="all-reduces in one captured graph (2 per layer)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--name", default="allreduce")
    args = ap.parse_args()
    info = machine_info()
    print_machine(info)
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(worker, args=(world, os.path.join(tmp, "init"), args, out), nprocs=world, join=True)
        import json

        with open(out) as f:
            rows = json.load(f)
    print_table(rows, ["method", "rows", "bytes", "us_per_call", "max_abs_err", "error"])
    print(write_json(args.name, {"benchmark": "allreduce", "machine": info, "args": vars(args), "rows": rows}))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["method"] for r in rows):
        pts = [r for r in rows if r["method"] == name and "us_per_call" in r]
        if pts:
            ax.plot([r["bytes"] for r in pts], [r["us_per_call"] for r in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per all-reduce")
    ax.set_ylabel("µs per call (in a CUDA graph)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path(args.name), dpi=120)
    print(png_path(args.name))


if __name__ == "__main__":
    main()
