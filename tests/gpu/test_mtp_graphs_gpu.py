"""MTP speculation on CUDA with the shipped head: the MTP module's passes replayed as CUDA graphs.

Asserted: greedy tokens with graphs equal those with `enforce_eager=True` and those of no
speculation, at batch 1 and 16, with 1 and 3 draft tokens; and one captured MTP pass (padded
to the next captured size) gives the eager pass's hidden states and drafts on the same inputs.
"""

from __future__ import annotations

import gc

import pytest
import torch

from fastdeploy import LLM, SamplingParams
from fastdeploy.common.step_input import ChunkInput
from fastdeploy.model_executor.device_inputs import upload_int64
from fastdeploy.worker.input_prep import prepare_inputs
from tools.mtp_prompts import as_chat, held_out_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BATCHES = (1, 16)
MAX_TOKENS = 48
PROMPTS = held_out_prompts(max(BATCHES))


def _engine(**kwargs) -> LLM:
    return LLM(device="cuda", guided_decoding_backend="off", max_num_seqs=max(BATCHES), num_kv_blocks=512, **kwargs)


def _release() -> None:
    """Return the memory of engines dropped by the caller before the next one is built."""
    gc.collect()
    torch.cuda.empty_cache()


def _tokens(llm: LLM, batch: int) -> list[list[int]]:
    outputs = llm.chat(as_chat(PROMPTS[:batch]), SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def no_speculation() -> dict[int, list[list[int]]]:
    llm = _engine()
    tokens = {batch: _tokens(llm, batch) for batch in BATCHES}
    del llm
    _release()
    return tokens


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_with_graphs_equals_eager_and_no_speculation(no_speculation, k):
    for eager in (False, True):
        llm = _engine(speculative_config={"method": "mtp", "num_speculative_tokens": k}, enforce_eager=eager)
        mtp_pass = llm.engine.executor.runner.mtp.mtp_pass
        assert (mtp_pass.graphs is None) == eager
        for batch in BATCHES:
            assert _tokens(llm, batch) == no_speculation[batch], f"k={k} eager={eager} batch={batch}"
        stats = llm.engine.spec_stats
        assert stats.num_draft_tokens > 0 and stats.mean_accepted_length > 1.0, stats
        del llm, mtp_pass
        _release()


def test_captured_mtp_pass_equals_eager_pass():
    llm = _engine(speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    runner = llm.engine.executor.runner
    mtp_pass = runner.mtp.mtp_pass
    vocab, hidden_size = runner.model_config.vocab_size, runner.model_config.hidden_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    # 12 rows (padded to 16), then 3 rows (padded to 4; rows a larger pass left become padding).
    for num_seqs in (4, 1):
        # Each sequence catches up 3 pairs at positions 20..22 as decode rows, on its own two blocks.
        chunks = [ChunkInput(s, torch.randint(0, vocab, (3,), generator=gen).tolist(), 20, [2 * s + 1, 2 * s + 2],
                             True) for s in range(num_seqs)]
        drafts: dict[int, list[int]] = {s: [] for s in range(num_seqs)}
        input_ids, positions, meta, _ = prepare_inputs(chunks, drafts, runner.block_size, runner.device)
        assert mtp_pass.buffers.fits(input_ids.shape[0], meta)
        prev = torch.randn(input_ids.shape[0], hidden_size, generator=gen).to(runner.device, runner.dtype)
        (draft_rows,) = upload_int64([[3 * s + 2 for s in range(num_seqs)]], runner.device)
        with torch.inference_mode():
            hidden, tokens = mtp_pass(input_ids, prev, positions, meta, draft_rows)
            mtp_pass.graphs, graphs = None, mtp_pass.graphs
            eager_hidden, _ = mtp_pass(input_ids, prev, positions, meta, draft_rows)
            mtp_pass.graphs = graphs
            eager_logits = runner.model.compute_logits(eager_hidden).float()
        torch.testing.assert_close(hidden.float(), eager_hidden.float(), atol=2e-2, rtol=2e-2)
        # The drafts are the eager pass's argmax up to bf16 near ties.
        best = eager_logits.max(dim=1).values
        assert (eager_logits.gather(1, tokens[:, None])[:, 0] >= best - 0.05).all(), (tokens, eager_logits.argmax(1))
    del llm, runner, mtp_pass
    _release()


def test_captured_fill_writes_the_cache_the_drafting_pass_writes():
    """At draft cap 0 the MTP module only fills its cache, from its own graphs: the same K/V."""
    llm = _engine(speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    runner = llm.engine.executor.runner
    mtp_pass = runner.mtp.mtp_pass
    assert mtp_pass.fill_graphs is not None
    vocab, hidden_size = runner.model_config.vocab_size, runner.model_config.hidden_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    chunks = [ChunkInput(s, torch.randint(0, vocab, (3,), generator=gen).tolist(), 20, [2 * s + 1, 2 * s + 2],
                         True) for s in range(5)]
    input_ids, positions, meta, _ = prepare_inputs(chunks, {s: [] for s in range(5)}, runner.block_size,
                                                   runner.device)
    prev = torch.randn(input_ids.shape[0], hidden_size, generator=gen).to(runner.device, runner.dtype)
    written = []
    with torch.inference_mode():
        for fill in (False, True):
            mtp_pass.kv_cache.zero_()
            if fill:
                mtp_pass.fill(input_ids, prev, positions, meta)
            else:
                mtp_pass(input_ids, prev, positions, meta, None)
            torch.cuda.synchronize()
            written.append(mtp_pass.kv_cache.clone())
    assert written[0].abs().sum() > 0
    assert torch.equal(written[1], written[0])
    del llm, runner, mtp_pass
    _release()


def test_pairs_kept_and_taken_in_later_write_what_filling_each_step_writes_on_cuda():
    """The CUDA twin of the CPU test: steps without drafts keep their pairs by slot and one pass
    takes them in later (here replayed as the captured fill graph, the rows padded): the K/V
    the step-by-step fill writes, bf16 rounding aside."""
    from tests.spec_decode.mtp_kept_pairs import kept_then_taken_in

    llm = _engine(speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    runner = llm.engine.executor.runner
    mtp_pass = runner.mtp.mtp_pass
    assert mtp_pass.fill_graphs is not None
    bs = runner.block_size
    # Five sequences, six steps each (30 rows: one captured fill graph); the second one's
    # pairs cross into a new block.
    starts = [20, 2 * bs - 3, 7, 2 * bs + 8, 15]
    tables = [[3 * s + 1, 3 * s + 2, 3 * s + 3] for s in range(len(starts))]
    with torch.inference_mode():
        mtp_pass.kv_cache.zero_()
        filled, kept = kept_then_taken_in(mtp_pass, 6, starts, tables, runner.model_config.hidden_size,
                                          runner.model_config.vocab_size, runner.device)
    # The last block is the spare one that padding rows write to: scratch, not compared.
    pool = slice(0, runner.num_blocks)
    assert filled[:, pool].abs().sum() > 0
    torch.testing.assert_close(kept[:, pool].float(), filled[:, pool].float(), atol=2e-2, rtol=2e-2)
    del llm, runner, mtp_pass
    _release()
