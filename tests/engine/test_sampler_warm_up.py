"""The model runner samples made-up rows of every kind once at start-up, before serving.

On CUDA that compiles the sampler's Triton kernels (the kept set, its prefilter, the mask's
bounds and compaction) before the first request, and before the process freezes its start-up
heap. Here: which batches it samples, and that it leaves the global random state alone.
"""

from __future__ import annotations

import pytest
import torch

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.model_executor.layers.sample.sampler import Sampler
from fastdeploy.worker.model_runner import ModelRunner
from fastdeploy.worker.warmup import warm_up_sampler
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
                      "masks": meta.return_sampling_mask is not None, "logprobs": meta.max_num_logprobs})
        out = call(self, logits, meta, settle_kept_sets)
        assert out.sampled_token_ids.shape == (logits.shape[0],)
        return out

    monkeypatch.setattr(Sampler, "__call__", recording)
    return calls


@pytest.mark.parametrize("masks", [True, False])
def test_start_up_samples_every_kind_of_row(model_dir, sampled, masks) -> None:
    _runner(model_dir, masks)
    mixed = {"greedy": 1, "truncated": 3, "plain": 1, "logprobs": 1}
    want = [{**mixed, "masks": False}]
    if masks:  # the masked path, and a step whose masked rows are all greedy (no kept sets)
        want += [{**mixed, "masks": True}, {"greedy": 2, "truncated": 0, "plain": 0, "masks": True, "logprobs": -1}]
    assert sampled == want


def test_warm_up_leaves_the_global_random_state(model_dir) -> None:
    runner = _runner(model_dir, True)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    warm_up_sampler(runner.sampler, runner.model_config.vocab_size, runner.device, True, runner.config.logprobs_mode)
    assert torch.equal(torch.get_rng_state(), before)
