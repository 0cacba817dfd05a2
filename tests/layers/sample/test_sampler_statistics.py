"""Empirical draw distributions match the truncated, renormalised distribution (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kept_set_reference import reference_kept_set
from sampler_test_utils import make_meta
from scipy.stats import chisquare

from fastdeploy.model_executor.layers.sample.sampler import Sampler

LOGITS = torch.tensor([2.0, 1.6, 1.5, 1.1, 0.9, 0.4, 0.3, 0.0, -0.5, -1.0, -1.7, -3.0])
N_DRAWS = 20000

CASES = {
    "plain_t1.2": dict(temperature=1.2),
    "top_k4_t0.8": dict(temperature=0.8, top_k=4),
    "top_p0.8_t1.3": dict(temperature=1.3, top_p=0.8),
    "min_p0.2": dict(temperature=1.0, min_p=0.2),
    "k6_p0.9_minp0.05_t0.7": dict(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05),
    "k8_p0.7_t2": dict(temperature=2.0, top_k=8, top_p=0.7),
}


def _expected(logits: torch.Tensor, temperature: float, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    ref = reference_kept_set(logits.numpy(), temperature, top_k, np.float32(top_p), np.float32(min_p))
    x = logits.double().numpy() / np.float64(np.float32(temperature))
    p = np.exp(x - x.max())
    q = np.zeros_like(p)
    q[ref.ids] = p[ref.ids]
    return q / q.sum()


def _assert_matches(counts: np.ndarray, expected: np.ndarray) -> None:
    outside = expected == 0
    assert counts[outside].sum() == 0, "drew a token outside the kept set"
    kept = ~outside
    if kept.sum() == 1:
        return
    n = counts.sum()
    res = chisquare(counts[kept], expected[kept] * n)
    assert res.pvalue > 1e-3, (counts, expected * n, res.pvalue)


@pytest.mark.parametrize("name", list(CASES))
def test_batched_draws_match_truncated_distribution(name):
    params = CASES[name]
    torch.manual_seed(2024)
    logits = LOGITS.repeat(N_DRAWS, 1)
    out = Sampler()(logits, make_meta(N_DRAWS, **params))
    counts = np.bincount(out.sampled_token_ids.numpy(), minlength=LOGITS.numel())
    _assert_matches(counts, _expected(LOGITS, **params))


def test_draws_follow_processed_logits_with_bias_and_penalties():
    torch.manual_seed(7)
    b = N_DRAWS
    logits = LOGITS.repeat(b, 1)
    bias_rows = torch.arange(b).repeat_interleave(2)
    bias_cols = torch.tensor([9, 0]).repeat(b)
    bias_vals = torch.tensor([3.0, -1.0]).repeat(b)
    output = torch.tensor([[1, 1, -1]]).repeat(b, 1)
    meta = make_meta(b, temperature=0.9, top_p=0.85, frequency_penalty=0.2, presence_penalty=0.1,
                     output_token_ids=output, logit_bias=(bias_rows, bias_cols, bias_vals))
    out = Sampler()(logits, meta)
    processed = LOGITS.clone()
    processed[9] += 3.0
    processed[0] -= 1.0
    processed[1] -= 0.2 * 2 + 0.1
    counts = np.bincount(out.sampled_token_ids.numpy(), minlength=LOGITS.numel())
    _assert_matches(counts, _expected(processed, 0.9, top_p=0.85))


def test_seeded_row_draws_match_distribution():
    # One seeded row drawn step after step: the per-row generator path, not the batched one.
    params = dict(temperature=0.9, top_k=7, top_p=0.95)
    gen = torch.Generator().manual_seed(11)
    sampler = Sampler()
    logits = LOGITS.unsqueeze(0)
    meta = make_meta(1, generators=[gen], **params)
    toks = [int(sampler(logits, meta).sampled_token_ids[0]) for _ in range(3000)]
    counts = np.bincount(np.array(toks), minlength=LOGITS.numel())
    _assert_matches(counts, _expected(LOGITS, **params))


def test_greedy_never_samples():
    logits = LOGITS.repeat(100, 1)
    out = Sampler()(logits, make_meta(100, temperature=0.0, top_k=3))
    assert (out.sampled_token_ids == 0).all()
