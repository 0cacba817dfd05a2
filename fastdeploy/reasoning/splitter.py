"""Text-level split of one output into reasoning and content, delta by delta."""

from __future__ import annotations


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Routes streamed text to reasoning until the end marker, to content after it.

    A marker split across deltas is held back until it is complete (or proven not to be
    the marker), so no delta ever shows part of it. A start marker that opens the output
    is dropped; it is held back only while the output could still become that marker.
    """

    def __init__(self, start_marker: str, end_marker: str, *, reasoning: bool = True) -> None:
        self.start_marker = start_marker
        self.end_marker = end_marker
        self.in_reasoning = reasoning
        self._opening = reasoning  # the output's start has not been checked for a start marker yet
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of output text."""
        if not self.in_reasoning:
            return "", delta
        text = self._held + delta
        self._held = ""
        if self._opening:
            stripped = text.lstrip()
            if stripped and self.start_marker.startswith(stripped) and stripped != self.start_marker:
                self._held = text
                return "", ""
            if stripped.startswith(self.start_marker):
                text = stripped[len(self.start_marker):]
            self._opening = not stripped
        end = text.find(self.end_marker)
        if end >= 0:
            self.in_reasoning = False
            return text[:end], text[end + len(self.end_marker):]
        keep = _partial_suffix(text, self.end_marker)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the output (it was reasoning)."""
        held, self._held = self._held, ""
        return held, ""
