"""The sampling masks of a run of tokens, kept as int32 CSR from the worker's frame to the API layer.

A token's kept set can hold thousands of vocabulary ids, and every generated token has one.
Turning them into Python lists per step in the engine costs far more than computing them,
so they travel as two little-endian int32 byte buffers (msgpack carries each as one binary
blob) and become lists only where a response is written. A step's runs are views of the
worker's frame, not copies of it, and a decoded message's runs are views of the message.
Whoever keeps a run past the step (a whole response being accumulated) takes its own copy
with `owned()`, so no frame stays alive for one request's sake.

In the engine the small buffers (a run's offsets, a delta's logZ) are bytes cut from one
copy per step, and a run's ids are a flat uint8 numpy view of the frame; decoded buffers
are memoryviews (format "B"). All are byte buffers with the same length and slicing, so
every method takes any of them. The engine avoids memoryviews and lists because the garbage
collector tracks them and tracks neither bytes nor numpy arrays: with two memoryviews and a
logZ list per masked delta, 64 steps at batch 256 whose deltas stay alive (as a server's do
until written) ran 141 young collections with masks against 71 without
(`benchmarks/mask_gc.py --hold`); now 70. A delta's logZ is float32 bytes (`logz_values`
gives the floats). `encode_buffers` is the encoders' hook that sends the numpy views as
msgpack binary.

Row i holds `ids[offsets[i]:offsets[i + 1]]`; `offsets[0] == 0`. An empty row means null
(the whole vocabulary): a kept set is never empty, a greedy row holds its argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, TypeAlias, cast

import msgspec
import numpy as np

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
LOGZ_BYTES = _F32.itemsize  # per token in a logZ buffer


if TYPE_CHECKING:
    ByteBuffer: TypeAlias = bytes | memoryview
    IdsBuffer: TypeAlias = bytes | memoryview | np.ndarray  # the engine's: numpy views of the frame
else:
    ByteBuffer = IdsBuffer = memoryview  # what msgspec decodes the fields to

_EMPTY_OFFSETS = np.zeros(1, dtype=_I32).tobytes()
_NO_IDS = b""


def logz_buffer(logz: np.ndarray) -> bytes:
    """The float32 LE bytes of a step's logZ, which deltas slice (4 bytes per token)."""
    return np.ascontiguousarray(logz, dtype=_F32).tobytes()


def logz_values(buf: ByteBuffer | None) -> list[float] | None:
    """The floats of a delta's logZ buffer (None stays None)."""
    return None if buf is None else np.frombuffer(buf, dtype=_F32).tolist()


def encode_buffers(obj: object) -> memoryview:
    """msgspec `enc_hook`: a run's numpy view of its ids goes out as msgpack binary."""
    if isinstance(obj, np.ndarray):
        return memoryview(obj)  # type: ignore[arg-type]  # numpy declares __buffer__ for Python >= 3.12 only
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


class SamplingMasks(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="ids"):
    # gc=False: the engine builds one per masked delta per step, and as tracked objects they
    # doubled the garbage collector's passes over a masked run (116 vs 59 young collections
    # in 64 steps at batch 256). They hold only byte buffers, which never refer back to them,
    # so they cannot close a reference cycle.
    # Declared as memoryview, the type they decode to; the engine's are bytes / numpy (above).
    offsets: ByteBuffer = _EMPTY_OFFSETS  # int32 LE [n + 1], offsets[0] == 0
    ids: IdsBuffer = _NO_IDS  # int32 LE [offsets[n]], each row's ids sorted

    @classmethod
    def from_lists(cls, masks: Sequence[Sequence[int] | None]) -> SamplingMasks:
        """The CSR of the public form; None (null) becomes an empty row."""
        lengths = np.fromiter((0 if m is None else len(m) for m in masks), dtype=np.int64, count=len(masks))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(_I32)
        ids = [i for m in masks if m for i in m]
        return cls(offsets.tobytes(), np.asarray(ids, dtype=_I32).tobytes())

    def owned(self) -> SamplingMasks:
        """The same rows in buffers of their own (one copy), holding no frame or message alive."""
        return SamplingMasks(bytes(self.offsets), bytes(self.ids))

    def __eq__(self, other: object) -> bool:
        """Same rows: compares the buffers' bytes (numpy's == would compare element-wise)."""
        if not isinstance(other, SamplingMasks):
            return NotImplemented
        return (np.array_equal(np.frombuffer(self.offsets, np.uint8), np.frombuffer(other.offsets, np.uint8))
                and np.array_equal(np.frombuffer(self.ids, np.uint8), np.frombuffer(other.ids, np.uint8)))

    def offsets_array(self) -> np.ndarray:
        return np.frombuffer(self.offsets, dtype=_I32)

    def ids_array(self) -> np.ndarray:
        return np.frombuffer(self.ids, dtype=_I32)

    def __len__(self) -> int:
        """Number of tokens (rows)."""
        return len(self.offsets) // _I32.itemsize - 1

    @property
    def num_ids(self) -> int:
        return len(self.ids) // _I32.itemsize

    def row_lengths(self) -> np.ndarray:
        """Ids kept per token; 0 for a null row."""
        return np.diff(self.offsets_array())

    def head(self, n: int) -> SamplingMasks:
        """The first n >= 0 rows (all of them when n >= len)."""
        if n >= len(self):
            return self
        end = int(self.offsets_array()[n])
        return SamplingMasks(self.offsets[:(n + 1) * _I32.itemsize], self.ids[:end * _I32.itemsize])

    def id_rows(self) -> list[np.ndarray | None]:
        """One int32 numpy view of the ids per token, None for a null row: what a JSON encoder
        that writes numpy arrays (orjson) takes without a Python int per id."""
        offsets = self.offsets_array().tolist()
        ids = self.ids_array()
        return [ids[a:b] if b > a else None for a, b in pairwise(offsets)]

    def to_lists(self) -> list[list[int] | None]:
        """The public form: one sorted id list per token, None for a null row.

        One `.tolist()` per row on numpy slices: the fastest of the numpy ways measured
        (np.split, one big .tolist() sliced in Python) at 64 tokens x 4,500 ids."""
        offsets = self.offsets_array().tolist()
        ids = self.ids_array()
        return [ids[a:b].tolist() if b > a else None for a, b in pairwise(offsets)]


def concat_masks(runs: Sequence[SamplingMasks | SamplingBitmaps]) -> SamplingMasks | SamplingBitmaps:
    """The runs one after the other, as one run: one copy of the ids, offsets rebased."""
    if len(runs) == 1:
        return runs[0]
    if not runs:
        return SamplingMasks()
    if isinstance(runs[0], SamplingBitmaps):
        return concat_bitmaps(cast(Sequence[SamplingBitmaps], runs))
    masks = cast(Sequence[SamplingMasks], runs)  # the runs of one delta share its format
    parts = [masks[0].offsets_array()]
    base = int(parts[0][-1])
    for run in masks[1:]:
        offsets = run.offsets_array()
        parts.append(offsets[1:] + base)
        base += int(offsets[-1])
    ids = b"".join(r.ids for r in masks)  # type: ignore[misc]  # numpy declares __buffer__ for Python >= 3.12 only
    return SamplingMasks(np.concatenate(parts).astype(_I32, copy=False).tobytes(), ids)


def split_runs(offsets: np.ndarray, ids: np.ndarray, counts: Sequence[int]) -> list[SamplingMasks]:
    """A CSR (a frame's views; `offsets` need not start at 0) cut into consecutive runs of
    `counts[b]` rows, each rebased to its own start.

    The offsets of every run are rebased in one numpy pass into one new table; each run's
    ids are a view of `ids`, not a copy: a step at batch 256 can carry 100 MB of ids."""
    counts64 = np.asarray(counts, dtype=np.int64)
    starts = np.cumsum(counts64) - counts64  # first row of each run
    entries = counts64 + 1  # offsets entries per run
    first_entry = np.cumsum(entries) - entries
    rows = np.repeat(starts - first_entry, entries) + np.arange(int(entries.sum()), dtype=np.int64)
    offsets64 = offsets.astype(np.int64)
    table = (offsets64[rows] - np.repeat(offsets64[starts], entries)).astype(_I32).tobytes()
    id_bytes = np.ascontiguousarray(ids, dtype=_I32).reshape(-1).view(np.uint8)
    # Byte bounds of every run's table entries and ids, computed in numpy: the loop only slices.
    size = _I32.itemsize
    ends = starts + counts64
    bounds = zip((first_entry * size).tolist(), ((first_entry + entries) * size).tolist(),
                 (offsets64[starts] * size).tolist(), (offsets64[ends] * size).tolist(), strict=True)
    return [SamplingMasks(table[e0:e1], id_bytes[i0:i1]) for e0, e1, i0, i1 in bounds]


def bitmap_width(vocab_size: int) -> int:
    """Bytes in one token's bitmap: ceil(V / 8)."""
    return (vocab_size + 7) // 8


class SamplingBitmaps(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="bitmap"):
    """The sampling masks of a run of tokens as bitmaps over the vocabulary: the wire form of
    `sampling_mask_format: "bitmap"`.

    Token i's kept set is the bitmap `bits[j * width:(j + 1) * width]`, j the number of
    non-null rows before it, where id v is kept iff bit (v % 8) of byte (v // 8) is set,
    least significant bit first; a row whose `present` byte is 0 is null (the whole
    vocabulary). A token costs `width` = ceil(V/8) bytes whatever its kept set's size, where
    ids cost 4 bytes per kept id: bitmaps are smaller once a set holds more than V/32 ids.
    """

    width: int = 0  # bytes per bitmap row
    present: ByteBuffer = _NO_IDS  # uint8 [n]: 1 = a bitmap row, 0 = null
    bits: IdsBuffer = _NO_IDS  # uint8 [width * sum(present)]; the engine's: a flat numpy view

    def __len__(self) -> int:
        return len(self.present)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingBitmaps):
            return NotImplemented
        return (self.width == other.width and bytes(self.present) == bytes(other.present)
                and bytes(self.bits) == bytes(other.bits))

    def owned(self) -> SamplingBitmaps:
        return SamplingBitmaps(self.width, bytes(self.present), bytes(self.bits))

    def head(self, n: int) -> SamplingBitmaps:
        """The first n >= 0 rows (all of them when n >= len)."""
        if n >= len(self):
            return self
        rows = int(np.count_nonzero(np.frombuffer(self.present, np.uint8, count=n)))
        return SamplingBitmaps(self.width, self.present[:n], self.bits[:rows * self.width])

    def rows(self) -> list[bytes | None]:
        """One bitmap (bytes) per token, None for a null row."""
        present = np.frombuffer(self.present, np.uint8).tolist()
        bits = bytes(self.bits)
        out: list[bytes | None] = []
        start = 0
        for flag in present:
            if flag:
                out.append(bits[start:start + self.width])
                start += self.width
            else:
                out.append(None)
        return out


def bitmap_rows(rows: np.ndarray, present: np.ndarray | None = None) -> SamplingBitmaps:
    """uint8 [n, width] bitmaps, one per token, all zero for a null row (a kept set is never
    empty), as a run: the worker's form (`StepOutput.mask_bits`) to the wire's.

    `present` (bool [n], from `rows_present`) spares the pass over the rows. When every row
    is a bitmap, as in a truncated step, the run's bits are a flat view of `rows` (the engine
    sends them as msgpack binary through `encode_buffers`), not a copy."""
    if present is None:
        present = rows_present(rows)
    if present.all():
        return SamplingBitmaps(rows.shape[1], _ones(len(present)), np.ascontiguousarray(rows).reshape(-1))
    return SamplingBitmaps(rows.shape[1], present.astype(np.uint8).tobytes(), rows[present].tobytes())


def rows_present(bits: np.ndarray) -> np.ndarray:
    """bool [...]: whether each bitmap (the last axis of `bits`) has a bit set; a null row has
    none. One pass over a step's bitmaps, read 8 bytes at a time where the width allows."""
    width = bits.shape[-1]
    flat = bits.reshape(-1, width)
    if width % 8 == 0 and flat.flags.c_contiguous:
        flat = flat.view(np.uint64)
    return np.asarray(flat.any(axis=1)).reshape(bits.shape[:-1])


_ONES = b"\x01" * 64


def _ones(n: int) -> bytes:
    return _ONES[:n] if n <= len(_ONES) else b"\x01" * n


def byte_view(data: IdsBuffer) -> memoryview:
    """A buffer field (bytes, a decoded memoryview or the engine's contiguous numpy view) as a
    flat memoryview of its bytes, without a copy."""
    view = data.data if isinstance(data, np.ndarray) else memoryview(data)
    return view.cast("B")


def concat_bitmaps(runs: Sequence[SamplingBitmaps]) -> SamplingBitmaps:
    return SamplingBitmaps(runs[0].width, b"".join(r.present for r in runs),
                           b"".join(byte_view(r.bits) for r in runs))


SampledMasks = SamplingMasks | SamplingBitmaps  # a delta's masks in either wire format

