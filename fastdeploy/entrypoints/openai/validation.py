"""Checks of a parsed request that need the tokenizer or the engine's limits; each failure is a 400.

Pydantic has checked types and ranges by now (see request_limits.py); what is left
depends on the model (vocabulary, context length) or on several fields together.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastdeploy.common.limits import EngineLimits
from fastdeploy.common.text_encoding import encode_ids
from fastdeploy.entrypoints.openai.errors import APIError, bad_request
from fastdeploy.entrypoints.openai.protocol import (
    GUIDED_FIELDS,
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
)
from fastdeploy.entrypoints.openai.request_limits import MAX_PROMPTS

# Text longer than this is tokenized on a worker thread: the Rust tokenizer lets go of the GIL, and
# a prompt of megabytes (seconds of tokenizing, 3.9 s for 6 MiB on the 2-core VM) on the event
# loop stalled every stream the server was sending. Shorter text is tokenized in place, sparing the
# thread hand-off to the usual prompt (10 ms for 4,310 tokens).
INLINE_ENCODE_CHARS = 1 << 16
# JSON Schema keywords that name another schema by URI; only fragments of the same document may be used.
REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
# Keys under which a schema may also be given as JSON text (response_format.json_schema.schema, ...).
SCHEMA_TEXT_KEYS = ("schema", "json_schema", "parameters")


def _json_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return None  # not JSON: the guided-decoding parser reports it


def encode_text(tokenizer, text: str, param: str) -> list[int]:
    """Token ids of user text; text the tokenizer cannot take is the caller's fault, not ours."""
    try:
        return encode_ids(tokenizer, text)
    except Exception as exc:  # tokenizers raise TypeError, ValueError, Rust panics as exceptions
        raise bad_request(f"`{param}` cannot be tokenized: {exc}", param) from None


async def encode_texts(tokenizer, texts: list[str], param: str) -> list[list[int]]:
    """`encode_text` of each text, on a worker thread when together they are long enough to stall
    the event loop (one request's 256 prompts as much as one long one)."""
    def encode_all() -> list[list[int]]:
        return [encode_text(tokenizer, text, param) for text in texts]

    if sum(len(text) for text in texts) <= INLINE_ENCODE_CHARS:
        return encode_all()
    return await asyncio.to_thread(encode_all)


def check_context(num_prompt: int, max_tokens: int | None, limits: EngineLimits, max_tokens_param: str,
                  prompt_word: str) -> None:
    """A completion that cannot fit beside its prompt is refused at once, in OpenAI's words,
    instead of running until the context is full."""
    if max_tokens is None or not 0 < num_prompt < limits.max_model_len:
        return  # no room for any completion: EngineLimits.validate says so about the prompt
    if num_prompt + max_tokens > limits.max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the {prompt_word}, {max_tokens} in the completion). "
            f"Please reduce the length of the {prompt_word} or completion.",
            "invalid_request_error", max_tokens_param, "context_length_exceeded")


def check_sampling(request: CommonRequest, limits: EngineLimits) -> None:
    # Chat asks for top_logprobs (logprobs is a switch); completions for logprobs, a count.
    field = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
    value = getattr(request, field)
    if value is not None and value > limits.max_logprobs:
        raise bad_request(f"{field} must be at most {limits.max_logprobs} (--max-logprobs), got {value}", field)
    if request.top_k is not None and request.top_k > limits.vocab_size:
        raise bad_request(f"top_k must be at most the vocabulary size {limits.vocab_size} "
                          f"(or 0 / -1 for off), got {request.top_k}", "top_k")


def check_choices(request: CompletionRequest, num_prompts: int) -> None:
    """Bounds the engine requests one HTTP request may queue (prompts x n)."""
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request(f"best_of must equal n ({request.n}): choosing the best of more samples is not "
                          f"supported, got {request.best_of}", "best_of")
    if num_prompts * request.n > MAX_PROMPTS:
        raise bad_request(f"{num_prompts} prompts x n={request.n} is {num_prompts * request.n} choices; "
                          f"one request may ask for at most {MAX_PROMPTS}", "n" if request.n > 1 else "prompt")


def external_ref(value: Any) -> str | None:
    """The first `$ref` (or dynamic ref) in `value` that points outside the document, or None."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, child in node.items():
                if key in REF_KEYWORDS and isinstance(child, str) and not child.startswith("#"):
                    return child
                stack.append(_json_text(child) if key in SCHEMA_TEXT_KEYS and isinstance(child, str) else child)
        elif isinstance(node, list):
            stack.extend(node)
    return None


def check_no_external_refs(request: CommonRequest) -> None:
    """A schema may only refer to its own parts: the server never reads a file or a URL for a request."""
    for field in GUIDED_FIELDS:
        value = getattr(request, field)
        ref = external_ref(_json_text(value) if isinstance(value, str) else value)
        if ref is not None:
            raise bad_request(f"`{field}` refers to {ref!r}: a `$ref` must point inside the schema ('#/...'); "
                              "this server reads no files or URLs for a request", field)
