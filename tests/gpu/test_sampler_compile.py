"""The kept set's row search compiles in the background at start-up (`start_sampler_compile`),
for the very arguments the sampler passes: the warm-up after it compiles no variant of its own;
while it compiles, the worker samples on the torch path, and switches with the same draws."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.model_executor.layers.sample import kept_set_prefilter
from fastdeploy.model_executor.layers.sample import kept_set_search_kernels as search_kernels
from fastdeploy.model_executor.layers.sample.kept_set_gpu import PREFILTER_MIN_SHRINK
from fastdeploy.model_executor.layers.sample.kept_set_torch import TorchKeptSetBackend
from fastdeploy.model_executor.layers.sample.kept_set_triton import TritonKeptSetBackend
from fastdeploy.model_executor.layers.sample.sampler import Sampler
from fastdeploy.worker.input_prep import sampling_metadata
from fastdeploy.worker.sequence_state import WorkerSequence
from fastdeploy.worker.warmup import (
    SamplerWarmUp,
    start_sampler_compile,
    wait_sampler_compile,
    warm_up_sampler,
    warmed_up_sampler,
)
from tests.gpu.test_triton_attention import _compiled_variants

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("vocab_size", [49152, 152064, 8000])
def test_the_background_compile_leaves_the_warm_up_nothing_to_compile(vocab_size: int) -> None:
    device = torch.device("cuda")
    kernel = search_kernels._kept_set_kernel
    kernel.device_caches.clear()  # this process's earlier launches must not stand in for the compile
    futures = start_sampler_compile(vocab_size, device)
    wait_sampler_compile(futures)
    compiled = _compiled_variants(kernel)
    # Two variants (full rows, a prefilter's candidates); rows too narrow for the prefilter: one.
    assert len(futures) == compiled == (2 if vocab_size > kept_set_prefilter.CAP * PREFILTER_MIN_SHRINK else 1)
    warm_up_sampler(Sampler(device), vocab_size, device, with_masks=True, logprobs_mode="raw_logprobs")
    assert _compiled_variants(kernel) == compiled


def _seeded_rows(sampler: Sampler, logits: torch.Tensor, device: torch.device) -> tuple[list[int], list[list[int]]]:
    """Tokens and kept sets of seeded, masked rows (peaked and flat, top-p, top-k, min-p)."""
    params = [SamplingParams(top_p=0.9, seed=1), SamplingParams(temperature=1.5, top_p=0.99, seed=2),
              SamplingParams(top_k=40, seed=3), SamplingParams(min_p=0.05, seed=4)]
    states = [WorkerSequence([0], p, True, torch.Generator(device).manual_seed(p.seed)) for p in params]
    out = sampler(logits, sampling_metadata(states, "raw_logprobs", device), settle_kept_sets=True)
    offsets = out.mask_offsets.tolist()
    ids = out.mask_ids.tolist()
    return out.sampled_token_ids.tolist(), [sorted(ids[a:b]) for a, b in zip(offsets, offsets[1:], strict=False)]


def test_a_fresh_compile_serves_on_the_torch_path_then_switches_with_the_same_draws(tmp_path, monkeypatch) -> None:
    """With nothing in Triton's cache the row search compiles for longer than the warm-up waits:
    the sampler starts on the torch kept-set path, and the one `PendingSampler.poll` hands over
    once the compile is done draws the same seeded tokens from the same kept sets."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    device, vocab_size = torch.device("cuda"), 152064
    search_kernels._kept_set_kernel.device_caches.clear()
    futures = start_sampler_compile(vocab_size, device)
    sampler, pending = warmed_up_sampler(futures, SamplerWarmUp(vocab_size, device, True, "raw_logprobs"))
    assert pending is not None, "a fresh compile finished within the warm-up's wait"
    assert isinstance(sampler._kept_sets, TorchKeptSetBackend)
    logits = torch.randn(4, vocab_size, generator=torch.Generator(device).manual_seed(7), device=device) * 3.0
    logits[1] *= 0.1  # flat
    on_torch = _seeded_rows(sampler, logits, device)
    wait_sampler_compile(futures)
    compiled = pending.poll()
    assert compiled is not None and isinstance(compiled._kept_sets, TritonKeptSetBackend)
    assert _seeded_rows(compiled, logits, device) == on_torch
