"""Prompt-lookup drafting: continue the context the way an earlier occurrence of its suffix continued."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, context: np.ndarray, max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens following the latest earlier match of the context's suffix.

        Longer suffixes are tried first (a longer match predicts better); among matches of
        one length the most recent wins, since text that repeats tends to repeat its
        latest form. `context` is int64 [L] (prompt + output).
        """
        length = len(context)
        if max_drafts <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = context[length - n:]
            # Windows that end before the suffix itself starts.
            windows = sliding_window_view(context[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return context[start: start + max_drafts].tolist()
        return []
