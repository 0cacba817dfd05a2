"""Shared helpers for the benchmark scripts: machine description, table, JSON, PNG."""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or a broken build: the caller reports it as missing
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers depend on; stored in every result file."""
    return {**_machine_only(), "git_commit": benchmark_commit()}


def benchmark_commit() -> str | None:
    """The commit measured: BENCH_COMMIT where a copied tree's .git is not the tree's own (a device
    machine gets the working tree, not its history); else HEAD, marked "+dirty" when the tracked
    files differ from it."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=5).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return None
    return f"{commit}+dirty" if commit and dirty else commit


def _machine_only() -> dict[str, Any]:
    import torch

    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "llama_cpp_python": _version("llama_cpp"),
    }


class CollectorWatch:
    """The cyclic garbage collector's passes by generation, and the seconds spent in them,
    counted from creation on (`gc.callbacks`); callers difference two `snapshot()`s."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def snapshot(self) -> tuple[list[int], list[float]]:
        return list(self.count), list(self.seconds)


def machine_with_device(device: torch.device, threads: int) -> tuple[dict[str, Any], str]:
    """Sets torch's CPU threads, prints `machine_info()` with the device's name added and
    returns both (the name: the GPU's on CUDA, the CPU model otherwise)."""
    import torch

    torch.set_num_threads(threads)
    info = machine_info()
    info["device"] = torch.cuda.get_device_name() if device.type == "cuda" else info["cpu"]
    print_machine(info)
    return info, info["device"]


def print_machine(info: dict[str, Any]) -> None:
    print(f"# {info['date']}  {info['cpu']}  cores={info['cores']}  torch {info['torch']} "
          f"(threads={info['torch_threads']})  transformers {info['transformers']}  "
          f"llama-cpp-python {info['llama_cpp_python'] or 'n/a'}  commit {info['git_commit']}")


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Plain fixed-width table; floats with 1-2 decimals, None as '-'."""
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def write_json(name: str, payload: dict[str, Any]) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def png_path(name: str) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    return os.path.join(RESULTS_DIR, f"{name}.png")


def pyplot():
    """matplotlib without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ~50 ms on an H100: far longer than the host takes to queue what follows it.
SLEEP_CYCLES = 100_000_000


def queued_device_ms(fn: Callable[[], object], calls: int = 1) -> float:
    """CUDA: device ms per call of `fn`, with all `calls` calls queued behind a sleep kernel
    first, so the host's time to issue them is not in it (between two events)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes moved per second (read + write) by a large on-device copy; median of 20 after 5 warm-ups."""
    import torch

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= 5:
            times.append(time.perf_counter() - t)
    del src, dst
    return 2 * num_bytes / statistics.median(times)


def finish_bar_axis(ax, ylabel: str) -> None:
    """The bar charts' axis finish: a small label and legend, a light horizontal grid."""
    ax.set_ylabel(ylabel, fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_mb(pid: int) -> float:
    """Resident memory of process `pid` and every process under it (a server's engine and
    workers), in MiB."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def engine_processes(pid: int) -> list[tuple[Any, list[Any]]]:
    """The engines under the `fastdeploy serve` process `pid` (psutil processes) with each one's
    workers: spawned children that start processes of their own (the multiprocessing resource
    tracker starts none; a local Ray's processes are not spawned by multiprocessing)."""
    import psutil

    engines = []
    for child in psutil.Process(pid).children():
        try:
            if child.children() and "spawn_main" in " ".join(child.cmdline()):
                engines.append((child, child.children()))
        except psutil.Error:
            pass
    return engines


def start_py_spy(pid: int, path: str, rate: int) -> subprocess.Popen:
    """py-spy recording process `pid` and its children to `path` (raw format) without pausing
    them (--nonblocking), waits included (--idle); `stop_py_spy` ends it."""
    return subprocess.Popen(["py-spy", "record", "--nonblocking", "--idle", "--subprocesses", "--rate", str(rate),
                             "--format", "raw", "--output", path, "--pid", str(pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def stop_py_spy(profiler: subprocess.Popen) -> None:
    profiler.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    profiler.wait(timeout=60)


# Kernel families of a decode step, matched in this order against the lower-cased kernel name.
KERNEL_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("paged_attention", "flash", "attn")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "splitk", "gemv", "grouped_gemm")),
    ("norm, rope, activation", ("rms_norm", "rope", "silu", "qk_norm", "layernorm")),
    ("all-reduce", ("allreduce", "all_reduce", "nccl", "symm", "one_shot", "two_shot")),
    ("sampler", ("argmax", "topk", "sort", "softmax", "kept_set", "_choose", "histogram", "_gather_kernel",
                 "_mask", "compact", "cumsum", "exponential", "uniform", "philox", "log_softmax", "gumbel",
                 "reduce_kernel", "max_kernel")),
    ("copies, fills", ("memcpy", "memset", "copy", "fill", "cat", "index", "scatter", "gather")),
)


def kernel_family(name: str) -> str:
    lowered = name.lower()
    for family, needles in KERNEL_FAMILIES:
        if any(n in lowered for n in needles):
            return family
    return "other"


def device_profile(events: Sequence[Any], steps: int) -> dict[str, Any]:
    """Per step, from a torch profiler's CUDA events over `steps` steps: device busy (the union
    of every kernel and copy on every stream), idle within the window, kernel ms by stream,
    by family (`KERNEL_FAMILIES`) and by name."""
    import torch

    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    if not device:
        return {"busy_ms": 0.0, "idle_ms": 0.0, "streams_ms": [], "families_ms": {}, "kernels_ms": {}}
    spans = sorted((e.time_range.start, e.time_range.end) for e in device)
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, start, end = busy + end - start, s, e
        else:
            end = max(end, e)
    busy += end - start
    window = max(e for _, e in spans) - spans[0][0]
    by_stream: dict[int, float] = defaultdict(float)
    by_family: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in device:
        us = e.time_range.elapsed_us()
        by_stream[e.device_resource_id] += us
        by_family[kernel_family(e.name)] += us
        by_name[e.name[:80]] += us
    per_step = 1e-3 / steps  # µs over the run -> ms per step
    return {"busy_ms": busy * per_step, "idle_ms": (window - busy) * per_step,
            "streams_ms": [us * per_step for us in sorted(by_stream.values(), reverse=True)],
            "families_ms": {k: v * per_step for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
            "kernels_ms": {k: v * per_step for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}}
