"""Prefix caching on CUDA: decode rows that share a prompt's cached blocks (a prompt's n
samples, a prompt sent again, a sequence's draft rows) are attended together by the Triton
decode kernel, and every result is the uncached engine's."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.speculative_config import parse_speculative_config
from tests.random_qwen2 import save_random_qwen2
from tests.scheduler.test_prefix_cache import _assert_same, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_random_qwen2(tmp_path_factory.mktemp("qwen2_sharing"), vocab_size=VOCAB)


def _config(model_dir: str, caching: bool, spec: dict | None = None) -> EngineConfig:
    return EngineConfig(model=model_dir, device="cuda", dtype="float32", guided_decoding_backend="off",
                        enable_keep_sampling_mask=True, speculative=parse_speculative_config(spec),
                        cache=CacheConfig(block_size=16, num_blocks=256, enable_prefix_caching=caching),
                        scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=256, max_num_batched_tokens=512))


def _waves(sampled: bool) -> list[list[tuple[str, list[int], SamplingParams]]]:
    """Prompts of 150 and 131 tokens (several 64-token chunks of shared keys), sampled n times,
    then sent again, longer, in a second wave that finds them cached."""
    g = torch.Generator().manual_seed(0)
    long_a = torch.randint(3, VOCAB, (150,), generator=g).tolist()
    long_b = torch.randint(3, VOCAB, (131,), generator=g).tolist()

    def params(n: int, seed: int) -> SamplingParams:
        if not sampled:
            return SamplingParams(n=n, max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=2)
        return SamplingParams(n=n, max_tokens=12, ignore_eos=True, temperature=1.0, top_p=0.9, seed=seed, logprobs=2)

    first = [("a", long_a, params(4, 1)), ("b", long_b, params(3, 2))]
    second = [("a_again", long_a, params(4, 3)), ("a_longer", long_a + [5, 6, 7], params(2, 4)),
              ("b_again", long_b, params(3, 5))]
    return [first, second]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_shared_prefix_rows_give_the_uncached_results(model_dir, sampled):
    plain, _, _ = _run(_config(model_dir, False), _waves(sampled))
    cached, hits, _ = _run(_config(model_dir, True), _waves(sampled))
    assert hits >= 3 * 128  # the second wave's prompts found their blocks
    _assert_same(cached, plain)


def test_shared_prefix_rows_with_ngram_drafts_give_the_uncached_results(model_dir):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    plain, _, _ = _run(_config(model_dir, False, ngram), _waves(False))
    cached, hits, _ = _run(_config(model_dir, True, ngram), _waves(False))
    assert hits > 0
    _assert_same(cached, plain)


def test_shared_prefix_rows_with_mtp_drafts_give_the_uncached_results(model_dir, tmp_path_factory):
    """MTP's blocks hold the head's own K/V too: with the cache (prompt blocks only, the first pair
    after a hit from the kept hidden state), on the device's graphs and drafting paths, every
    result is the uncached engine's."""
    from fastdeploy.model_executor.models.mtp import MTPHead, mtp_config, save_mtp_head
    from fastdeploy.worker.model_runner import ModelRunner

    torch.manual_seed(7)
    head_dir = str(tmp_path_factory.mktemp("mtp_sharing"))
    save_mtp_head(MTPHead(mtp_config(ModelRunner(_config(model_dir, False)).model_config)), head_dir,
                  dtype=torch.float32)
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "model": head_dir}
    plain, _, _ = _run(_config(model_dir, False, mtp), _waves(False))
    cached, hits, _ = _run(_config(model_dir, True, mtp), _waves(False))
    assert hits > 0
    _assert_same(cached, plain)
