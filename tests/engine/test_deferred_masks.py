"""Masked deltas of a step whose mask ids are still crossing PCIe come out one `step()` later.

On CUDA the worker returns a masked frame once its head is on the host; the engine applies the
tokens at once and hands the masked deltas out with the next step. The CPU runner's frames are
whole, so here an executor holds each masked frame's ids back the way the device does: they
read as garbage until the step's completion is waited for. Every request must get the tokens,
masks, logZ and finish reasons of the plain run, in order, and no delta after its abort. On an
H100 the same comparison runs the CUDA path against one that waits for every frame at once.
"""

from __future__ import annotations

import pytest
import torch

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.common.request import EngineRequest, RequestDelta
from fastdeploy.common.sampling_masks import SamplingBitmaps, logz_values
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.step_frame import unpack_step_frame
from fastdeploy.common.step_input import StepInput
from fastdeploy.engine.engine_core import EngineCore
from fastdeploy.engine.executor import InProcessExecutor, LocalStep
from fastdeploy.output.token_processor import AppliedStep, TokenProcessor
from fastdeploy.worker.step_output import StepOutput
from tests.bitmaps import bitmap_lists
from tests.random_qwen2 import save_random_qwen2

# (sampling settings, max_tokens, wants the mask): finishing at different steps, one opted out.
MIXES = [
    ({"top_p": 0.9}, 7, True),
    ({"top_k": 50, "temperature": 0.8}, 3, True),
    ({"top_p": 0.95, "min_p": 0.01}, 5, False),
    ({"temperature": 0.0}, 4, True),
    ({"top_k": 400, "top_p": 0.8}, 9, True),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # 40,000 ids: above the GPU kept-set prefilter's threshold, so CUDA runs take that path too.
    return save_random_qwen2(tmp_path_factory.mktemp("qwen2_40k"), vocab_size=40_000)


class HeldBackIds:
    """The completion of a frame whose mask ids read as -7 until it is waited for."""

    def __init__(self, ids) -> None:
        self.ids, self.saved = ids, ids.copy()
        ids[:] = -7
        self.waited = False

    def synchronize(self) -> None:
        self.ids[:] = self.saved
        self.waited = True


class FinishedStep:
    def __init__(self, output: StepOutput) -> None:
        self.output = output

    def result(self) -> StepOutput:
        return self.output


class HoldingBackExecutor(InProcessExecutor):
    """The CPU runner, each masked frame returned with its ids still to come."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.completions: list[HeldBackIds] = []

    def submit(self, step: StepInput) -> FinishedStep:
        output = super().submit(step).result()
        frame = bytearray(output.frame)
        ids = unpack_step_frame(frame).mask_ids
        if ids is None or not len(ids):
            return FinishedStep(StepOutput(frame, output.events, mask_bits=output.mask_bits))
        self.completions.append(HeldBackIds(ids))
        return FinishedStep(StepOutput(frame, output.events, self.completions[-1], output.mask_bits))


class WaitingExecutor(InProcessExecutor):
    """Every frame whole before the engine sees it."""

    def submit(self, step: StepInput) -> FinishedStep:
        output = super().submit(step).result()
        output.wait_mask_ids()
        return FinishedStep(output)


class BesideEngineExecutor(InProcessExecutor):
    """The CPU runner, declared to run beside the engine's thread as a worker process or a GPU
    does; logs each step's submission next to the token processor's mask cuts."""

    def __init__(self, config: EngineConfig, log: list[tuple[str, int]]) -> None:
        super().__init__(config)
        self.runs_beside_engine = True
        self.log = log

    def submit(self, step: StepInput) -> LocalStep:
        self.log.append(("submit", step.message_id))
        return super().submit(step)


class LoggingTokenProcessor(TokenProcessor):
    def __init__(self, processor: TokenProcessor, log: list[tuple[str, int]]) -> None:
        super().__init__(list(processor.eos_token_ids), processor.max_model_len)
        self.log = log

    def attach_masks(self, applied: AppliedStep) -> None:
        if applied.masked:
            self.log.append(("attach", applied.frame.message_id))
        super().attach_masks(applied)


def _config(model_dir: str, device: str) -> EngineConfig:
    return EngineConfig(model=model_dir, device=device, dtype="float32", guided_decoding_backend="off",
                        enable_keep_sampling_mask=True, cache=CacheConfig(block_size=4, num_blocks=256),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64))


def _run(core: EngineCore, abort_after: dict[str, int] | None = None,
         mask_format: str = "ids") -> tuple[dict, list[list[RequestDelta]]]:
    """Per request: tokens, mask lists, logZ, finish reason; and the deltas of every step() call.
    `abort_after[r] = n` aborts request r once n of its tokens are out. Bitmaps are decoded to lists."""
    for i, (mix, max_tokens, mask) in enumerate(MIXES):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=11 + i, return_sampling_mask=mask,
                                sampling_mask_format=mask_format, **mix)
        core.add_request(EngineRequest(f"r{i}", [3 + i, 17, 42, 5 * i + 1, 9], params, 0.0))
    out = {f"r{i}": ([], [], [], None) for i in range(len(MIXES))}
    calls = []
    try:
        while core.has_work():
            deltas = core.step()
            calls.append(deltas)
            for d in deltas:
                tokens, masks, logz, finish = out[d.request_id]
                assert finish is None, f"{d.request_id}: a delta after its finish"
                tokens += d.token_ids
                if d.sampling_mask is not None:
                    rows = (bitmap_lists(d.sampling_mask) if isinstance(d.sampling_mask, SamplingBitmaps)
                            else d.sampling_mask.to_lists())
                    assert len(rows) == len(d.token_ids) == len(logz_values(d.logz))
                    masks += rows
                    logz += logz_values(d.logz)
                if d.finish_reason is not None:
                    out[d.request_id] = (tokens, masks, logz, d.finish_reason)
                elif abort_after and len(tokens) >= abort_after.get(d.request_id, 1 << 30):
                    assert core.abort([d.request_id])[0].finish_reason == "abort"
                    out[d.request_id] = (tokens, masks, logz, "abort")
    finally:
        core.shutdown()
    return out, calls


def _assert_masks_hold_their_tokens(out: dict) -> None:
    for i, (_, _, wants_mask) in enumerate(MIXES):
        tokens, masks, logz, _ = out[f"r{i}"]
        assert len(masks) == (len(tokens) if wants_mask else 0)
        for token, row, z in zip(tokens, masks, logz, strict=False):  # masks are [] when not asked for
            assert row is not None and token in row and row == sorted(set(row)) and z <= 1e-6


def _first_call(calls: list[list[RequestDelta]], request_id: str) -> int:
    return next(k for k, deltas in enumerate(calls) if any(d.request_id == request_id for d in deltas))


def test_deferred_masked_deltas_equal_the_plain_run(model_dir) -> None:
    plain, plain_calls = _run(EngineCore(_config(model_dir, "cpu"), InProcessExecutor(_config(model_dir, "cpu"))))
    executor = HoldingBackExecutor(_config(model_dir, "cpu"))
    deferred, deferred_calls = _run(EngineCore(_config(model_dir, "cpu"), executor))
    assert deferred == plain
    _assert_masks_hold_their_tokens(plain)
    assert executor.completions and all(c.waited for c in executor.completions)
    # Masked deltas come one call later (the last ones from a call that runs no step); the
    # opted-out request's do not wait.
    assert _first_call(deferred_calls, "r0") == _first_call(plain_calls, "r0") + 1
    assert _first_call(deferred_calls, "r2") == _first_call(plain_calls, "r2")
    assert len(deferred_calls) == len(plain_calls) + 1


def test_masks_are_cut_while_the_next_step_runs(model_dir) -> None:
    """A runner beside the engine (a worker process, a GPU): the engine submits step m + 1
    before it cuts step m's masks, and every request still gets what the plain run gives."""
    plain, plain_calls = _run(EngineCore(_config(model_dir, "cpu"), InProcessExecutor(_config(model_dir, "cpu"))))
    log: list[tuple[str, int]] = []
    core = EngineCore(_config(model_dir, "cpu"), BesideEngineExecutor(_config(model_dir, "cpu"), log))
    core.token_processor = LoggingTokenProcessor(core.token_processor, log)
    beside, beside_calls = _run(core)
    assert beside == plain
    submitted = [m for kind, m in log if kind == "submit"]
    cuts = [(i, m) for i, (kind, m) in enumerate(log) if kind == "attach"]
    assert cuts and len(cuts) == len({m for _, m in cuts})  # each step's masks cut once
    for i, m in cuts:
        if m != submitted[-1]:
            assert log.index(("submit", m + 1)) < i, f"step {m}'s masks were cut before step {m + 1} was submitted"
    assert _first_call(beside_calls, "r0") == _first_call(plain_calls, "r0") + 1
    assert _first_call(beside_calls, "r2") == _first_call(plain_calls, "r2")


def test_abort_drops_the_held_back_delta(model_dir) -> None:
    plain, _ = _run(EngineCore(_config(model_dir, "cpu"), InProcessExecutor(_config(model_dir, "cpu"))),
                    abort_after={"r0": 2, "r4": 3})
    deferred, _ = _run(EngineCore(_config(model_dir, "cpu"), HoldingBackExecutor(_config(model_dir, "cpu"))),
                       abort_after={"r0": 2, "r4": 3})
    # The engine sees a request's masked tokens one call later, so an abort lands a step later
    # and that step's batch differs: logZ may move in float32's last bits.
    for request_id, (tokens, masks, logz, finish) in plain.items():
        assert deferred[request_id][0::3] == (tokens, finish) and deferred[request_id][1] == masks
        assert deferred[request_id][2] == pytest.approx(logz, abs=1e-5)
    assert plain["r0"][3] == "abort" and len(plain["r0"][0]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_deferred_masks_equal_waiting_for_every_frame(model_dir) -> None:
    config = _config(model_dir, "cuda")
    waited, _ = _run(EngineCore(config, WaitingExecutor(config)))
    deferred, calls = _run(EngineCore(config, InProcessExecutor(config)))
    assert deferred == waited
    _assert_masks_hold_their_tokens(deferred)
    assert _first_call(calls, "r0") == _first_call(calls, "r2") + 1  # the CUDA path did defer


def test_bitmap_deltas_hold_the_sets_of_the_id_lists(model_dir) -> None:
    """Bitmaps come from the worker beside the frame; deferred and cut per delta they give the
    id lists' sets, tokens and logZ."""
    ids, _ = _run(EngineCore(_config(model_dir, "cpu"), HoldingBackExecutor(_config(model_dir, "cpu"))))
    bitmaps, _ = _run(EngineCore(_config(model_dir, "cpu"), HoldingBackExecutor(_config(model_dir, "cpu"))),
                      mask_format="bitmap")
    assert bitmaps == ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bitmaps_hold_the_sets_of_the_id_lists(model_dir) -> None:
    config = _config(model_dir, "cuda")
    ids, _ = _run(EngineCore(config, InProcessExecutor(config)))
    bitmaps, _ = _run(EngineCore(config, InProcessExecutor(config)), mask_format="bitmap")
    assert [v[0::3] for v in bitmaps.values()] == [v[0::3] for v in ids.values()]  # tokens, finish
    assert [v[1] for v in bitmaps.values()] == [v[1] for v in ids.values()]
    for request_id, values in ids.items():
        assert bitmaps[request_id][2] == pytest.approx(values[2], abs=1e-5)
    _assert_masks_hold_their_tokens(bitmaps)
