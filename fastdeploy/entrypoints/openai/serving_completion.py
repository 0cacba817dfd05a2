"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import Response

from fastdeploy.entrypoints.openai.formatting import ServedChoice, completion_logprobs, extra_fields, usage
from fastdeploy.entrypoints.openai.full_body import BodyLayout
from fastdeploy.entrypoints.openai.protocol import CompletionRequest
from fastdeploy.entrypoints.openai.serving_engine import OpenAIServing, new_request_id, until_disconnected
from fastdeploy.entrypoints.openai.streamed_response import StreamedResponse
from fastdeploy.entrypoints.openai.validation import check_choices, encode_texts


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest, raw_request: Request):
        self.check_model(request.model)
        params = self.sampling_params(request)
        texts_or_ids = request.prompts()
        check_choices(request, len(texts_or_ids))
        encoded = iter(await encode_texts(self.tokenizer, [p for p in texts_or_ids if isinstance(p, str)], "prompt"))
        prompts = [next(encoded) if isinstance(p, str) else list(p) for p in texts_or_ids]
        request_id = new_request_id("cmpl")
        engine_requests = self.engine_requests(request, request_id, prompts, params, "prompt")
        model = request.model or self.served_model_names[0]
        if request.stream:
            events = await self.started_choices(engine_requests, raw_request)
            return StreamedResponse(self._stream(request, request_id, model, prompts, engine_requests, events))
        return await until_disconnected(raw_request,
                                        self._full(request, request_id, model, prompts, engine_requests))

    async def _full(self, request, request_id, model, prompts, engine_requests) -> Response:
        def render_choice(i: int, c: ServedChoice, splices: list[list[bytes]] | None) -> dict:
            choice = {
                "index": i,
                "text": c.text,
                "logprobs": completion_logprobs(c.logprobs, 0) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **extra_fields(c, request.return_token_ids, splices),
            }
            if request.return_token_ids:
                choice["prompt_token_ids"] = prompts[i // request.n]
            return choice

        def render_tail(choices: list[ServedChoice]) -> dict:
            return {"usage": usage(sum(len(p) for p in prompts), sum(len(c.token_ids) for c in choices))}

        envelope = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
        return await self.full_response(engine_requests, BodyLayout(envelope, render_choice, render_tail))

    async def _stream(self, request, request_id, model, prompts, engine_requests,
                      events) -> AsyncGenerator[bytes, None]:
        created = int(time.time())
        text_offsets = [0] * len(engine_requests)

        def wrap(choices: list[dict], **extra) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": choices, **extra}

        def format_choice(event) -> dict:
            c = event.chunk
            choice = {
                "index": event.index,
                "text": c.text,
                "logprobs": completion_logprobs(c.logprobs, text_offsets[event.index])
                if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                **extra_fields(c, request.return_token_ids),
            }
            text_offsets[event.index] += len(c.text)
            return choice

        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        async for line in self.sse_events(events, format_choice, wrap, sum(len(p) for p in prompts),
                                          include_usage):
            yield line
