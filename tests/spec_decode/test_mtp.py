"""The MTP draft module: paged serving path vs dense training path, loading, and MTP speculation."""

from __future__ import annotations

import pytest
import torch

from fastdeploy import LLM, SamplingParams
from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.layers.attention import allocate_kv_caches
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata, PrefillSeq
from fastdeploy.model_executor.models.llama import LlamaForCausalLM
from fastdeploy.model_executor.models.mtp import MTPHead, load_mtp_head, mtp_config, save_mtp_head
from fastdeploy.spec_decode.mtp_proposer import PendingDrafts
from tools.dense_llama import dense_hidden_states

BS = 4


def _config() -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip


def _chunk_meta(start: int, length: int, table: torch.Tensor, as_rows: bool = False) -> AttentionMetadata:
    """One sequence computing positions start..start+length-1: a prefill chunk, or (`as_rows`, or
    length 1) decode rows, each attending to the cache up to its own position."""
    positions = torch.arange(start, start + length)
    slots = table[positions // BS] * BS + positions % BS
    if length == 1 or as_rows:
        return AttentionMetadata(slots, length, table.repeat(length, 1), positions + 1, [], BS)
    return AttentionMetadata(slots, 0, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                             [PrefillSeq(0, length, start + length, table)], BS)


def test_paged_path_equals_dense_path():
    torch.manual_seed(0)
    config = _config()
    target = LlamaForCausalLM(config).eval()
    head = MTPHead(mtp_config(config, intermediate_size=24)).eval()
    length = 12
    tokens = torch.randint(0, config.vocab_size, (length,))
    prev_hidden = torch.randn(length, config.hidden_size)
    embeds = target.model.embed_tokens(tokens)
    with torch.no_grad():
        dense = head.forward_dense(embeds[None], prev_hidden[None], target.model.norm)[0]
        cache = allocate_kv_caches(mtp_config(config), 8, BS, torch.float32, "cpu")[0]
        table = torch.tensor([5, 2, 7])  # scattered blocks
        paged = []
        # A prefill chunk, a second chunk on top of the cache, then single-token decodes.
        for start, n in ((0, 6), (6, 4), (10, 1), (11, 1)):
            at = slice(start, start + n)
            paged.append(head(embeds[at], prev_hidden[at], torch.arange(start, start + n),
                              _chunk_meta(start, n, table), cache, target.model.norm))
        torch.testing.assert_close(torch.cat(paged), dense, atol=1e-5, rtol=1e-5)
        # The serving layout of a step's catch-up: runs of pairs as decode rows in one batch.
        cache.zero_()
        paged = []
        for start, n, as_rows in ((0, 5, False), (5, 3, True), (8, 1, False), (9, 3, True)):
            at = slice(start, start + n)
            paged.append(head(embeds[at], prev_hidden[at], torch.arange(start, start + n),
                              _chunk_meta(start, n, table, as_rows), cache, target.model.norm))
        torch.testing.assert_close(torch.cat(paged), dense, atol=1e-5, rtol=1e-5)


def test_fill_writes_the_cache_a_drafting_pass_writes():
    """A step after which no drafts are taken runs `MTPPass.fill`: the same K/V in the MTP cache
    as the drafting pass, and no draft."""
    from fastdeploy.spec_decode.mtp_pass import MTPPass

    torch.manual_seed(1)
    config = _config()
    target = LlamaForCausalLM(config).eval()
    head = MTPHead(mtp_config(config)).eval()
    table = torch.tensor([3, 6, 1])
    caches = []
    for filling in (False, True):
        cache = allocate_kv_caches(mtp_config(config), 8, BS, torch.float32, "cpu")[0]
        mtp_pass = MTPPass(head, target, cache)
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for start, n in ((0, 6), (6, 3), (9, 1)):  # a prompt chunk, a catch-up run, a decode row
                args = (torch.randint(0, config.vocab_size, (n,), generator=g),
                        torch.randn(n, config.hidden_size, generator=g), torch.arange(start, start + n),
                        _chunk_meta(start, n, table, as_rows=n == 3))
                if filling:
                    assert mtp_pass.fill(*args) is None
                else:
                    hidden, tokens = mtp_pass(*args, None)
                    assert tokens.shape == (n,)
        caches.append(cache)
    assert caches[0].abs().sum() > 0
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)


def test_pairs_kept_and_taken_in_later_write_what_filling_each_step_writes():
    """Steps without drafts sent ahead keep their pairs by slot instead of running the MTP
    module; the pass that takes them in later (all of a sequence's, the batch's sequences
    together, each attending to the pairs before it in the same pass) writes the K/V that
    filling after every step wrote, a block boundary crossed and an unsettled row included."""
    from fastdeploy.spec_decode.mtp_pass import MTPPass
    from tests.spec_decode.mtp_kept_pairs import kept_then_taken_in

    torch.manual_seed(2)
    config = _config()
    target = LlamaForCausalLM(config).eval()
    head = MTPHead(mtp_config(config)).eval()
    cache = allocate_kv_caches(mtp_config(config), 12, BS, torch.float32, "cpu")[0]
    cache.copy_(torch.randn(cache.shape))
    for max_rows in (1 << 20, 4):  # one pass; passes of 4 rows, sequences split across them
        with torch.no_grad():
            filled, kept = kept_then_taken_in(MTPPass(head, target, cache), 6, [5, 3, 9],
                                              [[4, 1, 6, 8], [0, 5, 10], [2, 3, 7, 11]], config.hidden_size,
                                              config.vocab_size, torch.device("cpu"), max_rows)
        torch.testing.assert_close(kept, filled, atol=1e-5, rtol=1e-5)


def test_split_gaps_keeps_each_sequences_pairs_in_order_within_the_row_limit():
    from fastdeploy.spec_decode.mtp_gaps import split_gaps

    assert split_gaps([(10, 5, [1]), (20, 7, [2])], 4) == [[(9, 4, [1])], [(10, 1, [1]), (16, 3, [2])],
                                                             [(20, 4, [2])]]
    assert split_gaps([(10, 5, [1])], 100) == [[(10, 5, [1])]]
    assert split_gaps([], 4) == []


def test_pending_drafts_resolve_per_sequence_in_draft_order():
    # Pass 0 drafted for sequences 7, 3, 9; pass 1 only for 9 and 7 (3 had no slot left).
    pending = PendingDrafts([[7, 3, 9], [9, 7]], torch.tensor([70, 30, 90, 91, 71]))
    assert pending.resolve() == {7: [70, 71], 3: [30], 9: [90, 91]}
    assert PendingDrafts([], torch.zeros(0, dtype=torch.long)).resolve() == {}


def test_save_load_round_trip_and_shape_check(tmp_path):
    torch.manual_seed(1)
    config = _config()
    head = MTPHead(mtp_config(config, intermediate_size=24))
    save_mtp_head(head, str(tmp_path), dtype=torch.float32)
    loaded = load_mtp_head(str(tmp_path), config, torch.float32, "cpu")
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    other = ModelConfig(**{**config.__dict__, "hidden_size": 64})
    with pytest.raises(ValueError, match="hidden_size"):
        load_mtp_head(str(tmp_path), other, torch.float32, "cpu")


@pytest.fixture(scope="module")
def base() -> LLM:
    return LLM(max_num_seqs=8)


def test_mtp_greedy_equals_non_speculative_for_any_head(base, tmp_path_factory):
    """Verification makes the output independent of the draft quality: a random head must give
    exactly the non-speculative greedy tokens (and logprobs), with 1, 2 and 3 draft tokens."""
    torch.manual_seed(2)
    directory = str(tmp_path_factory.mktemp("mtp"))
    save_mtp_head(MTPHead(mtp_config(base.engine.executor.runner.model_config)), directory, dtype=torch.float32)
    prompts = [[{"role": "user", "content": "Count from 1 to 12."}],
               [{"role": "user", "content": "Name three planets."}]]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    expected = base.chat(prompts, params)
    for k in (3,):  # a recursion two drafts past the catch-up pair (one draft: test_mtp_head.py)
        spec = LLM(max_num_seqs=8, speculative_config={"method": "mtp", "num_speculative_tokens": k,
                                                        "model": directory})
        got = spec.chat(prompts, params)
        assert spec.engine.spec_stats.num_draft_tokens > 0
        for e, g in zip(expected, got, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert lg.logprob == pytest.approx(le.logprob, abs=1e-4)


@pytest.mark.parametrize("cap", [0, 1, 2])
def test_mtp_drafts_no_more_than_the_announced_cap(base, tmp_path_factory, monkeypatch, cap):
    """The engine announces each step's draft cap one step ahead; the MTP module drafts no more
    than that after the step before it (at cap 0 its first pass only keeps its K/V current), and
    the greedy output stays the non-speculative one."""
    from fastdeploy.scheduler.draft_policy import DraftPolicy
    from fastdeploy.spec_decode.mtp_proposer import MTPProposer

    torch.manual_seed(3)
    directory = str(tmp_path_factory.mktemp("mtp_cap"))
    save_mtp_head(MTPHead(mtp_config(base.engine.executor.runner.model_config)), directory, dtype=torch.float32)
    monkeypatch.setattr(DraftPolicy, "cap", lambda self, num_rows: cap)
    drafted: list[int] = []
    propose = MTPProposer.propose

    def counting(self, work, step_hidden, max_drafts=None, fill_in_flight=None, stored_hidden=None):
        pending = propose(self, work, step_hidden, max_drafts, fill_in_flight, stored_hidden)
        drafted.append(len(pending.seq_ids))  # passes that drafted
        return pending

    monkeypatch.setattr(MTPProposer, "propose", counting)
    prompts = [[{"role": "user", "content": "Count from 1 to 12."}]]
    params = SamplingParams(temperature=0, max_tokens=24)
    spec = LLM(max_num_seqs=8, speculative_config={"method": "mtp", "num_speculative_tokens": 3, "model": directory})
    got = spec.chat(prompts, params)
    assert got[0].outputs[0].token_ids == base.chat(prompts, params)[0].outputs[0].token_ids
    assert drafted and max(drafted) == cap
    assert (spec.engine.spec_stats.num_draft_tokens > 0) == (cap > 0)


@pytest.mark.parametrize("keep_hidden", [True, False])
def test_mtp_drafts_after_a_prefix_cache_hit_are_those_computed_from_scratch(base, monkeypatch, keep_hidden):
    """A second prompt that starts with the first one's 70 tokens takes four blocks from the
    prefix cache: the MTP module reads their K/V of its own, and its first pair after them takes
    the target's hidden state kept for the cached prefix's last position. Its drafts (in turn, so
    each reaches the host) are those of the same prompt on an engine without the cache. Without
    that kept hidden state (`keep_hidden=False`: patched out) the pair reads another state than
    the target's at that position (whether the drafts show it depends on the head)."""
    from fastdeploy.spec_decode.mtp_proposer import MTPProposer
    from fastdeploy.worker.mtp_step import MTPStep

    drafts: list[tuple[int, int, list[int]]] = []  # (seq_id, newest position, drafts)
    propose = MTPProposer.propose

    read_hidden: list[torch.Tensor] = []  # the kept hidden states that first pairs after a hit read

    def recording(self, work, step_hidden, max_drafts=None, fill_in_flight=None, stored_hidden=None):
        read_hidden.extend(stored_hidden[w.stored_hidden_slot].clone() for w in work if w.stored_hidden_slot >= 0)
        pending = propose(self, work, step_hidden, max_drafts, fill_in_flight, stored_hidden)
        made = pending.resolve() if pending.seq_ids else {}
        drafts.extend((w.seq_id, w.start + len(w.tokens) - 1, made[w.seq_id]) for w in work if w.seq_id in made)
        return pending

    monkeypatch.setattr(MTPProposer, "propose", recording)
    if not keep_hidden:
        monkeypatch.setattr(MTPStep, "_keep_prompt_block_ends", lambda self, chunks, hidden, sequences: None)
    tokenizer = base.tokenizer
    shared = tokenizer.encode("Repeat this list exactly: " + ", ".join(f"item {i} is {i * i}" for i in range(30)))[:70]
    first, second = shared + [100, 200, 300, 400, 500], shared + [900, 800, 700, 600]
    params = SamplingParams(temperature=0, max_tokens=24)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}

    def second_run(caching: bool) -> tuple[list[int], list[tuple[int, list[int]]], int]:
        llm = LLM(max_num_seqs=4, speculative_config=spec, enable_prefix_caching=caching, async_scheduling="off")
        try:
            if caching:
                llm.generate([{"prompt_token_ids": first}], params)
            drafts.clear()
            out = llm.generate([{"prompt_token_ids": second}], params)[0].outputs[0].token_ids
            last = max(seq_id for seq_id, _, _ in drafts)  # a finished step's drafting may come late
            return out, [(at, d) for seq_id, at, d in drafts if seq_id == last], llm.engine.block_manager.hit_tokens
        finally:
            llm.engine.shutdown()

    cached_out, cached_drafts, hits = second_run(True)
    plain_out, plain_drafts, _ = second_run(False)
    assert hits == 64 and len(plain_drafts) >= 8
    assert cached_out == plain_out == base.generate([{"prompt_token_ids": second}], params)[0].outputs[0].token_ids
    # The target's hidden state at the cached prefix's last position (63), from a dense forward.
    target = dense_hidden_states(base.engine.executor.runner.model, torch.tensor([second]))[0, hits - 1]
    assert len(read_hidden) == 1  # the cached run's one hit
    assert torch.allclose(read_hidden[0].float(), target, atol=1e-3, rtol=1e-3) == keep_hidden
    if keep_hidden:
        assert cached_drafts == plain_drafts
