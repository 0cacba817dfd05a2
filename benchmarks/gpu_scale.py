"""GPU at scale: the GPU-at-scale issue's figures on one CUDA GPU, merged into one JSON.

    python benchmarks/gpu_scale.py

runs every part on the CUDA GPU (about 12-15 minutes on an H100: docs/benchmarks.md, "GPU at
scale"). A 10-minute device call holds about half of it: split with `--parts`, e.g.
`--parts step guided mask` (no embedded GGUF needed) and `--parts spec spec_server guided_server
ready` (needs it), each call merging its figures into the same file; `--budget-s` skips a part
that would not fit, `--copy-to "$OUT"` copies the results out after every part, and `--commit`
(with `--dirty`) stamps a tree copy without `.git` (a device machine's).

Figures (inner keys are batch sizes or client counts, as strings; ratios above 1 favour the first named):

- step_over_floor[B]: decode step of the Llama-3-8B shape (random bf16 weights, CUDA graphs) as
  the engine runs it, each step launched before the one ahead of it is finished (asynchronous
  scheduling), over the floor (the weights one step reads / the measured copy bandwidth);
  benchmarks/gpu_decode.py's `pipelined_vs_floor` (the details keep `in_turn_vs_floor`, one
  `ModelRunner.execute` after another).
- guided_over_unconstrained[B]: in process, greedy chat under a JSON schema, tok/s over the same
  prompts unconstrained on equal work (each unconstrained row decodes as many tokens as its
  constrained twin); the 7B shape with Qwen's tokenizer on CUDA; benchmarks/guided.py's `throughput`.
- mtp_speedup[B], ngram_speedup[B]: in process, the embedded SmolLM2-135M repeating text it is given
  (benchmarks/speculative.py's prompts of `--spec-prompts`: "long", a JSON array of four records,
  whose answers run 220-330 tokens; "short", a JSON record or a code block, answers of 33-82
  tokens, past which the model writes on after its end of turn), greedy, `--max-tokens` tokens (EOS ignored):
  tok/s with the shipped MTP head (2 drafts) or n-gram speculation (4 drafts) over tok/s without;
  the median of per-round ratios (rounds rotate the engines' order).
- mtp_server_speedup[C], ngram_server_speedup[C]: the same through `fastdeploy serve` (one server per
  configuration, all up at once): C clients, each sending `--requests-per-client` non-streaming chat
  requests one after another; tok/s = completion tokens / wall time of the run.
- guided_server_ratio[C]: through the flag-off embedded server, a 12-item JSON array schema via
  `response_format` (the request ends when the array closes or at `--max-tokens`) against its
  unconstrained twin (max_tokens = the tokens its constrained request produced, EOS ignored).
- server_ready_s: seconds from `fastdeploy serve` to a 200 from /health. `embedded`: the embedded
  model's server on a machine that compiled its kernels before (Triton's cache not empty);
  `embedded_fresh_machine`: the first start of this run, when it found Triton's cache empty (then
  one more start gives `embedded`); `llama3_8b_dummy`: `llama3_8b --load-format dummy --device cuda`.
- mask_server_ratio[C]: benchmarks/serving_mask.py's flat case through the server: the 7B shape with
  Qwen's tokenizer (`--vocab-size 152064`), C clients (client processes: `--mask-client-procs`),
  tok/s with `--enable-keep-sampling-mask` and bitmap masks over tok/s without.

Parts: step, guided and spec run each in a child process of this script (its GPU memory is freed when
it ends; a hung one is killed at `--part-timeout`); spec_server and guided_server share one flag-off
embedded server, which also gives `server_ready_s["embedded"]`; ready, mask. Every server is stopped
at the end, on an error and on SIGTERM. A part that fails is recorded as failed, with its error, and
the others go on.

Output: benchmarks/results/gpu_scale.json (`gpu_scale_cpu.json` with `--device cpu`), merged with the
file there: figures of parts not run stay, with `measured_at` saying at which commit each was
measured (`figure: commit`, or `figure.key: commit` where a figure's values come from different
commits); `runs[part]` holds each part's latest details; a PNG and a table. Written after every part.

CPU smoke test (step and mask need CUDA and are recorded as skipped there):

    python benchmarks/gpu_scale.py --device cpu --parts spec_server guided_server --clients 1 2 \\
        --max-tokens 16 --requests-per-client 1
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import REPO_ROOT, RESULTS_DIR, cpu_model, png_path, print_table, pyplot, write_json  # noqa: E402
from benchmarks.serving import Server, fastdeploy_server  # noqa: E402

NAME = "gpu_scale"
PARTS = ["step", "guided", "spec", "spec_server", "guided_server", "ready", "mask"]
IN_PROCESS = {"step", "guided", "spec"}
CUDA_ONLY = {"step", "mask"}
# The parts that load the flag-off embedded server; any other part first stops every server, so
# that it has the GPU (and the host's cores) to itself.
OFF_SERVER_PARTS = {"spec_server", "guided_server"}
FIGURES = {  # figure -> the part that measures it
    "step_over_floor": "step",
    "guided_over_unconstrained": "guided",
    "mtp_speedup": "spec",
    "ngram_speedup": "spec",
    "mtp_server_speedup": "spec_server",
    "ngram_server_speedup": "spec_server",
    "server_ready_s": "ready",
    "guided_server_ratio": "guided_server",
    "mask_server_ratio": "mask",
}
# Rough H100 seconds of each part at the default sizes, from docs/benchmarks.md's start-up and
# throughput figures; `--budget-s` skips a part when less than this is left.
PART_ESTIMATE_S = {"step": 70, "guided": 100, "spec": 90, "spec_server": 240, "guided_server": 60, "ready": 80,
                   "mask": 150}

SPECS: dict[str, dict[str, Any]] = {
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
}
PEOPLE_SCHEMA = {"type": "array",
                 "items": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                           "required": ["name", "age"]},
                 "minItems": 12, "maxItems": 12}
# Several embedded servers (or engines) share one GPU: each gets a fixed KV pool instead of "all
# that is free" (4096 blocks of 16 tokens: 64 sequences of 1,024 tokens).
EMBEDDED_KV_BLOCKS = 4096
# The 7B shape with Qwen's real vocabulary, as `benchmarks/qwen_dummy_dir.py --out qwen7b` writes it.
QWEN_DIRS = ["qwen7b"]
QWEN_VOCAB = 152064
LLAMA_8B_ARGS = ["llama3_8b", "--load-format", "dummy", "--device", "cuda"]


# --- where and what ---------------------------------------------------------------------------------

def git_state(given: str | None, given_dirty: bool) -> tuple[str | None, bool | None]:
    """(full HEAD hash, tree dirty): `--commit` and `--dirty` as given (a device machine's tree
    copy: whatever .git it carries need not be the tree's), else from git."""
    if given:
        return given, given_dirty
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if head.returncode != 0 or status.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip())


def device_name(device: str) -> str:
    """The GPU's name from nvidia-smi (this process never initialises CUDA: it forks client
    processes, and the GPU's memory is for the parts); the CPU model otherwise."""
    if not device.startswith("cuda"):
        return cpu_model()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
        names = out.stdout.strip().splitlines()
        if names:
            return names[0].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "cuda (name unknown)"


def triton_cache_files() -> int:
    """Files in Triton's kernel cache: none means no kernel was compiled on this machine yet."""
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return sum(len(files) for _, _, files in os.walk(root)) if os.path.isdir(root) else 0


def qwen7b_dir(given: str | None) -> str:
    """The 7B-shape dummy directory with Qwen's tokenizer: `--qwen-dir`, else ./qwen7b."""
    if given:
        return given
    for rel in QWEN_DIRS:
        path = os.path.join(REPO_ROOT, rel)
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
    raise FileNotFoundError(f"no 7B-shape directory with Qwen's tokenizer in {QWEN_DIRS}: "
                            "make one with benchmarks/qwen_dummy_dir.py or pass --qwen-dir")


def embedded_serve_args(device: str, max_num_seqs: int) -> list[str]:
    """`fastdeploy serve` arguments of an embedded server that may share its GPU with others."""
    serve = ["--device", device, "--max-num-seqs", str(max_num_seqs)]
    if device.startswith("cuda"):
        serve += ["--num-kv-blocks", str(EMBEDDED_KV_BLOCKS)]
    return serve


def embedded_server_args(args: argparse.Namespace) -> list[str]:
    return embedded_serve_args(args.device, max(64, *args.clients))


def log_tail(path: str, chars: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


@dataclass
class PartOutput:
    """What a part measured so far: figures (kept even when the part fails later) and details."""
    figures: dict[str, dict[str, float]] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def put(self, figure: str, key: int | str, value: float) -> None:
        self.figures.setdefault(figure, {})[str(key)] = round(float(value), 3)


def median_ratio(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Median, min and max of the per-round ratios (a round's runs are back to back, so a slow
    spell of the machine moves both sides of its ratio)."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def rotated(names: list[str], round_index: int) -> list[str]:
    """Each round starts with the next configuration, so none is always first after an idle spell."""
    k = round_index % len(names)
    return names[k:] + names[:k]


# --- in-process parts (each in a child process) -------------------------------------------------------

def part_step(args: argparse.Namespace, out: PartOutput) -> None:
    from benchmarks.common import copy_bandwidth
    from benchmarks.gpu_decode import bench_fastdeploy, step_ms

    # gpu_decode.py's 4 GiB copy on a GPU; a small one where this runs as a CPU check.
    bandwidth = copy_bandwidth(args.device, 4 * 2**30 if args.device.startswith("cuda") else 2**26)
    settings = argparse.Namespace(model=args.step_model, device=args.device, batches=args.step_batches, prompt_len=128,
                                  warmup=4, steps=args.step_steps, max_model_len=512, prefill_tokens=8192,
                                  prefill_len=512, share_prefix=[1], skip_eager=True)
    info, rows, _ = bench_fastdeploy(settings)
    floor_ms = 1e3 * info["weight_bytes_streamed"] / bandwidth
    for row in rows:
        # As gpu_decode.py: the step as the engine runs it (steps overlapped, CUDA graphs where
        # captured); the step in turn beside it.
        row["vs_floor"] = step_ms(row) / floor_ms
        row["in_turn_vs_floor"] = row.get("graph_step_ms", row.get("eager_step_ms", 0.0)) / floor_ms
        out.put("step_over_floor", row["batch"], row["vs_floor"])
    out.details.update({"copy_bandwidth_bytes_per_s": bandwidth, "floor_ms": floor_ms, **info, "decode": rows})


def guided_model(args: argparse.Namespace) -> tuple[str | None, str, str]:
    """(model, load_format, dtype) of the in-process guided part."""
    if args.guided_model:
        return args.guided_model, "dummy" if args.guided_model.endswith(".json") else "auto", "auto"
    if args.device.startswith("cuda"):
        return os.path.join(qwen7b_dir(args.qwen_dir), "config.json"), "dummy", "bfloat16"
    return None, "auto", "float32"  # the embedded model on the CPU


def part_guided(args: argparse.Namespace, out: PartOutput) -> None:
    from benchmarks.guided import throughput
    from fastdeploy import LLM

    model, load_format, dtype = guided_model(args)
    llm = LLM(model, load_format=load_format, device=args.device, dtype=dtype,
              max_num_seqs=max(64, *args.guided_batches), max_model_len=1024)
    out.details.update({"model": model or "embedded", "max_tokens": args.guided_max_tokens, "rows": []})
    for batch in args.guided_batches:  # one batch at a time: a later failure keeps the earlier figures
        rows = throughput(llm, [batch], args.guided_max_tokens, args.rounds)
        out.details["rows"] += rows
        out.put("guided_over_unconstrained", batch, rows[-1]["vs_unconstrained"])


def part_spec(args: argparse.Namespace, out: PartOutput) -> None:
    from benchmarks.draft_policy import step_counts
    from benchmarks.speculative import prompts, timed
    from benchmarks.speculative_mtp import engines
    from fastdeploy import LLM, SamplingParams

    blocks = EMBEDDED_KV_BLOCKS if args.device.startswith("cuda") else None
    max_seqs = max(args.spec_batches)
    mtp_k = int(SPECS["mtp"]["num_speculative_tokens"])
    built = engines(args.device, max_seqs, [mtp_k], False, False, None, blocks)
    llms = {"off": built["off"], "mtp": built[f"mtp-k{mtp_k}"],
            "ngram": LLM(device=args.device, max_num_seqs=max_seqs, guided_decoding_backend="off",
                         num_kv_blocks=blocks, speculative_config=SPECS["ngram"])}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    out.details.update({"specs": SPECS, "prompts": args.spec_prompts, "max_tokens": args.max_tokens,
                        "rounds": args.rounds, "rows": []})
    for batch in args.spec_batches:
        conversations = prompts(batch, args.spec_prompts)
        for llm in llms.values():  # warm-up at full length: every shape the timed runs reach
            timed(llm, conversations, params)
        stats0 = {n: _spec_counts(llms[n]) for n in SPECS}
        steps0 = {n: step_counts(llms[n]) for n in SPECS}
        tok_s: dict[str, list[float]] = {n: [] for n in llms}
        tokens: dict[str, list] = {}
        for r in range(args.rounds):
            for name in rotated(list(llms), r):
                wall, count, tokens[name] = timed(llms[name], conversations, params)
                tok_s[name].append(count / wall)
        row: dict[str, Any] = {"batch": batch, "tokens": sum(len(t) for t in tokens["off"]),
                               "off_tok_s": statistics.median(tok_s["off"])}
        for name in SPECS:
            ratio, low, high = median_ratio(tok_s[name], tok_s["off"])
            drafted, accepted, verified = (a - b for a, b in zip(_spec_counts(llms[name]), stats0[name], strict=True))
            row.update({f"{name}_tok_s": statistics.median(tok_s[name]), f"{name}_speedup": ratio,
                        f"{name}_speedup_range": [low, high], f"{name}_acceptance": accepted / max(1, drafted),
                        f"{name}_tokens_per_step": 1 + accepted / max(1, verified),
                        f"{name}_identical": sum(a == b for a, b in zip(tokens[name], tokens["off"], strict=True)),
                        # The timed rounds' steps: how many, and of them sent ahead, with a prefill
                        # chunk, verifying drafts.
                        f"{name}_steps": {k: v - steps0[name][k] for k, v in step_counts(llms[name]).items()},
                        # What the draft policy measured and chose, per batch-size class, by now.
                        f"{name}_policy": llms[name].engine.draft_policy.describe()
                        if llms[name].engine.draft_policy is not None else None,
                        f"{name}_policy_details": llms[name].engine.draft_policy.details()
                        if llms[name].engine.draft_policy is not None else None})
            out.put(f"{name}_speedup", batch, ratio)
        out.details["rows"].append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def _spec_counts(llm: Any) -> tuple[int, int, int]:
    stats = llm.engine.spec_stats
    return stats.num_draft_tokens, stats.num_accepted_draft_tokens, stats.num_verified_sequences


IN_PROCESS_PARTS: dict[str, Callable[[argparse.Namespace, PartOutput], None]] = {
    "step": part_step, "guided": part_guided, "spec": part_spec}


def child_main(args: argparse.Namespace) -> None:
    """One in-process part, its output (figures so far, details, error) written to --child-out."""
    out = PartOutput()
    error = None
    try:
        IN_PROCESS_PARTS[args.child](args, out)
    except BaseException as exc:  # SystemExit of a helper too: written down, then the parent decides
        error = f"{type(exc).__name__}: {exc}"
        out.details["traceback"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
    with open(args.child_out, "w") as f:
        json.dump({"figures": out.figures, "details": out.details, "error": error}, f, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter shutdown: an engine's threads must not hold the exit up.
    os._exit(0 if error is None else 1)


# --- load through the server --------------------------------------------------------------------------

@dataclass
class Load:
    tokens: list[int]    # completion tokens of each request, in request order
    texts: list[str]
    wall_s: float
    client_cpu_s: float  # this process's CPU time during the run: near wall_s, the client was the limit

    @property
    def tok_s(self) -> float:
        return sum(self.tokens) / self.wall_s


async def send_all(server: Server, bodies: list[dict], clients: int, timeout_s: float) -> tuple[list[dict], float]:
    replies: list[dict] = [{} for _ in bodies]
    share = math.ceil(len(bodies) / clients)

    async def client_loop(client: httpx.AsyncClient, c: int) -> None:
        for i in range(c * share, min(len(bodies), (c + 1) * share)):  # a client's requests one after another
            resp = await client.post(server.base + "/v1/chat/completions", json={"model": server.model, **bodies[i]})
            if resp.status_code != 200:
                raise RuntimeError(f"{server.name}: HTTP {resp.status_code}: {resp.text[:300]}")
            replies[i] = resp.json()

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client, c) for c in range(clients)))
        wall = time.perf_counter() - start
    return replies, wall


def run_load(server: Server, bodies: list[dict], clients: int, timeout_s: float) -> Load:
    """`clients` concurrent clients share `bodies` (non-streaming chat, one body per request); a
    failed request fails the run: a figure must not count a request that did not complete."""
    if timeout_s <= 0:
        raise TimeoutError("the time budget is spent")
    cpu0 = time.process_time()
    replies, wall = asyncio.run(asyncio.wait_for(send_all(server, bodies, min(clients, len(bodies)), timeout_s),
                                                 timeout_s))
    return Load([r["usage"]["completion_tokens"] for r in replies],
                [r["choices"][0]["message"].get("content") or "" for r in replies], wall, time.process_time() - cpu0)


def copy_bodies(n: int, max_tokens: int, kind: str = "short") -> list[dict]:
    """benchmarks/speculative.py's prompts of `kind` (repeat a JSON array, a record or a code block
    exactly), greedy, exactly `max_tokens` tokens each."""
    from benchmarks.speculative import prompts

    return [{"messages": conversation, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            for conversation in prompts(n, kind)]


def people_bodies(n: int, max_tokens: int) -> list[dict]:
    """The 12-item array schema through `response_format`; each request with its own system message."""
    fmt = {"type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE_SCHEMA}}
    return [{"messages": [{"role": "system", "content": f"Request {i}. You answer with JSON only."},
                          {"role": "user", "content": "List 12 people with a name and an age each, as a JSON array."}],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "response_format": fmt}
            for i in range(n)]


def twin_bodies(constrained: list[dict], lengths: list[int]) -> list[dict]:
    """Each constrained request without its schema, decoding exactly as many tokens as it produced."""
    return [{**{k: v for k, v in body.items() if k != "response_format"}, "max_tokens": max(1, n)}
            for body, n in zip(constrained, lengths, strict=True)]


def valid_people(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, list) and len(value) == 12 and all(
        isinstance(v, dict) and isinstance(v.get("name"), str) and isinstance(v.get("age"), int) for v in value)


# --- the run: servers, budget, parts in this process --------------------------------------------------

class Run:
    """One invocation: its settings, the servers it has up, its clock."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = args.device.startswith("cuda")
        self.started = time.perf_counter()
        self.live: list[Server] = []
        self.children: list[subprocess.Popen] = []
        self.off: Server | None = None
        self.off_start: dict[str, Any] | None = None
        self.off_error: str | None = None
        self.spec: dict[str, Server] = {}
        self.log_dir = os.path.join(RESULTS_DIR, "logs")
        os.makedirs(self.log_dir, exist_ok=True)

    def remaining_s(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.started) if self.args.budget_s else math.inf

    def timeout(self, limit: float) -> float:
        return min(limit, self.remaining_s())

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{NAME}-{name}.log")

    def start_servers(self, servers: list[Server]) -> None:
        """Starts `servers` side by side (their start-ups overlap) and waits for all of them."""
        self.live.extend(servers)
        timeout = self.timeout(self.args.start_timeout)
        if timeout <= 0:
            raise TimeoutError("the time budget is spent")

        def start(server: Server) -> None:
            server.start(self.log_path(server.name), timeout, poll_s=0.25)

        with ThreadPoolExecutor(len(servers)) as pool:
            futures = [pool.submit(start, s) for s in servers]
        errors = [f"{exc!r}; log tail: {log_tail(self.log_path(s.name))}"
                  for s, f in zip(servers, futures, strict=True) if (exc := f.exception()) is not None]
        if errors:
            self.stop_servers(servers)  # none of them half up, holding GPU memory, while later parts run
            raise RuntimeError(" | ".join(errors))

    def stop_servers(self, servers: list[Server] | None = None) -> None:
        """Stops `servers` (default: every live one), each even when another's stop fails."""
        for server in list(self.live if servers is None else servers):
            try:
                server.stop()
            except Exception as exc:  # stop the others all the same
                print(f"stopping {server.name}: {exc!r}", flush=True)
            _kill_group(server.proc)  # anything of its session still there (engine, worker)
            if server in self.live:
                self.live.remove(server)
        if self.off not in self.live:
            self.off = None
        if any(s not in self.live for s in self.spec.values()):
            self.spec = {}

    def terminate_all(self) -> None:
        """SIGTERM: every server and child asked to end at once, without waiting (a signal handler)."""
        for proc in [s.proc for s in self.live] + self.children:
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass

    def off_server(self) -> Server:
        """The flag-off embedded server, started on first use; its start is timed (ready part)."""
        if self.off_error is not None:
            raise RuntimeError(f"the flag-off server did not start: {self.off_error}")
        if self.off is None:
            cache_files = triton_cache_files() if self.cuda else None
            server = fastdeploy_server("off", embedded_server_args(self.args))
            try:
                self.start_servers([server])
            except Exception as exc:
                self.off_error = repr(exc)
                raise
            self.off = server
            self.off_start = {"ready_s": round(server.ready_s or 0.0, 2), "args": embedded_server_args(self.args),
                              "triton_cache_files_before": cache_files, "fresh_machine": cache_files == 0,
                              "worker": _worker_line(self.log_path("off"))}
            print(f"flag-off server ready in {server.ready_s:.1f} s", flush=True)
        return self.off

    def run_child(self, part: str, out: PartOutput) -> None:
        """An in-process part in a child process of its own, killed past --part-timeout."""
        fd, path = tempfile.mkstemp(suffix=f"-{part}.json")
        os.close(fd)
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", part, "--child-out", path]
        timeout = self.timeout(self.args.part_timeout)
        if timeout <= 0:
            raise TimeoutError("the time budget is spent")
        proc = subprocess.Popen(cmd, start_new_session=True)
        self.children.append(proc)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            raise TimeoutError(f"{part} ran past {timeout:.0f} s and was killed") from None
        finally:
            _kill_group(proc)  # whatever it started and left behind
            self.children.remove(proc)
            data = _read_json(path)
            os.unlink(path)
            out.figures.update(data.get("figures", {}))
            out.details.update(data.get("details", {}))
        if data.get("error") or proc.returncode != 0:
            raise RuntimeError(data.get("error") or f"{part} exited with {proc.returncode}")


def _kill_group(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


# A speculating server's step counters in /metrics, by what the rows call them.
SPEC_STEP_SERIES = {"steps": "num_steps", "sent_ahead": "num_steps_sent_ahead",
                    "with_prefill": "num_steps_with_prefill", "verify": "num_verify_steps"}


def _spec_steps(server: Server) -> dict[str, float]:
    """The server's step counters so far (its /metrics; empty when it does not answer)."""
    try:
        text = httpx.get(server.base + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        for key, name in SPEC_STEP_SERIES.items():
            series = f"fastdeploy_spec_decode_{name}_total"
            if line.startswith(series) and line[len(series):len(series) + 1] in (" ", "{"):
                values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def _policy_line(log_path: str) -> str | None:
    """The draft policy as the server last logged it (its engine's stats line, every few seconds
    while it has work): best cap and each cap's tokens per sequence per second, per class."""
    marker = "draft caps (best cap, tokens per sequence per second of each cap): "
    lines = [line for line in log_tail(log_path, 200_000).splitlines() if marker in line]
    return lines[-1].split(marker, 1)[1].strip() if lines else None


def _worker_line(log_path: str) -> str | None:
    from benchmarks.server_ready import READY_LINE

    found = READY_LINE.search(log_tail(log_path, 200_000))
    return found.group(0) if found else None


def part_spec_server(run: Run, out: PartOutput) -> None:
    args = run.args
    off = run.off_server()
    if not run.spec:
        started = [fastdeploy_server(name, [*embedded_server_args(args), "--speculative-config", json.dumps(spec)])
                   for name, spec in SPECS.items()]
        run.start_servers(started)  # side by side: the flag-off server idles meanwhile
        run.spec = {s.name: s for s in started}
    out.details.update({"specs": SPECS, "server_args": embedded_server_args(args), "prompts": args.spec_prompts,
                        "max_tokens": args.max_tokens,
                        "requests_per_client": args.requests_per_client, "rounds": args.rounds, "rows": [],
                        "started_side_by_side_ready_s": {n: round(s.ready_s or 0.0, 2) for n, s in run.spec.items()}})
    servers = {"off": off, **run.spec}
    for clients in args.clients:
        bodies = copy_bodies(clients * args.requests_per_client, args.max_tokens, args.spec_prompts)
        for server in servers.values():  # warm-up: the run's shape once, at full length
            run_load(server, bodies[:clients], clients, run.timeout(args.load_timeout))
        loads: dict[str, list[Load]] = {n: [] for n in servers}
        steps_before = {name: _spec_steps(server) for name, server in run.spec.items()}
        for r in range(args.rounds):
            for name in rotated(list(servers), r):
                loads[name].append(run_load(servers[name], bodies, clients, run.timeout(args.load_timeout)))
        time.sleep(1.5)  # the engines report their counters to /metrics about once a second
        steps_during = {name: {k: v - steps_before[name].get(k, 0.0) for k, v in _spec_steps(server).items()}
                        for name, server in run.spec.items()}
        off_tok_s = [load.tok_s for load in loads["off"]]
        row: dict[str, Any] = {"clients": clients, "requests": len(bodies), "tokens": sum(loads["off"][-1].tokens),
                               "off_tok_s": statistics.median(off_tok_s)}
        for name in SPECS:
            ratio, low, high = median_ratio([load.tok_s for load in loads[name]], off_tok_s)
            row.update({f"{name}_tok_s": statistics.median(load.tok_s for load in loads[name]),
                        f"{name}_speedup": ratio, f"{name}_speedup_range": [low, high],
                        f"{name}_identical_texts": sum(
                            a == b for a, b in zip(loads[name][-1].texts, loads["off"][-1].texts, strict=True)),
                        f"{name}_policy": _policy_line(run.log_path(name)),
                        # The timed rounds' steps: how many, and of them sent ahead, with a
                        # prefill chunk, verifying drafts.
                        f"{name}_steps": steps_during[name]})
            out.put(f"{name}_server_speedup", clients, ratio)
        row["client_cpu_share_max"] = max(ld.client_cpu_s / ld.wall_s for runs in loads.values() for ld in runs)
        out.details["rows"].append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def part_guided_server(run: Run, out: PartOutput) -> None:
    """Constrained runs against their unconstrained twins on the flag-off server; within a round the
    order alternates, and a twin decodes the lengths of the latest constrained run (greedy: the
    same each time, which `equal_work` checks)."""
    args = run.args
    off = run.off_server()
    out.details.update({"schema": PEOPLE_SCHEMA, "max_tokens": args.max_tokens,
                        "requests_per_client": args.requests_per_client, "rounds": args.rounds, "rows": []})
    for clients in args.clients:
        constrained = people_bodies(clients * args.requests_per_client, args.max_tokens)
        # Warm-up: the schema compiles here (then it is cached), and both kinds of run once.
        lengths = run_load(off, constrained, clients, run.timeout(args.load_timeout)).tokens
        run_load(off, twin_bodies(constrained, lengths), clients, run.timeout(args.load_timeout))
        guided: list[Load] = []
        free: list[Load] = []
        equal_work = True
        for r in range(args.rounds):
            twin_lengths = lengths
            if r % 2 == 0:
                guided.append(run_load(off, constrained, clients, run.timeout(args.load_timeout)))
                twin_lengths = guided[-1].tokens
                free.append(run_load(off, twin_bodies(constrained, twin_lengths), clients,
                                     run.timeout(args.load_timeout)))
            else:
                free.append(run_load(off, twin_bodies(constrained, twin_lengths), clients,
                                     run.timeout(args.load_timeout)))
                guided.append(run_load(off, constrained, clients, run.timeout(args.load_timeout)))
            lengths = guided[-1].tokens
            equal_work &= guided[-1].tokens == twin_lengths and free[-1].tokens == [max(1, n) for n in twin_lengths]
        ratio, low, high = median_ratio([g.tok_s for g in guided], [u.tok_s for u in free])
        row = {"clients": clients, "requests": len(constrained), "tokens": sum(lengths),
               "json_schema_tok_s": statistics.median(g.tok_s for g in guided),
               "unconstrained_tok_s": statistics.median(u.tok_s for u in free), "ratio": ratio,
               "ratio_range": [low, high], "equal_work": equal_work,
               "valid_12_item_arrays": sum(valid_people(t) for t in guided[-1].texts),
               "client_cpu_share_max": max(ld.client_cpu_s / ld.wall_s for ld in guided + free)}
        out.put("guided_server_ratio", clients, ratio)
        out.details["rows"].append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def part_ready(run: Run, out: PartOutput) -> None:
    """`embedded` from the flag-off server's start when this run had one (else a start here);
    when that start found Triton's cache empty it is the fresh-machine figure, and one more start
    gives `embedded`. Then the 8B dummy, alone on the GPU (every other server is stopped by now)."""
    from benchmarks.server_ready import one_start

    args = run.args
    starts: list[dict[str, Any]] = []

    def timed_start(label: str, serve_args: list[str]) -> float:
        timeout = run.timeout(args.start_timeout)
        if timeout <= 0:
            raise TimeoutError("the time budget is spent")
        cache_files = triton_cache_files() if run.cuda else None
        # A start that began on the torch kept-set path stays up until it switches, so the next
        # start finds the kernels in Triton's cache (a machine that has started it before).
        result = one_start(serve_args, run.log_path(f"ready-{label}-{len(starts) + 1}"), timeout,
                           settle_s=min(120.0, max(0.0, run.timeout(args.start_timeout) - 60.0)))
        starts.append({"server": label, "args": serve_args, "triton_cache_files_before": cache_files, **result})
        out.details["starts"] = starts
        if result["ready_s"] is None:
            raise RuntimeError(f"{label} server not ready within {timeout:.0f} s (or it exited); log tail: "
                               f"{log_tail(run.log_path(f'ready-{label}-{len(starts)}'))}")
        print(f"{label} server ready in {result['ready_s']:.1f} s", flush=True)
        return result["ready_s"]

    first = run.off_start
    if first is None:  # no server part ran before: this part's own first start
        files = triton_cache_files() if run.cuda else None
        ready_s = timed_start("embedded", embedded_server_args(args))
        first = {"ready_s": round(ready_s, 2), "fresh_machine": run.cuda and files == 0}
    else:
        starts.append({"server": "embedded (the flag-off server)", **first})
    if first["fresh_machine"]:
        out.put("server_ready_s", "embedded_fresh_machine", first["ready_s"])
        out.put("server_ready_s", "embedded", timed_start("embedded", embedded_server_args(args)))
    else:
        out.put("server_ready_s", "embedded", first["ready_s"])
    if run.cuda:
        out.put("server_ready_s", "llama3_8b_dummy", timed_start("llama3_8b_dummy", LLAMA_8B_ARGS))
    else:
        out.details["llama3_8b_dummy"] = "skipped: needs CUDA"


def part_mask(run: Run, out: PartOutput) -> None:
    """benchmarks/serving_mask.py's H100 measurement (flat case, bitmap format), its two servers
    started side by side."""
    import benchmarks.serving_mask as sm

    args = run.args
    serve = [qwen7b_dir(args.qwen_dir), "--load-format", "dummy", "--device", args.device, "--max-num-seqs",
             str(max(64, args.mask_clients)), "--num-kv-blocks", "4096"]
    servers = {"off": fastdeploy_server("mask-off", serve),
               "on": fastdeploy_server("mask-on", [*serve, "--enable-keep-sampling-mask"])}
    run.start_servers(list(servers.values()))
    settings = argparse.Namespace(clients=args.mask_clients, requests_per_client=args.mask_requests_per_client,
                                  max_tokens=args.max_tokens, vocab_size=QWEN_VOCAB,
                                  client_procs=args.mask_client_procs)
    sm.warm_up(servers["off"], ["flat"], [None], args.mask_clients, args.max_tokens)
    sm.warm_up(servers["on"], ["flat"], ["bitmap"], args.mask_clients, args.max_tokens)
    runs = []
    for r in range(args.mask_rounds):
        order = [("off", None), ("on", "bitmap")]
        for name, fmt in order if r % 2 == 0 else order[::-1]:  # as serving_mask.py: reversed every other round
            if run.remaining_s() <= 0:
                raise TimeoutError("the time budget is spent")
            result = sm.measure(servers[name], "flat", fmt, settings)
            result["round"] = r
            runs.append(result)
    rows = sm.summarise(runs)
    flat = next(row for row in rows if row["format"] == "bitmap")
    off = next(row for row in rows if row["format"] == "off")
    out.put("mask_server_ratio", args.mask_clients, flat["ratio"])
    out.details.update({"server_args": serve, "clients": args.mask_clients,
                        "client_procs": args.mask_client_procs, "requests_per_client": args.mask_requests_per_client,
                        "max_tokens": args.max_tokens, "rounds": args.mask_rounds, "warm_up": "full length",
                        "ratio": flat["ratio"], "ratio_min": flat["ratio_min"], "ratio_max": flat["ratio_max"],
                        "off_tok_s": off["tok_s"], "bitmap_tok_s": flat["tok_s"], "summary": rows, "runs": runs})


SERVER_PARTS: dict[str, Callable[[Run, PartOutput], None]] = {
    "spec_server": part_spec_server, "guided_server": part_guided_server, "ready": part_ready, "mask": part_mask}


# --- the JSON: merge, history, table, PNG -----------------------------------------------------------

def merge_figures(payload: dict[str, Any], figures: dict[str, dict[str, float]], commit: str | None) -> None:
    """New values over the old ones, key by key; `measured_at[figure]` is the commit of all of a
    figure's values, or `measured_at["figure.key"]` one value's where they differ."""
    measured_at = payload.setdefault("measured_at", {})
    for figure, values in figures.items():
        old = payload.get(figure) or {}
        per_key = {k: measured_at.get(f"{figure}.{k}", measured_at.get(figure)) for k in old}
        per_key.update({k: commit for k in values})
        merged = {**old, **values}
        payload[figure] = dict(sorted(merged.items(), key=lambda kv: (not kv[0].isdigit(),
                                                                      int(kv[0]) if kv[0].isdigit() else kv[0])))
        for key in [k for k in measured_at if k == figure or k.startswith(f"{figure}.")]:
            del measured_at[key]
        if set(per_key.values()) == {commit}:
            measured_at[figure] = commit
        else:
            measured_at.update({f"{figure}.{k}": c for k, c in per_key.items() if c is not None})


def record_history(payload: dict[str, Any], part: str, record: dict[str, Any], out: PartOutput) -> None:
    """The mask and start-up runs are also appended to the lists the file kept before this script."""
    stamp = {"device": record["device"], "commit": record["commit"], "date": record["date"][:10],
             "script": "benchmarks/gpu_scale.py"}
    if part == "mask" and "ratio" in out.details:
        keep = ("clients", "client_procs", "requests_per_client", "max_tokens", "rounds", "warm_up", "ratio",
                "ratio_min", "ratio_max", "off_tok_s", "bitmap_tok_s")
        payload.setdefault("mask_server_ratio_runs", {}).setdefault(str(out.details["clients"]), []).append(
            {**stamp, **{k: out.details[k] for k in keep}})
    if part == "ready" and out.details.get("starts"):
        payload.setdefault("server_ready_runs", []).append({**stamp, "starts": out.details["starts"]})


def write_payload(name: str, payload: dict[str, Any], copy_to: str | None) -> str:
    path = write_json(name, payload)
    try:
        plot(payload, png_path(name))
    except Exception as exc:  # a missing matplotlib must not lose the figures
        print(f"no PNG: {exc!r}", flush=True)
    if copy_to:
        os.makedirs(copy_to, exist_ok=True)
        for p in (path, png_path(name)):
            if os.path.exists(p):
                shutil.copy(p, copy_to)
    return path


def plot(payload: dict[str, Any], path: str) -> None:
    plt = pyplot()
    figures = [f for f in FIGURES if payload.get(f)]
    if not figures:
        return
    cols = 3
    fig, axes = plt.subplots(math.ceil(len(figures) / cols), cols, figsize=(4.2 * cols, 3.2 * math.ceil(
        len(figures) / cols)), squeeze=False)
    for ax, figure in zip(axes.flat, figures, strict=False):
        values = payload[figure]
        bars = ax.bar(list(values), list(values.values()), color="tab:blue")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        if figure != "server_ready_s":
            ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(figure, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds" if figure == "server_ready_s" else "batch / clients", fontsize=7)
    for ax in list(axes.flat)[len(figures):]:
        ax.axis("off")
    fig.suptitle(f"GPU at scale: {payload.get('device')}, {str(payload.get('commit'))[:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_figures(payload: dict[str, Any]) -> None:
    measured_at = payload.get("measured_at", {})
    rows = []
    for figure in FIGURES:
        for key, value in (payload.get(figure) or {}).items():
            commit = measured_at.get(f"{figure}.{key}", measured_at.get(figure))
            rows.append({"figure": figure, "key": key, "value": value, "measured_at": (commit or "-")[:10]})
    if rows:
        print_table(rows, ["figure", "key", "value", "measured_at"])
    runs = payload.get("runs", {})
    for part in PARTS:  # runs also keeps earlier runs under other names, as they were recorded
        record = runs.get(part)
        if isinstance(record, dict) and record.get("status") != "ok":
            print(f"{part}: {record.get('status')}: {record.get('error') or record.get('reason')}")


# --- main ------------------------------------------------------------------------------------------------

def run_part(run: Run, part: str, stamp: dict[str, Any]) -> tuple[dict[str, Any], PartOutput]:
    """One part: (its record for runs[part], what it measured)."""
    out = PartOutput()
    record: dict[str, Any] = {**stamp, "date": datetime.datetime.now().isoformat(timespec="seconds")}
    if part in CUDA_ONLY and not run.cuda:
        return {**record, "status": "skipped", "reason": "needs CUDA"}, out
    if run.remaining_s() < PART_ESTIMATE_S[part]:
        return {**record, "status": "skipped",
                "reason": f"time budget: {run.remaining_s():.0f} s left, about {PART_ESTIMATE_S[part]} s needed"}, out
    print(f"\n## {part}", flush=True)
    t0 = time.perf_counter()
    try:
        if part in IN_PROCESS:
            run.run_child(part, out)
        else:
            SERVER_PARTS[part](run, out)
        record["status"] = "ok"
    except Exception as exc:  # recorded, and the other parts go on
        record.update({"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:4000]})
        print(f"{part} failed: {record['error'][:600]}", flush=True)
        traceback.print_exc()
    record["seconds"] = round(time.perf_counter() - t0, 1)
    record.update(_rounded(out.details))
    return record, out


def _rounded(value: Any) -> Any:
    """Details with floats to 4 decimals: the JSON stays readable."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value


def store(payload: dict[str, Any], part: str, record: dict[str, Any], out: PartOutput) -> None:
    merge_figures(payload, out.figures, record["commit"])
    runs = payload.setdefault("runs", {})
    previous = runs.get(part)
    if record["status"] != "ok" and previous is not None:
        # A failed or skipped attempt does not hide the details behind the figures still in the file.
        last_ok = previous if previous.get("status") == "ok" else previous.get("last_ok")
        if last_ok is not None:
            record["last_ok"] = {k: v for k, v in last_ok.items() if k != "last_ok"}
    runs[part] = record
    if record["status"] == "ok":
        record_history(payload, part, record, out)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda; cpu runs what it can with small sizes (a smoke test)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    p.add_argument("--name", default=None, help="result file stem (default: gpu_scale, gpu_scale_cpu on the CPU)")
    p.add_argument("--commit", default=None, help="full commit hash of the tree, where it has no .git")
    p.add_argument("--dirty", action="store_true", help="with --commit: the tree differs from that commit")
    p.add_argument("--copy-to", default=None, help="also copy the JSON and PNG here after every part ($OUT)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="seconds this run may take (0: no limit); a part is skipped when less than its estimate "
                        "is left, and waits end at the budget")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of every comparison (median of ratios)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="tokens per request / sequence (speculation, the guided server's cap, the mask part)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64], help="client counts of the server parts")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--step-model", default="llama3_8b", help="bundled config name or config.json of the step part")
    p.add_argument("--step-batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--step-steps", type=int, default=16, help="timed decode steps per batch and mode")
    p.add_argument("--guided-batches", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--guided-max-tokens", type=int, default=64, help="in process (benchmarks/guided.py's default)")
    p.add_argument("--guided-model", default=None,
                   help="in-process guided model (default: the 7B shape with Qwen's tokenizer on CUDA, the "
                        "embedded model on the CPU)")
    p.add_argument("--spec-batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--spec-prompts", choices=("long", "short"), default="long",
                   help="the speculation parts' copying requests (benchmarks/speculative.py's prompts)")
    p.add_argument("--mask-clients", type=int, default=64)
    p.add_argument("--mask-requests-per-client", type=int, default=2)
    p.add_argument("--mask-rounds", type=int, default=3)
    p.add_argument("--mask-client-procs", type=int, default=8,
                   help="load-generator processes of the mask part (a 7B bitmap body is about 6 MB)")
    p.add_argument("--qwen-dir", default=None, help="7B-shape directory with Qwen's tokenizer "
                                                    f"(default: {QWEN_DIRS[0]})")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--load-timeout", type=float, default=600.0, help="seconds one timed load may take")
    p.add_argument("--part-timeout", type=float, default=900.0, help="seconds an in-process part may take")
    p.add_argument("--child", choices=sorted(IN_PROCESS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args)
        return
    commit, dirty = git_state(args.commit, args.dirty)
    if commit is None:
        print("# no commit known (no .git here): pass --commit", flush=True)
    name = args.name or (NAME if args.device.startswith("cuda") else f"{NAME}_cpu")
    stamp: dict[str, Any] = {"device": device_name(args.device), "commit": commit}
    if dirty:
        stamp["dirty"] = True
    print(f"# {stamp['device']}  commit {commit}{' (dirty)' if dirty else ''}  parts {args.parts}", flush=True)
    run = Run(args)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        run.terminate_all()
        raise SystemExit(128 + signum)  # unwinds through the finally below: every server stopped

    signal.signal(signal.SIGTERM, on_sigterm)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    payload = _read_json(path)
    try:
        for part in [p for p in PARTS if p in args.parts]:
            if part not in OFF_SERVER_PARTS:
                run.stop_servers()
            record, out = run_part(run, part, stamp)
            payload.update({**stamp, "date": record["date"]})
            if not dirty:
                payload.pop("dirty", None)
            store(payload, part, record, out)
            write_payload(name, payload, args.copy_to)  # after every part: a run cut short keeps the rest
    finally:
        run.stop_servers()
    print()
    print_figures(payload)
    print(f"wrote {path} and {png_path(name)} ({time.perf_counter() - run.started:.0f} s)")


if __name__ == "__main__":
    main()
