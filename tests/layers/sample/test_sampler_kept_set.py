"""Sampling masks and logZ equal the float64 reference kept set, row by row."""

from __future__ import annotations

import numpy as np
import torch
from kept_set_reference import reference_kept_set
from sampler_test_utils import csr_row, make_meta, token_bitmask

from fastdeploy.model_executor.layers.sample.kept_set_torch import TorchKeptSetBackend
from fastdeploy.model_executor.layers.sample.sampler import Sampler, kept_set_backend, process_logits

TEMPS = [0.0, 0.3, 0.7, 1.0, 1.0, 1.5]
TOP_KS = [0, 0, 1, 5, 50, 500, 2000]
TOP_PS = [1.0, 1.0, 0.5, 0.9, 0.95, 0.99]
MIN_PS = [0.0, 0.0, 0.0, 0.01, 0.05, 0.2]


def _random_batch(rng: np.random.Generator, b: int, v: int, with_bitmask: bool):
    scale = rng.choice([1.0, 3.0, 8.0], size=(b, 1))
    logits = torch.from_numpy((rng.standard_normal((b, v)) * scale).astype(np.float32))
    # A few rows with coarse logits create exact ties, including across boundaries.
    coarse = rng.random(b) < 0.1
    logits[coarse] = torch.round(logits[coarse] * 2) / 2
    pick = lambda xs: [xs[i] for i in rng.integers(0, len(xs), size=b)]  # noqa: E731
    has_pen = rng.random(b) < 0.3
    n_bias = int(rng.integers(1, 4 * b))
    bias = (
        torch.from_numpy(rng.integers(0, b, n_bias)),
        torch.from_numpy(rng.integers(0, v, n_bias)),
        torch.from_numpy(rng.normal(0, 5, n_bias).astype(np.float32)),
    )
    prompt = torch.from_numpy(rng.integers(0, v, (b, 20)))
    output = torch.from_numpy(rng.integers(0, v, (b, 10)))
    output[torch.from_numpy(rng.random((b, 10)) < 0.3)] = -1
    bitmask = None
    if with_bitmask:
        words = (v + 31) // 32
        bitmask = token_bitmask(rng.random((b, words * 32)) < 0.7)
    meta = make_meta(
        b,
        temperature=pick(TEMPS),
        top_k=pick(TOP_KS),
        top_p=pick(TOP_PS),
        min_p=pick(MIN_PS),
        repetition_penalty=np.where(has_pen, rng.uniform(0.8, 1.5, b), 1.0).tolist(),
        presence_penalty=np.where(has_pen, rng.uniform(-1, 1, b), 0.0).tolist(),
        frequency_penalty=np.where(has_pen, rng.uniform(-0.5, 0.5, b), 0.0).tolist(),
        prompt_token_ids=prompt,
        output_token_ids=output,
        logit_bias=bias,
        return_sampling_mask=(rng.random(b) < 0.95).tolist(),
        token_bitmask=bitmask,
    )
    return logits, meta


def _check_batch(logits, meta) -> tuple[int, int]:
    """Returns (rows checked against the reference, rows with tie-allowed differences)."""
    out = Sampler()(logits, meta)
    proc = process_logits(logits, meta)
    b = logits.shape[0]
    assert out.mask_offsets.dtype == torch.int32 and out.mask_ids.dtype == torch.int32
    assert out.mask_offsets.shape == (b + 1,) and out.logz.shape == (b,)
    checked = tied = 0
    for r in range(b):
        ids = csr_row(out, r)
        tok = int(out.sampled_token_ids[r])
        assert np.isfinite(float(proc[r, tok])), "drew a disallowed token"
        t, k, p, mp = (float(meta.temperature[r]), int(meta.top_k[r]), float(meta.top_p[r]), float(meta.min_p[r]))
        truncates = t <= 0 or k > 0 or p < 1 or mp > 0
        ref = reference_kept_set(proc[r].numpy(), t, k, p, mp)
        if truncates:
            # Whether or not the mask was requested, the draw stays in the reference set.
            assert tok in set(ref.ids.tolist()) | ref.ambiguous
        if not truncates and meta.token_bitmask is not None and bool(meta.return_sampling_mask[r]):
            # No truncation under a grammar: the draw's support is the ids the bitmask allowed.
            allowed = np.flatnonzero(np.isfinite(proc[r].numpy())).tolist()
            assert ids == ([] if len(allowed) == proc.shape[1] else allowed) and float(out.logz[r]) == 0.0
            assert not ids or tok in ids
            checked += 1
            continue
        if not (truncates and bool(meta.return_sampling_mask[r])):
            assert ids == [] and float(out.logz[r]) == 0.0
            continue
        checked += 1
        assert ids == sorted(ids) and tok in ids
        diff = set(ids) ^ set(ref.ids.tolist())
        assert diff <= ref.ambiguous, (r, sorted(diff)[:10], t, k, p, mp)
        if diff:
            tied += 1
        else:
            assert abs(float(out.logz[r]) - ref.logz) < 1e-5, (r, float(out.logz[r]), ref.logz)
    return checked, tied


def test_kept_set_matches_reference_small_vocab():
    rng = np.random.default_rng(1234)
    checked = 0
    for i in range(9):
        logits, meta = _random_batch(rng, 256, 1000, with_bitmask=i % 3 == 0)
        c, _ = _check_batch(logits, meta)
        checked += c
    assert checked >= 2000


def test_kept_set_matches_reference_large_vocab():
    rng = np.random.default_rng(99)
    logits, meta = _random_batch(rng, 12, 49152, with_bitmask=False)
    _check_batch(logits, meta)
    logits, meta = _random_batch(rng, 6, 49152, with_bitmask=True)
    _check_batch(logits, meta)


def test_top_p_window_and_full_sort_fallback():
    # Peaked rows (scale 6) are decided inside the first TOP_P_WINDOW sorted entries;
    # flat rows (scale 0.5) need the full-sort fallback. Both must match the reference.
    gen = torch.Generator().manual_seed(3)
    scales = torch.tensor([6.0, 6.0, 6.0, 0.5, 0.5, 6.0, 0.5, 2.0]).unsqueeze(1)
    logits = torch.randn(8, 49152, generator=gen) * scales
    meta = make_meta(8, top_p=[0.5, 0.9, 0.99, 0.5, 0.9, 0.9, 0.3, 0.95], top_k=[0, 0, 0, 0, 0, 3000, 0, 0],
                     min_p=[0.0] * 7 + [0.01], return_sampling_mask=True)
    checked, _ = _check_batch(logits, meta)
    assert checked == 8
    # Without any top-k row the windows widen 64 -> 1024 -> full sort as needed.
    scales = torch.tensor([8.0, 3.0, 0.5, 6.0, 1.0]).unsqueeze(1)
    logits = torch.randn(5, 49152, generator=gen) * scales
    meta = make_meta(5, top_p=[0.5, 0.9, 0.9, 0.99, 1.0], min_p=[0.0, 0.0, 0.0, 0.001, 0.3],
                     temperature=[1.0, 0.7, 1.0, 1.3, 1.0], return_sampling_mask=True)
    checked, _ = _check_batch(logits, meta)
    assert checked == 5


def test_exact_tie_at_top_k_boundary_is_allowed():
    logits = torch.tensor([[5.0, 3.0, 3.0, 1.0, 0.0]])
    meta = make_meta(1, top_k=2, return_sampling_mask=True)
    out = Sampler()(logits, meta)
    ids = csr_row(out, 0)
    assert len(ids) == 2 and 0 in ids and (1 in ids or 2 in ids)
    ref = reference_kept_set(logits[0].numpy(), 1.0, 2, 1.0, 0.0)
    assert set(ids) ^ set(ref.ids.tolist()) <= ref.ambiguous


def test_no_truncation_rows_are_null_and_no_mask_means_none():
    logits = torch.randn(3, 50)
    out = Sampler()(logits, make_meta(3, return_sampling_mask=True))
    assert out.mask_offsets.tolist() == [0, 0, 0, 0] and out.mask_ids.numel() == 0
    assert out.logz.tolist() == [0.0, 0.0, 0.0]
    out = Sampler()(logits, make_meta(3, top_k=5))
    assert out.mask_offsets is None and out.mask_ids is None and out.logz is None


def test_greedy_mask_and_logz():
    logits = torch.tensor([[1.0, 4.0, 2.0], [0.0, -1.0, 3.0]])
    out = Sampler()(logits, make_meta(2, temperature=0.0, return_sampling_mask=True, top_k=[0, 2]))
    assert out.sampled_token_ids.tolist() == [1, 2]
    assert out.mask_offsets.tolist() == [0, 1, 2] and out.mask_ids.tolist() == [1, 2]
    expected = torch.log_softmax(logits.double(), 1)[[0, 1], [1, 2]].float()
    torch.testing.assert_close(out.logz, expected)


def test_empty_batch():
    out = Sampler()(torch.empty(0, 100), make_meta(0, max_num_logprobs=3, return_sampling_mask=[]))
    assert out.sampled_token_ids.shape == (0,)
    assert out.logprobs.shape == (0, 4) and out.logprob_token_ids.shape == (0, 4)
    assert out.mask_offsets.tolist() == [0] and out.mask_ids.numel() == 0 and out.logz.shape == (0,)


def test_kept_set_backend_is_chosen_from_the_device():
    """A sampler given its device holds that device's backend from the start; one given none
    takes the first call's, and both draw the same tokens and masks."""
    assert isinstance(kept_set_backend(torch.device("cpu")), TorchKeptSetBackend)
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 3
    outs = []
    for sampler in (Sampler("cpu"), Sampler()):
        torch.manual_seed(0)
        outs.append(sampler(logits, make_meta(4, top_p=0.9, top_k=[0, 20, 0, 5], return_sampling_mask=True)))
    assert torch.equal(outs[0].sampled_token_ids, outs[1].sampled_token_ids)
    assert [csr_row(outs[0], r) for r in range(4)] == [csr_row(outs[1], r) for r in range(4)]


def test_sorted_and_dense_csr_list_the_same_kept_sets(monkeypatch):
    """Narrow windows list their kept ids by sorting the window, wide ones through a dense flag
    array: forced through the dense path, every batch gives the same CSR and logz."""
    from fastdeploy.model_executor.layers.sample import kept_set_torch

    rng = np.random.default_rng(7)
    for v in (1000, 49152):
        logits, meta = _random_batch(rng, 32, v, with_bitmask=False)
        meta.temperature[:4] = 0.0  # greedy rows list their token
        sorted_out = Sampler()(logits, meta)
        monkeypatch.setattr(kept_set_torch, "SORTED_CSR_MAX_WINDOW", 0)
        dense_out = Sampler()(logits, meta)
        monkeypatch.undo()
        assert torch.equal(sorted_out.mask_offsets, dense_out.mask_offsets)
        assert torch.equal(sorted_out.mask_ids[:int(sorted_out.mask_offsets[-1])],
                           dense_out.mask_ids[:int(dense_out.mask_offsets[-1])])
        assert torch.equal(sorted_out.logz, dense_out.logz)
        assert int(sorted_out.mask_offsets[-1]) > 0
