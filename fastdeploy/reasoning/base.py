"""The reasoning parser interface and its registry (one name per thinking style)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

from fastdeploy.reasoning.end_detector import EndMarkerDetector
from fastdeploy.reasoning.splitter import ReasoningSplitter

_PARSERS: dict[str, type[ReasoningParser]] = {}

# Enough prompt tokens to hold an end marker and the whitespace a template puts after it.
_PROMPT_TAIL_TOKENS = 32


class ReasoningParser:
    """A thinking style delimited by a start and an end marker (text, e.g. `<think>`, `</think>`).

    Everything the model generates before the end marker is reasoning; a start marker at
    the very beginning of the output is dropped. A prompt that already ends with the end
    marker (a template that turned thinking off) leaves no reasoning: the whole output is
    the answer. Subclasses set the markers; styles that need more override the methods.
    """

    start_marker: ClassVar[str]
    end_marker: ClassVar[str]

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # The worker matches the marker on token ids: its canonical tokenization (one id for
        # models that have it as a special token, several otherwise).
        self.end_token_ids: list[int] = tokenizer.encode(self.end_marker, add_special_tokens=False)

    def prompt_closes_reasoning(self, prompt_text: str) -> bool:
        """Whether the prompt itself ended thinking, so generation starts with the answer."""
        return prompt_text.rstrip().endswith(self.end_marker)

    def prompt_ids_close_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        tail = self.tokenizer.decode(list(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return self.prompt_closes_reasoning(tail)

    def splitter(self, prompt_text: str) -> ReasoningSplitter:
        """A streaming splitter for one output of a prompt."""
        return ReasoningSplitter(self.start_marker, self.end_marker,
                                 reasoning=not self.prompt_closes_reasoning(prompt_text))

    def split(self, prompt_text: str, output_text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None where there is none."""
        splitter = self.splitter(prompt_text)
        r1, c1 = splitter.feed(output_text)
        r2, c2 = splitter.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def end_detector(self) -> EndMarkerDetector:
        return EndMarkerDetector(self.end_token_ids)


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    """Class decorator: make a parser selectable as `--reasoning-parser NAME`."""

    def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _PARSERS[name] = cls
        return cls

    return register


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(_PARSERS))}") from None


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)
