"""The kept set behind one interface: what the sampler asks of top-k / top-p / min-p.

The kept set of a truncating row is the support the sampler draws from after top-k, top-p
(on the top-k renormalised mass) and min-p. A row without truncation draws from every id its
processed logits leave finite: the whole vocabulary (a null mask), unless a grammar's bitmask
disallowed some, and then those it allowed. Two backends compute them:

* `kept_set_torch.TorchKeptSetBackend`: sorted windows decided in float64, any device; the
  exact oracle the other backend is held to.
* `kept_set_triton.TritonKeptSetBackend`: sort-free Triton kernels (CUDA).

The sampler picks one per device (`sampler.kept_set_backend`) and uses only the operations below: the
draw, the processed logits of the kept entries, the rows it could not settle, and the sampling
mask (CSR ids, bitmaps and logZ).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from fastdeploy.model_executor.layers.sample.metadata import SamplerOutput, SamplingMetadata

# A sampled token id (in `SamplerOutput.sampled_token_ids`, and so in the worker's packed
# frame) for a row whose kept set the GPU kernel could not settle: its draw came from a superset
# and must not be used; the worker samples the step again with settled sets. -1 pads draft slots.
UNSETTLED_TOKEN = -2

# Entries of the sampling mask's row slots (`RowGroups.mask_slots`, int32 [B], read by the CUDA
# mask kernel): a truncating row holds its index (>= 0) among the truncating rows, a row without
# truncation PLAIN_SLOT, a greedy row GREEDY_SLOT. Slot numbers, not token ids: GREEDY_SLOT has a
# value of its own so that it is never read as UNSETTLED_TOKEN.
PLAIN_SLOT = -1
GREEDY_SLOT = -3

# Gumbel noise for the truncating rows: float32 [T, V], or [T, W] at the ids given (int64 [T, W]).
NoiseFn = Callable[[torch.Tensor | None], torch.Tensor]


class KeptSets(Protocol):
    """Kept sets of a step's truncating rows (T of them), as a backend holds them."""

    def draw(self, noise: NoiseFn) -> torch.Tensor:
        """int64 [T]: a Gumbel-max draw over each row's kept set of proc / temperature."""
        ...

    def write_processed_logits(self, final: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes proc / temperature of the kept entries into ``final`` (float32 [B, V], -inf
        elsewhere) at batch rows ``rows`` (int64 [T]). Only after `draw`."""
        ...

    def unsettled(self) -> torch.Tensor | None:
        """bool [T]: rows whose kept set is a superset (their draw is void); None where every
        set is exact."""
        ...


class KeptSetBackend(Protocol):
    """How one device computes kept sets and the sampling mask built from them."""

    # Whether `KeptSets.unsettled` can report rows without `settle` (so a step may need a redraw).
    leaves_unsettled: bool

    def kept_sets(
        self,
        proc: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        settle: bool,
        want_logz: torch.Tensor | None,
    ) -> KeptSets:
        """Kept sets of truncating, non-greedy rows.

        proc: float32 [T, V] processed logits (before temperature). temperature: [T] (> 0).
        top_k: int64 [T] (0 = off). top_p: [T] (1 = off). min_p: [T] (0 = off).
        settle: every set exact, at the cost of a host read where a backend may leave sets
        unsettled. want_logz: bool [T], rows whose logZ the sampling mask needs (None: none).
        """
        ...

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
        """Sets ``out.mask_offsets``, ``out.mask_ids``, ``out.logz`` and, where ``as_bits`` (bool
        [B]) is given, ``out.mask_bits``: kept sets of the requested rows (bool [B]) as CSR,
        the rows of ``as_bits`` as bitmaps with empty CSR rows.

        proc: float32 [B, V]. groups: the greedy, truncating and plain rows (int64); a greedy
        row keeps its sampled token (``out.sampled_token_ids``), with logZ its mass under the
        temperature-1 softmax. Where ``meta.token_bitmask`` is set, a plain row keeps the ids
        whose processed logits are finite (logZ 0: the draw's whole mass), and is empty if that
        is every id; otherwise plain rows, and rows that did not ask, are empty with logZ 0.
        kept: the truncating rows' sets (None without such rows).
        """
        ...
