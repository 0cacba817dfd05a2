"""Speculative verification samples exactly the non-speculative distribution (chi-square, fixed seeds).

A small Markov "model" (next-token logits depend on the previous token) stands in for
the transformer, so each position's target distribution is known; the real Sampler
(top-k, top-p, min-p, temperature) and the real acceptance rule run on it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from fastdeploy.model_executor.layers.sample.metadata import SamplingMetadata
from fastdeploy.model_executor.layers.sample.sampler import Sampler
from fastdeploy.spec_decode.verification import accepted_counts

V = 6
N = 30000


def _meta(rows: int, temperature: float, top_k: int, top_p: float, min_p: float) -> SamplingMetadata:
    def full(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype)

    return SamplingMetadata(
        temperature=full(temperature, torch.float32), top_k=full(top_k, torch.int64),
        top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32),
        repetition_penalty=full(1.0, torch.float32), presence_penalty=full(0.0, torch.float32),
        frequency_penalty=full(0.0, torch.float32), prompt_token_ids=None, output_token_ids=None,
        logit_bias_rows=None, logit_bias_cols=None, logit_bias_values=None, generators=[None] * rows,
        max_num_logprobs=-1, logprobs_mode="raw_logprobs", return_sampling_mask=None)


@pytest.mark.parametrize("params", [
    dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0),
    dict(temperature=0.8, top_k=0, top_p=0.8, min_p=0.0),
    dict(temperature=1.3, top_k=4, top_p=0.9, min_p=0.1),
])
def test_two_token_joint_distribution_equals_sequential_sampling(params):
    torch.manual_seed(1234)
    table = torch.randn(V, V) * 1.5  # logits of the next token given the previous one
    sampler = Sampler()
    last = 0
    drafts = [2, 4]  # a fixed two-token proposal, as n-gram lookup gives; both often inside the kept sets

    # Non-speculative: token 1 from row `last`, token 2 from the row of token 1.
    t1 = sampler(table[last].expand(N, V).contiguous(), _meta(N, **params)).sampled_token_ids
    t2 = sampler(table[t1], _meta(N, **params)).sampled_token_ids
    plain = (t1 * V + t2).numpy()

    # Speculative: slots conditioned on the drafts, all sampled in one call, then accepted.
    slots = torch.stack([table[last], table[drafts[0]], table[drafts[1]]])
    logits = slots.repeat(N, 1)
    sampled = sampler(logits, _meta(3 * N, **params)).sampled_token_ids.tolist()
    counts = accepted_counts(sampled, [drafts] * N)
    tokens = np.array(sampled).reshape(N, 3)
    # The second token of a run that stopped after one token is sampled afresh after it.
    short = np.array(counts) == 1
    follow = sampler(table[torch.from_numpy(tokens[short, 0])], _meta(int(short.sum()), **params))
    second = tokens[:, 1].copy()
    second[short] = follow.sampled_token_ids.numpy()
    spec = tokens[:, 0] * V + second

    assert (np.array(counts) > 1).mean() > 0.05, "the drafts were (almost) never accepted: the test is vacuous"
    table_counts = np.stack([np.bincount(plain, minlength=V * V), np.bincount(spec, minlength=V * V)])
    table_counts = table_counts[:, table_counts.sum(axis=0) > 0]
    p_value = chi2_contingency(table_counts).pvalue
    assert p_value > 0.001, f"speculative and plain distributions differ (p={p_value:.2e})"
