"""Seeded reproducibility across batch compositions, and logprobs semantics."""

from __future__ import annotations

import torch
from sampler_test_utils import csr_row, make_meta

from fastdeploy.model_executor.layers.sample.sampler import Sampler, process_logits

V = 500


def _run_steps(row_logits, neighbours: int, position: int, seed: int, steps: int = 6) -> list[int]:
    """Tokens of a seeded row placed at `position` among `neighbours` other rows."""
    g = torch.Generator().manual_seed(1000 + neighbours)
    b = neighbours + 1
    temps = (torch.rand(b, generator=g) * 1.5).tolist()
    top_ks = torch.randint(0, 60, (b,), generator=g).tolist()
    top_ps = (0.5 + 0.5 * torch.rand(b, generator=g)).tolist()
    gens: list[torch.Generator | None] = [
        torch.Generator().manual_seed(i) if i % 2 else None for i in range(b)
    ]
    temps[position], top_ks[position], top_ps[position] = 0.8, 40, 0.9
    mine = torch.Generator().manual_seed(seed)
    gens[position] = mine
    meta = make_meta(b, temperature=temps, top_k=top_ks, top_p=top_ps, generators=gens,
                     return_sampling_mask=[i == 0 for i in range(b)])
    toks = []
    for _ in range(steps):
        logits = torch.randn(b, V, generator=g) * 2
        logits[position] = row_logits
        toks.append(int(Sampler()(logits, meta).sampled_token_ids[position]))
    return toks


def test_seed_reproducible_regardless_of_batch():
    row = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 2
    alone = _run_steps(row, 0, 0, seed=123)
    assert alone == _run_steps(row, 3, 2, seed=123)
    assert alone == _run_steps(row, 17, 9, seed=123)
    assert alone == _run_steps(row, 40, 40, seed=123)
    # ...and the seed matters.
    others = [_run_steps(row, 0, 0, seed=s) for s in (1, 2, 3)]
    assert any(o != alone for o in others)


def _meta_with_processing(b, mode, k):
    out_ids = torch.randint(0, 64, (b, 5), generator=torch.Generator().manual_seed(3))
    return make_meta(
        b,
        temperature=[0.7, 0.0, 1.3, 1.0],
        top_k=[10, 0, 0, 0],
        top_p=[0.9, 1.0, 1.0, 1.0],
        min_p=[0.0, 0.0, 0.1, 0.0],
        frequency_penalty=0.5,
        output_token_ids=out_ids,
        logit_bias=(torch.tensor([0, 3]), torch.tensor([5, 6]), torch.tensor([4.0, -2.0])),
        max_num_logprobs=k,
        logprobs_mode=mode,
        return_sampling_mask=True,
    )


def _check_columns(out, lp, k):
    b = lp.shape[0]
    assert out.logprob_token_ids.shape == (b, k + 1) and out.logprobs.shape == (b, k + 1)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], lp.gather(1, sampled[:, None]).squeeze(1))
    top_vals, _ = lp.topk(k, dim=1)
    torch.testing.assert_close(out.logprobs[:, 1:], top_vals)
    torch.testing.assert_close(lp.gather(1, out.logprob_token_ids[:, 1:]), top_vals)
    ranks = (lp > lp.gather(1, sampled[:, None])).sum(1) + 1
    assert torch.equal(out.sampled_token_ranks, ranks)


def test_raw_logprobs_are_from_original_logits():
    torch.manual_seed(0)
    logits = torch.randn(4, 64) * 2
    out = Sampler()(logits, _meta_with_processing(4, "raw_logprobs", 5))
    _check_columns(out, torch.log_softmax(logits, dim=1), 5)


def test_processed_logprobs_are_the_sampling_distribution():
    torch.manual_seed(1)
    logits = torch.randn(4, 64) * 2
    meta = _meta_with_processing(4, "processed_logprobs", 5)
    out = Sampler()(logits, meta)
    proc = process_logits(logits, meta)
    t = meta.temperature.clamp(min=1e-6)
    expected = torch.empty(4, 64)
    for r in range(4):
        kept = torch.tensor(csr_row(out, r)) if csr_row(out, r) else torch.arange(64)
        row = torch.full((64,), float("-inf"))
        if meta.temperature[r] == 0:
            row[int(proc[r].argmax())] = 0.0
        else:
            scaled = proc[r] / t[r]
            row[kept] = torch.log_softmax(scaled[kept], dim=0)
        expected[r] = row
    _check_columns(out, expected, 5)
    # Greedy row: the sampled token has logprob 0 and rank 1.
    assert out.logprobs[1, 0] == 0.0 and out.sampled_token_ranks[1] == 1
    # Truncated rows renormalise over the kept set.
    assert abs(float(torch.logsumexp(expected[0], 0))) < 1e-5


def test_zero_top_logprobs_and_none():
    logits = torch.randn(3, 20)
    out = Sampler()(logits, make_meta(3, max_num_logprobs=0))
    assert out.logprobs.shape == (3, 1) and out.logprob_token_ids.shape == (3, 1)
    out = Sampler()(logits, make_meta(3))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_token_ranks is None


def test_input_logits_not_modified():
    logits = torch.randn(4, 64)
    before = logits.clone()
    Sampler()(logits, _meta_with_processing(4, "processed_logprobs", 3))
    assert torch.equal(logits, before)
