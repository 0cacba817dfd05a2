"""Reasoning parsers: split a reasoning model's thinking from its answer.

`--reasoning-parser NAME` selects one. The API server uses it to fill `reasoning_content`
apart from `content`; the worker uses its end marker to start guided-decoding constraints
only once thinking has ended. See docs/reasoning.md.
"""

from fastdeploy.reasoning.base import (
    ReasoningParser,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)
from fastdeploy.reasoning.end_detector import EndMarkerDetector
from fastdeploy.reasoning.splitter import ReasoningSplitter
from fastdeploy.reasoning.think import ThinkReasoningParser

__all__ = [
    "EndMarkerDetector",
    "ReasoningParser",
    "ReasoningSplitter",
    "ThinkReasoningParser",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
