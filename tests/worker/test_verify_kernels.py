"""A verify step's bookkeeping as one kernel each (`fastdeploy/worker/verify_kernels.py`): the
placement of a predecessor's tokens and drafts into a step's inputs, and the accept counts, equal
their tensor versions (on the GPU, and on the CPU under Triton's interpreter); the tensor
verification equals the host's rule (`accepted_counts`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy.spec_decode.ngram_device import NO_DRAFT
from fastdeploy.spec_decode.verification import accepted_counts
from fastdeploy.worker import verify_kernels
from fastdeploy.worker.verify_kernels import PlacedRows
from tests.triton_interpreter import run_under_interpreter


def _place_case(rng: np.random.Generator, device: torch.device) -> tuple:
    """A predecessor of R sampled sequences (tokens, drafts, advance) and a decode step whose
    in-flight sequences each hold a run of 1 + width rows, among rows of other sequences."""
    block_size = int(rng.choice([1, 4, 16]))
    num_prev = int(rng.integers(1, 9))
    cols = int(rng.integers(1, 5))
    tokens = torch.tensor(rng.integers(-3, 500, num_prev), device=device)  # negative: an unsettled marker
    drafts = torch.tensor(rng.integers(-1, 500, (num_prev, cols)), device=device) if rng.random() < 0.8 else None
    with_advance = rng.random() < 0.7
    advance = torch.tensor(rng.integers(0, cols + 1, num_prev), device=device) if with_advance else None
    width = 0 if drafts is None else int(rng.integers(0, cols + 1))
    in_flight = rng.permutation(num_prev)[:int(rng.integers(1, num_prev + 1))]
    runs = [(int(r), int(rng.integers(0, width + 1)) if width else 0) for r in in_flight]
    if width and all(w == 0 for _, w in runs):
        runs[0] = (runs[0][0], width)
    others = int(rng.integers(0, 4))  # rows of sequences not in flight, between the runs
    order = rng.permutation(len(runs) + others)
    flat, source, offset, firsts = [], [], [], {}
    row = 0
    for k in order:
        if k < len(runs):
            prev, w = runs[k]
            firsts[prev] = row
            flat.extend(range(row, row + w + 1))
            source.extend([prev] * (w + 1))
            offset.extend(range(w + 1))
            row += w + 1
        else:
            row += 1
    num_rows = row
    table_width = 8
    max_pos = table_width * block_size - cols - 2
    positions = torch.tensor(rng.integers(0, max_pos, num_rows), device=device)
    context_lens = positions + 1
    tables = torch.tensor(rng.integers(0, 1000, (num_rows, table_width)), device=device)
    slot_mapping = torch.tensor(rng.integers(0, 10**6, num_rows), device=device)
    input_ids = torch.tensor(rng.integers(0, 500, num_rows), device=device)
    # The step's sampled sequences: the in-flight ones (their predecessor rows and widths) and others.
    sampled = [(prev, w) for prev, w in runs] + [(0, 0)] * others
    sampled = [sampled[i] for i in rng.permutation(len(sampled))]
    placed = PlacedRows(*[torch.tensor(a, dtype=torch.long, device=device).reshape(-1) for a in
                          (flat, source, offset, [p for p, _ in sampled], [w for _, w in sampled])])
    return placed, tokens, drafts, advance, input_ids, positions, context_lens, tables, slot_mapping, block_size, \
        max((w for _, w in runs), default=0)


def _clone(case: tuple) -> tuple:
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in case)


def _verify_case(rng: np.random.Generator, device: torch.device) -> tuple:
    batch = int(rng.integers(1, 40))
    width = int(rng.integers(1, 6))
    widths = rng.integers(0, width + 1, batch)
    widths[0] = width
    vocab = int(rng.choice([2, 3, 50]))  # small vocabularies: long agreeing runs
    sampled = torch.tensor(rng.integers(0, vocab, int((widths + 1).sum())), device=device)
    drafted = rng.integers(0, vocab, (batch, width + int(rng.integers(0, 2))))
    drafted[np.arange(drafted.shape[1]) >= widths[:, None]] = NO_DRAFT
    starts = np.cumsum(widths + 1) - (widths + 1)
    return sampled, torch.tensor(starts, device=device), torch.tensor(widths, device=device), \
        torch.tensor(drafted, device=device), width


def test_tensor_verification_follows_the_host_rule() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        sampled, starts, widths, drafted, width = _verify_case(rng, torch.device("cpu"))
        got = verify_kernels._verify_torch(sampled, starts, widths, drafted, width)
        drafts = [drafted[b, :int(w)].tolist() for b, w in enumerate(widths)]
        counts = accepted_counts(sampled.tolist(), drafts)
        assert got.accepted.tolist() == counts
        assert got.newest.tolist() == [int(sampled[s + c - 1]) for s, c in zip(starts.tolist(), counts, strict=True)]
        assert got.advance.tolist() == [c - 1 for c in counts]
        assert got.valid.sum().item() == sampled.numel()
        assert torch.equal(got.tokens[got.valid], sampled)


def _kernels_against_tensor_ops(device: torch.device, cases: int) -> None:
    rng = np.random.default_rng(1)
    for _ in range(cases):
        case = _place_case(rng, device)
        want_case, got_case = _clone(case), _clone(case)
        want = verify_kernels._place_torch(*want_case)
        got = verify_kernels._place_triton(*got_case)
        for w, g in zip(want, got, strict=True):
            assert (w is None and g is None) or torch.equal(w, g)
        for w, g in zip(want_case[4:9], got_case[4:9], strict=True):  # the step's inputs, written in place
            assert torch.equal(w, g)
        verify_case = _verify_case(rng, device)
        want_v = verify_kernels._verify_torch(*verify_case)
        got_v = verify_kernels._verify_triton(*verify_case)
        for field in ("rows", "valid", "tokens", "accepted", "newest", "advance"):
            assert torch.equal(getattr(want_v, field), getattr(got_v, field)), field


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_equal_the_tensor_versions() -> None:
    _kernels_against_tensor_ops(torch.device("cuda"), 300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels themselves run on CUDA (above)")
def test_kernels_under_the_triton_interpreter() -> None:
    """The kernels' logic where there is no GPU, run by Triton's interpreter (set before the
    kernels are defined)."""
    run_under_interpreter("tests.worker.test_verify_kernels", "_kernels_against_tensor_ops", 40)
