"""Prompt-lookup drafting on the device, for a step sent ahead of its predecessor's frame.

A step scheduled before the tokens of the one running are on the host cannot take n-gram drafts
from the host's copy of the context. The worker keeps every computed token id at its KV cache
slot (`TokenHistory`), so a sequence's context is read through its block table as its K/V are,
and `propose` finds the drafts there, with `NgramProposer.propose`'s rule: the longest suffix
(of `max_n` down to `min_n` tokens) that occurred earlier, its latest occurrence, and the tokens
that followed it. Where the host proposer returns fewer than asked (no match, or the match runs
into the newest token) the rest are -1, which no sampled token equals, so verification rejects
them as it rejects a wrong draft.
"""

from __future__ import annotations

import torch

try:  # pragma: no cover - only on machines with triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

NO_DRAFT = -1  # a draft slot without a token: never equal to a sampled token
_PAD = -2  # context positions past a sequence's length: never equal to a token of it


class TokenHistory:
    """Each computed token id at its KV cache slot (int64 [slots]): the token a position holds is
    where its K/V are, so a sequence's context is read through its block table, shared prefix
    blocks included. Slots past a sequence's newest token may hold stale ids; nothing reads them."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.tokens = torch.full((num_slots,), _PAD, dtype=torch.long, device=device)

    def write(self, slot_mapping: torch.Tensor, input_ids: torch.Tensor) -> None:
        """The step's input ids at their slots (queued behind the step's inputs)."""
        self.tokens.index_copy_(0, slot_mapping, input_ids)


def propose(history: TokenHistory, block_tables: torch.Tensor, block_size: int, lengths: torch.Tensor,
            newest: torch.Tensor, min_n: int, max_n: int, num_drafts: int) -> torch.Tensor:
    """int64 [B, num_drafts]: each sequence's n-gram drafts, NO_DRAFT where it has fewer.

    Sequence b's context is its `lengths[b]` tokens: positions 0 .. lengths[b] - 2 from `history`
    through `block_tables[b]` (int64 [B, W]), and `newest[b]`, not yet computed, at lengths[b] - 1.
    Every sequence must have W * block_size >= lengths[b]."""
    if triton is not None and history.tokens.is_cuda:
        return _propose_triton(history.tokens, block_tables, block_size, lengths, newest, min_n, max_n, num_drafts)
    return _propose_torch(history.tokens, block_tables, block_size, lengths, newest, min_n, max_n, num_drafts)


def propose_after_step(history: TokenHistory, block_tables: torch.Tensor, block_size: int, positions: torch.Tensor,
                       first_rows: torch.Tensor | None, accepted: torch.Tensor | None, newest: torch.Tensor,
                       min_n: int, max_n: int, num_drafts: int) -> torch.Tensor:
    """`propose` for the sequences of a pure decode step (`positions` and `block_tables`: its
    rows'): sequence b's first row is `first_rows[b]` (a view may be strided; None: row b, one
    row each) and its context runs to the token after its last accepted row, positions[first
    row] + accepted[b] + 1 tokens (`accepted` None: one each). On CUDA the lengths are found in
    the lookup's own launch."""
    if triton is not None and history.tokens.is_cuda:
        return _after_step_triton(history.tokens, block_tables, block_size, positions, first_rows, accepted, newest,
                                  min_n, max_n, num_drafts)
    if first_rows is None:
        lengths, tables = positions + 2, block_tables
    else:
        assert accepted is not None
        lengths, tables = positions[first_rows] + accepted.long() + 1, block_tables[first_rows]
    return _propose_torch(history.tokens, tables, block_size, lengths, newest, min_n, max_n, num_drafts)


def warm_up(history: TokenHistory, min_n: int, max_n: int) -> None:
    """Runs the lookup once per variant a step can take (sequences of one row, and of a verify
    step's runs), so that it does not compile while a step waits on it."""
    device = history.tokens.device
    tables, positions = torch.zeros(1, 1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long,
                                                                                         device=device)
    for rows, accepted in ((None, None), (positions, torch.ones(1, dtype=torch.int32, device=device))):
        propose_after_step(history, tables, 1, positions, rows, accepted, positions, min_n, max_n, 1)


def _after_step_triton(tokens: torch.Tensor, block_tables: torch.Tensor, block_size: int, positions: torch.Tensor,
                       first_rows: torch.Tensor | None, accepted: torch.Tensor | None, newest: torch.Tensor,
                       min_n: int, max_n: int, num_drafts: int) -> torch.Tensor:
    batch = newest.shape[0]
    out = torch.empty(batch, num_drafts, dtype=torch.long, device=newest.device)
    if batch:  # unused pointers get a tensor of the right kind; the flags keep them unread
        _ngram_kernel[(batch,)](tokens, block_tables, block_tables.stride(0),
                                first_rows if first_rows is not None else positions,
                                first_rows.stride(0) if first_rows is not None else 1, int(first_rows is not None),
                                positions, accepted if accepted is not None else positions, positions, newest, out,
                                block_size, num_drafts, MIN_N=min_n, MAX_N=max_n, K_P2=slot_block(num_drafts),
                                BLOCK=256, FROM_STEP=True)
    return out


def _propose_torch(tokens: torch.Tensor, block_tables: torch.Tensor, block_size: int, lengths: torch.Tensor,
                   newest: torch.Tensor, min_n: int, max_n: int, num_drafts: int) -> torch.Tensor:
    """`propose` as tensor operations over each sequence's whole padded context."""
    device = tokens.device
    width = block_tables.shape[1] * block_size
    pos = torch.arange(width, device=device)
    slots = block_tables[:, pos // block_size] * block_size + pos % block_size
    lengths = lengths.unsqueeze(1)
    context = torch.where(pos == lengths - 1, newest.unsqueeze(1), tokens[slots])
    context = torch.where(pos < lengths, context, _PAD)
    start = torch.full_like(lengths, -1)
    # Shortest first: a longer suffix that also matches overrides (the host tries it first).
    for n in range(min_n, max_n + 1):
        if n > width - 1:
            break
        suffix = context.gather(1, (lengths - n).clamp(min=0) + torch.arange(n, device=device))
        windows = context.unfold(1, n, 1)  # [B, width - n + 1, n]
        first = torch.arange(width - n + 1, device=device)
        # Windows of the context before its last token; a suffix of n needs n + 1 tokens.
        ok = (windows == suffix.unsqueeze(1)).all(-1) & (first + n <= lengths - 1) & (lengths - 1 >= n)
        hit = torch.where(ok, first, -1).amax(1, keepdim=True)
        start = torch.where(hit >= 0, hit + n, start)
    at = start + torch.arange(num_drafts, device=device)
    taken = (start >= 0) & (at < lengths)
    return torch.where(taken, context.gather(1, at.clamp(0, width - 1)), NO_DRAFT)


def _propose_triton(tokens: torch.Tensor, block_tables: torch.Tensor, block_size: int, lengths: torch.Tensor,
                    newest: torch.Tensor, min_n: int, max_n: int, num_drafts: int) -> torch.Tensor:
    """`propose` as one kernel launch: a program per sequence scans its context."""
    batch = lengths.shape[0]
    out = torch.empty(batch, num_drafts, dtype=torch.long, device=tokens.device)
    if batch:
        _ngram_kernel[(batch,)](tokens, block_tables, block_tables.stride(0), lengths, 1, 0, lengths, lengths,
                                lengths, newest, out, block_size, num_drafts, MIN_N=min_n, MAX_N=max_n,
                                K_P2=slot_block(num_drafts), BLOCK=256, FROM_STEP=False)
    return out


def slot_block(width: int) -> int:
    """A speculation kernel's block over a sequence's drafts or slots: one size for every width up
    to 8, so a step's changing cap does not compile a kernel again mid-serving."""
    return max(8, triton.next_power_of_2(width))


if triton is not None:

    @triton.jit
    def _token_at(tokens, table, pos, length, newest, block_size):
        """The context's token at `pos` (a scalar or a block of positions inside it)."""
        block = tl.load(table + pos // block_size)
        token = tl.load(tokens + block * block_size + pos % block_size)
        return tl.where(pos == length - 1, newest, token)

    # Sizes and strides change from step to step; specialising on them would compile again.
    @triton.jit(do_not_specialize=["table_stride", "rows_stride", "has_rows", "block_size", "num_drafts"])
    def _ngram_kernel(Tokens, Tables, table_stride, FirstRows, rows_stride, has_rows, Positions, Accepted, Lengths,
                      Newest, Out, block_size, num_drafts, MIN_N: tl.constexpr, MAX_N: tl.constexpr,
                      K_P2: tl.constexpr, BLOCK: tl.constexpr, FROM_STEP: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        if FROM_STEP:  # `propose_after_step`: the sequence's first row and its accepted tokens
            if has_rows != 0:
                row = tl.load(FirstRows + b * rows_stride)
                length = tl.load(Positions + row) + tl.load(Accepted + b).to(tl.int64) + 1
            else:
                row = b
                length = tl.load(Positions + row) + 2
        else:
            row = b
            length = tl.load(Lengths + b)
        table = Tables + row * table_stride
        newest = tl.load(Newest + b)
        start = length * 0 - 1
        for n in tl.static_range(MIN_N, MAX_N + 1):
            hit = length * 0 - 1
            if length - 1 >= n:
                for first0 in range(0, length - n, BLOCK):  # windows start at most at length - 1 - n
                    first = first0 + tl.arange(0, BLOCK)
                    ok = first + n <= length - 1
                    for j in tl.static_range(n):
                        want = _token_at(Tokens, table, length - n + j, length, newest, block_size)
                        got = _token_at(Tokens, table, tl.where(ok, first + j, 0), length, newest, block_size)
                        ok = ok & (got == want)
                    hit = tl.maximum(hit, tl.max(tl.where(ok, first, -1), 0))
            start = tl.where(hit >= 0, hit + n, start)
        k = tl.arange(0, K_P2)
        at = start + k
        taken = (start >= 0) & (at < length) & (k < num_drafts)
        token = _token_at(Tokens, table, tl.where(taken, at, 0), length, newest, block_size)
        tl.store(Out + b * num_drafts + k, tl.where(taken, token, -1), mask=k < num_drafts)
