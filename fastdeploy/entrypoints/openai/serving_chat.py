"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import Response

from fastdeploy.entrypoints.openai.errors import bad_request
from fastdeploy.entrypoints.openai.formatting import ServedChoice, chat_logprobs, extra_fields, sse, usage
from fastdeploy.entrypoints.openai.full_body import BodyLayout
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest
from fastdeploy.entrypoints.openai.serving_engine import OpenAIServing, new_request_id, until_disconnected
from fastdeploy.entrypoints.openai.streamed_response import StreamedResponse
from fastdeploy.entrypoints.openai.validation import encode_texts
from fastdeploy.reasoning import ReasoningParser, ReasoningSplitter, get_reasoning_parser


class OpenAIServingChat(OpenAIServing):
    def __init__(self, client, tokenizer, served_model_names: list[str], metrics) -> None:
        super().__init__(client, tokenizer, served_model_names, metrics)
        name = client.config.reasoning_parser
        self.reasoning: ReasoningParser | None = get_reasoning_parser(name)(tokenizer) if name else None

    async def _prompt(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        messages = [m.template_fields() for m in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # template errors are the caller's messages, not ours
            raise bad_request(f"messages cannot be formatted with the chat template: {exc}", "messages") from None
        [tokens] = await encode_texts(self.tokenizer, [text], "messages")
        return text, tokens

    async def create(self, request: ChatCompletionRequest, raw_request: Request):
        self.check_model(request.model)
        params = self.sampling_params(request)
        prompt_text, prompt = await self._prompt(request)
        request_id = new_request_id("chatcmpl")
        engine_requests = self.engine_requests(request, request_id, [prompt], params, "messages")
        model = request.model or self.served_model_names[0]
        if request.stream:
            events = await self.started_choices(engine_requests, raw_request)
            return StreamedResponse(self._stream(request, request_id, model, prompt_text, prompt, engine_requests,
                                                 events))
        return await until_disconnected(
            raw_request, self._full(request, request_id, model, prompt_text, prompt, engine_requests))

    def _message(self, prompt_text: str, text: str) -> dict:
        if self.reasoning is None:
            return {"role": "assistant", "content": text}
        reasoning, content = self.reasoning.split(prompt_text, text)
        return {"role": "assistant", "content": content, "reasoning_content": reasoning}

    async def _full(self, request, request_id, model, prompt_text, prompt, engine_requests) -> Response:
        def render_choice(i: int, c: ServedChoice, splices: list[list[bytes]] | None) -> dict:
            return {
                "index": i,
                "message": self._message(prompt_text, c.text),
                "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **extra_fields(c, request.return_token_ids, splices),
            }

        def render_tail(choices: list[ServedChoice]) -> dict:
            tail: dict = {"usage": usage(len(prompt), sum(len(c.token_ids) for c in choices))}
            if request.return_token_ids:
                tail["prompt_token_ids"] = prompt
            return tail

        envelope = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model}
        return await self.full_response(engine_requests, BodyLayout(envelope, render_choice, render_tail))

    async def _stream(self, request, request_id, model, prompt_text, prompt, engine_requests,
                      events) -> AsyncGenerator[bytes, None]:
        created = int(time.time())

        def chunk(choices: list[dict], **extra) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices, **extra}

        first = {"prompt_token_ids": prompt} if request.return_token_ids else {}
        yield sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(engine_requests))], **first))

        splitters: dict[int, ReasoningSplitter] = {}

        def delta(event) -> dict:
            c = event.chunk
            if self.reasoning is None:
                return {"content": c.text} if c.text or c.finish_reason is None else {}
            splitter = splitters.setdefault(event.index, self.reasoning.splitter(prompt_text))
            reasoning, content = splitter.feed(c.text)
            if c.finish_reason is not None:
                held, _ = splitter.finish()
                reasoning += held
            fields = {"reasoning_content": reasoning} if reasoning else {}
            if content:
                fields["content"] = content
            return fields

        def format_choice(event) -> dict:
            c = event.chunk
            return {
                "index": event.index,
                "delta": delta(event),
                "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                **extra_fields(c, request.return_token_ids),
            }

        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        async for line in self.sse_events(events, format_choice, chunk, len(prompt), include_usage):
            yield line
