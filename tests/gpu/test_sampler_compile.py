"""The kept set's row search compiles in the background at start-up (`start_sampler_compile`),
for the very arguments the sampler passes: the warm-up after it compiles no variant of its own."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.model_executor.layers.sample import kept_set_prefilter
from fastdeploy.model_executor.layers.sample import kept_set_search_kernels as search_kernels
from fastdeploy.model_executor.layers.sample.kept_set_gpu import PREFILTER_MIN_SHRINK
from fastdeploy.model_executor.layers.sample.sampler import Sampler
from fastdeploy.worker.warmup import start_sampler_compile, wait_sampler_compile, warm_up_sampler
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
