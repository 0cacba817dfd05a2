"""Per-request sampling parameters, validated once at the edge."""

from __future__ import annotations

import msgspec

from fastdeploy.common.errors import ParameterError
from fastdeploy.common.guided_spec import GuidedSpec

__all__ = ["SAMPLING_MASK_FORMATS", "ParameterError", "SamplingParams"]

SAMPLING_MASK_FORMATS = ("ids", "bitmap")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. Travels API server → engine → worker as msgpack."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logit_bias: dict[int, float] = {}
    # None: no logprobs; 0: the sampled token's only; k: plus the top k.
    logprobs: int | None = None
    return_sampling_mask: bool | None = None  # None: follow the server flag
    # How each token's kept set is written: "ids" (sorted id lists) or "bitmap" (base64 of
    # ceil(V/8) bytes, LSB first); None: the server's --sampling-mask-format.
    sampling_mask_format: str | None = None
    skip_special_tokens: bool = True
    # Structured output: a JSON schema, regex, choice list, EBNF grammar or structural tag.
    guided: GuidedSpec | None = None

    def validate(self, max_logprobs: int, vocab_size: int | None = None) -> None:
        """Raise ParameterError naming the first bad parameter."""
        if self.n < 1:
            raise ParameterError(f"n must be at least 1, got {self.n}", "n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParameterError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise ParameterError(f"temperature must be non-negative, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise ParameterError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParameterError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.repetition_penalty <= 0:
            raise ParameterError(
                f"repetition_penalty must be positive, got {self.repetition_penalty}", "repetition_penalty"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ParameterError(f"{name} must be in [-2, 2], got {value}", name)
        if self.logprobs is not None:
            if self.logprobs < 0:
                raise ParameterError(f"logprobs must be non-negative, got {self.logprobs}", "logprobs")
            if self.logprobs > max_logprobs:
                raise ParameterError(
                    f"top_logprobs={self.logprobs} is above the server maximum {max_logprobs}", "top_logprobs"
                )
        if self.sampling_mask_format not in (None, *SAMPLING_MASK_FORMATS):
            raise ParameterError(f"sampling_mask_format must be one of {', '.join(SAMPLING_MASK_FORMATS)}, "
                                 f"got {self.sampling_mask_format!r}", "sampling_mask_format")
        if vocab_size is not None:
            for name in ("logit_bias", "stop_token_ids"):
                for token_id in getattr(self, name):
                    if not 0 <= token_id < vocab_size:
                        raise ParameterError(f"{name}: token id {token_id} is outside the vocabulary "
                                             f"(0 to {vocab_size - 1})", name)
        for token_id, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise ParameterError(f"logit_bias for token {token_id} must be in [-100, 100]", "logit_bias")

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the token history (repetition / presence / frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def for_choice(self, index: int) -> SamplingParams:
        """The i-th of n samples: its own sequence and its own seed (seed + i), so samples differ."""
        seed = None if self.seed is None else self.seed + index
        return msgspec.structs.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k < 0 else self.top_k
