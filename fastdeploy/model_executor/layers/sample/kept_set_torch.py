"""The torch kept-set backend: sorted windows decided in float64 (`truncation.kept_window`).

Any device; exact (every set settled), so it is also the oracle of the Triton backend. The
draw only looks at each row's window: its noise is drawn at the window's ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdeploy.model_executor.layers.sample.kept_set import KeptSets, NoiseFn
from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput, SamplingMetadata
from fastdeploy.model_executor.layers.sample.ops import pack_bits
from fastdeploy.model_executor.layers.sample.truncation import (
    KeptWindow,
    kept_logz,
    kept_window,
    scaled_lse,
    take_rows,
)

NEG_INF = float("-inf")
# Widest window whose kept ids are listed by sorting it rather than through a dense flag array.
SORTED_CSR_MAX_WINDOW = 4096


@dataclass
class WindowKeptSets:
    """Kept sets of T rows as sorted windows; ``x`` (float32 [T, W], proc / temperature at the
    window's ids) is set by `draw`."""

    window: KeptWindow
    proc: torch.Tensor  # float32 [T, V]
    temperature: torch.Tensor  # [T]
    x: torch.Tensor | None = None

    def draw(self, noise: NoiseFn) -> torch.Tensor:
        win = self.window
        self.x = self.proc.gather(1, win.idx) / self.temperature.unsqueeze(1)  # float32 [T, W]
        scores = self.x + noise(win.idx)
        scores.masked_fill_(~win.keep, NEG_INF)
        return win.idx.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)

    def write_processed_logits(self, final: torch.Tensor, rows: torch.Tensor) -> None:
        assert self.x is not None, "draw first"
        win = self.window
        r_ix = rows.unsqueeze(1).expand_as(win.idx)[win.keep]
        final[r_ix, win.idx[win.keep]] = self.x[win.keep]

    def unsettled(self) -> torch.Tensor | None:
        return None


class TorchKeptSetBackend:
    """`KeptSetBackend` on any device."""

    leaves_unsettled = False

    def kept_sets(
        self,
        proc: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        settle: bool,
        want_logz: torch.Tensor | None,
    ) -> WindowKeptSets:
        window = kept_window(proc, temperature, top_k, top_p, min_p, want_lse=want_logz)
        return WindowKeptSets(window, proc, temperature)

    def fill_sampling_mask(
        self,
        out: SamplerOutput,
        proc: torch.Tensor,
        meta: SamplingMetadata,
        requested: torch.Tensor,
        groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        kept: KeptSets | None,
        as_bits: torch.Tensor | None,
    ) -> None:
        assert kept is None or isinstance(kept, WindowKeptSets)
        g_rows, t_rows, p_rows = groups
        fill_sampling_mask(out, proc, requested, g_rows, t_rows, kept.window if kept is not None else None, as_bits,
                           p_rows if meta.token_bitmask is not None else None)


def fill_sampling_mask(
    out: SamplerOutput,
    proc: torch.Tensor,
    requested: torch.Tensor,
    g_rows: torch.Tensor,
    t_rows: torch.Tensor,
    win: KeptWindow | None,
    as_bits: torch.Tensor | None = None,
    guided_rows: torch.Tensor | None = None,
) -> None:
    """Kept sets as CSR (int32 offsets [B+1], ids [M] ascending per row) and logz float32 [B];
    the rows of `as_bits` (bool [B]) as bitmaps (`out.mask_bits`) with empty CSR rows.

    guided_rows: rows without truncation in a step a grammar masked (int64). Each keeps the
    ids its processed logits leave finite, logz 0, and an empty row if that is every id (a row
    the grammar does not constrain). Other rows that do not truncate, or did not ask, get an
    empty CSR row and logz 0.
    """
    device = proc.device
    b, v = proc.shape
    logz = torch.zeros(b, dtype=torch.float32, device=device)
    # The requested rows' kept ids: truncating rows from their windows, greedy rows their token.
    t_kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, window ids, kept prefix)
    g_kept: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids)
    if t_rows.numel():
        assert win is not None, "truncating rows come with their windows"
        sel = requested[t_rows]
        if bool(sel.any()):
            rows, sub = (t_rows, win) if bool(sel.all()) else (
                t_rows[sel], KeptWindow(win.idx[sel], win.x[sel], win.keep[sel], win.lse[sel]))
            t_kept = rows, sub.idx, sub.keep
            logz[rows] = kept_logz(sub).float()
    if g_rows.numel():
        rows = g_rows[requested[g_rows]]
        if rows.numel():
            tok = out.sampled_token_ids[rows]
            g_kept = rows, tok
            # Greedy rows report the argmax's mass under the temperature-1 softmax.
            x = take_rows(proc, rows)
            lse = scaled_lse(x, torch.ones(rows.numel(), device=device), exact=False)
            logz[rows] = (x.gather(1, tok.unsqueeze(1)).squeeze(1).double() - lse).float()
    out.logz = logz
    # A draw without truncation over a grammar's bitmask: its support is the allowed ids.
    p_kept: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, bool [n, V] flags)
    if guided_rows is not None and guided_rows.numel():
        rows = guided_rows[requested[guided_rows]]
        if rows.numel():
            flags = torch.isfinite(take_rows(proc, rows))
            p_kept = rows, flags & ~flags.all(dim=1, keepdim=True)

    wants_bits = as_bits is not None and bool(as_bits.any())
    if not wants_bits and p_kept is None and (t_kept is None or t_kept[1].shape[1] <= SORTED_CSR_MAX_WINDOW):
        # Narrow windows (peaked rows): each row's kept ids sorted within its window, a few
        # hundred entries, instead of a dense [B, V] flag array to select from (about 10 ms a
        # step at batch 16 with a 49k vocabulary on 2 CPU cores, for a hundred ids a row).
        width = t_kept[1].shape[1] if t_kept is not None else 1
        table = torch.full((b, width), v, dtype=torch.int64, device=device)  # v: no id
        if t_kept is not None:
            rows, idx, keep = t_kept
            table[rows] = torch.where(keep, idx, v).sort(dim=1).values
        if g_kept is not None:
            table[g_kept[0], 0] = g_kept[1]
        present = table < v
        _set_csr(out, present.sum(dim=1), table.masked_select(present))
        return

    # Every kept id is set in a dense [B, V] flag array; selecting the column ids it flags lists
    # them row by row in ascending order, which is the CSR. Sorting each row's window of ids instead cost about
    # 30 ms per step at batch 16 with 40,000-id sets (a third of a flat step on 2 CPU cores).
    kept_flags = torch.zeros(b, v, dtype=torch.bool, device=device)
    if t_kept is not None:
        rows, idx, keep = t_kept
        # A window's kept entries are a prefix that starts at its top id, which is always kept;
        # pointing the entries past the prefix at that id makes one scatter of True set exactly
        # the kept ids (about a third of the time of a boolean-indexed write of every kept id).
        ids = torch.where(keep, idx, idx[:, :1])
        if rows.numel() == b:
            kept_flags.scatter_(1, ids, True)
        else:
            kept_flags[rows] = torch.zeros(rows.numel(), v, dtype=torch.bool, device=device).scatter_(1, ids, True)
    if g_kept is not None:
        kept_flags[g_kept[0], g_kept[1]] = True
    if p_kept is not None:
        kept_flags[p_kept[0]] = p_kept[1]
    if as_bits is not None:
        out.mask_bits = pack_bits(kept_flags & as_bits.unsqueeze(1))
        if bool((as_bits | ~requested).all()):  # no row lists ids: the CSR is empty
            out.mask_offsets = torch.zeros(b + 1, dtype=torch.int32, device=device)
            out.mask_ids = torch.empty(0, dtype=torch.int32, device=device)
            return
        kept_flags[as_bits] = False
    _set_csr(out, kept_flags.sum(dim=1),
             torch.arange(v, dtype=torch.int32, device=device).expand(b, v).masked_select(kept_flags))


def _set_csr(out: SamplerOutput, counts: torch.Tensor, ids: torch.Tensor) -> None:
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    offsets[1:] = torch.cumsum(counts, dim=0)
    out.mask_offsets = offsets.to(torch.int32)
    out.mask_ids = ids.to(torch.int32)
