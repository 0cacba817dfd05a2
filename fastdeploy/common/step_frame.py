"""The packed step output: one binary frame per worker step, and its codec.

Layout, little-endian, every array padded to 8 bytes:

    meta        int64[8]   [message_id, flag | (k << 8), B, N, M, 0, 0, 0]
    seq_ids     int64[B]   engine sequence ids, the key of every row
    num_tokens  int32[B]   tokens accepted per sequence this step
    token_ids   int64[N]   accepted tokens, sequence after sequence
    -- if flag & HAS_LOGPROBS, with k the largest top_logprobs in the step:
    lp_ids      int64[N, k+1]   column 0 the accepted token, then the top-k
    lp_values   float32[N, k+1]
    ranks       int64[N]
    -- if flag & HAS_MASK:
    mask_offsets int32[N+1]  CSR over mask_ids; an empty row means null
    mask_ids     int32[M]
    logz         float32[N]

The Python functions here define the format; the packer ops must match them byte for byte.
`unpack_step_frame` is the one decoder, in the engine and in the worker alike: numpy views
of the buffer, no copy (measured faster than the C++ unpack op, whose dispatch and tensor
wrapping cost more than the views it saves).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy.common.sampling_masks import SamplingMasks, split_runs

# A packed frame: bytes, or a view of the pinned host buffer the packer op wrote (the worker
# hands that buffer on as it is rather than copying a step's output, masks included, once more).
FrameBuffer = bytes | memoryview

HAS_LOGPROBS = 1
HAS_MASK = 2
META_LEN = 8


@dataclass
class StepFrame:
    message_id: int
    seq_ids: np.ndarray  # int64 [B]
    num_tokens: np.ndarray  # int32 [B]
    token_ids: np.ndarray  # int64 [N]
    lp_ids: np.ndarray | None = None  # int64 [N, k+1]
    lp_values: np.ndarray | None = None  # float32 [N, k+1]
    ranks: np.ndarray | None = None  # int64 [N]
    mask_offsets: np.ndarray | None = None  # int32 [N+1]
    mask_ids: np.ndarray | None = None  # int32 [M]
    logz: np.ndarray | None = None  # float32 [N]

    @property
    def max_num_logprobs(self) -> int:
        return -1 if self.lp_ids is None else self.lp_ids.shape[1] - 1

    def logprob_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(lp_ids, lp_values, ranks), which a frame holds all of or none of."""
        if self.lp_ids is None:
            return None
        if self.lp_values is None or self.ranks is None:
            raise ValueError("lp_ids needs lp_values and ranks")
        return self.lp_ids, self.lp_values, self.ranks

    def mask_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(mask_offsets, mask_ids, logz), which a frame holds all of or none of."""
        if self.mask_offsets is None:
            return None
        if self.mask_ids is None or self.logz is None:
            raise ValueError("mask_offsets needs mask_ids and logz")
        return self.mask_offsets, self.mask_ids, self.logz


def _padded(array: np.ndarray) -> bytes:
    raw = array.tobytes()
    return raw + b"\0" * (-len(raw) % 8)


def pack_step_frame(frame: StepFrame) -> bytes:
    flag = 0
    k = 0
    logprobs, mask = frame.logprob_arrays(), frame.mask_arrays()
    if logprobs is not None:
        flag |= HAS_LOGPROBS
        k = logprobs[0].shape[1] - 1
    if mask is not None:
        flag |= HAS_MASK
    num_mask_ids = 0 if frame.mask_ids is None else len(frame.mask_ids)
    meta = np.zeros(META_LEN, dtype="<i8")
    meta[:5] = [frame.message_id, (flag & 0xFF) | (k << 8), len(frame.seq_ids), len(frame.token_ids), num_mask_ids]
    parts = [
        meta,
        frame.seq_ids.astype("<i8", copy=False),
        frame.num_tokens.astype("<i4", copy=False),
        frame.token_ids.astype("<i8", copy=False),
    ]
    if logprobs is not None:
        lp_ids, lp_values, ranks = logprobs
        parts += [lp_ids.astype("<i8", copy=False), lp_values.astype("<f4", copy=False),
                  ranks.astype("<i8", copy=False)]
    if mask is not None:
        mask_offsets, mask_ids, logz = mask
        parts += [mask_offsets.astype("<i4", copy=False), mask_ids.astype("<i4", copy=False),
                  logz.astype("<f4", copy=False)]
    return b"".join(_padded(np.ascontiguousarray(p)) for p in parts)


class _Reader:
    def __init__(self, buf: FrameBuffer) -> None:
        self.buf = memoryview(buf)
        self.offset = 0

    def take(self, dtype: str, count: int) -> np.ndarray:
        nbytes = np.dtype(dtype).itemsize * count
        if self.offset + nbytes > len(self.buf):
            raise ValueError("step frame is truncated")
        array = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.offset)
        self.offset += nbytes + (-nbytes % 8)
        return array


def unpack_step_frame(buf: FrameBuffer) -> StepFrame:
    reader = _Reader(buf)
    meta = reader.take("<i8", META_LEN)
    message_id, packed_flag, batch, num_tokens, num_mask_ids = (int(x) for x in meta[:5])
    flag, k = packed_flag & 0xFF, packed_flag >> 8
    frame = StepFrame(
        message_id=message_id,
        seq_ids=reader.take("<i8", batch),
        num_tokens=reader.take("<i4", batch),
        token_ids=reader.take("<i8", num_tokens),
    )
    if flag & HAS_LOGPROBS:
        frame.lp_ids = reader.take("<i8", num_tokens * (k + 1)).reshape(num_tokens, k + 1)
        frame.lp_values = reader.take("<f4", num_tokens * (k + 1)).reshape(num_tokens, k + 1)
        frame.ranks = reader.take("<i8", num_tokens)
    if flag & HAS_MASK:
        frame.mask_offsets = reader.take("<i4", num_tokens + 1)
        frame.mask_ids = reader.take("<i4", num_mask_ids)
        frame.logz = reader.take("<f4", num_tokens)
    return frame


@dataclass
class SeqStepResult:
    """One sequence's share of a frame, as Python lists (one .tolist() per array); the
    sampling masks stay CSR, as they can hold thousands of ids per token."""

    seq_id: int
    token_ids: list[int]
    logprobs: list[list[float]] | None
    logprob_token_ids: list[list[int]] | None
    ranks: list[int] | None
    sampling_mask: SamplingMasks | None
    logz: list[float] | None


def split_by_sequence(frame: StepFrame, with_masks: bool = True) -> list[SeqStepResult]:
    """One result per sequence of the frame; without `with_masks` the sampling masks and logZ
    are left None (and the frame's mask ids are not read)."""
    seq_ids = frame.seq_ids.tolist()
    counts = frame.num_tokens.tolist()
    tokens = frame.token_ids.tolist()
    lp_ids = frame.lp_ids.tolist() if frame.lp_ids is not None else None
    lp_values = frame.lp_values.tolist() if frame.lp_values is not None else None
    ranks = frame.ranks.tolist() if frame.ranks is not None else None
    masks: list[SamplingMasks] | None = None
    logz = None
    mask = frame.mask_arrays() if with_masks else None
    if mask is not None:
        masks = split_runs(mask[0], mask[1], counts)
        logz = mask[2].tolist()
    results = []
    start = 0
    for b, (seq_id, count) in enumerate(zip(seq_ids, counts, strict=True)):
        end = start + count
        results.append(
            SeqStepResult(
                seq_id=seq_id,
                token_ids=tokens[start:end],
                logprobs=lp_values[start:end] if lp_values is not None else None,
                logprob_token_ids=lp_ids[start:end] if lp_ids is not None else None,
                ranks=ranks[start:end] if ranks is not None else None,
                sampling_mask=masks[b] if masks is not None else None,
                logz=logz[start:end] if logz is not None else None,
            )
        )
        start = end
    return results


def shorten_step_frame(frame: StepFrame, num_tokens: list[int]) -> StepFrame:
    """The frame keeping only the first `num_tokens[b]` (<= frame.num_tokens[b]) tokens of each
    sequence, on the host: how the worker ends a run its grammar completed or rejected after
    the device had already packed the step."""
    old = frame.num_tokens.astype(np.int64)
    new = np.asarray(num_tokens, dtype=np.int64)
    if new.shape != old.shape or (new < 0).any() or (new > old).any():
        raise ValueError("num_tokens must lie in 0..frame.num_tokens per sequence")
    starts = np.cumsum(old) - old
    rows = np.repeat(starts, new) + np.arange(int(new.sum()), dtype=np.int64) - np.repeat(np.cumsum(new) - new, new)
    out = StepFrame(frame.message_id, frame.seq_ids.copy(), new.astype(np.int32), frame.token_ids[rows])
    logprobs, mask = frame.logprob_arrays(), frame.mask_arrays()
    if logprobs is not None:
        out.lp_ids, out.lp_values, out.ranks = (a[rows] for a in logprobs)
    if mask is not None:
        mask_offsets, mask_ids, logz = mask
        offsets = mask_offsets.astype(np.int64)
        lengths = offsets[rows + 1] - offsets[rows]
        out.mask_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(out.mask_offsets[:-1], lengths)
        out.mask_ids = mask_ids[np.repeat(offsets[rows], lengths) + within]
        out.logz = logz[rows]
    return out
