"""read_gguf gives what gguf.GGUFReader gives: every metadata value, every tensor's name,
type, shape and data (typed arrays as typed arrays, other types as their row bytes)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from fastdeploy.model_executor.model_loader import embedded_model_path
from fastdeploy.model_executor.model_loader.gguf_file import read_gguf


def assert_same_as_gguf_reader(path: str) -> None:
    ours = read_gguf(path)
    reader = GGUFReader(path)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours.metadata[key] == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, ref in zip(ours.tensors, reader.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type and mine.shape == tuple(int(d) for d in ref.shape), mine.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data, ref.data), mine.name


def test_the_embedded_model():
    assert_same_as_gguf_reader(embedded_model_path())


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_several_tensor_types(tmp_path, alignment):
    path = str(tmp_path / "all.gguf")
    writer = GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "naïve 日本語 🎉")
    writer.add_string("t.empty", "")
    writer.add_array("t.strings", ["a", "", "ü", "x" * 1000])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.empty_array", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 3, 32)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.BF16):
        dense = rng.standard_normal((5, 96)).astype(np.float32)
        blocks = quants.quantize(dense, kind)
        writer.add_tensor(kind.name.lower(), blocks, raw_shape=blocks.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(path))
