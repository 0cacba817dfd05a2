"""Tensor parallelism: 2 ranks (gloo on CPU here, NCCL on GPUs) give the tokens of 1 rank (Qwen2, Qwen3-MoE)."""

from __future__ import annotations

import pytest
import torch

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.common.ipc import make_ipc_dir
from fastdeploy.common.request import EngineRequest
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.speculative_config import SpeculativeConfig
from fastdeploy.distributed.shard import shard_weight, vocab_shard
from fastdeploy.engine.engine_core import EngineCore
from fastdeploy.engine.executor import InProcessExecutor, WorkerProcessExecutor
from tests.random_hf_models import save_random_hf_model
from tests.random_qwen2 import save_random_qwen2

VOCAB = 253



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # An odd vocabulary: padding on the last rank.
    return save_random_qwen2(tmp_path_factory.mktemp("qwen2"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    # Experts split along their intermediate dim; o_proj's bias added once, after the all-reduce.
    return save_random_hf_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", VOCAB, num_hidden_layers=3,
                                mlp_only_layers=[1], attention_bias=True)


def _generate(model_dir: str, tp: int, device: str = "cpu", worker_process: bool = False,
              async_scheduling: str = "off", speculative: SpeculativeConfig | None = None,
              stats: list | None = None) -> list:
    """Greedy tokens and logprobs of four requests; `stats` receives the engine's SpecDecodeStats."""
    config = EngineConfig(model=model_dir, device=device, dtype="float32", tensor_parallel_size=tp,
                          async_scheduling=async_scheduling, speculative=speculative,
                          guided_decoding_backend="off", cache=CacheConfig(block_size=4, num_blocks=256),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64))
    if worker_process:  # the server's layout: rank 0 in a worker process that spawns the other ranks
        ipc_dir = make_ipc_dir()
        executor = WorkerProcessExecutor(config, ipc_dir)
    else:  # offline `LLM`: rank 0 in this process
        executor = InProcessExecutor(config)
    core = EngineCore(config, executor)
    g = torch.Generator().manual_seed(3)
    for i in range(4):
        prompt = torch.randint(3, VOCAB, (5 + 9 * i,), generator=g).tolist()
        core.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                     logprobs=3)))
    results: dict[str, tuple[list, list]] = {}
    try:
        while core.has_work():
            for delta in core.step():
                tokens, logprobs = results.setdefault(delta.request_id, ([], []))
                tokens.extend(delta.token_ids)
                logprobs.extend(delta.logprobs or [])
    finally:
        if stats is not None:
            stats.append(core.spec_stats)
        core.shutdown()
    return [results[f"r{i}"] for i in range(4)]


@pytest.mark.parametrize("worker_process", [False, True], ids=["in-process", "worker-process"])
def test_two_ranks_give_the_greedy_tokens_and_logprobs_of_one(model_dir, worker_process):
    single = _generate(model_dir, 1)
    split = _generate(model_dir, 2, worker_process=worker_process)
    for (tokens_1, lp_1), (tokens_2, lp_2) in zip(single, split, strict=True):
        assert tokens_2 == tokens_1
        torch.testing.assert_close(torch.tensor(lp_2), torch.tensor(lp_1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("worker_process", [False, True], ids=["in-process", "worker-process"])
def test_two_ranks_with_steps_scheduled_ahead_give_the_tokens_of_one_in_turn(model_dir, worker_process,
                                                                            monkeypatch):
    """Asynchronous scheduling under tensor parallelism: rank 1's plans hold placeholders for the
    tokens rank 0 sampled in the step before, which rank 0 broadcasts."""
    from fastdeploy.worker import model_runner

    broadcasts = []
    original = model_runner.broadcast_from_first
    monkeypatch.setattr(model_runner, "broadcast_from_first", lambda x: (broadcasts.append(x.numel()), original(x)))
    single = _generate(model_dir, 1)
    split = _generate(model_dir, 2, worker_process=worker_process, async_scheduling="on")
    if not worker_process:  # rank 0 in this process: the steps did read tokens in flight
        assert len(broadcasts) >= 20, broadcasts
    for (tokens_1, lp_1), (tokens_2, lp_2) in zip(single, split, strict=True):
        assert tokens_2 == tokens_1
        torch.testing.assert_close(torch.tensor(lp_2), torch.tensor(lp_1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed"])
def test_two_ranks_with_ngram_drafts_and_steps_ahead_give_the_tokens_of_one(model_dir, adaptive):
    """n-gram speculation under tensor parallelism with asynchronous scheduling: steps with drafts
    go in turn (rank 0's drafts are on the host), the others ahead; greedy tokens as one rank
    without speculation."""
    single = _generate(model_dir, 1)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                             adaptive=adaptive)
    stats: list = []
    split = _generate(model_dir, 2, async_scheduling="on", speculative=spec, stats=stats)
    if not adaptive:  # every decode step verified drafts where the lookup found some, in turn
        assert stats[0].num_verify_steps >= 5 and stats[0].num_steps_ahead == 0, stats
    # (The adaptive policy's caps follow measured step times, so what ran varies from run to run.)
    for (tokens_1, lp_1), (tokens_2, lp_2) in zip(single, split, strict=True):
        assert tokens_2 == tokens_1
        torch.testing.assert_close(torch.tensor(lp_2), torch.tensor(lp_1), atol=1e-4, rtol=1e-4)


def test_two_ranks_of_a_moe_model_give_the_tokens_of_one(moe_dir):
    single = _generate(moe_dir, 1)
    split = _generate(moe_dir, 2)
    for (tokens_1, lp_1), (tokens_2, lp_2) in zip(single, split, strict=True):
        assert tokens_2 == tokens_1
        torch.testing.assert_close(torch.tensor(lp_2), torch.tensor(lp_1), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("which", ["model_dir", "moe_dir"])
def test_two_gpus_give_the_greedy_tokens_of_one(request, which):
    path = request.getfixturevalue(which)  # Qwen2, and Qwen3-MoE through the fused MoE
    # The first two-GPU engine of this process all-reduces through symmetric memory; later ones
    # take NCCL (the spawned rank's process is new, this one is not): both paths run.
    ahead = _generate(path, 2, device="cuda", async_scheduling="on")  # rank 0 broadcasts in-flight tokens
    split = _generate(path, 2, device="cuda")
    single = _generate(path, 1, device="cuda")
    assert [tokens for tokens, _ in ahead] == [tokens for tokens, _ in split]
    for (tokens_1, lp_1), (tokens_2, lp_2) in zip(single, split, strict=True):
        assert tokens_2 == tokens_1
        torch.testing.assert_close(torch.tensor(lp_2), torch.tensor(lp_1), atol=1e-3, rtol=1e-3)


def test_shards_cover_the_full_tensors():
    w = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    assert torch.equal(torch.cat([shard_weight("model.layers.0.self_attn.q_proj.weight", w, r, 2) for r in (0, 1)]), w)
    assert torch.equal(torch.cat([shard_weight("model.layers.0.mlp.down_proj.weight", w, r, 2) for r in (0, 1)], 1), w)
    assert torch.equal(shard_weight("model.norm.weight", w, 1, 2), w)
    expert = "model.layers.0.mlp.experts.3."
    assert torch.equal(torch.cat([shard_weight(expert + "up_proj.weight", w, r, 2) for r in (0, 1)]), w)
    assert torch.equal(torch.cat([shard_weight(expert + "down_proj.weight", w, r, 2) for r in (0, 1)], 1), w)
    assert torch.equal(shard_weight("model.layers.0.mlp.gate.weight", w, 1, 2), w)  # the router is replicated
    assert torch.equal(shard_weight("model.layers.0.self_attn.o_proj.bias", w[0], 1, 2), w[0])  # added after the sum
    assert torch.equal(shard_weight("model.layers.0.self_attn.q_norm.weight", w[0], 1, 2), w[0])
    rows = [shard_weight("model.embed_tokens.weight", w[:7], r, 2) for r in (0, 1)]
    assert [r.shape[0] for r in rows] == [4, 4] and torch.equal(torch.cat(rows)[:7], w[:7])
    assert not rows[1][3].any()  # padding row
    assert vocab_shard(7, 1, 2) == (4, 8)
