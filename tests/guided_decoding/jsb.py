"""JSONSchemaBench harness shared by the coverage test and benchmarks/guided_decoding.py.

Each schema runs in a forked child process: the child compiles through a
GrammarCompileService with a timeout, then drives one GuidedState per test instance token by
token. xgrammar cannot interrupt a compile, so a schema that times out leaves a thread
burning CPU; ending the child ends that thread too, and a hard deadline in the parent
covers a hang or crash anywhere else. Forking (not spawning) keeps the tokenizer info and
imports, so a child starts in milliseconds.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

JSB_DIR = Path(__file__).resolve().parents[3] / "shared" / "eval" / "jsonschemabench"


@dataclass
class Case:
    name: str
    schema: str  # compact JSON text
    instances: list[tuple[list[int], bool]]  # (token ids of json.dumps(data), valid)


@dataclass
class Result:
    name: str
    status: str  # "ok" | "compile_error" | "timeout" | "crash"
    message: str = ""
    compile_s: float = 0.0  # cold, as seen through the service (submit -> ready)
    cached_s: float = 0.0  # the same spec again, through the service's cache
    accepted: list[tuple[bool, bool]] = field(default_factory=list)  # (valid, accepted) per instance
    fill_s: list[float] = field(default_factory=list)  # per-token fill_next_token_bitmask times


def load_cases(tokenizer, directory: Path = JSB_DIR) -> list[Case]:
    """Every schema file with its instances serialized by json.dumps and tokenized."""
    cases = []
    for path in sorted(directory.glob("*.json")):
        d = json.loads(path.read_text())
        texts = [json.dumps(t["data"]) for t in d["tests"]]
        ids = tokenizer(texts, add_special_tokens=False).input_ids if texts else []
        cases.append(
            Case(path.name, json.dumps(d["schema"]),
                 [(i, bool(t["valid"])) for i, t in zip(ids, d["tests"], strict=True)])
        )
    return cases


def _child(conn: Connection, tokenizer_info, case: Case, timeout_s: float, measure_fill: bool) -> None:
    from fastdeploy.model_executor.guided_decoding import (
        GrammarCompileService,
        GuidedSpec,
        GuidedState,
        allocate_bitmask,
    )
    from fastdeploy.model_executor.guided_decoding.xgrammar_backend import XGrammarBackend

    res = Result(case.name, "ok")
    try:
        backend = XGrammarBackend(tokenizer_info, compiler_threads=1)
        service = GrammarCompileService(backend, max_workers=1, timeout_s=timeout_s)
        spec = GuidedSpec("json_schema", case.schema)
        t0 = time.perf_counter()
        service.submit(0, spec)
        while True:
            ready, failed = service.poll()
            if ready or failed:
                break
            time.sleep(0.002)
        res.compile_s = time.perf_counter() - t0
        if failed:
            msg = failed[0]
            res.status = "timeout" if "timed out" in msg else "compile_error"
            res.message = msg
        else:
            t0 = time.perf_counter()
            service.compile(spec)
            res.cached_s = time.perf_counter() - t0
            grammar = ready[0]
            eos = tokenizer_info.stop_token_ids
            bitmask = allocate_bitmask(1, tokenizer_info.vocab_size)
            for ids, valid in case.instances:
                state = GuidedState(grammar)
                ok = True
                for t in ids:
                    if measure_fill:
                        t1 = time.perf_counter()
                        state.fill_bitmask(bitmask, 0)
                        res.fill_s.append(time.perf_counter() - t1)
                    if not state.accept(t):
                        ok = False
                        break
                # The instance must be complete: a stop token is accepted and terminates.
                ok = ok and state.accept(eos[0]) and state.is_terminated
                res.accepted.append((valid, ok))
    except BaseException as e:  # report, never hang the parent
        res.status, res.message = "crash", f"{type(e).__name__}: {e}"
    conn.send(res)
    conn.close()
    os._exit(0)  # also ends an abandoned (timed-out) compile thread


def run_cases(
    cases: list[Case],
    tokenizer_info,
    *,
    timeout_s: float,
    parallel: int = 2,
    measure_fill: bool = False,
    hard_margin_s: float = 20.0,
) -> list[Result]:
    """Run every case in forked children, `parallel` at a time; results in case order."""
    ctx = mp.get_context("fork")
    # Biggest schemas first (a proxy for the slowest): fewer stragglers at the end.
    todo = sorted(enumerate(cases), key=lambda ic: len(ic[1].schema))
    running: dict[Connection, tuple[int, mp.Process, float]] = {}
    results: dict[int, Result] = {}
    while todo or running:
        while todo and len(running) < parallel:
            i, case = todo.pop()
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(child, tokenizer_info, case, timeout_s, measure_fill))
            p.start()
            child.close()
            running[parent] = (i, p, time.monotonic() + timeout_s + hard_margin_s)
        for conn in wait(list(running), timeout=0.05):
            i, p, _ = running.pop(conn)
            try:
                results[i] = conn.recv()
            except EOFError:  # died without reporting: a crash in native code
                results[i] = Result(cases[i].name, "crash", f"child exited with {p.exitcode}")
            p.join()
        now = time.monotonic()
        for conn, (i, p, deadline) in list(running.items()):
            if now > deadline:
                p.kill()
                p.join()
                running.pop(conn)
                results[i] = Result(cases[i].name, "timeout", "hard deadline")
    return [results[i] for i in range(len(cases))]


def rates(results: list[Result]) -> dict[str, float]:
    """compile: schemas compiled / all; valid_accept, invalid_reject: over instances of
    compiled schemas; schema_exact: compiled schemas where every instance is judged right."""
    n = len(results)
    compiled = [r for r in results if r.status == "ok"]
    valid = [acc for r in compiled for v, acc in r.accepted if v]
    invalid = [acc for r in compiled for v, acc in r.accepted if not v]
    exact = [r for r in compiled if all(v == acc for v, acc in r.accepted)]
    return {
        "schemas": n,
        "compiled": len(compiled),
        "compile": len(compiled) / n if n else 0.0,
        "valid_instances": len(valid),
        "valid_accept": sum(valid) / len(valid) if valid else 0.0,
        "invalid_instances": len(invalid),
        "invalid_reject": (len(invalid) - sum(invalid)) / len(invalid) if invalid else 0.0,
        "schema_exact": len(exact) / len(compiled) if compiled else 0.0,
        "timeouts": sum(r.status == "timeout" for r in results),
        "compile_errors": sum(r.status == "compile_error" for r in results),
        "crashes": sum(r.status == "crash" for r in results),
    }
