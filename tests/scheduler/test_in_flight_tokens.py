"""The scheduler with a step in flight (asynchronous scheduling): a sequence's sampled token is
not known yet, yet the next step computes it; a step scheduled ahead never preempts."""

from fastdeploy.common.config import SchedulerConfig
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.step_input import IN_FLIGHT_TOKEN
from fastdeploy.scheduler.block_manager import BlockManager
from fastdeploy.scheduler.scheduler import Scheduler
from fastdeploy.scheduler.sequence import SeqStatus, Sequence


def make(num_blocks: int = 64, max_model_len: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(8, max_model_len, 64), BlockManager(num_blocks, 4))


def send_ahead(sched: Scheduler, step) -> None:
    """What the engine does once a step is sent `followed`: its samples are in flight, its K/V counted."""
    for chunk in step.chunks:
        if chunk.samples:
            chunk.seq.num_in_flight += 1
    sched.on_step_done(step)


def land(step, token: int = 7) -> None:
    """The step's frame is read: each in-flight token becomes known."""
    for chunk in step.chunks:
        if chunk.samples:
            chunk.seq.num_in_flight -= 1
            chunk.seq.output_token_ids.append(token)


def test_the_next_step_computes_the_token_in_flight() -> None:
    sched = make()
    a = Sequence(0, "a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10))
    sched.add(a)
    first = sched.schedule()
    send_ahead(sched, first)
    second = sched.schedule(may_preempt=False)
    (chunk,) = second.chunks
    assert (chunk.start, chunk.num_tokens, chunk.samples) == (5, 1, True)
    assert a.token_slice(chunk.start, chunk.start + chunk.num_tokens) == [IN_FLIGHT_TOKEN]
    land(first, token=9)
    assert a.token_slice(5, 6) == [9] and a.num_uncomputed_tokens == 1  # position 5 is being computed


def test_a_sequence_whose_token_in_flight_is_its_last_is_not_scheduled_again() -> None:
    sched = make(max_model_len=7)
    by_length = Sequence(0, "a", [1, 2, 3], SamplingParams(max_tokens=1))
    by_context = Sequence(1, "b", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=50))
    going_on = Sequence(2, "c", [1, 2, 3], SamplingParams(max_tokens=50))
    for s in (by_length, by_context, going_on):
        sched.add(s)
    first = sched.schedule()
    send_ahead(sched, first)
    assert [c.seq for c in sched.schedule(may_preempt=False).chunks] == [going_on]


def test_a_step_scheduled_ahead_leaves_out_what_does_not_fit_instead_of_preempting() -> None:
    sched = make(num_blocks=3)
    a = Sequence(0, "a", [1, 2, 3, 4], SamplingParams())
    b = Sequence(1, "b", [1, 2, 3, 4], SamplingParams())
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # a block each for the prompts, one block free
    assert len(first.chunks) == 2
    send_ahead(sched, first)
    ahead = sched.schedule(may_preempt=False)  # both tokens in flight start a block: one is left
    assert [c.seq for c in ahead.chunks] == [a] and ahead.num_blocked == 1 and not ahead.preempted
    assert b.status == SeqStatus.RUNNING and sched.num_preemptions == 0
    send_ahead(sched, ahead)
    land(first)
    land(ahead)
    in_turn = sched.schedule()  # nothing in flight: the usual policy preempts the newest
    assert in_turn.preempted == [b] and sched.num_preemptions == 1


def test_a_step_done_leaves_a_finished_sequence_alone() -> None:
    sched = make()
    a = Sequence(0, "a", [1, 2, 3, 4, 5], SamplingParams())
    sched.add(a)
    step = sched.schedule()
    sched.finish(a)  # aborted while its step ran
    sched.on_step_done(step)
    assert a.num_computed_tokens == 0 and a.status == SeqStatus.FINISHED


def test_token_slice_is_the_context_slice_with_in_flight_positions_marked():
    """Every (start, end) up to two positions past the known tokens, across the prompt/output seam."""
    seq = Sequence(0, "r0", [11, 12, 13, 14], SamplingParams())
    seq.output_token_ids = [21, 22, 23]
    context = seq.prompt_token_ids + seq.output_token_ids
    for start in range(len(context) + 3):
        for end in range(start, len(context) + 3):
            known = context[start:end]
            assert seq.token_slice(start, end) == known + [IN_FLIGHT_TOKEN] * (end - start - len(known))
