"""Continuous batching: token budget, chunked prefill, max_num_seqs, preemption by recompute."""

from fastdeploy.common.config import SchedulerConfig
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.scheduler.block_manager import BlockManager
from fastdeploy.scheduler.scheduler import Scheduler
from fastdeploy.scheduler.sequence import SeqStatus, Sequence


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, max_model_len, budget), bm), bm


def seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(range(1, prompt_len + 1)), SamplingParams())


def run_step(sched: Scheduler, sample_token: int = 5):
    step = sched.schedule()
    sched.on_step_done(step)
    for chunk in step.chunks:
        if chunk.samples:
            chunk.seq.output_token_ids.append(sample_token)
    return step


def test_token_budget_chunks_long_prompts():
    sched, _ = make_scheduler(budget=10)
    a = seq(0, 25)
    sched.add(a)
    steps = [run_step(sched) for _ in range(3)]
    assert [c.num_tokens for s in steps for c in s.chunks] == [10, 10, 5]
    assert [c.samples for s in steps for c in s.chunks] == [False, False, True]
    assert a.num_computed_tokens == 25 and a.output_token_ids == [5]


def test_decodes_come_first_and_share_the_budget():
    sched, _ = make_scheduler(budget=8)
    a, b = seq(0, 3), seq(1, 20)
    sched.add(a)
    run_step(sched)  # a prefilled
    sched.add(b)
    step = run_step(sched)
    assert step.chunks[0].seq is a and step.chunks[0].num_tokens == 1
    assert step.chunks[1].seq is b and step.chunks[1].num_tokens == 7


def test_max_num_seqs_caps_the_running_batch():
    sched, _ = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(4):
        sched.add(seq(i, 3))
    run_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_preemption_recomputes_and_keeps_generated_tokens():
    # 6 blocks of 4 tokens: two sequences of 8 tokens fill 4 blocks, then growth must preempt.
    sched, bm = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = seq(0, 7), seq(1, 7)
    sched.add(a)
    sched.add(b)
    preempted = []
    for _ in range(12):
        step = run_step(sched)
        preempted += step.preempted
        assert bm.num_free_blocks >= 0
        used = sum(len(s.block_ids) for s in sched.running)
        assert used + bm.num_free_blocks == bm.num_blocks
    assert preempted and preempted[0] is b  # the newest running sequence is the victim
    assert b.num_preemptions >= 1
    # b's generated tokens survive: they are recomputed as part of its next prefill.
    assert len(b.output_token_ids) >= 1


def test_finish_frees_blocks_wherever_the_sequence_is():
    sched, bm = make_scheduler()
    a, b = seq(0, 9), seq(1, 9)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.finish(a)
    sched.finish(b)
    assert a.status == SeqStatus.FINISHED and bm.num_free_blocks == bm.num_blocks
    assert not sched.has_work()


def test_a_decode_without_drafts_still_holds_the_draft_models_slots():
    """An MTP decode step of cap 0 reserves no drafts but keeps the slots its draft module writes
    past the newest token; with drafts, those come on top of the drafts' own slots. Step by step,
    across block boundaries, the blocks held are exactly what the steps so far needed (a step
    with drafts leaves its blocks to the ones after it)."""
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(8, 256, 32), bm, num_lookahead_slots=2, num_draft_model_slots=2)
    a = seq(0, 5)
    sched.add(a)
    needed = 0
    for step_index in range(14):
        cap = 2 if step_index % 5 == 4 else 0
        step = sched.schedule(max_drafts=cap)
        (chunk,) = step.chunks
        target = chunk.start + chunk.num_tokens
        needed = max(needed, target + chunk.num_lookahead + (2 if chunk.samples else 0))
        assert chunk.num_lookahead == (cap if chunk.num_tokens == 1 else 0)
        assert len(a.block_ids) == -(-needed // 4), (step_index, target, a.block_ids)
        sched.on_step_done(step)
        a.output_token_ids.append(5)
