"""A request's deltas reach its consumer as sent while it keeps up, merged when it falls behind."""

from __future__ import annotations

import asyncio

from fastdeploy.common.request import RequestDelta
from fastdeploy.common.sampling_masks import SamplingMasks
from fastdeploy.engine.delta_inbox import DeltaInbox, merge_run


def _delta(tokens: list[int], **fields) -> RequestDelta:
    return RequestDelta("r", tokens, **fields)


def test_a_consumer_that_keeps_up_gets_each_delta_as_sent() -> None:
    async def main() -> list[list[RequestDelta]]:
        inbox = DeltaInbox()
        taken = []
        for step in range(3):
            inbox.put(_delta([step]))
            taken.append(await inbox.take())
        return taken

    assert [[d.token_ids for d in batch] for batch in asyncio.run(main())] == [[[0]], [[1]], [[2]]]


def test_a_consumer_behind_gets_the_waiting_deltas_as_one() -> None:
    async def main() -> list[RequestDelta]:
        inbox = DeltaInbox()
        consumer = asyncio.create_task(inbox.take())
        await asyncio.sleep(0)  # the consumer waits for the first delta
        inbox.put(_delta([1], num_prompt_tokens=5, logprobs=[[-0.1]], logprob_token_ids=[[1]], ranks=[1]))
        inbox.put(_delta([2], logprobs=[[-0.2]], logprob_token_ids=[[2]], ranks=[3]))
        inbox.put(_delta([3], logprobs=[[-0.3]], logprob_token_ids=[[3]], ranks=[1],
                         finish_reason="stop", stop_reason=3))
        return await consumer

    (merged,) = asyncio.run(main())
    assert merged.token_ids == [1, 2, 3] and merged.num_prompt_tokens == 5
    assert merged.logprobs == [[-0.1], [-0.2], [-0.3]] and merged.logprob_token_ids == [[1], [2], [3]]
    assert merged.ranks == [1, 3, 1]
    assert (merged.finish_reason, merged.stop_reason) == ("stop", 3)


def test_what_cannot_be_merged_stays_apart_in_order() -> None:
    mask = SamplingMasks.from_lists([[1, 2]])
    deltas = [
        _delta([1]),
        _delta([2], sampling_mask=mask),  # masks are cut per step: never merged
        _delta([3], logprobs=[[-0.5]]),  # logprobs present on one side only
        _delta([4]),
        _delta([], error="engine stopped", finish_reason="error"),
        _delta([5]),  # after a finish nothing is folded in
    ]
    out = merge_run(deltas)
    assert [d.token_ids for d in out] == [[1], [2], [3], [4], [], [5]]
    assert out[1].sampling_mask is mask


def test_deltas_without_per_token_fields_merge_across_a_finish() -> None:
    out = merge_run([_delta([1]), _delta([2]), _delta([3], finish_reason="length")])
    assert len(out) == 1 and out[0].token_ids == [1, 2, 3] and out[0].finish_reason == "length"
