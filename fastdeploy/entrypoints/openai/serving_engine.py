"""What chat and completions share: validation, fan-out of n choices, output state per choice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from fastdeploy.common.request import EngineRequest
from fastdeploy.common.sampling_params import ParameterError, SamplingParams
from fastdeploy.engine.admission import admit_request
from fastdeploy.engine.engine_client import EngineClient, EngineDeadError
from fastdeploy.entrypoints.openai.errors import APIError, bad_request, engine_unavailable
from fastdeploy.entrypoints.openai.formatting import ServedChoice, json_response, sse, usage
from fastdeploy.entrypoints.openai.full_body import BodyLayout, ProgressiveBody
from fastdeploy.entrypoints.openai.metrics import ServerMetrics
from fastdeploy.entrypoints.openai.protocol import GUIDED_FIELDS, CommonRequest
from fastdeploy.entrypoints.openai.streamed_response import StreamedResponse
from fastdeploy.entrypoints.openai.validation import check_context, check_no_external_refs, check_sampling
from fastdeploy.output.detokenizer import TokenTexts
from fastdeploy.output.output_processor import OutputChunk, RequestOutputState

DISCONNECT_POLL_S = 0.5

_T = TypeVar("_T")

logger = logging.getLogger(__name__)


@dataclass
class ChoiceEvent:
    index: int
    chunk: OutputChunk


class OpenAIServing:
    def __init__(self, client: EngineClient, tokenizer, served_model_names: list[str],
                 metrics: ServerMetrics) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.served_model_names = served_model_names
        self.metrics = metrics

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")

    def generation_error(self, message: str | None, status: int) -> APIError:
        """The error a choice finished with: 503 once the engine is gone, else the engine's status."""
        if not self.client.healthy:
            return engine_unavailable(message or "the engine stopped")
        if status == 400:
            return bad_request(message or "invalid request")
        return APIError(status, message or "generation failed", "server_error")

    def sampling_params(self, request: CommonRequest) -> SamplingParams:
        check_no_external_refs(request)
        try:
            return request.to_sampling_params()
        except ParameterError as exc:
            raise bad_request(str(exc), exc.param) from None

    def engine_requests(self, request: CommonRequest, request_id: str, prompts: list[list[int]],
                        params: SamplingParams, prompt_param: str) -> list[EngineRequest]:
        """One engine request per (prompt, choice); validated here so a bad one is a 400, not a stream error."""
        limits = self.client.limits
        if not self.client.healthy or limits is None:
            raise engine_unavailable(f"the engine is not available: {self.client.dead_reason}")
        check_sampling(request, limits)
        max_tokens_param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) is not None \
            else "max_tokens"
        for tokens in prompts:
            check_context(len(tokens), params.max_tokens, limits, max_tokens_param, prompt_param)
        now = time.time()
        requests = []
        for p, tokens in enumerate(prompts):
            for i in range(params.n):
                requests.append(EngineRequest(f"{request_id}-{p}-{i}", tokens, params.for_choice(i), now))
        for engine_request in requests:
            try:
                admit_request(limits, engine_request, prompt_param)
            except ParameterError as exc:
                guided_field = request.guided_field()
                param = guided_field if guided_field and exc.param in GUIDED_FIELDS else exc.param
                raise bad_request(str(exc), param) from None
        return requests

    async def full_response(self, requests: list[EngineRequest], layout: BodyLayout) -> Response:
        """The non-streaming answer: written whole once every choice has finished, where the
        first failed choice fails the whole response; or, once the first choice's bitmap masks
        fill a block, written while the choices run (`full_body.ProgressiveBody`)."""
        choices = [ServedChoice(i) for i in range(len(requests))]
        events = self.run_choices(requests)
        progressive = False
        try:
            async for event in events:
                choice = choices[event.index]
                choice.add(event.chunk)
                if choice.finish_reason == "error":
                    raise self.choice_error(choice)
                if choices[0].has_mask_block():
                    progressive = True
                    body = ProgressiveBody(layout, choices, events, self.choice_error)
                    return StreamedResponse(body.parts(), media_type="application/json")
        finally:
            if not progressive:
                await events.aclose()
        splices: list[list[bytes]] = []  # bitmap arrays, written into the body without a copy
        return json_response(layout.body(choices, splices), splices=splices)

    def choice_error(self, choice: ServedChoice) -> APIError:
        return self.generation_error(choice.error, choice.error_status)

    async def started_choices(self, requests: list[EngineRequest],
                              raw_request: Request) -> AsyncGenerator[ChoiceEvent, None]:
        """The choices' events for a stream, once the first has come: a request the engine refuses
        at its first step (a constraint no token can start, a grammar that does not compile) gets
        its error status, not a 200 whose stream holds only the error. The client leaving while
        it waits aborts the requests, as in `until_disconnected`."""
        events = self.run_choices(requests)
        try:
            first = await until_disconnected(raw_request, anext(events, None))
            if first is not None and first.chunk.finish_reason == "error":
                raise self.generation_error(first.chunk.error, first.chunk.error_status)
        except BaseException:
            await events.aclose()
            raise
        return self._resumed(first, events)

    @staticmethod
    async def _resumed(first: ChoiceEvent | None, events: AsyncGenerator[ChoiceEvent, None]
                       ) -> AsyncGenerator[ChoiceEvent, None]:
        async with contextlib.aclosing(events):
            if first is not None:
                yield first
            async for event in events:
                yield event

    async def sse_events(self, events: AsyncGenerator[ChoiceEvent, None],
                         format_choice: Callable[[ChoiceEvent], dict], wrap: Callable[..., dict],
                         prompt_tokens: int, include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE body shared by chat and completions: one event per chunk, usage, [DONE].

        `events`: from `started_choices`. `format_choice` renders one choice's chunk;
        `wrap(choices, **extra)` the envelope. A choice that fails after the first event ends the
        stream with one error event.
        """
        completion_tokens = 0
        try:
            async for event in events:
                c = event.chunk
                if c.finish_reason == "error":
                    yield sse(self.generation_error(c.error, c.error_status).body())
                    break
                completion_tokens += len(c.token_ids)
                choice = format_choice(event)
                if c.finish_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                yield sse(wrap([choice]))
            else:
                if include_usage:
                    yield sse(wrap([], usage=usage(prompt_tokens, completion_tokens)))
        except APIError as exc:
            yield sse(exc.body())
        except Exception as exc:
            # A fault of ours: logged, and the client still gets an error event and the end of the stream
            # (the headers are sent by now; raising would cut the body short without a word).
            logger.exception("stream failed")
            yield sse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body())
        finally:
            await events.aclose()
        yield sse("[DONE]")

    async def run_choices(self, requests: list[EngineRequest]) -> AsyncGenerator[ChoiceEvent, None]:
        """Merge the deltas of all choices as they come, index = position in `requests`."""
        if len(requests) == 1:
            # One choice (the usual request): its chunks straight from the engine client, with no
            # task and queue between (each cost a wake-up per streamed chunk).
            try:
                async with contextlib.aclosing(self._choice_chunks(requests[0])) as chunks:
                    async for chunk in chunks:
                        yield ChoiceEvent(0, chunk)
            except EngineDeadError as exc:
                raise engine_unavailable(str(exc)) from None
            return
        queue: asyncio.Queue[ChoiceEvent | BaseException | None] = asyncio.Queue()

        async def pump(index: int, engine_request: EngineRequest) -> None:
            try:
                async with contextlib.aclosing(self._choice_chunks(engine_request)) as chunks:
                    async for chunk in chunks:
                        await queue.put(ChoiceEvent(index, chunk))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # surfaced to the consumer
                await queue.put(exc)
                raise
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, EngineDeadError):
                    raise engine_unavailable(str(item))
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _choice_chunks(self, engine_request: EngineRequest) -> AsyncGenerator[OutputChunk, None]:
        """One choice's output chunks until its last, with its metrics; a choice given up before
        its last chunk (the client left, a sibling failed) counts as aborted."""
        state = RequestOutputState(engine_request.params, self.tokenizer, self.token_texts)
        arrival = time.monotonic()
        last = None
        series = self.metrics.for_request(None)
        finished = False
        try:
            async with contextlib.aclosing(self.client.generate(engine_request)) as deltas:
                async for delta in deltas:
                    if last is None:  # the replica serving it is known once it answers
                        series = self.metrics.for_request(self.client.replica_of(engine_request.request_id))
                    chunk = state.update(delta)
                    now = time.monotonic()
                    if chunk.token_ids:
                        if last is None:
                            series.ttft.observe(now - arrival)
                            series.prompt_tokens.inc(chunk.num_prompt_tokens)
                        else:
                            series.itl.observe(now - last)
                        last = now
                        series.generation_tokens.inc(len(chunk.token_ids))
                    if chunk.finish_reason is not None:
                        finished = True
                        series.finished(chunk.finish_reason)
                    yield chunk
                    if finished:
                        break
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                series.finished("abort")
            raise


async def until_disconnected(raw_request: Request, work: Awaitable[_T]) -> _T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw_request.is_disconnected():
                task.cancel()
                await asyncio.wait({task})  # its clean-up done: what it iterated may be closed now
                raise APIError(499, "client disconnected", "client_closed_request")
    finally:
        if not task.done():
            task.cancel()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
