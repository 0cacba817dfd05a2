"""One request's deltas on their way from the engine client's reader to the request's consumer.

The reader puts each engine step's delta in the request's inbox; the consumer takes every delta
waiting at once. While the consumer keeps up that is one delta a step, as sent. When it falls
behind (an API process streaming for more sequences than it can answer one step at a time),
consecutive deltas are merged into one of several tokens, as a speculative step's delta is:
everything above (detokenizing, stop strings, metrics, one SSE event) then runs once for them
rather than once per token, so the server catches up instead of falling further behind.
"""

from __future__ import annotations

import asyncio
from collections import deque

from fastdeploy.common.request import RequestDelta


def mergeable(first: RequestDelta, second: RequestDelta) -> bool:
    """Whether `second` can be folded into `first`: `first` does not end the request, neither
    carries an error, and their per-token fields are present alike. Deltas with sampling masks
    stay as they are (their masks are byte buffers cut per step)."""
    return (first.finish_reason is None and first.error is None and second.error is None
            and first.sampling_mask is None and second.sampling_mask is None
            and first.logz is None and second.logz is None
            and (first.logprobs is None) == (second.logprobs is None)
            and (first.logprob_token_ids is None) == (second.logprob_token_ids is None)
            and (first.ranks is None) == (second.ranks is None))


def merge(first: RequestDelta, second: RequestDelta) -> RequestDelta:
    """`first` then `second` as one delta (`mergeable` holds)."""
    def joined(a: list | None, b: list | None) -> list | None:
        return None if a is None or b is None else a + b

    return RequestDelta(first.request_id, first.token_ids + second.token_ids,
                        logprobs=joined(first.logprobs, second.logprobs),
                        logprob_token_ids=joined(first.logprob_token_ids, second.logprob_token_ids),
                        ranks=joined(first.ranks, second.ranks),
                        finish_reason=second.finish_reason, stop_reason=second.stop_reason,
                        num_prompt_tokens=first.num_prompt_tokens or second.num_prompt_tokens)


def merge_run(deltas: list[RequestDelta]) -> list[RequestDelta]:
    """Consecutive mergeable deltas merged; order and content otherwise kept."""
    out: list[RequestDelta] = []
    for delta in deltas:
        if out and mergeable(out[-1], delta):
            out[-1] = merge(out[-1], delta)
        else:
            out.append(delta)
    return out


class DeltaInbox:
    def __init__(self) -> None:
        self._deltas: deque[RequestDelta] = deque()
        self._arrived = asyncio.Event()

    def put(self, delta: RequestDelta) -> None:
        self._deltas.append(delta)
        self._arrived.set()

    async def take(self) -> list[RequestDelta]:
        """Every delta waiting (waits for one), consecutive ones merged where they can be."""
        while not self._deltas:
            self._arrived.clear()
            await self._arrived.wait()
        waiting = list(self._deltas)
        self._deltas.clear()
        return merge_run(waiting)
