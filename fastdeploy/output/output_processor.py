"""Per-request output state on the caller's side: text, stop strings, logprob entries, masks."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from transformers import PreTrainedTokenizerBase

from fastdeploy.common.request import RequestDelta
from fastdeploy.common.sampling_masks import LOGZ_BYTES, SampledMasks, SamplingBitmaps, concat_masks, logz_values
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.output.detokenizer import IncrementalDetokenizer, TokenTexts


# Structs the cyclic collector does not track (`gc=False`; they hold no cycles): a long
# generation with logprobs keeps k + 1 of them per token, and as tracked objects they made the
# collector run more often and walk them all in every full pass.
class TopLogprob(msgspec.Struct, gc=False):
    token_id: int
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob, gc=False):
    top_logprobs: list[TopLogprob] = []


@dataclass
class OutputChunk:
    """What a request gained from one engine delta, ready to format or accumulate."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    sampling_masks: SampledMasks | None  # CSR ids or bitmaps; lists only when a response is written
    sampling_logz: list[float] | None
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None
    error_status: int
    num_prompt_tokens: int


@dataclass
class CompletionOutput:
    """One whole sample, accumulated from its chunks (offline results, non-streaming responses).

    `sampling_mask` is the public form, built from the chunks on first read: one sorted id
    list per token, or with `sampling_mask_format="bitmap"` one bitmap (bytes, ceil(V/8) of
    them, least significant bit first); None for a token without truncation.
    `sampling_masks` is the same as one run (CSR or bitmaps).
    """

    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    sampling_logz: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_status: int = 500
    # Chunks are joined once when read, not at every step: joining per step copies a
    # long generation's ids over and over.
    _mask_runs: list[SampledMasks] | None = field(default=None, init=False, repr=False)
    _mask_lists: list[list[int] | None] | list[bytes | None] | None = field(default=None, init=False, repr=False)
    # The text's pieces, joined when read: `text += piece` copies the whole text per step, which
    # at tens of thousands of tokens costs more host time per token than the rest of the chunk.
    _text_parts: list[str] = field(default_factory=list, init=False, repr=False)

    @property
    def text(self) -> str:
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    def add(self, chunk: OutputChunk) -> None:
        if chunk.text:
            self._text_parts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        # Lists grown in place: rebuilding one per chunk copies everything gathered before.
        if chunk.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(chunk.logprobs)
        if chunk.sampling_masks is not None:
            self._keep_masks(chunk.sampling_masks)
            if self.sampling_logz is None:
                self.sampling_logz = []
            self.sampling_logz.extend(chunk.sampling_logz or [])
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason
            self.error, self.error_status = chunk.error, chunk.error_status

    def _keep_masks(self, masks: SampledMasks) -> None:
        """Keep one chunk's masks (a copy: the chunk's are views of a step's frame)."""
        if self._mask_runs is None:
            self._mask_runs = []
        self._mask_runs.append(masks.owned())
        self._mask_lists = None

    @property
    def sampling_masks(self) -> SampledMasks | None:
        if self._mask_runs is None:
            return None
        if len(self._mask_runs) != 1:
            self._mask_runs = [concat_masks(self._mask_runs)]
        return self._mask_runs[0]

    @property
    def sampling_mask(self) -> list[list[int] | None] | list[bytes | None] | None:
        masks = self.sampling_masks
        if masks is None:
            return None
        if self._mask_lists is None:
            self._mask_lists = masks.rows() if isinstance(masks, SamplingBitmaps) else masks.to_lists()
        return self._mask_lists


class RequestOutputState:
    """Turns one sequence's engine deltas into text chunks, applying stop strings.

    With stop strings, up to (longest stop - 1) characters are held back until it is
    clear they do not start a stop string, so a stream never emits text it must retract.
    """

    def __init__(self, params: SamplingParams, tokenizer: PreTrainedTokenizerBase, token_texts: TokenTexts) -> None:
        self.params = params
        self.token_texts = token_texts
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        # The decoded text from character `_base` on: what is not handed out yet and the last
        # characters a stop string that ends in the next delta may start in. The whole text,
        # grown per delta, would be copied at every step (quadratic in a long generation's length).
        self._tail = ""
        self._base = 0
        self.emitted = 0  # characters of the decoded text already handed out
        self.finished = False
        # Up to (longest stop - 1) characters are held back from what is handed out.
        self._longest_stop = max((len(s) for s in params.stop), default=1)

    def _logprob_entries(self, delta: RequestDelta) -> list[TokenLogprob] | None:
        if self.params.logprobs is None or delta.logprobs is None or delta.logprob_token_ids is None:
            return None
        k = self.params.logprobs
        texts = self.token_texts
        entries = []
        for ids, values in zip(delta.logprob_token_ids, delta.logprobs, strict=True):
            top = [TopLogprob(t, texts.text(t), v, texts.raw_bytes(t))
                   for t, v in zip(ids[1:k + 1], values[1:k + 1], strict=True)]
            entries.append(TokenLogprob(ids[0], texts.text(ids[0]), values[0], texts.raw_bytes(ids[0]), top))
        return entries

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        """The first stop string that ends after `search_from` (an index into the decoded text)."""
        best = None
        for stop in self.params.stop:
            index = self._tail.find(stop, max(0, search_from - len(stop) + 1 - self._base))
            if index != -1 and (best is None or index + self._base < best[0]):
                best = (index + self._base, stop)
        return best

    def update(self, delta: RequestDelta) -> OutputChunk:
        finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
        search_from = self._base + len(self._tail)
        hit = None
        if self.params.stop:
            # Token by token: a stop string inside a multi-token (speculative) delta also
            # drops the tokens after the one that completed it.
            for n, token in enumerate(delta.token_ids, start=1):
                self._tail += self.detokenizer.add([token])
                hit = self._find_stop(search_from)
                if hit is not None:
                    if n < len(delta.token_ids):
                        delta = _first_tokens(delta, n)
                    break
        else:
            self._tail += self.detokenizer.add(delta.token_ids)
        end = self._base + len(self._tail)
        if hit is not None:
            index, stop = hit
            end = index + len(stop) if self.params.include_stop_str_in_output else index
            self._tail = self._tail[:end - self._base]
            finish_reason, stop_reason = "stop", stop
        elif finish_reason is None:
            end = max(self.emitted, end - self._longest_stop + 1)
        text = self._tail[self.emitted - self._base:end - self._base]
        self.emitted = end
        # Keep what the next delta may still need: the text not handed out, and the last
        # characters a stop string completed by the next delta may begin in.
        keep_from = min(self.emitted, self._base + len(self._tail) - self._longest_stop + 1)
        if keep_from > self._base:
            self._tail = self._tail[keep_from - self._base:]
            self._base = keep_from
        self.finished = finish_reason is not None
        return OutputChunk(
            text=text,
            token_ids=delta.token_ids,
            logprobs=self._logprob_entries(delta),
            sampling_masks=delta.sampling_mask,
            sampling_logz=logz_values(delta.logz),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            error=delta.error,
            error_status=delta.error_status,
            num_prompt_tokens=delta.num_prompt_tokens,
        )


def _first_tokens(delta: RequestDelta, n: int) -> RequestDelta:
    """The delta cut to its first n tokens (every per-token field alike)."""
    def cut(values: list | None) -> list | None:
        return None if values is None else values[:n]

    return msgspec.structs.replace(
        delta, token_ids=delta.token_ids[:n], logprobs=cut(delta.logprobs),
        logprob_token_ids=cut(delta.logprob_token_ids), ranks=cut(delta.ranks),
        sampling_mask=None if delta.sampling_mask is None else delta.sampling_mask.head(n),
        logz=None if delta.logz is None else delta.logz[:LOGZ_BYTES * n])
