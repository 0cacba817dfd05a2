"""Prefix caching: shared full blocks, computed once, and results that never depend on it.

The pool's rules are tested on the block manager and scheduler alone; exactness through the
real engine (a small random Qwen2 on CPU, float32): the same requests with caching on and off
give the same tokens, logprobs, sampling masks and logZ, also with preemption, chunked
prefill, n > 1 groups and n-gram speculative decoding.
"""

from __future__ import annotations

import pytest

from fastdeploy.common.config import CacheConfig, EngineConfig, SchedulerConfig
from fastdeploy.common.request import EngineRequest
from fastdeploy.common.sampling_masks import logz_values
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.speculative_config import parse_speculative_config
from fastdeploy.engine.engine_core import EngineCore
from fastdeploy.engine.executor import InProcessExecutor
from fastdeploy.scheduler.block_manager import BlockManager
from fastdeploy.scheduler.prefix_hash import extend_block_hashes, root_hash
from fastdeploy.scheduler.scheduler import MIN_SHARED_TOKENS_TO_WAIT, Scheduler
from fastdeploy.scheduler.sequence import Sequence
from tests.random_qwen2 import save_random_qwen2

BLOCK = 4


def _hashes(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BLOCK, root_hash("m", "float32"))
    return out


def test_hash_covers_the_whole_prefix_and_the_model():
    a, b = _hashes([1, 2, 3, 4, 5, 6, 7, 8]), _hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # the same second block after another first
    assert _hashes([1, 2, 3, 4, 5, 6, 7]) == a[:1]  # only full blocks
    other = []
    extend_block_hashes(other, [1, 2, 3, 4], BLOCK, root_hash("m", "bfloat16"))
    assert other[0] != a[0]


def test_shared_blocks_are_counted_and_evicted_only_when_free_runs_out():
    bm = BlockManager(4, BLOCK, enable_prefix_caching=True)
    h = _hashes(list(range(8)))
    first: list[int] = []
    bm.grow(first, 8)
    bm.register(first[0], h[0])
    bm.register(first[1], h[1])
    second: list[int] = []
    bm.share(second, bm.cached_blocks(h))
    assert second == first and bm.num_free_blocks == 2
    blocks = list(first)
    bm.free(first)
    assert bm.num_free_blocks == 2  # still held by the second sequence
    bm.free(second)
    assert bm.num_free_blocks == 4 and bm.cached_blocks(h) == blocks  # free, and still cached
    taken: list[int] = []
    bm.grow(taken, 8)  # the two never-used blocks first
    assert bm.cached_blocks(h) == blocks
    bm.grow(taken, 12)  # then the least recently freed cached block: the tail of the prefix
    assert bm.cached_blocks(h) == blocks[:1]
    assert bm.num_free_blocks == 1 and not bm.can_grow([], 5)  # the head, still cached, is the last


def test_admission_takes_the_cached_prefix_and_computes_at_least_one_token():
    bm = BlockManager(64, BLOCK, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(8, 256, 64), bm)
    first = Sequence(0, "a", list(range(1, 13)), SamplingParams())
    sched.add(first)
    step = sched.schedule()
    sched.on_step_done(step)
    assert first.num_registered_blocks == 3
    sched.finish(first)
    # Same 12 tokens: the last block is recomputed (its last token gives the logits).
    again = Sequence(1, "b", list(range(1, 13)), SamplingParams())
    longer = Sequence(2, "c", list(range(1, 13)) + [50, 51], SamplingParams())
    sched.add(again)
    sched.add(longer)
    step = sched.schedule()
    starts = {c.seq.request_id: (c.start, c.num_tokens) for c in step.chunks}
    assert starts == {"b": (8, 4), "c": (12, 2)}
    assert bm.hit_tokens == 8 + 12 and bm.query_tokens == 8 + 8 + 12  # the first one found nothing


def test_a_group_waits_for_the_prefix_its_first_member_computes():
    bm = BlockManager(128, BLOCK, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(8, 256, 64), bm)
    prompt = list(range(1, 71))  # 17 full blocks (68 tokens) before the last token
    assert 16 * BLOCK >= MIN_SHARED_TOKENS_TO_WAIT
    group = [Sequence(i, f"g{i}", list(prompt), SamplingParams()) for i in range(3)]
    for seq in group:
        sched.add(seq)
    step = sched.schedule()
    assert [c.seq.request_id for c in step.chunks] == ["g0"]
    sched.on_step_done(step)
    step = sched.schedule()
    # g0's first chunk (the 64-token step budget) computed 16 blocks; the one left in flight is
    # too short to wait for.
    assert sorted((c.seq.request_id, c.start) for c in step.chunks if c.seq is not group[0]) == [("g1", 64),
                                                                                                  ("g2", 64)]
    assert group[1].block_ids[:16] == group[0].block_ids[:16] == group[2].block_ids[:16]


def test_a_short_shared_prefix_is_not_waited_for():
    # Two shared blocks (8 tokens, like a chat template's start): every prompt is admitted at once.
    bm = BlockManager(64, BLOCK, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(8, 256, 64), bm)
    seqs = [Sequence(i, f"s{i}", [7] * 8 + [100 + i] * 9, SamplingParams()) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    step = sched.schedule()
    assert sorted((c.seq.request_id, c.start) for c in step.chunks) == [("s0", 0), ("s1", 0), ("s2", 0)]
    sched.on_step_done(step)
    # Each computed its own copy of the shared blocks; the first registered stays the cached one.
    later = Sequence(9, "later", [7] * 8 + [200] * 9, SamplingParams())
    sched.add(later)
    step = sched.schedule()
    assert [(c.seq.request_id, c.start) for c in step.chunks if c.seq is later] == [("later", 8)]


# Engine-level exactness.

PREFIX = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101]
MIXES = [
    {"temperature": 0.0, "logprobs": 3},
    {"temperature": 0.9, "top_p": 0.9, "seed": 5},
    {"temperature": 1.0, "top_k": 40, "seed": 6, "n": 3},
    {"temperature": 0.0, "logprobs": 2, "repetition_penalty": 1.2},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_random_qwen2(tmp_path_factory.mktemp("qwen2_prefix"), vocab_size=512)


def _config(model_dir: str, caching: bool, num_blocks: int, spec: dict | None = None,
            budget: int = 64) -> EngineConfig:
    return EngineConfig(model=model_dir, device="cpu", dtype="float32", guided_decoding_backend="off",
                        enable_keep_sampling_mask=True, speculative=parse_speculative_config(spec),
                        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=caching),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=budget))


def _run(config: EngineConfig, waves: list[list[tuple[str, list[int], SamplingParams]]]) -> tuple[dict, int, int]:
    """Each wave's requests added together and run to the end; per request (fanned out by n):
    tokens, logprobs, mask rows and logZ. Also the cache's hit tokens and the preemptions."""
    core = EngineCore(config, InProcessExecutor(config))
    out: dict[str, tuple[list, list, list, list]] = {}
    wants_logprobs: set[str] = set()
    try:
        for wave in waves:
            for request_id, prompt, params in wave:
                for k in range(params.n):
                    core.add_request(EngineRequest(f"{request_id}.{k}", prompt, params))
                    out[f"{request_id}.{k}"] = ([], [], [], [])
                    if params.logprobs is not None:
                        wants_logprobs.add(f"{request_id}.{k}")
            while core.has_work():
                for d in core.step():
                    assert d.error is None, d.error
                    tokens, logprobs, masks, logz = out[d.request_id]
                    tokens += d.token_ids
                    if d.request_id in wants_logprobs:
                        logprobs += [row[0] for row in d.logprobs]
                    if d.sampling_mask is not None:
                        masks += d.sampling_mask.to_lists()
                        logz += logz_values(d.logz)
        return out, core.block_manager.hit_tokens, core.scheduler.num_preemptions
    finally:
        core.shutdown()


def _waves() -> list[list[tuple[str, list[int], SamplingParams]]]:
    """A first wave that fills the cache, then prompts that share its prefixes (whole, longer,
    and cut mid-block) and a conversation that resends an answer."""
    def params(i: int, max_tokens: int = 6) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **MIXES[i % len(MIXES)])
    first = [(f"a{i}", PREFIX + [200 + i, 3, 5], params(i)) for i in range(len(MIXES))]
    second = [(f"b{i}", PREFIX + [200 + i, 3, 5, 9, 8, 7][:3 + i], params(i + 1)) for i in range(len(MIXES))]
    second += [("cut", PREFIX[:10], params(0)), ("whole", PREFIX + [200, 3, 5], params(0))]
    return [first, second]


def _greedy_waves() -> list[list[tuple[str, list[int], SamplingParams]]]:
    """`_waves`' requests, greedy with logprobs: speculation's results are then exact."""
    return [[(w_id, prompt, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=2))
             for w_id, prompt, _ in wave] for wave in _waves()]


def _assert_same(cached: dict, plain: dict) -> None:
    assert cached.keys() == plain.keys()
    for request_id, (tokens, logprobs, masks, logz) in plain.items():
        c_tokens, c_logprobs, c_masks, c_logz = cached[request_id]
        assert c_tokens == tokens, request_id
        assert c_masks == masks, request_id
        assert c_logprobs == pytest.approx(logprobs, abs=1e-4), request_id
        assert c_logz == pytest.approx(logz, abs=1e-4), request_id


def test_caching_changes_no_result(model_dir):
    plain, plain_hits, _ = _run(_config(model_dir, False, 256), _waves())
    cached, hits, _ = _run(_config(model_dir, True, 256), _waves())
    assert plain_hits == 0 and hits >= 4 * len(PREFIX) // BLOCK * BLOCK
    _assert_same(cached, plain)
    assert all(len(v[0]) == 6 for v in plain.values())


def test_caching_with_preemption_and_chunked_prefill_changes_no_result(model_dir):
    """A pool too small for the batch preempts sequences that hold shared blocks, and a small
    token budget prefills in chunks; the results stay those of the uncached run."""
    plain, _, _ = _run(_config(model_dir, False, 256), _waves())
    cached, hits, preemptions = _run(_config(model_dir, True, 18, budget=12), _waves())
    assert hits > 0 and preemptions > 0
    _assert_same(cached, plain)


def test_with_a_draft_models_cache_only_prompt_blocks_are_cached_and_two_tokens_computed():
    """MTP keeps K/V of its own in the blocks: the cache takes prompt blocks only (their MTP K/V
    and last hidden states are written as the prompt is computed), a hit leaves at least two
    tokens to compute (a prefill chunk, never a one-token decode row) and marks the first chunk."""
    bm = BlockManager(64, BLOCK, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(8, 256, 64), bm, draft_model_cache=True)
    first = Sequence(0, "a", list(range(1, 11)), SamplingParams())  # 2.5 blocks of prompt
    sched.add(first)
    step = sched.schedule()
    assert not step.chunks[0].after_cache_hit
    sched.on_step_done(step)
    first.output_token_ids += [90, 91, 92, 93, 94, 95]  # blocks 3 and 4 hold output
    first.num_computed_tokens = 16
    sched.register_computed_blocks(first)
    assert first.num_registered_blocks == 2  # the prompt's full blocks only
    sched.finish(first)
    whole = Sequence(1, "b", list(range(1, 9)), SamplingParams())  # exactly the two cached blocks
    longer = Sequence(2, "c", list(range(1, 11)) + [90, 91], SamplingParams())
    sched.add(whole)
    sched.add(longer)
    step = sched.schedule()
    starts = {c.seq.request_id: (c.start, c.num_tokens, c.after_cache_hit) for c in step.chunks}
    # "b": 8 tokens, so only the first block (the last two tokens computed); "c": both blocks.
    assert starts == {"b": (4, 4, True), "c": (8, 4, True)}


def test_caching_with_mtp_speculation_changes_no_result(model_dir, tmp_path_factory):
    """MTP (a random head: drafts rarely hold, which verification makes no matter) with the
    prefix cache, a pool small enough to preempt and a token budget that chunks prefills: the
    results are those of the uncached run, and the cache was hit."""
    import torch

    from fastdeploy.model_executor.models.mtp import MTPHead, mtp_config, save_mtp_head
    from fastdeploy.worker.model_runner import ModelRunner

    torch.manual_seed(7)
    head_dir = str(tmp_path_factory.mktemp("mtp_prefix"))
    model_config = ModelRunner(_config(model_dir, False, 256)).model_config
    save_mtp_head(MTPHead(mtp_config(model_config)), head_dir, dtype=torch.float32)
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "model": head_dir}
    greedy = _greedy_waves()
    plain, _, _ = _run(_config(model_dir, False, 256, mtp), greedy)
    cached, hits, _ = _run(_config(model_dir, True, 256, mtp), greedy)
    assert hits > 0
    _assert_same(cached, plain)
    squeezed, hits, preemptions = _run(_config(model_dir, True, 24, mtp, budget=12), greedy)
    assert hits > 0 and preemptions > 0
    _assert_same(squeezed, plain)


def test_caching_with_ngram_speculation_changes_no_result(model_dir):
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    greedy = _greedy_waves()
    plain, _, _ = _run(_config(model_dir, False, 256, ngram), greedy)
    cached, hits, _ = _run(_config(model_dir, True, 256, ngram), greedy)
    assert hits > 0
    _assert_same(cached, plain)

