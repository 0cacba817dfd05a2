"""Offline inference: the engine run in this process."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from tqdm import tqdm

from fastdeploy.common.request import EngineRequest
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.common.text_encoding import encode_ids
from fastdeploy.engine.args import EngineArgs
from fastdeploy.engine.engine_core import EngineCore
from fastdeploy.engine.executor import InProcessExecutor
from fastdeploy.model_executor.model_loader import get_tokenizer
from fastdeploy.output.detokenizer import TokenTexts
from fastdeploy.output.output_processor import CompletionOutput, RequestOutputState

# One prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": [...]}.
Prompt = str | list[int] | dict[str, Any]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class LLM:
    """`LLM()` loads the embedded SmolLM2-135M-Instruct; `LLM(path)` a GGUF file or HF directory.

    `tokenizer=` names a tokenizer directory or GGUF file for weights that come without one.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.config = self.engine_args.create_engine_config()
        self.tokenizer = get_tokenizer(model, self.config.tokenizer)
        self.token_texts = TokenTexts(self.tokenizer)
        self.engine = EngineCore(self.config, InProcessExecutor(self.config))
        self._request_ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | list[int] | Sequence[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """`prompts`: one prompt or a list of them; a prompt is a string, a list of token ids,
        or a dict `{"prompt": str}` / `{"prompt_token_ids": [int, ...]}` as vLLM takes them."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]
        else:
            batch = list(cast(Sequence[Prompt], prompts))
        texts: list[str | None] = []
        token_lists: list[list[int]] = []
        for i, prompt in enumerate(batch):
            text, tokens = self._prompt(prompt, i)
            texts.append(text)
            token_lists.append(tokens)
        return self._run(texts, token_lists, sampling_params, use_tqdm)

    def _prompt(self, prompt: object, index: int) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt; anything else is a TypeError that says what is taken."""
        if isinstance(prompt, dict):
            if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
                prompt = prompt["prompt"]
            elif set(prompt) == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
            else:
                raise TypeError(f"prompt {index}: a dict prompt has exactly one key, 'prompt' (a string) or "
                                f"'prompt_token_ids' (a list of ints); got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            return prompt, encode_ids(self.tokenizer, prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"prompt {index}: expected a string, a list of token ids or a dict with 'prompt' or "
                        f"'prompt_token_ids'; got {type(prompt).__name__}")

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = cast(list[list[dict]], [messages] if messages and isinstance(messages[0], dict) else messages)
        texts = [cast(str, self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True))
                 for c in conversations]
        token_lists = [encode_ids(self.tokenizer, t) for t in texts]
        return self._run(texts, token_lists, sampling_params, use_tqdm)

    def _run(self, texts: Sequence[str | None], token_lists: list[list[int]],
             sampling_params: SamplingParams | list[SamplingParams] | None, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(token_lists)
        results: list[RequestOutput] = []
        states: dict[str, tuple[RequestOutputState, CompletionOutput]] = {}
        requests = []
        for text, tokens, params in zip(texts, token_lists, params_list, strict=True):
            params.validate(self.config.max_logprobs)
            request_id = str(next(self._request_ids))
            outputs = [CompletionOutput(index=i) for i in range(params.n)]
            results.append(RequestOutput(request_id, text, tokens, outputs))
            for i, output in enumerate(outputs):
                child = params.for_choice(i)
                engine_request = EngineRequest(f"{request_id}-{i}", tokens, child, time.time())
                self.engine.validate(engine_request)
                requests.append(engine_request)
                states[engine_request.request_id] = (
                    RequestOutputState(child, self.tokenizer, self.token_texts), output)
        for request in requests:
            self.engine.add_request(request)
        progress = tqdm(total=len(requests), disable=not use_tqdm, desc="generating")
        while self.engine.has_work():
            deltas = self.engine.step()
            if not deltas and self.engine.num_running == 0 and self.engine.waiting_for_grammar:
                time.sleep(0.005)  # only grammar compiles are in flight
            for delta in deltas:
                state, output = states[delta.request_id]
                chunk = state.update(delta)
                output.add(chunk)
                if chunk.finish_reason is not None:
                    progress.update(1)
                    if delta.finish_reason is None:  # a stop string ended it on this side
                        self.engine.abort([delta.request_id])
        progress.close()
        return results

