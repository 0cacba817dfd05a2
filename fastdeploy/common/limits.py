"""What a request must satisfy before it is queued: the engine's limits and the checks that need nothing else.

The engine layer adds the grammar backend's choice (fastdeploy/engine/admission.py)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from fastdeploy.common.errors import ParameterError
from fastdeploy.common.sampling_params import SamplingParams


class EngineLimits(msgspec.Struct, array_like=True):
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    enable_keep_sampling_mask: bool
    kv_capacity_tokens: int  # whole KV pool, in tokens
    guided_backend: str = "auto"  # --guided-decoding-backend: auto | xgrammar | llguidance | off
    disable_any_whitespace: bool = False  # --guided-decoding-disable-any-whitespace

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams, prompt_param: str = "prompt") -> None:
        """Raise ParameterError naming the parameter that makes a request impossible."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ParameterError("the prompt is empty", prompt_param)
        if num_prompt >= self.max_model_len:
            raise ParameterError(
                f"the prompt has {num_prompt} tokens; this model's context is {self.max_model_len} tokens "
                "and at least one must be left for the completion",
                prompt_param,
            )
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ParameterError("the prompt holds a token id outside the vocabulary", prompt_param)
        params.validate(self.max_logprobs, self.vocab_size)
        if params.return_sampling_mask and not self.enable_keep_sampling_mask:
            raise ParameterError(
                "return_sampling_mask needs the server to run with --enable-keep-sampling-mask",
                "return_sampling_mask",
            )
        max_tokens = params.max_tokens or self.max_model_len
        longest = min(num_prompt + max_tokens, self.max_model_len)
        if longest > self.kv_capacity_tokens:
            raise ParameterError(
                f"the request needs up to {longest} tokens of KV cache but the pool holds "
                f"{self.kv_capacity_tokens}; lower max_tokens",
                "max_tokens",
            )
