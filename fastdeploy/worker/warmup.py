"""Sampling made-up rows once before serving, so the first requests' steps compile nothing;
on a fresh machine, serving on the torch kept-set path until the Triton one has compiled."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.model_executor.layers.sample import kept_set_gpu
from fastdeploy.model_executor.layers.sample.kept_set_torch import TorchKeptSetBackend
from fastdeploy.model_executor.layers.sample.sampler import Sampler
from fastdeploy.worker.input_prep import sampling_metadata
from fastdeploy.worker.sequence_state import WorkerSequence

logger = logging.getLogger(__name__)


def warm_up_sampler(sampler: Sampler, vocab_size: int, device: torch.device, with_masks: bool,
                    logprobs_mode: str) -> None:
    """Samples a few made-up rows of every kind once before serving: greedy, truncating
    (peaked and flat logits), plain, with logprobs; with and without sampling masks where
    they are on, and a step of greedy rows alone.

    On CUDA the sampler's Triton kernels compile here instead of inside the first
    requests' steps, and what compiling leaves on the heap is among the start-up objects the
    process then freezes out of the garbage collector's walks (`startup_heap`). Every row has
    a seeded generator of its own: the global random state is left as it was."""
    v = vocab_size
    params = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.95, logprobs=1),
              SamplingParams(top_p=0.95), SamplingParams(top_k=50, top_p=0.9), SamplingParams()]
    gen = torch.Generator(device).manual_seed(0)
    logits = torch.randn(len(params), v, generator=gen, device=device) * 4.0
    logits[2] *= 0.1  # flat: its top-p set outgrows the prefilter's candidates
    batches = [(params, False, False)]
    if with_masks:
        # Masked rows of every kind, a step whose masked rows are all greedy (no kept sets), and
        # a step under a grammar's bitmask (its plain rows keep the allowed ids).
        batches += [(params, True, False), (params[:1] * 2, True, False), (params, True, True)]
    for rows, mask, guided in batches:
        states = [WorkerSequence([0], p, mask, torch.Generator(device).manual_seed(i))
                  for i, p in enumerate(rows)]
        meta = sampling_metadata(states, logprobs_mode, device)
        if guided:
            bitmask = torch.full((len(rows), -(-v // 32)), -1, dtype=torch.int32)
            bitmask[-1, 1:] = 0  # the plain row: ids 0-31 allowed
            meta.token_bitmask = bitmask.to(device)
        sampler(logits[:len(rows)], meta, settle_kept_sets=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# How long the background compiles may take (each takes 20-30 s on an H100 host) before the
# worker stops waiting for them and keeps the torch path.
SAMPLER_COMPILE_TIMEOUT_S = 600.0
# How long the warm-up waits for them before serving without them: Triton finds kernels it
# compiled before in its cache within this time; a fresh compile takes far longer.
CACHED_COMPILE_WAIT_S = 2.0


def start_sampler_compile(vocab_size: int, device: torch.device) -> list[Future]:
    """Starts compiling the sampler's slowest kernels (the kept set's row search, 20-30 s a
    variant on an H100 host) in background threads, so they overlap each other and the start-up
    work that follows; `warm_up_sampler` then finds them compiled once the futures are done.
    Nothing to compile (an empty list) where the sort-free GPU path is not used."""
    if not kept_set_gpu.uses_fast_path(device):
        return []
    meta = sampling_metadata([WorkerSequence([0], SamplingParams(top_p=0.9), False, None)], "raw_logprobs", device)
    dtypes = (meta.temperature.dtype, meta.top_k.dtype, meta.top_p.dtype, meta.min_p.dtype)
    return kept_set_gpu.compile_row_search(vocab_size, dtypes, device)


def wait_sampler_compile(compiling: list[Future]) -> None:
    """Waits for `start_sampler_compile`'s futures, each at most SAMPLER_COMPILE_TIMEOUT_S: a
    compile that fails or hangs raises its error."""
    for future in compiling:
        future.result(timeout=SAMPLER_COMPILE_TIMEOUT_S)


@dataclass
class SamplerWarmUp:
    """How the sampler is warmed up: the arguments `warm_up_sampler` takes besides the sampler."""

    vocab_size: int
    device: torch.device
    with_masks: bool
    logprobs_mode: str

    def run(self, sampler: Sampler) -> None:
        warm_up_sampler(sampler, self.vocab_size, self.device, self.with_masks, self.logprobs_mode)


@dataclass
class PendingSampler:
    """The Triton kept-set path still compiling in the background while the worker serves on the
    torch path (exact, the Triton path's reference, slower on wide batches). `poll` returns the
    warmed-up Triton sampler once the compile is done; a compile that fails or outlasts
    SAMPLER_COMPILE_TIMEOUT_S leaves the worker on the torch path, with the error logged."""

    compiling: list[Future]
    warm_up: SamplerWarmUp
    started: float = field(default_factory=time.monotonic)
    given_up: bool = False

    def poll(self) -> Sampler | None:
        if self.given_up:
            return None
        if not all(future.done() for future in self.compiling):
            if time.monotonic() - self.started > SAMPLER_COMPILE_TIMEOUT_S:
                self.given_up = True
                logger.error("the kept set's Triton kernels did not compile within %.0f s; sampling stays on "
                             "the torch path", SAMPLER_COMPILE_TIMEOUT_S)
            return None
        for future in self.compiling:
            error = future.exception()
            if error is not None:
                self.given_up = True
                logger.error("the kept set's Triton kernels failed to compile; sampling stays on the torch path",
                             exc_info=error)
                return None
        sampler = Sampler(self.warm_up.device)
        # The sampler's smaller kernels compile here, in the step that switches (about 3 s on an
        # H100 host, once), so that no request's step compiles them later.
        self.warm_up.run(sampler)
        logger.info("sampling switched from the torch to the Triton kept-set path after %.1f s of serving",
                    time.monotonic() - self.started)
        return sampler


def warmed_up_sampler(compiling: list[Future], warm_up: SamplerWarmUp) -> tuple[Sampler, PendingSampler | None]:
    """The sampler to serve with from the first step, warmed up, and the Triton path still
    compiling (None when there is none): where `start_sampler_compile`'s compile is not done
    within CACHED_COMPILE_WAIT_S (a fresh machine), serving starts on the torch kept-set path
    instead of waiting 30-60 s for it."""
    wait_futures(compiling, timeout=CACHED_COMPILE_WAIT_S)
    pending = None
    if all(future.done() for future in compiling):
        wait_sampler_compile(compiling)  # raises a failed compile's error
        sampler = Sampler(warm_up.device)
    else:
        sampler = Sampler(warm_up.device, kept_sets=TorchKeptSetBackend())
        pending = PendingSampler(compiling, warm_up)
        logger.info("the kept set's Triton kernels are still compiling: sampling starts on the torch path")
    warm_up.run(sampler)
    return sampler, pending
