"""The sampler: logits [B, V] + SamplingMetadata -> SamplerOutput.

Pipeline per row (normative, see DESIGN.md "Sampler semantics"):
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

from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput, SamplingMetadata
from fastdeploy.model_executor.layers.sample.ops import (
    apply_logit_bias_,
    apply_penalties_,
    apply_temperature,
    apply_token_bitmask_,
)
from fastdeploy.model_executor.layers.sample.truncation import kept_logz, kept_set, truncation_flags

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


def gumbel_noise(rows: torch.Tensor, vocab_size: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise, float32 [len(rows), V].

    Seeded rows (``generators[row]`` not None) draw exactly V uniforms from their own
    generator, so their noise is independent of batch composition; the others share
    one batched draw from the default generator.
    """
    n = rows.numel()
    row_list = rows.tolist()
    seeded = [i for i, r in enumerate(row_list) if generators[r] is not None]
    if not seeded:
        u = torch.rand(n, vocab_size, device=device)
    else:
        u = torch.empty(n, vocab_size, device=device)
        unseeded = [i for i, r in enumerate(row_list) if generators[r] is None]
        if unseeded:
            idx = torch.tensor(unseeded, device=device)
            u.index_copy_(0, idx, torch.rand(len(unseeded), vocab_size, device=device))
        for i in seeded:
            u[i] = torch.rand(vocab_size, device=device, generator=generators[row_list[i]])
    # g = -log(-log u). u == 0 gives g = -inf: that token just loses (probability 2^-24).
    return u.log_().neg_().log_().neg_()


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

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        with torch.no_grad():
            return self._sample(logits, meta)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        device = logits.device
        b, v = logits.shape
        if b == 0:
            return _empty_output(meta, device)

        proc = process_logits(logits, meta)  # float32 [B, V]
        greedy = meta.temperature <= 0
        trunc = truncation_flags(meta.top_k, meta.top_p, meta.min_p) & ~greedy
        g_rows = greedy.nonzero().squeeze(1)
        ng_rows = (~greedy).nonzero().squeeze(1)
        t_rows = trunc.nonzero().squeeze(1)
        n_g, n_ng, n_t = g_rows.numel(), ng_rows.numel(), t_rows.numel()

        sampled = torch.empty(b, dtype=torch.int64, device=device)
        if n_g:
            sampled[g_rows] = proc.index_select(0, g_rows).argmax(dim=1)

        # Kept set of truncating rows, decided in float64 (see truncation.py).
        keep_t = lse_t = scaled_t = None
        if n_t:
            scaled_t = apply_temperature(proc.index_select(0, t_rows).double(), meta.temperature.index_select(0, t_rows))
            keep_t, lse_t = kept_set(
                scaled_t,
                meta.top_k.index_select(0, t_rows),
                meta.top_p.index_select(0, t_rows),
                meta.min_p.index_select(0, t_rows),
            )

        need_scaled32 = n_ng > 0 or (meta.max_num_logprobs >= 0 and meta.logprobs_mode == "processed_logprobs")
        scaled = apply_temperature(proc, meta.temperature) if need_scaled32 else None

        if n_ng:
            # Gumbel-max over the kept set == a draw from the renormalised kept distribution.
            all_ng = n_ng == b
            scores = scaled.clone() if all_ng else scaled.index_select(0, ng_rows)
            scores.add_(gumbel_noise(ng_rows, v, meta.generators, device))
            if n_t:
                pos = t_rows if all_ng else torch.searchsorted(ng_rows, t_rows)
                scores[pos] = scores[pos].masked_fill(~keep_t, NEG_INF)
            sampled[ng_rows] = scores.argmax(dim=1)

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
                final = scaled.clone()
                if n_t:
                    final[t_rows] = final[t_rows].masked_fill(~keep_t, NEG_INF)
                lp = torch.log_softmax(final, dim=1)
                if n_g:
                    onehot = torch.zeros(n_g, v, dtype=torch.bool, device=device)
                    onehot.scatter_(1, sampled[g_rows].unsqueeze(1), True)
                    lp[g_rows] = torch.zeros(n_g, v, device=device).masked_fill_(~onehot, NEG_INF)
            else:
                lp = torch.log_softmax(logits.float(), dim=1)
            out.logprob_token_ids, out.logprobs, out.sampled_token_ranks = _gather_log_probs(lp, sampled, k)

        if meta.return_sampling_mask is not None:
            self._fill_sampling_mask(out, meta, proc, greedy, t_rows, keep_t, lse_t, scaled_t)
        return out

    @staticmethod
    def _fill_sampling_mask(
        out: SamplerOutput,
        meta: SamplingMetadata,
        proc: torch.Tensor,
        greedy: torch.Tensor,
        t_rows: torch.Tensor,
        keep_t: torch.Tensor | None,
        lse_t: torch.Tensor | None,
        scaled_t: torch.Tensor | None,
    ) -> None:
        """Kept sets as CSR (int32 offsets [B+1], ids [M]) and logz float32 [B]."""
        device = proc.device
        b, v = proc.shape
        requested = meta.return_sampling_mask.to(device=device, dtype=torch.bool)
        trunc = torch.zeros(b, dtype=torch.bool, device=device)
        trunc[t_rows] = True
        req_rows = (requested & (trunc | greedy)).nonzero().squeeze(1)
        logz = torch.zeros(b, dtype=torch.float32, device=device)
        counts = torch.zeros(b, dtype=torch.int64, device=device)
        if req_rows.numel() == 0:
            out.mask_offsets = torch.zeros(b + 1, dtype=torch.int32, device=device)
            out.mask_ids = torch.empty(0, dtype=torch.int32, device=device)
            out.logz = logz
            return

        sel = torch.zeros(req_rows.numel(), v, dtype=torch.bool, device=device)
        req_t = req_rows[trunc[req_rows]]
        if req_t.numel():
            pos_t = torch.searchsorted(t_rows, req_t)
            sel[torch.searchsorted(req_rows, req_t)] = keep_t[pos_t]
            logz[req_t] = kept_logz(scaled_t[pos_t], keep_t[pos_t], lse_t[pos_t]).float()
        req_g = req_rows[greedy[req_rows]]
        if req_g.numel():
            tok = out.sampled_token_ids[req_g]
            sel[torch.searchsorted(req_rows, req_g), tok] = True
            # Greedy rows report the argmax's mass under the temperature-1 softmax.
            x = proc.index_select(0, req_g).double()
            logz[req_g] = (x.gather(1, tok.unsqueeze(1)).squeeze(1) - torch.logsumexp(x, dim=1)).float()

        counts[req_rows] = sel.sum(dim=1)
        offsets = torch.zeros(b + 1, dtype=torch.int64, device=device)
        offsets[1:] = torch.cumsum(counts, dim=0)
        # Row-major nonzero lists ids ascending within each row, rows in order.
        out.mask_ids = sel.nonzero()[:, 1].to(torch.int32)
        out.mask_offsets = offsets.to(torch.int32)
        out.logz = logz


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """Functional form of ``Sampler()(logits, meta)``."""
    return Sampler()(logits, meta)
