"""Kept sets as bitmaps (`sampling_mask_format: "bitmap"`) equal the sampler's CSR sets, row by row."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from sampler_test_utils import csr_row, make_meta

from fastdeploy.model_executor.layers.sample.ops import pack_bits, pack_bits_on_device
from fastdeploy.model_executor.layers.sample.sampler import Sampler


def _to(obj, device):
    tensors = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return dataclasses.replace(obj, **{n: t.to(device) for n, t in tensors.items() if isinstance(t, torch.Tensor)})


@pytest.mark.parametrize("pack", [pack_bits, pack_bits_on_device])
@pytest.mark.parametrize("v", [1, 8, 13, 49152])
def test_pack_bits_matches_numpy_packbits(v: int, pack):
    """Both forms (numpy on the CPU, torch ops for an accelerator, run here on the CPU)."""
    flags = torch.rand(5, v, generator=torch.Generator().manual_seed(v)) < 0.3
    want = np.packbits(flags.numpy(), axis=1, bitorder="little")
    assert pack(flags).numpy().tolist() == want.tolist()


def _batch(b: int, v: int, seed: int):
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy((rng.standard_normal((b, v)) * rng.choice([0.5, 2.0, 6.0], (b, 1))).astype(np.float32))
    kinds = rng.integers(0, 4, b)  # 0 greedy, 1 top_p, 2 top_k + min_p, 3 untruncated
    temperature = np.where(kinds == 0, 0.0, rng.uniform(0.5, 1.5, b))
    top_p = np.where(kinds == 1, rng.uniform(0.5, 0.99, b), 1.0)
    top_k = np.where(kinds == 2, rng.integers(1, 3000, b), 0)
    min_p = np.where(kinds == 2, 0.02, 0.0)
    requested = rng.random(b) < 0.9
    as_bits = requested & (rng.random(b) < 0.6)
    base = dict(temperature=temperature.tolist(), top_p=top_p.tolist(), top_k=top_k.tolist(), min_p=min_p.tolist(),
                return_sampling_mask=requested.tolist())
    return logits, base, as_bits, kinds


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("v", [1000, 49152])
def test_bitmap_rows_hold_the_same_sets_as_the_csr(device: str, v: int):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    b = 48
    logits, base, as_bits, kinds = _batch(b, v, seed=v)
    outs = []
    for bits in (None, as_bits):
        meta = make_meta(b, **base)
        if bits is not None:
            meta.mask_bitmap_rows = torch.from_numpy(bits)
        torch.manual_seed(5)  # the same draws in both calls
        outs.append(_to(Sampler()(logits.to(device), _to(meta, device), settle_kept_sets=True), "cpu"))
    ids_out, bits_out = outs
    assert ids_out.mask_bits is None
    assert bits_out.mask_bits.dtype == torch.uint8 and bits_out.mask_bits.shape == (b, (v + 7) // 8)
    assert torch.equal(bits_out.sampled_token_ids, ids_out.sampled_token_ids)
    assert torch.equal(bits_out.logz, ids_out.logz)
    rows = bits_out.mask_bits.numpy()
    for r in range(b):
        decoded = np.flatnonzero(np.unpackbits(rows[r], bitorder="little")).tolist()
        if as_bits[r]:
            assert csr_row(bits_out, r) == []  # the CSR leaves bitmap rows empty
            assert decoded == csr_row(ids_out, r)  # [] (all zero) for an untruncated row: null
            if kinds[r] != 3:
                assert int(bits_out.sampled_token_ids[r]) in decoded
        else:
            assert decoded == []
            assert csr_row(bits_out, r) == csr_row(ids_out, r)
