"""The model runner samples made-up rows of every kind once at start-up, before serving.

On CUDA that compiles the sampler's Triton kernels (the kept set, its prefilter, the mask's
bounds and compaction) before the first request, and before the process freezes its start-up
heap. Here: which batches it samples, that it leaves the global random state alone, and the
hand-over from the torch kept-set path to the Triton one when the latter's background compile
outlasts the start-up (the compile itself, on CUDA: tests/gpu/test_sampler_compile.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.model_executor.layers.sample.kept_set_torch import TorchKeptSetBackend
from fastdeploy.model_executor.layers.sample.sampler import Sampler
from fastdeploy.worker import warmup
from fastdeploy.worker.model_runner import ModelRunner
from fastdeploy.worker.warmup import SamplerWarmUp, warm_up_sampler, warmed_up_sampler
from tests.random_qwen2 import save_random_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # 40,000 ids: above the CUDA kept-set prefilter's threshold, as real vocabularies are.
    return save_random_qwen2(tmp_path_factory.mktemp("qwen2_40k_warm_up"), vocab_size=40_000)


def _runner(model_dir: str, masks: bool) -> ModelRunner:
    return ModelRunner(EngineConfig(
        model=model_dir, device="cpu", dtype="float32", guided_decoding_backend="off",
        enable_keep_sampling_mask=masks, cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)))


@pytest.fixture
def sampled(monkeypatch) -> list[dict]:
    """What each sampler call got: the row split, whether masks were asked, logprobs."""
    calls: list[dict] = []
    call = Sampler.__call__

    def recording(self, logits, meta, settle_kept_sets=False):
        greedy, truncated, plain = meta.row_groups.host
        calls.append({"greedy": len(greedy), "truncated": len(truncated), "plain": len(plain),
                      "masks": meta.return_sampling_mask is not None, "logprobs": meta.max_num_logprobs,
                      "grammar": meta.token_bitmask is not None})
        out = call(self, logits, meta, settle_kept_sets)
        assert out.sampled_token_ids.shape == (logits.shape[0],)
        return out

    monkeypatch.setattr(Sampler, "__call__", recording)
    return calls


@pytest.mark.parametrize("masks", [True, False])
def test_start_up_samples_every_kind_of_row(model_dir, sampled, masks) -> None:
    _runner(model_dir, masks)
    mixed = {"greedy": 1, "truncated": 3, "plain": 1, "logprobs": 1, "grammar": False}
    want = [{**mixed, "masks": False}]
    if masks:  # the masked path, a step whose masked rows are all greedy (no kept sets), one under a grammar
        want += [{**mixed, "masks": True},
                 {"greedy": 2, "truncated": 0, "plain": 0, "masks": True, "logprobs": -1, "grammar": False},
                 {**mixed, "masks": True, "grammar": True}]
    assert sampled == want


def test_warm_up_leaves_the_global_random_state(model_dir) -> None:
    runner = _runner(model_dir, True)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    warm_up_sampler(runner.sampler, runner.model_config.vocab_size, runner.device, True, runner.config.logprobs_mode)
    assert torch.equal(torch.get_rng_state(), before)


class BackgroundJob:
    """A job on a real thread pool that finishes (or fails) when the test says so: the place
    of the row search's compile, whose length the test cannot choose on this machine."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.future: Future = self.pool.submit(self._run)

    def _run(self) -> None:
        assert self.release.wait(timeout=30), "the test never released the job"
        if self.fail:
            raise RuntimeError("compile failed")

    def finish(self) -> None:
        self.release.set()
        self.pool.shutdown(wait=True)


def _warm_up() -> SamplerWarmUp:
    return SamplerWarmUp(vocab_size=1000, device=torch.device("cpu"), with_masks=True, logprobs_mode="raw_logprobs")


def test_a_compile_done_in_time_leaves_nothing_pending() -> None:
    job = BackgroundJob()
    job.finish()
    _, pending = warmed_up_sampler([job.future], _warm_up())
    assert pending is None


def test_a_compile_still_running_serves_on_the_torch_path_then_hands_over(monkeypatch, sampled) -> None:
    monkeypatch.setattr(warmup, "CACHED_COMPILE_WAIT_S", 0.05)
    job = BackgroundJob()
    sampler, pending = warmed_up_sampler([job.future], _warm_up())
    assert pending is not None and isinstance(sampler._kept_sets, TorchKeptSetBackend)
    warmed = len(sampled)
    assert warmed > 0  # the torch sampler was warmed up before serving
    assert pending.poll() is None and not pending.given_up  # still compiling: keep serving
    job.finish()
    compiled = pending.poll()
    assert compiled is not None and compiled is not sampler
    assert len(sampled) == 2 * warmed  # the new sampler is warmed up before it takes over


def test_a_failed_compile_keeps_the_torch_path(monkeypatch, caplog) -> None:
    monkeypatch.setattr(warmup, "CACHED_COMPILE_WAIT_S", 0.05)
    job = BackgroundJob(fail=True)
    sampler, pending = warmed_up_sampler([job.future], _warm_up())
    assert pending is not None
    job.finish()
    assert pending.poll() is None and pending.given_up
    assert "failed to compile" in caplog.text


def test_a_compile_past_its_bound_keeps_the_torch_path(monkeypatch, caplog) -> None:
    monkeypatch.setattr(warmup, "CACHED_COMPILE_WAIT_S", 0.05)
    job = BackgroundJob()
    _, pending = warmed_up_sampler([job.future], _warm_up())
    assert pending is not None
    monkeypatch.setattr(warmup, "SAMPLER_COMPILE_TIMEOUT_S", 0.0)
    assert pending.poll() is None and pending.given_up
    assert "did not compile within" in caplog.text
    job.finish()
    assert pending.poll() is None  # given up stays given up


def test_a_compile_that_failed_before_serving_fails_the_start_up() -> None:
    job = BackgroundJob(fail=True)
    job.finish()
    with pytest.raises(RuntimeError, match="compile failed"):
        warmed_up_sampler([job.future], _warm_up())
