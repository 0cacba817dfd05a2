"""`<think>` … `</think>`: DeepSeek-R1, Qwen3, QwQ and most open reasoning models."""

from __future__ import annotations

from fastdeploy.reasoning.base import ReasoningParser, register_reasoning_parser


@register_reasoning_parser("think")
class ThinkReasoningParser(ReasoningParser):
    start_marker = "<think>"
    end_marker = "</think>"
