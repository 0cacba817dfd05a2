"""OpenAI JSON shapes for choices, logprobs, sampling masks and usage."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from fastdeploy.output.output_processor import OutputChunk, TokenLogprob


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


def extra_fields(chunk_or_choice: "ChoiceAccumulator | OutputChunk", return_token_ids: bool) -> dict:
    """The fields OpenAI does not have: sampling masks and token ids."""
    extra = {}
    if chunk_or_choice.sampling_mask is not None:
        extra["sampling_mask"] = chunk_or_choice.sampling_mask
        extra["sampling_logz"] = chunk_or_choice.sampling_logz
    if return_token_ids:
        extra["token_ids"] = chunk_or_choice.token_ids
    return extra


@dataclass
class ChoiceAccumulator:
    """A whole choice, built from its chunks for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    sampling_mask: list | None = None
    sampling_logz: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_status: int = 500

    def add(self, chunk: OutputChunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        if chunk.sampling_mask is not None:
            self.sampling_mask = (self.sampling_mask or []) + chunk.sampling_mask
            self.sampling_logz = (self.sampling_logz or []) + chunk.sampling_logz
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.error = chunk.finish_reason, chunk.stop_reason, chunk.error
            self.error_status = chunk.error_status


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
