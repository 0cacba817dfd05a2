"""`--speculative-config`: which proposer drafts tokens and how many per step."""

from __future__ import annotations

import json
from typing import Any

import msgspec

METHODS = ("ngram", "mtp")


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    method: str
    num_speculative_tokens: int
    # n-gram (prompt lookup): the longest and shortest suffix searched for in the context.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # MTP: a directory with the draft module's `config.json` and `model.safetensors`;
    # None takes the head shipped for the embedded model.
    model: str | None = None
    # Per step, cap the drafts at what measured steps say pays at the current batch size
    # (scheduler/draft_policy.py); false: every decoding sequence gets num_speculative_tokens.
    adaptive: bool = True


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """JSON text or a dict → SpeculativeConfig; ValueError names the offending field."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    try:
        config = msgspec.convert(value, SpeculativeConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid --speculative-config: {e}") from None
    if config.method not in METHODS:
        raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {config.method!r}")
    if not 1 <= config.num_speculative_tokens <= 16:
        raise ValueError("num_speculative_tokens must be between 1 and 16")
    if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
        raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
    return config
