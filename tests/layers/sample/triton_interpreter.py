"""One long-lived child process with Triton's interpreter on, for a test module's CPU cases.

The interpreter must be chosen before triton is first imported, so the cases cannot run in the
pytest process. One spawned process (TRITON_INTERPRET=1 in its environment from the start)
imports the test module once and runs each case it is sent, a call such as
``"interpreted_case(48, 37, 1, 64)"``, in that module's namespace. After each case it puts back
what cases patch: every attribute of the fastdeploy modules and classes, of torch and of the test
module, the torch / numpy / random RNG states, torch's grad mode and default dtype; so each case
starts from the state of a fresh process, whatever ran before it.

The process runs at the lowest CPU priority. Cases may be queued ahead (`prefetch`), to run on
CPU the other tests leave idle; a call a test sends itself goes before the queued ones. Every
wait is bounded; a process that died or ran out of time is killed and the next call starts a
new one, so a case fails its own test only.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
import threading
import time

import pytest

START_TIMEOUT_S = 300
CALL_TIMEOUT_S = 540  # one test's wait, under pytest's per-test timeout (600 s)


def _patchable_state(module) -> list[tuple[object, dict]]:
    """(owner, attributes) of every fastdeploy module and class, torch and ``module``."""
    import torch

    owners: list[object] = [torch, module]
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "fastdeploy" or name.startswith("fastdeploy.")):
            continue
        owners.append(mod)
        owners += [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == name]
    return [(owner, dict(vars(owner))) for owner in owners]


def _put_back(state: list[tuple[object, dict]]) -> None:
    missing = object()
    for owner, attrs in state:
        now = vars(owner)
        for key, value in attrs.items():
            if now.get(key, missing) is not value:
                setattr(owner, key, value)


def _run_case(call: str, namespace: dict) -> tuple[str | None, str]:
    """Runs ``call``: (None or its traceback, what it wrote to stdout and stderr)."""
    import tempfile
    import traceback

    with tempfile.TemporaryFile("w+") as out:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            eval(call, namespace)
            error = None
        except BaseException:  # noqa: BLE001 - every failure goes back to its test
            error = traceback.format_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        return error, out.read()


def serve(conn, module_name: str, warm_imports: tuple[str, ...]) -> None:
    """The child's loop: takes (key, call, urgent) messages, runs urgent calls first and the
    others in the order sent, and answers (key, None or the traceback, the output)."""
    import collections
    import importlib
    import random

    import numpy as np
    import torch

    os.nice(19)
    module = importlib.import_module(module_name)
    for name in warm_imports:  # what the cases import, so that its state is recorded before the first case
        importlib.import_module(name)
    state = _patchable_state(module)
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    modes = (torch.is_grad_enabled(), torch.get_default_dtype())
    conn.send(("ready", "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1", ""))
    queued: collections.deque = collections.deque()
    while True:
        while not queued or conn.poll():  # block only with nothing to run
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg is None:
                return
            if msg[2]:
                queued.appendleft(msg)
            else:
                queued.append(msg)
        key, call, _ = queued.popleft()
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        error, output = _run_case(call, vars(module))
        _put_back(state)
        torch.set_grad_enabled(modes[0])
        torch.set_default_dtype(modes[1])
        conn.send((key, error, output))


class InterpreterProcess:
    """The interpreter process of the test module at ``module_file`` (beside this file), started
    on first use (or by `prefetch`) and again after a case killed it or ran out of time. A reader
    thread collects its answers, so a test waits on its own case only. ``warm_imports``: modules
    the cases import themselves."""

    def __init__(self, module_file: str, warm_imports: tuple[str, ...] = ()) -> None:
        self.module_name = os.path.splitext(os.path.basename(module_file))[0]
        self.warm_imports = tuple(warm_imports)
        self.ctx = multiprocessing.get_context("spawn")
        self.lock = threading.Condition()
        self.proc = None
        self.conn = None
        self.keys = itertools.count()
        self.queued: dict[str, int] = {}  # prefetched call -> key
        self.answers: dict[int | str, tuple] = {}
        self.ready = False
        self.lost: str | None = None  # why the process is gone

    def _start(self) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        code = (f"import sys; sys.path.insert(0, {here!r}); import triton_interpreter as ti; "
                f"ti.serve(conn, {self.module_name!r}, {self.warm_imports!r})")
        ours, theirs = self.ctx.Pipe()
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # the spawned process starts with this environment
        try:
            proc = self.ctx.Process(target=exec, args=(code, {"conn": theirs}), name="triton-interpreter")
            proc.start()
        finally:
            if before is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = before
        theirs.close()
        self.proc, self.conn, self.ready, self.lost = proc, ours, False, None
        threading.Thread(target=self._read, args=(proc, ours), daemon=True, name="triton-interpreter-reader").start()

    def _read(self, proc, conn) -> None:
        while True:
            try:
                key, error, output = conn.recv()
            except (EOFError, OSError):
                proc.join(10)
                with self.lock:
                    if self.proc is proc:
                        self.lost = f"the interpreter process died (exit code {proc.exitcode})"
                    self.lock.notify_all()
                return
            with self.lock:
                if self.proc is proc:
                    self.answers[key] = (error, output)
                self.lock.notify_all()

    def _send(self, call: str, urgent: bool) -> int:
        if self.proc is None:
            self._start()
        key = next(self.keys)
        self.conn.send((key, call, urgent))
        return key

    def _wait(self, key, timeout_s: float, what: str) -> tuple:
        deadline = time.monotonic() + timeout_s
        try:
            with self.lock:
                while key not in self.answers:
                    if self.lost is not None:
                        raise RuntimeError(f"{self.lost} before answering {what}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"the interpreter process gave no answer to {what} in {timeout_s} s")
                    self.lock.wait(min(left, 5.0))
                return self.answers.pop(key)
        except BaseException:  # lost, timed out, or pytest's own timeout: start afresh next time
            self.kill()
            raise

    def prefetch(self, calls: list[str]) -> None:
        """Queues ``calls`` (in test order) to run before their tests ask for them."""
        with self.lock:
            for call in calls:
                if call not in self.queued:
                    self.queued[call] = self._send(call, urgent=False)

    def run(self, call: str) -> None:
        """Runs ``call`` in the interpreter process (or takes its queued run's result); fails the
        calling test with the case's traceback and output."""
        with self.lock:
            key = self.queued.pop(call, None)
            if key is None:
                key = self._send(call, urgent=True)
        if not self.ready:
            interpreted, _ = self._wait("ready", START_TIMEOUT_S, "start-up")
            assert interpreted, "the child process is not running Triton's interpreter"
            self.ready = True
        error, output = self._wait(key, CALL_TIMEOUT_S, call)
        if error is not None:
            pytest.fail(f"{call} failed in the interpreter process:\n{output}{error}", pytrace=False)

    def kill(self) -> None:
        with self.lock:
            proc, conn = self.proc, self.conn
            self.proc = self.conn = None
            self.queued.clear()
            self.answers.clear()
        if proc is not None:
            proc.kill()
            proc.join(30)
            conn.close()

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.conn.send(None)
                self.proc.join(10)
            except OSError:
                pass
        self.kill()
