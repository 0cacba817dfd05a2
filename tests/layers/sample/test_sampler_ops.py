"""Each logit-processing op against a direct loop reference on a small vocabulary."""

from __future__ import annotations

import math

import torch

from fastdeploy.model_executor.layers.sample.ops import (
    apply_logit_bias_,
    apply_penalties_,
    apply_temperature,
    apply_token_bitmask_,
    token_counts,
    unpack_token_bitmask,
)


def test_logit_bias_accumulates_duplicates():
    logits = torch.zeros(3, 10)
    rows = torch.tensor([0, 0, 2, 2, 2])
    cols = torch.tensor([1, 1, 9, 0, 9])
    vals = torch.tensor([1.5, 2.0, -3.0, 0.25, -1.0])
    apply_logit_bias_(logits, rows, cols, vals)
    expected = torch.zeros(3, 10)
    for r, c, v in zip(rows.tolist(), cols.tolist(), vals.tolist(), strict=True):
        expected[r, c] += v
    torch.testing.assert_close(logits, expected)
    assert apply_logit_bias_(logits, None, None, None) is logits


def test_bitmask_unpack_matches_bit_loop():
    gen = torch.Generator().manual_seed(0)
    b, v = 4, 75  # not a multiple of 32: the last word is partial
    words = (v + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (b, words), generator=gen, dtype=torch.int64).to(torch.int32)
    got = unpack_token_bitmask(mask, v)
    for r in range(b):
        for j in range(v):
            word = int(mask[r, j // 32]) & 0xFFFFFFFF
            assert bool(got[r, j]) == bool((word >> (j % 32)) & 1)

    logits = torch.randn(b, v, generator=gen)
    before = logits.clone()
    apply_token_bitmask_(logits, mask)
    assert torch.equal(torch.isneginf(logits), ~got)
    assert torch.equal(logits[got], before[got])


def test_bitmask_bit31_and_all_ones():
    mask = torch.tensor([[-1], [-(2**31)]], dtype=torch.int32)  # all bits / only bit 31
    got = unpack_token_bitmask(mask, 32)
    assert got[0].all()
    assert got[1].tolist() == [False] * 31 + [True]


def test_token_counts_ignore_padding():
    ids = torch.tensor([[3, 3, 1, -1, -1], [0, -1, -1, -1, -1], [-1, -1, -1, -1, -1]])
    c = token_counts(ids, 5)
    assert c.tolist() == [[0, 1, 0, 2, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


def _loop_penalties(logits, prompt, output, rep, pres, freq):
    out = logits.clone()
    for r in range(out.shape[0]):
        seen = {t for t in prompt[r].tolist() if t >= 0} | {t for t in output[r].tolist() if t >= 0}
        for t in seen:
            x = float(out[r, t])
            out[r, t] = x / float(rep[r]) if x > 0 else x * float(rep[r])
        counts: dict[int, int] = {}
        for t in output[r].tolist():
            if t >= 0:
                counts[t] = counts.get(t, 0) + 1
        for t, n in counts.items():
            out[r, t] -= float(freq[r]) * n + float(pres[r])
    return out


def test_penalties_match_loop():
    gen = torch.Generator().manual_seed(1)
    b, v = 5, 40
    logits = torch.randn(b, v, generator=gen) * 3
    prompt = torch.randint(0, v, (b, 12), generator=gen)
    output = torch.randint(0, v, (b, 9), generator=gen)
    prompt[1, 6:] = -1
    output[2, 3:] = -1
    output[4, :] = -1
    rep = torch.tensor([1.0, 1.3, 0.8, 2.0, 1.1])
    pres = torch.tensor([0.0, 0.5, -0.5, 1.0, 0.2])
    freq = torch.tensor([0.0, 0.3, 0.1, -0.2, 0.7])
    expected = _loop_penalties(logits, prompt, output, rep, pres, freq)
    got = apply_penalties_(logits.clone(), prompt, output, rep, pres, freq)
    torch.testing.assert_close(got, expected)


def test_penalties_prompt_only_and_output_only():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 16, generator=gen)
    prompt = torch.tensor([[1, 2, -1], [5, 5, 5]])
    empty = torch.full((2, 1), -1)
    rep = torch.tensor([1.5, 2.0])
    zero = torch.zeros(2)
    got = apply_penalties_(logits.clone(), prompt, None, rep, zero, zero)
    torch.testing.assert_close(got, _loop_penalties(logits, prompt, empty, rep, zero, zero))
    output = torch.tensor([[7, 7, 7], [0, -1, -1]])
    pres, freq = torch.tensor([0.5, 1.0]), torch.tensor([0.25, 0.0])
    got = apply_penalties_(logits.clone(), None, output, rep, pres, freq)
    torch.testing.assert_close(got, _loop_penalties(logits, empty, output, rep, pres, freq))


def test_penalties_keep_neg_inf():
    logits = torch.tensor([[float("-inf"), 1.0, -1.0]])
    out = apply_penalties_(logits.clone(), torch.tensor([[0, 1, 2]]), torch.tensor([[0, 2]]),
                           torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([1.0]))
    assert math.isinf(out[0, 0]) and out[0, 0] < 0
    torch.testing.assert_close(out[0, 1:], torch.tensor([0.5, -4.0]))


def test_temperature_greedy_rows_unscaled():
    logits = torch.tensor([[2.0, 4.0], [2.0, 4.0], [2.0, 4.0]])
    out = apply_temperature(logits, torch.tensor([0.5, 0.0, 2.0]))
    torch.testing.assert_close(out, torch.tensor([[4.0, 8.0], [2.0, 4.0], [1.0, 2.0]]))
