"""A GGUF file's metadata and tensor locations, read in one pass over its header.

`gguf.GGUFReader` builds a numpy view per part of every metadata value, which for a
vocabulary of 49k strings and as many merges takes 5 s, paid by every process that loads
the model. This reader decodes values straight from the header bytes (0.25 s for the embedded
model) and maps each tensor's data like GGUFReader does: F32/F16/F64/I8-I64 as typed arrays in
numpy order, every other type as uint8 bytes whose last axis holds one row's blocks.
Files it does not read (a version before 2, big-endian) go to GGUFReader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY_OF = {t: np.dtype(f) for t, f in _SCALARS.items()}
_TYPED_TENSORS = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the row length first
    data: np.ndarray  # read-only map of the file


@dataclass
class GGUFFile:
    metadata: dict[str, Any]  # key -> value (arrays as lists)
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item = GGUFValueType(self.unpack("<I"))
            count = self.unpack("<Q")
            if item in _NUMPY_OF:  # one read for the whole array
                dtype = _NUMPY_OF[item]
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return values.tolist()
            return [self.value(item) for _ in range(count)]
        return self.unpack(_SCALARS[kind])


def read_gguf(path: str) -> GGUFFile:
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped.data))
    if bytes(mapped[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):  # version 1's counts are 32-bit; a byte-swapped version is a big-endian file
        return _with_gguf_reader(path)
    num_tensors, num_kv = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata = {}
    for _ in range(num_kv):
        key = cursor.string()
        metadata[key] = cursor.value(GGUFValueType(cursor.unpack("<I")))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
        infos.append((name, GGMLQuantizationType(cursor.unpack("<I")), dims, cursor.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, kind, dims, offset in infos:
        tensors.append(GGUFTensor(name, kind, dims, _tensor_data(mapped, data_start + offset, kind, dims)))
    if len({t.name for t in tensors}) != len(tensors):
        raise ValueError(f"{path} holds two tensors of one name")
    return GGUFFile(metadata, tensors)


def _tensor_data(mapped: np.ndarray, start: int, kind: GGMLQuantizationType, dims: tuple[int, ...]) -> np.ndarray:
    shape = tuple(reversed(dims))  # numpy order: rows first
    n = int(np.prod(dims))
    if kind in _TYPED_TENSORS:
        dtype = np.dtype(_TYPED_TENSORS[kind])
        return mapped[start:start + n * dtype.itemsize].view(dtype).reshape(shape)
    block, block_bytes = GGML_QUANT_SIZES[kind]
    row_bytes = shape[-1] // block * block_bytes
    return mapped[start:start + n // block * block_bytes].reshape(*shape[:-1], row_bytes)


def _with_gguf_reader(path: str) -> GGUFFile:
    reader = gguf.GGUFReader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = [GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data) for t in reader.tensors]
    return GGUFFile(metadata, tensors)
