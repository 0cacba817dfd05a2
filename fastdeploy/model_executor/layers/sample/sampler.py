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

import torch

from fastdeploy.model_executor.layers.sample import kept_set_gpu
from fastdeploy.model_executor.layers.sample.kept_set import UNSETTLED_TOKEN, KeptSetBackend, KeptSets
from fastdeploy.model_executor.layers.sample.kept_set_torch import TorchKeptSetBackend
from fastdeploy.model_executor.layers.sample.kept_set_triton import TritonKeptSetBackend
from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput, SamplingMetadata
from fastdeploy.model_executor.layers.sample.ops import (
    apply_logit_bias_,
    apply_penalties_,
    apply_temperature,
    apply_token_bitmask_,
)
from fastdeploy.model_executor.layers.sample.truncation import take_rows, truncation_flags

__all__ = ["UNSETTLED_TOKEN", "Sampler", "gumbel_noise", "kept_set_backend", "process_logits"]

NEG_INF = float("-inf")


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
    return greedy.nonzero().squeeze(1), trunc.nonzero().squeeze(1), plain.nonzero().squeeze(1)


def _gather_log_probs(
    lp: torch.Tensor, sampled: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def kept_set_backend(device: torch.device) -> KeptSetBackend:
    """The kept-set backend for ``device``: Triton's sort-free kernels on CUDA with Triton, the
    torch windows elsewhere."""
    if kept_set_gpu.uses_fast_path(device):
        return TritonKeptSetBackend()
    return TorchKeptSetBackend()


class Sampler:
    """Callable sampler; stateless apart from configuration.

    ``Sampler(device)(logits, meta)``: logits float32 [B, V] (not modified), meta a
    SamplingMetadata for those B rows. Returns SamplerOutput. A sampler serves one device: its
    kept-set backend is ``kept_sets`` where given, else chosen from ``device`` here, or from the
    first call's logits where no device is given.
    """

    def __init__(self, device: torch.device | str | None = None, kept_sets: KeptSetBackend | None = None) -> None:
        if kept_sets is None and device is not None:
            kept_sets = kept_set_backend(torch.device(device))
        self._kept_sets = kept_sets

    @property
    def leaves_unsettled(self) -> bool:
        """Whether a call without ``settle_kept_sets`` may mark tokens ``UNSETTLED_TOKEN``."""
        return self._kept_sets is not None and self._kept_sets.leaves_unsettled

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, settle_kept_sets: bool = False) -> SamplerOutput:
        """On CUDA, a truncating row whose kept set the kernel could not settle gets the token
        ``UNSETTLED_TOKEN`` (no host sync spent on finding out); ``settle_kept_sets=True``
        settles every set before the draw instead (one host read). Elsewhere every set is exact."""
        if self._kept_sets is None:
            self._kept_sets = kept_set_backend(logits.device)
        with torch.no_grad():
            return self._sample(logits, meta, settle_kept_sets, self._kept_sets)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, settle: bool,
                backend: KeptSetBackend) -> SamplerOutput:
        device = logits.device
        b, v = logits.shape
        if b == 0:
            return _empty_output(meta, device)

        proc = process_logits(logits, meta)  # float32 [B, V]
        temperature = meta.temperature.to(device)
        g_rows, t_rows, p_rows = _row_groups(meta, temperature)
        _, t_host, p_host = meta.row_groups.host if meta.row_groups is not None else (None, None, None)
        requested = meta.return_sampling_mask.to(device=device, dtype=torch.bool) \
            if meta.return_sampling_mask is not None else None
        # Rows whose kept sets go out as bitmaps, built here on the device: a bitmap's V/8 bytes
        # cross PCIe instead of 4 bytes per kept id, and their CSR rows stay empty.
        as_bits = None
        if requested is not None and meta.mask_bitmap_rows is not None:
            as_bits = meta.mask_bitmap_rows.to(device=device, dtype=torch.bool) & requested

        sampled = torch.empty(b, dtype=torch.int64, device=device)
        if g_rows.numel():
            sampled[g_rows] = take_rows(proc, g_rows).argmax(dim=1)

        # Truncating rows: the backend's kept sets; the draw (Gumbel-max over the kept entries =
        # a draw from the renormalised kept distribution) looks only at those.
        kept: KeptSets | None = None
        if t_rows.numel():
            kept = backend.kept_sets(
                take_rows(proc, t_rows),
                temperature[t_rows],
                meta.top_k[t_rows],
                meta.top_p[t_rows],
                meta.min_p[t_rows],
                settle=settle,
                want_logz=requested[t_rows] if requested is not None else None,
            )

            def noise(idx: torch.Tensor | None) -> torch.Tensor:
                return gumbel_noise(t_rows, v, meta.generators, device, idx=idx, row_list=t_host)

            sampled[t_rows] = kept.draw(noise)

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
                if x_p is not None:
                    final[p_rows] = x_p
                if kept is not None:
                    kept.write_processed_logits(final, t_rows)
                if g_rows.numel():
                    final[g_rows, sampled[g_rows]] = 0.0
                lp = torch.log_softmax(final, dim=1)
            else:
                lp = torch.log_softmax(logits.float(), dim=1)
            out.logprob_token_ids, out.logprobs, out.sampled_token_ranks = _gather_log_probs(lp, sampled, k)

        # Rows the kernel left unsettled (only without `settle`) get the redraw marker below.
        unsettled = kept.unsettled() if kept is not None else None
        if requested is not None:
            backend.fill_sampling_mask(out, proc, meta, requested, (g_rows, t_rows, p_rows), kept, as_bits)
        if unsettled is not None:
            out.sampled_token_ids[t_rows] = torch.where(unsettled, UNSETTLED_TOKEN, sampled[t_rows])
        return out
