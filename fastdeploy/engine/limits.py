"""What a request must satisfy before it is queued; checked by the API server and the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from fastdeploy.engine.errors import ParameterError
from fastdeploy.model_executor.guided_decoding.select import resolve_guided_spec

if TYPE_CHECKING:
    from fastdeploy.engine.request import EngineRequest


class EngineLimits(msgspec.Struct, array_like=True):
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    enable_keep_sampling_mask: bool
    kv_capacity_tokens: int  # whole KV pool, in tokens
    guided_backend: str = "auto"  # --guided-decoding-backend: auto | xgrammar | llguidance | off
    disable_any_whitespace: bool = False  # --guided-decoding-disable-any-whitespace

    def validate(self, request: "EngineRequest", prompt_param: str = "prompt") -> None:
        """Raise ParameterError naming the parameter that makes `request` impossible.

        A structured-output request also gets its grammar backend chosen and the server's
        whitespace default filled in (request.params.guided is replaced; idempotent).
        """
        self._validate(request, prompt_param)
        if request.params.guided is not None:
            request.params.guided = resolve_guided_spec(request.params.guided, self.guided_backend,
                                                        self.disable_any_whitespace)

    def _validate(self, request: "EngineRequest", prompt_param: str) -> None:
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ParameterError("the prompt is empty", prompt_param)
        if num_prompt >= self.max_model_len:
            raise ParameterError(
                f"the prompt has {num_prompt} tokens; this model's context is {self.max_model_len} tokens "
                "and at least one must be left for the completion",
                prompt_param,
            )
        if any(not 0 <= t < self.vocab_size for t in request.prompt_token_ids):
            raise ParameterError("the prompt holds a token id outside the vocabulary", prompt_param)
        request.params.validate(self.max_logprobs, self.vocab_size)
        if request.params.return_sampling_mask and not self.enable_keep_sampling_mask:
            raise ParameterError(
                "return_sampling_mask needs the server to run with --enable-keep-sampling-mask",
                "return_sampling_mask",
            )
        max_tokens = request.params.max_tokens or self.max_model_len
        longest = min(num_prompt + max_tokens, self.max_model_len)
        if longest > self.kv_capacity_tokens:
            raise ParameterError(
                f"the request needs up to {longest} tokens of KV cache but the pool holds "
                f"{self.kv_capacity_tokens}; lower max_tokens",
                "max_tokens",
            )
