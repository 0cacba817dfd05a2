"""Prompt-lookup drafting: continue the context the way an earlier occurrence of its suffix continued."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, context: np.ndarray, max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens following the latest earlier match of the context's suffix.

        Longer suffixes are tried first (a longer match predicts better); among matches of
        one length the most recent wins, since text that repeats tends to repeat its
        latest form. `context` is int64 [L] (prompt + output).

        Every earlier match ends at an earlier occurrence of the newest token, so only those
        places are compared (backwards, up to `max_n` tokens each): one pass over the context
        finds them, where a scan per suffix length would compare every window.
        """
        length = len(context)
        if max_drafts <= 0 or length < 2:
            return []
        ends = np.flatnonzero(context[: length - 1] == context[length - 1])
        if ends.size == 0:
            return []
        back = np.arange(min(self.max_n, length - 1))
        earlier = ends[:, None] - back
        agree = (earlier >= 0) & (context[np.maximum(earlier, 0)] == context[length - 1 - back])
        matched = agree.cumprod(axis=1).sum(axis=1)  # each place's suffix match, in tokens
        longest = int(matched.max())
        if longest < self.min_n:
            return []
        start = int(ends[np.flatnonzero(matched == longest)[-1]]) + 1
        return context[start: start + max_drafts].tolist()
