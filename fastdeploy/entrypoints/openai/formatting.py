"""OpenAI JSON shapes for choices, logprobs, sampling masks and usage."""

from __future__ import annotations

import json

from fastdeploy.output.output_processor import CompletionOutput, OutputChunk, TokenLogprob


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": e.bytes,
                "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top_logprobs],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict:
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }


def extra_fields(chunk_or_choice: CompletionOutput | OutputChunk, return_token_ids: bool) -> dict:
    """The fields OpenAI does not have: sampling masks and token ids."""
    extra = {}
    masks = chunk_or_choice.sampling_masks
    if masks is not None:
        # The only place the CSR becomes Python lists on the server.
        extra["sampling_mask"] = masks.to_lists()
        extra["sampling_logz"] = chunk_or_choice.sampling_logz
    if return_token_ids:
        extra["token_ids"] = chunk_or_choice.token_ids
    return extra


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
