"""n-gram lookup on the device (`ngram_device.propose`) drafts what the host's `NgramProposer`
drafts, reading each context through a block table from the per-slot token history; the CUDA
kernel equals the tensor version (on the GPU, and on the CPU under Triton's interpreter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdeploy.spec_decode import ngram_device
from fastdeploy.spec_decode.ngram_device import NO_DRAFT, TokenHistory
from fastdeploy.spec_decode.ngram_proposer import NgramProposer
from tests.triton_interpreter import run_under_interpreter


def _case(rng: np.random.Generator, device: torch.device) -> tuple:
    """Random contexts (small vocabularies repeat), stored at shuffled slots of a paged history."""
    block_size = int(rng.choice([1, 4, 16]))
    batch = int(rng.integers(1, 6))
    width = int(rng.integers(1, 40 // block_size + 3))
    num_blocks = batch * width + 3
    history = TokenHistory(num_blocks * block_size, device)
    tables = torch.tensor(rng.permutation(num_blocks)[:batch * width].reshape(batch, width), device=device)
    vocab = int(rng.choice([2, 3, 5, 50]))
    contexts = [rng.integers(0, vocab, int(rng.integers(1, width * block_size + 1))) for _ in range(batch)]
    for b, context in enumerate(contexts):
        positions = torch.arange(len(context) - 1, device=device)
        slots = tables[b, positions // block_size] * block_size + positions % block_size
        history.write(slots, torch.tensor(context[:-1], device=device))
    lengths = torch.tensor([len(c) for c in contexts], device=device)
    newest = torch.tensor([int(c[-1]) for c in contexts], device=device)
    min_n = int(rng.integers(1, 4))
    return history, tables, block_size, lengths, newest, min_n, int(rng.integers(min_n, 6)), \
        int(rng.integers(1, 6)), contexts


def test_lookup_from_a_decode_steps_rows_equals_the_lookup_from_lengths() -> None:
    rng = np.random.default_rng(2)
    for _ in range(100):
        history, tables, block_size, lengths, newest, min_n, max_n, k, _ = _case(rng, torch.device("cpu"))
        want = ngram_device.propose(history, tables, block_size, lengths, newest, min_n, max_n, k)
        step = _as_decode_step(rng, tables, lengths, rng.random() < 0.3)
        got = ngram_device.propose_after_step(history, step[1], block_size, step[0], step[2], step[3], newest,
                                              min_n, max_n, k)
        assert torch.equal(got, want)


def test_device_lookup_drafts_what_the_host_proposer_drafts() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        history, tables, block_size, lengths, newest, min_n, max_n, k, contexts = _case(rng, torch.device("cpu"))
        got = ngram_device.propose(history, tables, block_size, lengths, newest, min_n, max_n, k)
        host = NgramProposer(min_n, max_n)
        for b, context in enumerate(contexts):
            want = host.propose(context, k)
            assert got[b].tolist() == want + [NO_DRAFT] * (k - len(want)), (context.tolist(), min_n, max_n, k)


def _as_decode_step(rng: np.random.Generator, tables: torch.Tensor, lengths: torch.Tensor, one_row: bool) -> tuple:
    """A decode step holding the case's sequences: (its rows' positions and block tables, each
    sequence's first row, its accepted tokens) such that its context runs to `lengths`."""
    batch, device = lengths.shape[0], lengths.device
    if one_row:  # one row each, one token accepted: the row sits two before the context's end
        return lengths - 2, tables, None, None
    accepted = torch.tensor(rng.integers(1, 4, batch), dtype=torch.int32, device=device)
    num_rows = batch + int(rng.integers(0, 5))
    first_rows = torch.tensor(rng.permutation(num_rows)[:batch], device=device)
    positions = torch.tensor(rng.integers(0, 50, num_rows), device=device)
    positions[first_rows] = lengths - accepted.long() - 1
    step_tables = torch.tensor(rng.integers(0, 9, (num_rows, tables.shape[1])), device=device)
    step_tables[first_rows] = tables
    # A column of the verified slots' rows, as the worker passes it: a strided view.
    first_rows = torch.stack([first_rows, torch.zeros_like(first_rows)], 1)[:, 0]
    return positions, step_tables, first_rows, accepted


def _kernel_against_tensor_ops(device: torch.device, cases: int) -> None:
    rng = np.random.default_rng(1)
    for _ in range(cases):
        history, tables, block_size, lengths, newest, min_n, max_n, k, _ = _case(rng, device)
        args = (history.tokens, tables, block_size, lengths, newest, min_n, max_n, k)
        want = ngram_device._propose_torch(*args)
        assert torch.equal(ngram_device._propose_triton(*args), want)
        # The same lookups from a decode step's rows, their lengths found in the kernel.
        positions, step_tables, first_rows, accepted = _as_decode_step(rng, tables, lengths, rng.random() < 0.3)
        got = ngram_device._after_step_triton(history.tokens, step_tables, block_size, positions, first_rows,
                                              accepted, newest, min_n, max_n, k)
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_equals_the_tensor_version() -> None:
    _kernel_against_tensor_ops(torch.device("cuda"), 300)
    # Long contexts: many blocks of windows per program.
    history = TokenHistory(64 * 16, torch.device("cuda"))
    history.tokens.copy_(torch.arange(64 * 16, device="cuda") % 97)
    tables = torch.arange(64, device="cuda").view(1, 64)
    args = (history.tokens, tables, 16, torch.tensor([1000], device="cuda"), torch.tensor([5], device="cuda"), 2, 5, 4)
    assert torch.equal(ngram_device._propose_triton(*args), ngram_device._propose_torch(*args))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel itself runs on CUDA (above)")
def test_kernel_under_the_triton_interpreter() -> None:
    """The kernel's logic where there is no GPU: Triton's interpreter runs it (set before the
    kernel is defined). Not where there is one: the interpreter's scalars differ across Triton
    releases (3.9's run this kernel; the GPU machine's could not), and the compiled kernel is
    tested there."""
    run_under_interpreter("tests.spec_decode.test_ngram_device", "_kernel_against_tensor_ops", 12)
