"""Token-level detection of the end-of-thinking marker on the worker."""

from __future__ import annotations

from collections import deque


class EndMarkerDetector:
    """Watches one sequence's generated token ids for the end marker's token sequence.

    The marker may span several tokens (e.g. `</`, `think`, `>`), which can arrive in
    different steps or in one speculative run; only the last len(marker) ids are kept.
    """

    def __init__(self, marker_ids: list[int]) -> None:
        if not marker_ids:
            raise ValueError("the end marker has no tokens")
        self.marker_ids = list(marker_ids)
        self._recent: deque[int] = deque(maxlen=len(marker_ids))
        self.ended = False

    def feed(self, token_id: int) -> bool:
        """Add one generated token; True exactly when it completes the marker."""
        if self.ended:
            return False
        self._recent.append(int(token_id))
        self.ended = list(self._recent) == self.marker_ids
        return self.ended
