"""Sampling mask: kept-set kernel time vs the full sort, and decode throughput with the mask on vs off.

    python benchmarks/sampling_mask.py [--device cpu|cuda] [--skip-kernel] [--skip-e2e]
        [--e2e-model embedded|PATH --e2e-load-format dummy --e2e-dtype bfloat16] [--e2e-batches 64 256]

Kernel: for B in {1, 32, 256} x V in {49152, 151936}, the kept set of every row with
its CSR compaction and the copy of offsets / ids / logZ to the host, by

* "fast": CUDA: `kept_set_csr` of tests/layers/sample/kept_set_csr.py (a candidate prefilter over many programs
  per row, one Triton program per row finds the kept prefix, a compaction writes the CSR
  ids); CPU: the windowed partial sort of `truncation.py`, then CSR by a nonzero;
* "full sort": `truncation.kept_set_full_sort` (stable sort of every row, float64
  running sum), then CSR by a nonzero;

"masks_equal": both give the same CSR (offsets and ids).

next to the memory floor: reading the B x V float32 logits once (B·V·4 bytes) at the
device bandwidth measured here (a large copy, bytes read + written). Logits are
N(0, 4^2) ("peaked": top_p = 0.95 keeps a few hundred tokens) or N(0, 1) ("flat":
tens of thousands). Wall ms per call, synchronised, median; on CUDA also the device's busy
time per call (kernels and copies, from the profiler), which leaves out the host's latency.

End to end: decode throughput of one engine started with --enable-keep-sampling-mask,
alternating runs whose requests ask for the mask and runs whose requests opt out
(`return_sampling_mask: false`, so the worker computes nothing for it, as without the flag),
each side first in every other pair, several times, median tok/s of each: over the whole run
(prefill and the last steps included) and over its steady decode steps (from the end of the
second step to the end of the one before last). Default: the embedded model (CPU or CUDA:
--e2e-model embedded); a 7B-shape config with --e2e-load-format dummy on the GPU.

Writes benchmarks/results/sampling_mask_<device>.json and .png.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import machine_with_device, png_path, print_table, pyplot, write_json  # noqa: E402
from fastdeploy.model_executor.layers.sample import kept_set_gpu as ksg  # noqa: E402
from fastdeploy.model_executor.layers.sample.truncation import kept_logz, kept_set_full_sort, kept_window  # noqa: E402
from tests.layers.sample.kept_set_csr import kept_set_csr  # noqa: E402

BATCHES = (1, 32, 256)
VOCABS = (49152, 151936)
# name: (logit scale, temperature, top_k, top_p, min_p)
KERNEL_CONFIGS = {
    "top_p=0.95": (4.0, 1.0, 0, 0.95, 0.0),
    "flat top_p=0.95": (1.0, 1.0, 0, 0.95, 0.0),
    "top_k=50 top_p=0.9": (4.0, 1.0, 50, 0.9, 0.0),
    "min_p=0.05": (4.0, 1.0, 0, 1.0, 0.05),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device: torch.device, reps: int, budget_s: float) -> float:
    """Median wall ms per call (synchronised) after one warm-up; stops early past budget_s."""
    fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return statistics.median(times)


def device_busy_ms(fn, device: torch.device, reps: int = 5) -> float | None:
    """Mean ms per call the device spends in kernels and copies (torch profiler, self device
    time, so nested ops are not counted twice): the call's cost without the host's latency.
    None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    return sum(e.self_device_time_total for e in prof.key_averages()) / reps / 1e3


def bandwidth_gbs(device: torch.device) -> float:
    """Device memory bandwidth from a 1 GiB (CPU: 256 MiB) copy: (read + written) / time."""
    n = (1 << 28) if device.type == "cuda" else (1 << 26)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, reps=20, budget_s=5.0)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def _csr_of_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [R, V] -> (offsets int32 [R+1], ids int32 [M]) by a device nonzero."""
    offsets = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(mask.sum(dim=1), dim=0, out=offsets[1:])
    return offsets.to(torch.int32), mask.nonzero()[:, 1].to(torch.int32)


def _window_csr(x, t, k, p, mp):
    """The CPU path: the windowed partial sort of `truncation.kept_window`, then CSR."""
    win = kept_window(x, t, k, p, mp, want_lse=torch.ones(x.shape[0], dtype=torch.bool))
    mask = torch.zeros_like(x, dtype=torch.bool)
    keep = win.keep & (win.x > -math.inf)
    rows = torch.arange(x.shape[0]).unsqueeze(1).expand_as(keep)
    mask[rows[keep], win.idx[keep]] = True
    return (*_csr_of_mask(mask), kept_logz(win))


def _full_sort_csr(x, t, k, p, mp):
    ks = kept_set_full_sort(x, t, k, p, mp)
    return (*_csr_of_mask(ks.mask), ks.logz)


def kernel_grid(device: torch.device, reps: int, budget_s: float) -> list[dict]:
    bw = bandwidth_gbs(device)
    print(f"measured bandwidth: {bw:.0f} GB/s")
    fast_csr = kept_set_csr if ksg.uses_fast_path(device) else _window_csr
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (scale, t, k, p, mp) in KERNEL_CONFIGS.items():
        for v in VOCABS:
            for b in BATCHES:
                x = torch.randn(b, v, device=device, generator=gen) * scale
                params = [torch.full((b,), t, device=device), torch.full((b,), k, dtype=torch.int64, device=device),
                          torch.full((b,), p, device=device), torch.full((b,), mp, device=device)]

                def to_host(csr):
                    offsets, ids, logz = csr
                    return offsets.cpu(), ids.cpu(), logz.float().cpu()

                fast = lambda x=x, params=params: to_host(fast_csr(x, *params))  # noqa: E731
                full = lambda x=x, params=params: to_host(_full_sort_csr(x, *params))  # noqa: E731
                (go, gi, gl), (wo, wi, wl) = fast(), full()
                same = bool(torch.equal(go, wo) and torch.equal(gi, wi))
                logz_err = float((gl.double() - wl.double()).abs().max())
                kept = float(go.diff().float().mean())
                fast_ms = median_ms(fast, device, reps, budget_s)
                fast_dev, full_dev = device_busy_ms(fast, device), device_busy_ms(full, device)
                full_ms = median_ms(full, device, reps, budget_s)
                floor_ms = b * v * 4 / (bw * 1e9) * 1e3
                rows.append(dict(config=name, batch=b, vocab=v, fast_ms=fast_ms, full_sort_ms=full_ms,
                                 speedup=full_ms / fast_ms, floor_ms=floor_ms, kept_per_row=kept,
                                 masks_equal=same, max_logz_diff=logz_err, fast_device_ms=fast_dev,
                                 full_sort_device_ms=full_dev,
                                 device_speedup=full_dev / fast_dev if fast_dev else None))
                busy = f"  device {fast_dev:.3f} / {full_dev:.3f} ms" if fast_dev else ""
                print(f"{name:<20} B={b:<4} V={v:<7} fast {fast_ms:9.3f} ms  full sort {full_ms:9.3f} ms{busy}  "
                      f"x{full_ms / fast_ms:6.1f}  floor {floor_ms:.4f} ms  kept/row {kept:9.1f}  "
                      f"{'same' if same else 'MASKS DIFFER'}  dlogz {logz_err:.1e}", flush=True)
    for r in rows:
        r["bandwidth_gbs"] = bw
    return rows


def e2e(args, device: str) -> list[dict]:
    """Decode tok/s with the mask requested vs opted out, interleaved; medians of --e2e-reps."""
    from fastdeploy.common.request import EngineRequest
    from fastdeploy.common.sampling_params import SamplingParams
    from fastdeploy.common.startup_heap import settle_collector
    from fastdeploy.engine.args import EngineArgs
    from fastdeploy.engine.engine_core import EngineCore
    from fastdeploy.engine.executor import InProcessExecutor

    max_b = max(args.e2e_batches)
    model = None if args.e2e_model == "embedded" else args.e2e_model
    engine_args = EngineArgs(model=model, load_format=args.e2e_load_format, dtype=args.e2e_dtype,
                             device=device, max_num_seqs=max_b, max_model_len=512,
                             max_num_batched_tokens=max(2048, max_b * args.prompt_len),
                             enable_keep_sampling_mask=True)
    config = engine_args.create_engine_config()
    executor = InProcessExecutor(config)
    engine = EngineCore(config, executor)
    settle_collector("benchmark")  # as the serving processes do: no full collection walks the model
    vocab = executor.info.vocab_size
    counter = iter(range(10**9))

    def run(batch: int, mask: bool) -> tuple[float, float, float]:
        """(tok/s with prefill and the last steps included, tok/s of the steady decode steps,
        mean kept ids per masked token) of one batch of max_tokens each."""
        g = torch.Generator().manual_seed(next(counter))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=args.top_p, top_k=args.top_k,
                                ignore_eos=True, return_sampling_mask=mask)
        for i in range(batch):
            prompt = torch.randint(100, 30000, (args.prompt_len,), generator=g).tolist()
            engine.add_request(EngineRequest(f"{batch}-{mask}-{i}-{time.time()}", prompt, params, time.time()))
        tokens, kept, masked = 0, 0, 0
        steps: list[tuple[float, int]] = []  # (time after the step, tokens it handed out)
        t0 = time.perf_counter()
        while engine.has_work():
            step_tokens = 0
            for delta in engine.step():
                step_tokens += len(delta.token_ids)
                if delta.sampling_mask is not None:  # CSR: counted without building lists
                    # Two O(1) reads per delta: the consumer's own work stays out of the ratio.
                    # Every row here truncates (top_p < 1), so none is null.
                    kept += delta.sampling_mask.num_ids
                    masked += len(delta.sampling_mask)
            tokens += step_tokens
            steps.append((time.perf_counter(), step_tokens))
        whole = tokens / (time.perf_counter() - t0)
        # Steady decode: from the end of the second step to the end of the one before last, so
        # neither the prefill nor a step that only hands out deferred masks counts.
        steady = steps[2:-1]
        decode = sum(n for _, n in steady) / (steady[-1][0] - steps[1][0]) if steady else float("nan")
        return whole, decode, (kept / masked if masked else 0.0)

    rows = []
    for batch in args.e2e_batches:
        run(batch, True)  # warm-up: first use of this batch size
        on, off, on_decode, off_decode, kept = [], [], [], [], 0.0
        for rep in range(args.e2e_reps):
            # Each side goes first in every other pair, so neither always follows the other.
            for mask in (True, False) if rep % 2 == 0 else (False, True):
                tok_s, decode_tok_s, kept_ids = run(batch, mask)
                (on if mask else off).append(tok_s)
                (on_decode if mask else off_decode).append(decode_tok_s)
                kept = kept_ids if mask else kept
        row = dict(batch=batch, vocab=vocab, mask_on_tok_s=statistics.median(on),
                   mask_off_tok_s=statistics.median(off), on_runs=on, off_runs=off,
                   mask_on_decode_tok_s=statistics.median(on_decode),
                   mask_off_decode_tok_s=statistics.median(off_decode), on_decode_runs=on_decode,
                   off_decode_runs=off_decode, kept_per_token=kept)
        row["ratio"] = row["mask_on_tok_s"] / row["mask_off_tok_s"]
        row["decode_ratio"] = row["mask_on_decode_tok_s"] / row["mask_off_decode_tok_s"]
        rows.append(row)
        print(f"e2e B={batch}: mask on {row['mask_on_tok_s']:.1f} tok/s, off {row['mask_off_tok_s']:.1f} tok/s, "
              f"ratio {row['ratio']:.3f}, steady decode ratio {row['decode_ratio']:.3f}, "
              f"kept ids/token {kept:.0f}", flush=True)
    return rows


def plot(kernel: list[dict], e2e_rows: list[dict], device_name: str, path: str) -> None:
    plt = pyplot()
    configs = list(dict.fromkeys(r["config"] for r in kernel))
    n = len(configs) + (1 if e2e_rows else 0)
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.8))
    axes = list(axes) if n > 1 else [axes]
    for ax, name in zip(axes, configs, strict=True):
        for v, style in zip(VOCABS, ("-", "--"), strict=True):
            rows = [r for r in kernel if r["config"] == name and r["vocab"] == v]
            bs = [r["batch"] for r in rows]
            ax.plot(bs, [r["full_sort_ms"] for r in rows], "o" + style, color="C0", label=f"full sort V={v}")
            ax.plot(bs, [r["fast_ms"] for r in rows], "s" + style, color="C1", label=f"fast V={v}")
            ax.plot(bs, [r["floor_ms"] for r in rows], ":", color="gray", label=f"memory floor V={v}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("batch")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"ms per call, kept set + CSR to host ({device_name})", fontsize=8)
    axes[0].legend(fontsize=6)
    if e2e_rows:
        ax = axes[-1]
        labels = [str(r["batch"]) for r in e2e_rows]
        xs = range(len(e2e_rows))
        ax.bar([i - 0.2 for i in xs], [r["mask_off_tok_s"] for r in e2e_rows], 0.4, label="mask off")
        ax.bar([i + 0.2 for i in xs], [r["mask_on_tok_s"] for r in e2e_rows], 0.4, label="mask on")
        ax.set_xticks(list(xs), labels)
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tok/s (median)")
        ax.set_title("end to end", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=3.0, help="time budget per measured cell")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--e2e-model", default="embedded",
                    help="'embedded' (SmolLM2-135M-Instruct, default) or a model path / config for dummy weights")
    ap.add_argument("--e2e-load-format", default="auto")
    ap.add_argument("--e2e-dtype", default="float32")
    ap.add_argument("--e2e-batches", type=int, nargs="+", default=[8])
    ap.add_argument("--e2e-reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--name", default=None, help="result file stem (default sampling_mask_<device>)")
    args = ap.parse_args()
    device = torch.device(args.device)
    info, device_name = machine_with_device(device, args.threads)
    kernel = [] if args.skip_kernel else kernel_grid(device, args.reps, args.budget_s)
    if kernel:
        print_table(kernel, ["config", "batch", "vocab", "fast_ms", "full_sort_ms", "speedup", "fast_device_ms",
                             "full_sort_device_ms", "device_speedup", "floor_ms",
                             "kept_per_row", "masks_equal"])
    e2e_rows = [] if args.skip_e2e else e2e(args, args.device)
    if e2e_rows:
        print_table(e2e_rows, ["batch", "mask_off_tok_s", "mask_on_tok_s", "ratio", "mask_off_decode_tok_s",
                               "mask_on_decode_tok_s", "decode_ratio", "kept_per_token"])
    name = args.name or f"sampling_mask_{device.type}"
    print(write_json(name, {"benchmark": "sampling_mask", "machine": info, "args": vars(args), "kernel": kernel,
                            "e2e": e2e_rows}))
    plot(kernel, e2e_rows, device_name, png_path(name))
    print(png_path(name))


if __name__ == "__main__":
    main()
