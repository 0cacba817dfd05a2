"""OpenAI request bodies (pydantic, validated by FastAPI) and their mapping to SamplingParams."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fastdeploy.common.sampling_params import ParameterError, SamplingParams
from fastdeploy.entrypoints.openai.guided_request import guided_spec_from_request
from fastdeploy.entrypoints.openai.request_limits import (
    Choices,
    Count,
    LogitBias,
    LogprobCount,
    Metadata,
    PromptTexts,
    PromptTokenLists,
    Seed,
    StopString,
    StopStrings,
    StopTokenIds,
    TokenIds,
    TopK,
)

GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structural_tag")
# OpenAI fields taken only at a value that asks for nothing (no tools, text output; "auto" picks
# among no tools); any other value asks for what this server does not do, and is refused like an
# unknown field.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "tools": ([], None), "functions": ([], None), "tool_choice": ("none", "auto", None),
    "function_call": ("none", None), "modalities": (["text"], None),
}
# The same for a chat message: `tool_call_id` ties a tool result to its call (bookkeeping); an
# assistant turn's tool calls, refusal or audio would be dropped by the chat template unseen, so
# they are taken only empty.
MESSAGE_IGNORED_FIELDS = frozenset({"tool_call_id"})
MESSAGE_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "tool_calls": ([], None), "function_call": (None,), "refusal": (None,), "audio": (None,),
}
# Every object of a request: JSON types as they are (no "2" for 2, true for 1 or "yes" for true: a
# client sending them has a bug that a coercion would hide), no NaN or Infinity (1e999 is valid JSON
# and no parameter means anything by it), and no key this server does not know (refused naming it,
# never silently ignored).
STRICT_JSON = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def drop_inert(data: Any, known: Iterable[str], neutral: dict[str, tuple[Any, ...]],
               ignored: frozenset[str] = frozenset()) -> Any:
    """`data` without the keys that ask nothing of the server: `neutral` ones at a value that asks
    for nothing, and `ignored` ones whatever their value. A key the model declares (`known`) is
    always kept."""
    if not isinstance(data, dict):
        return data
    known = set(known)

    def inert(key: str, value: Any) -> bool:
        return key in ignored or (key in neutral and value in neutral[key])

    return {key: value for key, value in data.items() if key in known or not inert(key, value)}


class StreamOptions(BaseModel):
    model_config = STRICT_JSON
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = STRICT_JSON
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def text_only(cls, data: Any) -> Any:
        # Image, audio and file parts would make the server fetch or read what the URL names.
        if isinstance(data, dict) and data.get("type") != "text":
            raise ValueError(f"content parts of type {data.get('type')!r} are not supported: this server takes "
                             "text only and fetches no URLs or files")
        return data


class ChatMessage(BaseModel):
    model_config = STRICT_JSON
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def drop_inert_fields(cls, data: Any) -> Any:
        """Drop the message fields that ask nothing of this server (see MESSAGE_NEUTRAL_VALUES)."""
        return drop_inert(data, cls.model_fields, MESSAGE_NEUTRAL_VALUES, MESSAGE_IGNORED_FIELDS)

    def template_fields(self) -> dict[str, str]:
        """The message as the chat template takes it (a template that knows `name` shows it)."""
        fields = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            fields["name"] = self.name
        return fields

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class Prediction(BaseModel):
    """OpenAI's predicted output (a hint for its own speculative decoding)."""

    model_config = STRICT_JSON
    type: Literal["content"]
    content: str | list[TextPart]


class CommonRequest(BaseModel):
    """Fields shared by chat and completions, including the extra sampling fields."""

    # A field this server does not implement is refused (a 400 naming it), never silently ignored.
    model_config = STRICT_JSON
    model: str | None = None
    n: Choices = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Seed | None = None
    stop: StopString | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    logit_bias: LogitBias | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_sampling_mask: bool | None = None
    # "ids": sorted id lists; "bitmap": base64 of ceil(V/8) bytes per token; None: the server's default.
    sampling_mask_format: Literal["ids", "bitmap"] | None = None
    # OpenAI's bookkeeping and hints: they ask nothing of the output and are not used. Typed as
    # OpenAI types them, so a client's wrong type is the 400 it would be there.
    user: str | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prediction: Prediction | None = None
    parallel_tool_calls: bool | None = None
    # Structured output; at most one form per request.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    # JSON output without whitespace outside strings; None: the server's default.
    disable_any_whitespace: bool | None = None
    # Accept a grammar looser than the schema where no backend enforces all of it (else a 400).
    guided_best_effort: bool = False

    @model_validator(mode="before")
    @classmethod
    def drop_inert_fields(cls, data: Any) -> Any:
        """Drop the OpenAI fields that ask nothing of this server (see NEUTRAL_VALUES)."""
        return drop_inert(data, cls.model_fields, NEUTRAL_VALUES)

    def guided_field(self) -> str | None:
        """The structured-output field this request used, for naming it in errors."""
        for name in GUIDED_FIELDS:
            value = getattr(self, name)
            if value is not None and not (name == "response_format" and value.get("type") == "text"):
                return name
        return None

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def _max_tokens(self) -> int | None:
        raise NotImplementedError

    def to_sampling_params(self) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            # As OpenAI: the options of a stream asked for without one would be ignored.
            raise ParameterError("stream_options is only allowed when stream is true", "stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logit_bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                logit_bias[int(key)] = float(value)
            except ValueError:
                raise ParameterError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        return SamplingParams(
            n=self.n,
            max_tokens=self._max_tokens(),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            seed=self.seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logit_bias=logit_bias,
            logprobs=self._num_logprobs(),
            return_sampling_mask=self.return_sampling_mask,
            sampling_mask_format=self.sampling_mask_format,
            skip_special_tokens=self.skip_special_tokens,
            guided=guided_spec_from_request(
                {f: getattr(self, f) for f in GUIDED_FIELDS if getattr(self, f) is not None},
                disable_any_whitespace=self.disable_any_whitespace, best_effort=self.guided_best_effort),
        )


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None

    def _num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ParameterError("top_logprobs needs logprobs to be true", "top_logprobs")
            return None
        return self.top_logprobs or 0

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(CommonRequest):
    prompt: str | PromptTexts | TokenIds | PromptTokenLists
    max_tokens: Count | None = 16
    logprobs: LogprobCount | None = None
    # Taken only false: the completion comes without its prompt (and the engine keeps no prompt logprobs).
    echo: bool = False
    best_of: Choices | None = None

    @field_validator("echo")
    @classmethod
    def no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("`echo: true` is not supported: this server returns the completion without its prompt")
        return echo

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ParameterError("the prompt is empty", "prompt")
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)
