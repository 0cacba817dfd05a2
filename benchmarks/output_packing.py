"""Output path per step: packed frame (custom ops) vs a fixed-size layout, bytes and time.

    python benchmarks/output_packing.py [--device cpu|cuda] [--reps N] [--name output_packing]

One speculative step: S = 5 slots per sequence (4 draft tokens), accept counts drawn
from 1..5 (seed 0), B in {1, 64, 256}, top_logprobs k in {0, 5}, no sampling masks.
Each path is timed end to end, as the engine sees it: worker-side pack (with the copy
to the host on CUDA) -> one message over a ZMQ ipc socket -> engine-side unpack to
per-request Python lists (`split_by_sequence`: token ids, logprobs, top-k ids, ranks).

* packed: the runner's packer (`choose_packer`: C++ op on CPU; CUDA op: gather on device,
  frame written to pinned host memory) and the codec's `unpack_step_frame`.
* packed, staged (CUDA only): the frame built in device memory, its 64-byte header read
  back for the size, then one copy of exactly the frame.
* reference: the numpy packer (`ReferencePacker`) and the same unpacker.
* fixed: what a fixed layout ships: 20 top-k columns for every one of the S slots of
  every sequence, copied whole (one copy per array), every array `.tolist()`-ed and
  cut per request to its accepted slots and k + 1 columns.

Median wall ms per step over --reps after warm-up (synchronised). Prints a table,
writes JSON and a PNG under benchmarks/results/.

On CUDA it also times the step the saving is compared with: the dense matrix products
of one Llama-3-8B decode step over B x S tokens in bf16 (every linear layer and the LM
head, random weights; attention, norms and the sampler left out), a floor under that
model's real step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_info, png_path, print_machine, print_table, pyplot, write_json
from fastdeploy.common.step_frame import split_by_sequence, unpack_step_frame
from fastdeploy.common.step_slots import StepSlots
from fastdeploy.ops.step_packer import ReferencePacker, StepPacker, choose_packer, load_ops, op_args

SLOTS = 5
FIXED_TOP_K = 20
VOCAB = 49152
BATCHES = (1, 64, 256)
TOP_LOGPROBS = (0, 5)


def make_step(batch: int, k: int, top_k: int, device: str, seed: int = 0) -> StepSlots:
    """A step's slot layout with `top_k` + 1 logprob columns, on `device`."""
    g = torch.Generator().manual_seed(seed)
    slots = StepSlots(
        message_id=1,
        seq_ids=torch.arange(batch, dtype=torch.int64) + 1000,
        accept_counts=torch.randint(1, SLOTS + 1, (batch,), generator=g, dtype=torch.int32),
        token_ids=torch.randint(0, VOCAB, (batch, SLOTS), generator=g),
        num_logprobs=k,
        lp_ids=torch.randint(0, VOCAB, (batch, SLOTS, top_k + 1), generator=g),
        lp_values=-torch.rand(batch, SLOTS, top_k + 1, generator=g) * 10,
        ranks=torch.randint(1, 100, (batch, SLOTS), generator=g),
    )
    for name in ("seq_ids", "accept_counts", "token_ids", "lp_ids", "lp_values", "ranks"):
        setattr(slots, name, getattr(slots, name).to(device))
    return slots


def fixed_pack(slots: StepSlots) -> bytes:
    """The fixed layout: every array whole, copied to the host one by one."""
    arrays = (slots.seq_ids, slots.accept_counts, slots.token_ids, slots.lp_ids, slots.lp_values, slots.ranks)
    return b"".join(a.cpu().numpy().tobytes() for a in arrays)


def fixed_unpack(buf: bytes, batch: int, k: int) -> list[tuple]:
    """Per-request lists from the fixed layout: whole arrays to lists, then cut."""
    offset = 0

    def take(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        nonlocal offset
        array = np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
        offset += array.nbytes
        return array

    seq_ids = take("<i8", (batch,)).tolist()
    counts = take("<i4", (batch,)).tolist()
    tokens = take("<i8", (batch, SLOTS)).tolist()
    lp_ids = take("<i8", (batch, SLOTS, FIXED_TOP_K + 1)).tolist()
    lp_values = take("<f4", (batch, SLOTS, FIXED_TOP_K + 1)).tolist()
    ranks = take("<i8", (batch, SLOTS)).tolist()
    return [
        (seq_ids[b], tokens[b][:c], [row[: k + 1] for row in lp_values[b][:c]],
         [row[: k + 1] for row in lp_ids[b][:c]], ranks[b][:c])
        for b, c in enumerate(counts)
    ]


class Socket:
    """A ZMQ PAIR over ipc, both ends in this process: the worker -> engine hop."""

    def __init__(self) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.ctx = zmq.Context()
        self.tx, self.rx = self.ctx.socket(zmq.PAIR), self.ctx.socket(zmq.PAIR)
        address = f"ipc://{self.dir.name}/out"
        self.rx.bind(address)
        self.tx.connect(address)

    def hop(self, buf) -> bytes:
        self.tx.send(buf, copy=False)
        return self.rx.recv()

    def close(self) -> None:
        self.tx.close(0)
        self.rx.close(0)
        self.ctx.term()
        self.dir.cleanup()


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> tuple[float, object]:
    sync()
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1e3, result


def measure(name: str, pack: Callable[[], bytes], unpack: Callable[[bytes], object], socket: Socket,
            sync: Callable[[], None], reps: int) -> dict:
    pack_ms, hop_ms, unpack_ms, total_ms = [], [], [], []
    size = 0
    for i in range(reps + 3):
        t_pack, buf = timed(pack, sync)
        t_hop, received = timed(lambda b=buf: socket.hop(b), sync)
        t_unpack, _ = timed(lambda b=received: unpack(b), sync)
        size = len(received)
        if i >= 3:  # warm-up: op load, allocator pools, socket buffers
            pack_ms.append(t_pack)
            hop_ms.append(t_hop)
            unpack_ms.append(t_unpack)
            total_ms.append(t_pack + t_hop + t_unpack)
    median = statistics.median
    return {"path": name, "bytes": size, "pack_ms": median(pack_ms), "socket_ms": median(hop_ms),
            "unpack_ms": median(unpack_ms), "total_ms": median(total_ms)}


def matmul_floor_ms(batch: int, config_path: str, reps: int = 10) -> float:
    """Median ms of the linear layers of one decode step over batch x S tokens (bf16, CUDA)."""
    with open(config_path) as f:
        cfg = json.load(f)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    qkv = hidden + 2 * cfg["num_key_value_heads"] * head_dim
    dev, dt = "cuda", torch.bfloat16
    # One layer's weights reused for every layer: 0.4 GB, far past the L2 cache, so each
    # product still streams its weights from memory.
    w_qkv, w_o = torch.randn(qkv, hidden, device=dev, dtype=dt), torch.randn(hidden, hidden, device=dev, dtype=dt)
    w_up = torch.randn(2 * inter, hidden, device=dev, dtype=dt)
    w_down = torch.randn(hidden, inter, device=dev, dtype=dt)
    w_head = torch.randn(cfg["vocab_size"], hidden, device=dev, dtype=dt)
    x = torch.randn(batch * SLOTS, hidden, device=dev, dtype=dt)
    linear = torch.nn.functional.linear

    def step() -> None:
        h = x
        for _ in range(cfg["num_hidden_layers"]):
            linear(h, w_qkv)
            h = linear(h, w_o)
            up = linear(h, w_up)
            h = linear(up[:, :inter], w_down)
        linear(h, w_head)

    times = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def packed_bytes(packer: StepPacker, slots: StepSlots) -> bytes:
    return bytes(packer.pack(slots).buffer)  # no masks here: the frame is whole when it returns


def pack_staged(slots: StepSlots) -> bytes:
    """CUDA alternative kept for comparison: device buffer, size read back, then one exact copy."""
    return torch.ops.fastdeploy_ops.pack_step_slots_staged(*op_args(slots)).numpy().tobytes()


def run(device: str, reps: int) -> list[dict]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    load_ops(cuda=device == "cuda")
    packer, reference = choose_packer(torch.device(device)), ReferencePacker()
    socket = Socket()
    rows = []
    try:
        for batch in BATCHES:
            for k in TOP_LOGPROBS:
                packed = make_step(batch, k, top_k=k, device=device)  # the sampler gathers k + 1 columns
                fixed = make_step(batch, k, top_k=FIXED_TOP_K, device=device)
                paths = [
                    ("packed", lambda s=packed: packed_bytes(packer, s),
                     lambda b: split_by_sequence(unpack_step_frame(b))),
                    ("reference", lambda s=packed: packed_bytes(reference, s),
                     lambda b: split_by_sequence(unpack_step_frame(b))),
                    ("fixed", lambda s=fixed: fixed_pack(s), lambda b, B=batch, k=k: fixed_unpack(b, B, k)),
                ]
                if device == "cuda":
                    paths.insert(1, ("packed staged", lambda s=packed: pack_staged(s),
                                     lambda b: split_by_sequence(unpack_step_frame(b))))
                accepted = int(packed.accept_counts.sum())
                for name, pack, unpack in paths:
                    row = measure(name, pack, unpack, socket, sync, reps)
                    rows.append({"device": device, "batch": batch, "top_logprobs": k, "accepted": accepted, **row})
    finally:
        socket.close()
    for row in rows:
        fixed_row = next(r for r in rows if r["batch"] == row["batch"] and r["top_logprobs"] == row["top_logprobs"]
                         and r["path"] == "fixed")
        row["bytes_vs_fixed"] = fixed_row["bytes"] / row["bytes"]
        row["saved_ms_vs_fixed"] = fixed_row["total_ms"] - row["total_ms"]
    return rows


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    labels = list(dict.fromkeys(f"B={r['batch']} k={r['top_logprobs']}" for r in rows))
    width = 0.8 / len(paths)
    for i, name in enumerate(paths):
        sel = [r for r in rows if r["path"] == name]
        xs = [j + i * width for j in range(len(sel))]
        axes[0].bar(xs, [r["total_ms"] for r in sel], width, label=name)
        axes[1].bar(xs, [r["bytes"] / 1024 for r in sel], width, label=name)
    for ax, title in zip(axes, ("output path per step (ms)", "frame size (KiB)"), strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=30, fontsize=8)
        ax.set_title(f"{title}, {rows[0]['device']}, S={SLOTS}")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--name", default=None, help="result file stem (default output_packing[_gpu])")
    args = parser.parse_args()
    name = args.name or ("output_packing" if args.device == "cpu" else "output_packing_gpu")
    info = machine_info()
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    print_machine(info)
    rows = run(args.device, args.reps)
    columns = ["batch", "top_logprobs", "accepted", "path", "bytes", "bytes_vs_fixed", "pack_ms", "socket_ms",
               "unpack_ms", "total_ms", "saved_ms_vs_fixed"]
    step_floor = {}
    if args.device == "cuda":
        config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fastdeploy", "model_executor",
                              "models", "configs", "llama3_8b.json")
        step_floor = {batch: matmul_floor_ms(batch, config) for batch in BATCHES}
        for row in rows:
            row["step_floor_ms"] = step_floor[row["batch"]]
            # Fixed-layout step = floor + fixed output path; the gain is the share saved.
            fixed_ms = row["step_floor_ms"] + row["total_ms"] + row["saved_ms_vs_fixed"]
            row["step_gain_pct"] = 100 * row["saved_ms_vs_fixed"] / fixed_ms
        columns += ["step_floor_ms", "step_gain_pct"]
    print_table(rows, columns)
    print("json:", write_json(name, {"machine": info, "slots": SLOTS, "fixed_top_k": FIXED_TOP_K, "reps": args.reps,
                                     "llama3_8b_matmul_floor_ms": step_floor, "rows": rows}))
    plot(rows, png_path(name))
    print("png:", png_path(name))


if __name__ == "__main__":
    main()
