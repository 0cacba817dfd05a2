"""The sizes and ranges a request must keep to, as constants, pydantic types and server flags.

The bounded types carry their limits into the OpenAPI schema, so clients (and the
schema-driven tests) see them; anything pydantic rejects becomes a 400 naming the field.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, StringConstraints

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1

MAX_N = 16  # choices per prompt (n, best_of)
MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 512  # a stop string's length: generated text that long is held back while it may match
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries in logit_bias

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_JSON_DEPTH = 64

# A seed travels to torch.Generator.manual_seed, which takes 64 bits; choice i of n uses seed + i.
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# Counts and sizes: large enough for any real use, small enough for every integer type on the way.
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
Choices = Annotated[int, Field(ge=1, le=MAX_N)]
LogprobCount = Annotated[int, Field(ge=0, le=INT32_MAX)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
# Strict: JSON true or 2.0 is no token id.
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX, strict=True)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
# OpenAI's logit_bias maps token ids, written as decimal strings, to a bias in [-100, 100]. No
# leading zeros: "01" and "1" would name one token twice, with two biases.
LogitBiasKey = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,18})$")]
LogitBias = Annotated[dict[LogitBiasKey, float], Field(max_length=MAX_LOGIT_BIAS)]
# OpenAI's request metadata: at most 16 pairs, keys up to 64 characters, values up to 512.
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]
PromptTexts = Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
PromptTokenLists = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]


@dataclass(frozen=True)
class TransportLimits:
    """What the HTTP layer checks before a body is parsed into a request."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = TransportLimits()
        parser.add_argument("--max-request-body-bytes", type=int, default=d.max_body_bytes,
                            help="larger request bodies get 413 (default: %(default)s, 8 MiB)")
        parser.add_argument("--max-json-depth", type=int, default=d.max_json_depth,
                            help="request bodies nested deeper (objects and arrays) get 400 (default: %(default)s)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> TransportLimits:
        if args.max_request_body_bytes < 1 or args.max_json_depth < 1:
            raise SystemExit("--max-request-body-bytes and --max-json-depth must be positive")
        return cls(max_body_bytes=args.max_request_body_bytes, max_json_depth=args.max_json_depth)
