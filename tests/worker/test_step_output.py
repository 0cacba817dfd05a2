"""A step's bitmaps cross from the worker to the engine as two message parts: their shape and
their bytes, the latter a view of the array itself (megabytes a step, not copied on the way out)."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from fastdeploy.worker.step_output import decode_mask_bits, encode_mask_bits


@pytest.mark.parametrize("shape", [(3, 2, 5), (1, 1, 0), (64, 1, 19008)])
def test_bitmaps_survive_a_real_socket_and_leave_without_a_copy(shape: tuple[int, int, int]):
    bits = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    parts = encode_mask_bits(bits)
    if bits.size:
        assert np.shares_memory(np.frombuffer(parts[1], dtype=np.uint8), bits)
    ctx = zmq.Context()
    try:
        sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        receiver.bind("inproc://bits")
        sender.connect("inproc://bits")
        sender.send_multipart([b"frame", *parts], copy=False)
        assert receiver.poll(5000), "the message did not arrive"
        _, shape_part, bits_part = receiver.recv_multipart()
        got = decode_mask_bits(shape_part, bits_part)
        assert got is not None and got.shape == bits.shape and np.array_equal(got, bits)
        sender.close(linger=0)
        receiver.close(linger=0)
    finally:
        ctx.term()


def test_no_bitmaps_and_strided_bitmaps():
    assert encode_mask_bits(None) == (b"", b"")
    assert decode_mask_bits(b"", b"") is None
    strided = np.arange(48, dtype=np.uint8).reshape(2, 4, 6)[:, ::2]
    got = decode_mask_bits(*(bytes(p) for p in encode_mask_bits(strided)))
    assert got is not None and np.array_equal(got, strided)
