"""The sampler: logits [B, V] + SamplingMetadata -> SamplerOutput.

Pipeline per row (normative; docs/sampling.md describes it for users):
logit_bias -> token bitmask -> repetition / frequency / presence penalties ->
temperature -> softmax p -> top-k -> top-p (on the top-k renormalised mass) ->
min-p -> draw over the kept set. Temperature 0 is greedy (argmax of the processed
logits, kept set = {argmax}).

Everything is batched; the only Python loop is over seeded rows, to draw each
row's noise vector from its own generator so a seeded request's tokens do not
depend on its neighbours in the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from fastdeploy.model_executor.layers.sample import kept_set_gpu
from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput, SamplingMetadata
from fastdeploy.model_executor.layers.sample.ops import (
    apply_logit_bias_,
    apply_penalties_,
    apply_temperature,
    apply_token_bitmask_,
    pack_bits,
)
from fastdeploy.model_executor.layers.sample.truncation import (
    KeptWindow,
    kept_logz,
    kept_window,
    scaled_lse,
    take_rows,
    truncation_flags,
)

NEG_INF = float("-inf")
# Token id given to a row whose kept set the GPU kernel could not settle, so its draw (from a
# superset) must not be used: the caller redoes the step's sampling with settled sets.
# Distinct from -1, the padding of draft slots.
UNSETTLED_TOKEN = -2


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Bias, bitmask and penalties. Returns float32 [B, V]; never modifies ``logits``."""
    has_bias = meta.logit_bias_rows is not None and meta.logit_bias_rows.numel() > 0
    has_mask = meta.token_bitmask is not None
    has_pen = meta.prompt_token_ids is not None or meta.output_token_ids is not None
    out = logits.float()
    if not (has_bias or has_mask or has_pen):
        return out
    if out.data_ptr() == logits.data_ptr():
        out = out.clone()  # raw logprobs need the original values
    apply_logit_bias_(out, meta.logit_bias_rows, meta.logit_bias_cols, meta.logit_bias_values)
    apply_token_bitmask_(out, meta.token_bitmask)
    if has_pen:
        apply_penalties_(
            out,
            meta.prompt_token_ids,
            meta.output_token_ids,
            meta.repetition_penalty,
            meta.presence_penalty,
            meta.frequency_penalty,
        )
    return out


def gumbel_noise(
    rows: torch.Tensor,
    vocab_size: int,
    generators: list[torch.Generator | None],
    device: torch.device,
    idx: torch.Tensor | None = None,
    row_list: list[int] | None = None,
) -> torch.Tensor:
    """Standard Gumbel noise for ``rows``: float32 [n, V], or [n, W] at ids ``idx`` (int64 [n, W]).

    Seeded rows (``generators[row]`` not None) always draw exactly V uniforms from
    their own generator (gathered at ``idx`` if given), so their noise per token is
    independent of batch composition. Unseeded rows share one batched draw from the
    default generator, of only W values when ``idx`` is given. ``row_list`` is ``rows`` on
    the host where the caller has it (reading it back from the device would synchronise).
    """
    n = rows.numel()
    width = vocab_size if idx is None else idx.shape[1]
    if all(g is None for g in generators):
        return _gumbel(torch.rand(n, width, device=device))
    if row_list is None:
        row_list = rows.tolist()
    seeded = [i for i, r in enumerate(row_list) if generators[r] is not None]
    if not seeded:
        u = torch.rand(n, width, device=device)
    else:
        u = torch.empty(n, width, device=device)
        unseeded = [i for i, r in enumerate(row_list) if generators[r] is None]
        if unseeded:
            at = torch.tensor(unseeded, device=device)
            u.index_copy_(0, at, torch.rand(len(unseeded), width, device=device))
        for i in seeded:
            full = torch.rand(vocab_size, device=device, generator=generators[row_list[i]])
            u[i] = full if idx is None else full[idx[i]]
    return _gumbel(u)


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    """g = -log(-log u), in place. u == 0 gives g = -inf: that token just loses (probability 2^-24)."""
    return u.log_().neg_().log_().neg_()


def _row_groups(meta: SamplingMetadata, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy, truncating and plain rows (int64 index tensors): the host's split where given,
    else derived on the device (three `nonzero()` calls, each a synchronisation on CUDA)."""
    if meta.row_groups is not None:
        return meta.row_groups.greedy, meta.row_groups.truncated, meta.row_groups.plain
    greedy = temperature <= 0
    trunc = truncation_flags(meta.top_k, meta.top_p, meta.min_p).to(temperature.device) & ~greedy
    plain = ~greedy & ~trunc
    return tuple(m.nonzero().squeeze(1) for m in (greedy, trunc, plain))


def _mask_slots(meta: SamplingMetadata, b: int, g_rows: torch.Tensor, t_rows: torch.Tensor) -> torch.Tensor:
    """int32 [B] row slots for the CUDA mask kernel (see `RowGroups.mask_slots`): the host's
    where given, else scattered on the device."""
    if meta.row_groups is not None and meta.row_groups.mask_slots is not None:
        return meta.row_groups.mask_slots
    slots = torch.full((b,), -1, dtype=torch.int32, device=t_rows.device)
    slots[g_rows] = kept_set_gpu.GREEDY_SLOT
    slots[t_rows] = torch.arange(t_rows.numel(), dtype=torch.int32, device=t_rows.device)
    return slots


def _mask_capacity(meta: SamplingMetadata, v: int, num_truncated: int) -> int:
    """The most ids the truncating rows' kept sets can hold: top_k where the host gave it
    (a kept set never exceeds it), else the whole vocabulary per row."""
    top_k = meta.row_groups.truncated_top_k if meta.row_groups is not None else None
    if top_k is None:
        return num_truncated * v
    return int(np.where(top_k > 0, np.minimum(top_k, v), v).sum())


def _gather_log_probs(lp: torch.Tensor, sampled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Column 0 = sampled token, 1..k = top-k; ranks = 1 + #tokens with strictly larger logprob."""
    sampled_lp = lp.gather(1, sampled.unsqueeze(1))
    top_vals, top_ids = torch.topk(lp, k, dim=1) if k > 0 else (lp[:, :0], sampled.new_empty(lp.shape[0], 0))
    ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
    vals = torch.cat([sampled_lp, top_vals], dim=1).float()
    ranks = (lp > sampled_lp).sum(dim=1).to(torch.int64) + 1
    return ids, vals, ranks


def _empty_output(meta: SamplingMetadata, device: torch.device) -> SamplerOutput:
    k = max(meta.max_num_logprobs, 0)
    want_lp = meta.max_num_logprobs >= 0
    want_mask = meta.return_sampling_mask is not None
    return SamplerOutput(
        sampled_token_ids=torch.empty(0, dtype=torch.int64, device=device),
        logprob_token_ids=torch.empty(0, k + 1, dtype=torch.int64, device=device) if want_lp else None,
        logprobs=torch.empty(0, k + 1, dtype=torch.float32, device=device) if want_lp else None,
        sampled_token_ranks=torch.empty(0, dtype=torch.int64, device=device) if want_lp else None,
        mask_offsets=torch.zeros(1, dtype=torch.int32, device=device) if want_mask else None,
        mask_ids=torch.empty(0, dtype=torch.int32, device=device) if want_mask else None,
        logz=torch.empty(0, dtype=torch.float32, device=device) if want_mask else None,
    )


class Sampler:
    """Callable sampler; stateless apart from configuration.

    ``Sampler()(logits, meta)``: logits float32 [B, V] (not modified), meta a
    SamplingMetadata for those B rows. Returns SamplerOutput.
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, settle_kept_sets: bool = False) -> SamplerOutput:
        """On CUDA, a truncating row whose kept set the kernel could not settle gets the token
        ``UNSETTLED_TOKEN`` (no host sync spent on finding out); ``settle_kept_sets=True``
        settles every set before the draw instead (one host read). Elsewhere every set is exact."""
        with torch.no_grad():
            return self._sample(logits, meta, settle_kept_sets)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, settle: bool) -> SamplerOutput:
        device = logits.device
        b, v = logits.shape
        if b == 0:
            return _empty_output(meta, device)

        proc = process_logits(logits, meta)  # float32 [B, V]
        temperature = meta.temperature.to(device)
        g_rows, t_rows, p_rows = _row_groups(meta, temperature)
        _, t_host, p_host = meta.row_groups.host if meta.row_groups is not None else (None, None, None)
        want_mask = meta.return_sampling_mask is not None
        requested = meta.return_sampling_mask.to(device=device, dtype=torch.bool) if want_mask else None
        # Rows whose kept sets go out as bitmaps, built here on the device: a bitmap's V/8 bytes
        # cross PCIe instead of 4 bytes per kept id, and their CSR rows stay empty.
        as_bits = None
        if want_mask and meta.mask_bitmap_rows is not None:
            as_bits = meta.mask_bitmap_rows.to(device=device, dtype=torch.bool) & requested

        sampled = torch.empty(b, dtype=torch.int64, device=device)
        if g_rows.numel():
            sampled[g_rows] = take_rows(proc, g_rows).argmax(dim=1)

        # Truncating rows: kept set as a sorted window, decided in float64; the draw
        # (Gumbel-max over the kept entries = a draw from the renormalised kept
        # distribution) only looks at the window.
        win = x_t = kept = None
        fast = kept_set_gpu.uses_fast_path(device)  # CUDA: sort-free kept set as a dense mask
        if t_rows.numel() and fast:
            proc_t = take_rows(proc, t_rows)
            kept = kept_set_gpu.kept_set(
                proc_t, temperature[t_rows], meta.top_k[t_rows], meta.top_p[t_rows], meta.min_p[t_rows], settle
            )
            x_t = apply_temperature(proc_t, temperature[t_rows])  # float32 [T, V]
            noise = gumbel_noise(t_rows, v, meta.generators, device, row_list=t_host)
            scores = (x_t + noise).masked_fill_(~kept.mask, NEG_INF)
            sampled[t_rows] = scores.argmax(dim=1)
        elif t_rows.numel():
            proc_t = take_rows(proc, t_rows)
            win = kept_window(
                proc_t,
                temperature[t_rows],
                meta.top_k[t_rows],
                meta.top_p[t_rows],
                meta.min_p[t_rows],
                want_lse=requested[t_rows] if want_mask else None,
            )
            x_t = proc_t.gather(1, win.idx) / temperature[t_rows].unsqueeze(1)  # float32 [T, W]
            scores = x_t + gumbel_noise(t_rows, v, meta.generators, device, idx=win.idx, row_list=t_host)
            scores.masked_fill_(~win.keep, NEG_INF)
            sampled[t_rows] = win.idx.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)

        # Rows without truncation draw over the whole vocabulary (-inf tokens never win).
        x_p = None
        if p_rows.numel():
            x_p = apply_temperature(take_rows(proc, p_rows), temperature[p_rows])
            scores = x_p + gumbel_noise(p_rows, v, meta.generators, device, row_list=p_host)
            sampled[p_rows] = scores.argmax(dim=1)

        out = SamplerOutput(
            sampled_token_ids=sampled,
            logprob_token_ids=None,
            logprobs=None,
            sampled_token_ranks=None,
            mask_offsets=None,
            mask_ids=None,
            logz=None,
        )

        if meta.max_num_logprobs >= 0:
            k = min(meta.max_num_logprobs, v)
            if meta.logprobs_mode == "processed_logprobs":
                # The final sampling distribution: -inf outside the kept set.
                final = torch.full((b, v), NEG_INF, device=device)
                if p_rows.numel():
                    final[p_rows] = x_p
                if t_rows.numel() and fast:
                    final[t_rows] = x_t.masked_fill(~kept.mask, NEG_INF)
                elif t_rows.numel():
                    r_ix = t_rows.unsqueeze(1).expand_as(win.idx)[win.keep]
                    final[r_ix, win.idx[win.keep]] = x_t[win.keep]
                if g_rows.numel():
                    final[g_rows, sampled[g_rows]] = 0.0
                lp = torch.log_softmax(final, dim=1)
            else:
                lp = torch.log_softmax(logits.float(), dim=1)
            out.logprob_token_ids, out.logprobs, out.sampled_token_ranks = _gather_log_probs(lp, sampled, k)

        # Rows the kernel left unsettled (only without `settle`) get the redraw marker below.
        unsettled = kept.bounds.failed != 0 if kept is not None and not settle else None
        if want_mask and fast:
            slots = _mask_slots(meta, b, g_rows, t_rows)
            capacity = _mask_capacity(meta, v, t_rows.numel()) + g_rows.numel()
            kept_set_gpu.fill_sampling_mask_dense(out, proc, requested, slots, capacity, kept, skip_rows=as_bits)
            if as_bits is not None:
                flags = torch.zeros(b, v, dtype=torch.bool, device=device)
                if t_rows.numel():
                    flags[t_rows] = kept.mask
                if g_rows.numel():
                    flags[g_rows, sampled[g_rows]] = True
                out.mask_bits = pack_bits(flags & as_bits.unsqueeze(1))
        elif want_mask:
            _fill_sampling_mask(out, proc, requested, g_rows, t_rows, win, as_bits)
        if unsettled is not None:
            out.sampled_token_ids[t_rows] = torch.where(unsettled, UNSETTLED_TOKEN, sampled[t_rows])
        return out


def _fill_sampling_mask(
    out: SamplerOutput,
    proc: torch.Tensor,
    requested: torch.Tensor,
    g_rows: torch.Tensor,
    t_rows: torch.Tensor,
    win: KeptWindow | None,
    as_bits: torch.Tensor | None = None,
) -> None:
    """Kept sets as CSR (int32 offsets [B+1], ids [M] ascending per row) and logz float32 [B];
    the rows of `as_bits` (bool [B]) as bitmaps (`out.mask_bits`) with empty CSR rows.

    Rows that do not truncate, or did not ask, get an empty CSR row and logz 0.
    """
    device = proc.device
    b, v = proc.shape
    logz = torch.zeros(b, dtype=torch.float32, device=device)
    # Every kept id is set in a dense [B, V] flag array; selecting the column ids it flags lists
    # them row by row in ascending order, which is the CSR. Sorting each row's window of ids instead cost about
    # 30 ms per step at batch 16 with 40,000-id sets (a third of a flat step on 2 CPU cores).
    kept_flags = torch.zeros(b, v, dtype=torch.bool, device=device)

    if t_rows.numel():
        sel = requested[t_rows]
        if bool(sel.all()):
            rows, sub = t_rows, win
        elif bool(sel.any()):
            rows, sub = t_rows[sel], KeptWindow(win.idx[sel], win.x[sel], win.keep[sel], win.lse[sel])
        else:
            rows, sub = None, None
        if rows is not None:
            # A window's kept entries are a prefix that starts at its top id, which is always kept;
            # pointing the entries past the prefix at that id makes one scatter of True set exactly
            # the kept ids (about a third of the time of a boolean-indexed write of every kept id).
            ids = torch.where(sub.keep, sub.idx, sub.idx[:, :1])
            if rows.numel() == b:
                kept_flags.scatter_(1, ids, True)
            else:
                kept_flags[rows] = torch.zeros(rows.numel(), v, dtype=torch.bool, device=device).scatter_(1, ids, True)
            logz[rows] = kept_logz(sub).float()
    if g_rows.numel():
        rows = g_rows[requested[g_rows]]
        if rows.numel():
            tok = out.sampled_token_ids[rows]
            kept_flags[rows, tok] = True
            # Greedy rows report the argmax's mass under the temperature-1 softmax.
            x = take_rows(proc, rows)
            lse = scaled_lse(x, torch.ones(rows.numel(), device=device), exact=False)
            logz[rows] = (x.gather(1, tok.unsqueeze(1)).squeeze(1).double() - lse).float()

    out.logz = logz
    if as_bits is not None:
        out.mask_bits = pack_bits(kept_flags & as_bits.unsqueeze(1))
        if bool((as_bits | ~requested).all()):  # no row lists ids: the CSR is empty
            out.mask_offsets = torch.zeros(b + 1, dtype=torch.int32, device=device)
            out.mask_ids = torch.empty(0, dtype=torch.int32, device=device)
            return
        kept_flags[as_bits] = False
    offsets = torch.zeros(b + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(kept_flags.sum(dim=1), dim=0)
    out.mask_ids = torch.arange(v, dtype=torch.int32, device=device).expand(b, v).masked_select(kept_flags)
    out.mask_offsets = offsets.to(torch.int32)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """Functional form of ``Sampler()(logits, meta)``."""
    return Sampler()(logits, meta)
