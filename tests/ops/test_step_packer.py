"""The step packers against the Python reference, byte for byte.

`ReferencePacker` (numpy) defines the frame; `CpuOpPacker` (the C++ op) and `CudaOpPacker`
(`gpu` tests: each of its variants, and the ops behind them, the staged one included) must
produce the same bytes. The codec `unpack_step_frame` reads them; the C++ unpack op is kept
here as its oracle.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fastdeploy.common.step_frame import HAS_LOGPROBS, HAS_MASK, StepFrame, split_by_sequence, unpack_step_frame
from fastdeploy.common.step_slots import StepSlots, gather_step_slots
from fastdeploy.ops.step_packer import (
    CpuOpPacker,
    CudaOpPacker,
    DeferredIdsCopy,
    PackedStep,
    ReferencePacker,
    choose_packer,
    load_ops,
    op_args,
)

VOCAB = 49152
FIELDS = ("seq_ids", "num_tokens", "token_ids", "lp_ids", "lp_values", "ranks", "mask_offsets", "mask_ids", "logz")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_slots(seed: int, batch: int, slots: int, k: int, top_k: int | None, mask: bool,
               max_mask_row: int = 40) -> StepSlots:
    """Random slot contents; every slot (accepted or not) holds distinct-looking data."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, slots + 1, size=batch).astype(np.int32)
    counts[rng.random(batch) < 0.2] = 0  # sequences with nothing accepted
    rows = batch * slots
    result = StepSlots(
        message_id=int(rng.integers(0, 1 << 40)),
        seq_ids=torch.from_numpy(rng.choice(1 << 40, size=batch, replace=False).astype(np.int64)),
        accept_counts=torch.from_numpy(counts),
        token_ids=torch.from_numpy(rng.integers(0, VOCAB, size=(batch, slots)).astype(np.int64)),
        num_logprobs=k,
    )
    if top_k is not None:
        result.lp_ids = torch.from_numpy(rng.integers(0, VOCAB, size=(batch, slots, top_k + 1)).astype(np.int64))
        result.lp_values = torch.from_numpy(-rng.exponential(3.0, size=(batch, slots, top_k + 1)).astype(np.float32))
        result.ranks = torch.from_numpy(rng.integers(1, VOCAB, size=(batch, slots)).astype(np.int64))
    if mask:
        sizes = rng.integers(1, max_mask_row + 1, size=rows)
        sizes[rng.random(rows) < 0.3] = 0  # null rows (the whole vocabulary)
        result.mask_offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
        result.mask_ids = torch.from_numpy(rng.integers(0, VOCAB, size=int(sizes.sum())).astype(np.int32))
        result.logz = torch.from_numpy(-rng.random((batch, slots)).astype(np.float32))
    return result


def to_device(slots: StepSlots, device: str) -> StepSlots:
    moved = {f.name: getattr(slots, f.name) for f in dataclasses.fields(slots)}
    return StepSlots(**{name: v.to(device) if isinstance(v, torch.Tensor) else v for name, v in moved.items()})


def pack_step_slots_reference(slots: StepSlots) -> bytes:
    return bytes(ReferencePacker().pack(slots).buffer)


def pack_step_slots_tensor(slots: StepSlots) -> torch.Tensor:
    """The plain op (the whole frame at once) on the slots' device."""
    load_ops(cuda=slots.token_ids.is_cuda)
    return torch.ops.fastdeploy_ops.pack_step_slots(*op_args(slots))


def pack_step_slots(slots: StepSlots) -> bytes:
    return pack_step_slots_tensor(slots).numpy().tobytes()


def unpack_step_frame_op(buf: bytes | torch.Tensor) -> StepFrame:
    """The C++ unpack op: the oracle `unpack_step_frame` is checked against."""
    load_ops()
    if not isinstance(buf, torch.Tensor):
        buf = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    arrays = [t.numpy() for t in torch.ops.fastdeploy_ops.unpack_step_frame(buf)]
    meta, rest = arrays[0], iter(arrays[4:])
    flag = int(meta[1]) & 0xFF
    frame = StepFrame(message_id=int(meta[0]), seq_ids=arrays[1], num_tokens=arrays[2], token_ids=arrays[3])
    if flag & HAS_LOGPROBS:
        frame.lp_ids, frame.lp_values, frame.ranks = next(rest), next(rest), next(rest)
    if flag & HAS_MASK:
        frame.mask_offsets, frame.mask_ids, frame.logz = next(rest), next(rest), next(rest)
    return frame


def landed_bytes(packed: PackedStep) -> bytes:
    """A packed step's frame bytes once its mask ids, if still on their way, have landed."""
    if packed.mask_ids_pending is not None:
        packed.mask_ids_pending.synchronize()
    return bytes(packed.buffer)


def assert_frames_equal(got: StepFrame, want: StepFrame) -> None:
    assert got.message_id == want.message_id
    for name in FIELDS:
        x, y = getattr(got, name), getattr(want, name)
        assert (x is None) == (y is None), name
        if y is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            np.testing.assert_array_equal(x, y, err_msg=name)


# (k, K): no logprobs; k = 0 with K = 0 and K > k; k = 20 with K = 20 and K > k.
LOGPROB_CASES = [(-1, None), (0, 0), (0, 5), (20, 20), (20, 32)]
CASES = [
    pytest.param(batch, slots, k, top_k, mask, id=f"B{batch}-S{slots}-k{k}-K{top_k}-{'mask' if mask else 'nomask'}")
    for batch in (1, 256) for slots in (1, 5) for k, top_k in LOGPROB_CASES for mask in (False, True)
]


@pytest.mark.parametrize("batch, slots, k, top_k, mask", CASES)
def test_cpu_op_matches_reference(batch, slots, k, top_k, mask):
    seed = batch * 1000 + slots * 100 + k + 3 * (top_k or 0) + mask
    step = make_slots(seed, batch, slots, k, top_k, mask)
    want = pack_step_slots_reference(step)
    packed = CpuOpPacker().pack(step)
    got = bytes(packed.buffer)
    assert got == want
    assert_frames_equal(packed.frame, unpack_step_frame(want))
    assert_frames_equal(unpack_step_frame_op(got), unpack_step_frame(want))
    # Round trip: what comes out is exactly the accepted slots, in sequence order.
    assert_frames_equal(unpack_step_frame_op(got), gather_step_slots(step))
    assert split_by_sequence(unpack_step_frame_op(got)) == split_by_sequence(unpack_step_frame(want))


def test_gathered_rows_are_the_accepted_slots():
    step = make_slots(7, batch=3, slots=5, k=2, top_k=4, mask=True)
    step.accept_counts = torch.tensor([2, 0, 5], dtype=torch.int32)
    frame = CpuOpPacker().pack(step).frame
    rows = [(0, 0), (0, 1), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4)]
    assert frame.num_tokens.tolist() == [2, 0, 5]
    assert frame.token_ids.tolist() == [int(step.token_ids[b, s]) for b, s in rows]
    assert frame.lp_ids.tolist() == [step.lp_ids[b, s, :3].tolist() for b, s in rows]
    offsets = step.mask_offsets.tolist()
    masks = [step.mask_ids[offsets[b * 5 + s]:offsets[b * 5 + s + 1]].tolist() for b, s in rows]
    parts = split_by_sequence(frame)
    assert [p.seq_id for p in parts] == step.seq_ids.tolist()
    assert parts[1].token_ids == [] and parts[1].sampling_mask.to_lists() == []
    got_masks = parts[0].sampling_mask.to_lists() + parts[2].sampling_mask.to_lists()
    assert got_masks == [m or None for m in masks]


def test_nothing_accepted_and_empty_batch():
    for batch in (0, 4):
        step = make_slots(11, batch, slots=5, k=3, top_k=3, mask=True)
        step.accept_counts = torch.zeros(batch, dtype=torch.int32)
        assert pack_step_slots(step) == pack_step_slots_reference(step)
        frame = unpack_step_frame_op(pack_step_slots(step))
        assert frame.token_ids.size == 0 and frame.mask_offsets.tolist() == [0]


def test_non_contiguous_inputs():
    step = make_slots(13, batch=8, slots=5, k=4, top_k=6, mask=True)
    step.token_ids = step.token_ids.t().contiguous().t()  # same values, column-major
    step.lp_values = step.lp_values.transpose(0, 1).contiguous().transpose(0, 1)
    assert not step.token_ids.is_contiguous()
    assert pack_step_slots(step) == pack_step_slots_reference(step)


@pytest.mark.parametrize("change, message", [
    (lambda s: setattr(s, "accept_counts", torch.full_like(s.accept_counts, 6)), "accept_counts"),
    (lambda s: setattr(s, "num_logprobs", 7), "fewer than k"),
    (lambda s: setattr(s, "token_ids", s.token_ids.int()), "token_ids must be"),
    (lambda s: setattr(s, "mask_offsets", s.mask_offsets + 1000), "CSR"),
])
def test_invalid_slots_are_rejected(change, message):
    step = make_slots(17, batch=4, slots=5, k=3, top_k=6, mask=True)
    change(step)
    with pytest.raises(ValueError, match=message):
        pack_step_slots(step)


@pytest.mark.parametrize("unpack", [unpack_step_frame, unpack_step_frame_op])
def test_truncated_frame_is_rejected(unpack):
    buf = pack_step_slots(make_slots(19, batch=4, slots=5, k=3, top_k=3, mask=True))
    with pytest.raises(ValueError, match="truncated"):
        unpack(buf[: len(buf) - 16])
    with pytest.raises(ValueError, match="truncated"):
        unpack(buf[:40])


@pytest.mark.parametrize("packer", [ReferencePacker(), CpuOpPacker()], ids=["reference", "cpu op"])
def test_unpacked_arrays_are_views_of_the_frame(packer):
    packed = packer.pack(make_slots(23, batch=4, slots=5, k=2, top_k=2, mask=False))
    assert np.shares_memory(packed.frame.token_ids, np.frombuffer(packed.buffer, dtype=np.uint8))


def test_bitmaps_travel_beside_the_frame():
    step = make_slots(29, batch=3, slots=2, k=-1, top_k=None, mask=True)
    step.mask_bits = torch.randint(0, 256, (3, 2, 7), dtype=torch.uint8)
    for packer in (ReferencePacker(), CpuOpPacker()):
        packed = packer.pack(step)
        np.testing.assert_array_equal(packed.mask_bits, step.mask_bits.numpy())
        assert bytes(packed.buffer) == pack_step_slots_reference(step)


def test_host_packer_is_the_built_op():
    assert isinstance(choose_packer(torch.device("cpu")), CpuOpPacker)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch, slots, k, top_k, mask", CASES)
def test_cuda_ops_match_reference(batch, slots, k, top_k, mask):
    seed = batch * 1000 + slots * 100 + k + 3 * (top_k or 0) + mask
    step = make_slots(seed, batch, slots, k, top_k, mask)
    want = pack_step_slots_reference(step)
    on_gpu = to_device(step, "cuda")
    mapped = pack_step_slots_tensor(on_gpu)
    assert mapped.is_pinned()
    assert mapped.numpy().tobytes() == want
    assert torch.ops.fastdeploy_ops.pack_step_slots_staged(*op_args(on_gpu)).numpy().tobytes() == want
    assert _split_frame(on_gpu) == want
    assert landed_bytes(CudaOpPacker(torch.cuda.Stream()).pack(on_gpu)) == want


def _split_frame(slots: StepSlots) -> bytes:
    """The split op's frame, read once the mask ids it leaves in flight have landed."""
    frame = torch.ops.fastdeploy_ops.pack_step_slots_split(*op_args(slots))
    landed = torch.cuda.Event()
    landed.record()
    landed.synchronize()
    return frame.numpy().tobytes()


@pytest.mark.gpu
@needs_cuda
def test_cuda_op_writes_every_byte_of_a_reused_buffer():
    # The pinned pool hands a freed block out again: poison it, then pack the same
    # shapes into it; every returned byte, padding included, must be written anew.
    step = make_slots(31, batch=3, slots=5, k=1, top_k=2, mask=True)
    want = pack_step_slots_reference(step)
    for _ in range(3):
        frame = pack_step_slots_tensor(to_device(step, "cuda"))
        torch.empty(0, dtype=torch.uint8).set_(frame.untyped_storage()).fill_(0xAB)
        del frame
        assert pack_step_slots(to_device(step, "cuda")) == want


@pytest.mark.gpu
@needs_cuda
def test_cuda_many_ids_per_row():
    step = make_slots(37, batch=64, slots=5, k=5, top_k=8, mask=True, max_mask_row=5000)
    assert pack_step_slots(to_device(step, "cuda")) == pack_step_slots_reference(step)


@pytest.mark.gpu
@needs_cuda
def test_cuda_rows_of_a_near_flat_distribution():
    # Top-p over near-uniform logits keeps most of a 152k vocabulary: a few long rows must
    # be copied by the whole grid, not by one warp each.
    step = make_slots(43, batch=24, slots=1, k=-1, top_k=None, mask=True, max_mask_row=150_000)
    want = pack_step_slots_reference(step)
    assert pack_step_slots(to_device(step, "cuda")) == want
    assert _split_frame(to_device(step, "cuda")) == want


@pytest.mark.gpu
@needs_cuda
def test_cuda_overlapping_mask_rows_are_rejected():
    step = make_slots(41, batch=4, slots=5, k=-1, top_k=None, mask=True)
    step.accept_counts = torch.full((4,), 5, dtype=torch.int32)
    offsets = torch.zeros(21, dtype=torch.int32)
    offsets[1::2] = len(step.mask_ids)  # ten rows each claim every id
    step.mask_offsets = offsets
    with pytest.raises(ValueError, match="CSR"):
        pack_step_slots(to_device(step, "cuda"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_ids_buffer_longer_than_the_csr(device):
    # The CUDA sampler sizes its ids buffer from the shapes, not from the offsets: whatever
    # lies past the CSR's last offset must never reach the frame.
    step = make_slots(53, batch=6, slots=3, k=1, top_k=2, mask=True)
    want = pack_step_slots_reference(step)
    step.mask_ids = torch.cat([step.mask_ids, torch.full((777,), -5, dtype=torch.int32)])
    on_device = to_device(step, device)
    assert pack_step_slots(on_device) == want
    if device == "cuda":
        assert _split_frame(on_device) == want


def _one_accepted_slot(seed: int, batch: int, k: int, top_k: int | None, max_mask_row: int) -> StepSlots:
    """Slots as a plain sampling step makes them: one slot per sequence, each accepted, the ids
    in a buffer larger than the CSR (the CUDA sampler sizes it without reading the offsets)."""
    step = make_slots(seed, batch, 1, k, top_k, mask=True, max_mask_row=max_mask_row)
    step.accept_counts = torch.ones(batch, dtype=torch.int32)
    tail = torch.full((1000,), -5, dtype=torch.int32)  # never part of any row
    step.mask_ids = torch.cat([step.mask_ids, tail])
    return step


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch, k, top_k, max_mask_row", [(1, -1, None, 40), (7, 2, 3, 40), (64, -1, None, 5000),
                                                           (24, 0, 0, 150_000)])
def test_cuda_ids_copied_on_a_copy_stream_match_reference(batch, k, top_k, max_mask_row):
    step = _one_accepted_slot(batch + max_mask_row, batch, k, top_k, max_mask_row)
    want = pack_step_slots_reference(step)
    packed = CudaOpPacker(torch.cuda.Stream()).pack(to_device(step, "cuda"))
    assert isinstance(packed.mask_ids_pending, DeferredIdsCopy)
    assert landed_bytes(packed) == want
    assert np.shares_memory(packed.frame.mask_ids, np.frombuffer(packed.buffer, dtype=np.uint8))
    # The split op over the same over-sized buffer: the tail never reaches the frame.
    assert _split_frame(to_device(step, "cuda")) == want


@pytest.mark.gpu
@needs_cuda
def test_cuda_copying_ids_needs_one_accepted_slot_per_sequence():
    # Drafted slots go to the split op instead, whose frame is whole once its event is reached;
    # so does a one-slot step where a sequence accepted nothing (its ids are not in frame order).
    step = make_slots(47, batch=4, slots=3, k=-1, top_k=None, mask=True)
    packed = CudaOpPacker(torch.cuda.Stream()).pack(to_device(step, "cuda"))
    assert isinstance(packed.mask_ids_pending, torch.cuda.Event)
    assert landed_bytes(packed) == pack_step_slots_reference(step)
    step = _one_accepted_slot(48, 4, -1, None, 40)
    step.accept_counts[2] = 0
    packed = CudaOpPacker(torch.cuda.Stream()).pack(to_device(step, "cuda"))
    assert isinstance(packed.mask_ids_pending, torch.cuda.Event)
    assert landed_bytes(packed) == pack_step_slots_reference(step)
