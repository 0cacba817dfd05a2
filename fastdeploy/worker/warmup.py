"""Sampling made-up rows once before serving, so the first requests' steps compile nothing."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.model_executor.layers.sample import kept_set_gpu
from fastdeploy.model_executor.layers.sample.sampler import Sampler
from fastdeploy.worker.input_prep import sampling_metadata
from fastdeploy.worker.sequence_state import WorkerSequence


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
    batches = [(params, False)]
    if with_masks:
        # Masked rows of every kind, and a step whose masked rows are all greedy (no kept sets).
        batches += [(params, True), (params[:1] * 2, True)]
    for rows, mask in batches:
        states = [WorkerSequence([0], p, mask, torch.Generator(device).manual_seed(i))
                  for i, p in enumerate(rows)]
        sampler(logits[:len(rows)], sampling_metadata(states, logprobs_mode, device), settle_kept_sets=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# How long the warm-up waits for the background compiles (each takes 20-30 s on an H100 host).
SAMPLER_COMPILE_TIMEOUT_S = 600.0


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
    compile that fails or hangs fails the start-up with its error."""
    for future in compiling:
        future.result(timeout=SAMPLER_COMPILE_TIMEOUT_S)
