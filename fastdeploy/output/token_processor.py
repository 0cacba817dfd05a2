"""Turns a worker frame into per-request deltas and decides which sequences finished."""

from __future__ import annotations

from fastdeploy.engine.request import RequestDelta
from fastdeploy.output.step_frame import FrameBuffer, split_by_sequence, unpack_step_frame
from fastdeploy.scheduler.sequence import Sequence


class TokenProcessor:
    def __init__(self, eos_token_ids: list[int], max_model_len: int) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        params = seq.params
        if token in params.stop_token_ids:
            return "stop", token
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def process(self, frame_bytes: FrameBuffer, sequences: dict[int, Sequence],
                grammar_terminated: frozenset[int] = frozenset()) -> list[tuple[Sequence, RequestDelta]]:
        """Append accepted tokens to their sequences; return one delta per sequence in the frame.

        Tokens after a finishing token within one step (speculative runs) are dropped.
        A sequence whose grammar completed this step finishes with "stop".
        """
        results = []
        for part in split_by_sequence(unpack_step_frame(frame_bytes)):
            seq = sequences.get(part.seq_id)
            if seq is None:  # aborted while the step ran
                continue
            finish_reason = stop_reason = None
            kept = 0
            for token in part.token_ids:
                seq.output_token_ids.append(token)
                kept += 1
                finish_reason, stop_reason = self._finish_reason(seq, token)
                if finish_reason:
                    break
            if finish_reason is None and part.seq_id in grammar_terminated:
                finish_reason = "stop"
            # Rows that opted out travel as empty CSR rows; they must not read as "null".
            wants_mask = seq.return_sampling_mask and part.sampling_mask is not None
            delta = RequestDelta(
                request_id=seq.request_id,
                token_ids=part.token_ids[:kept],
                logprobs=part.logprobs[:kept] if part.logprobs is not None else None,
                logprob_token_ids=part.logprob_token_ids[:kept] if part.logprob_token_ids is not None else None,
                ranks=part.ranks[:kept] if part.ranks is not None else None,
                sampling_mask=part.sampling_mask.head(kept) if wants_mask else None,
                logz=part.logz[:kept] if wants_mask else None,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                num_prompt_tokens=len(seq.prompt_token_ids),
            )
            results.append((seq, delta))
        return results
