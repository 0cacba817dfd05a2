"""Shared builders for sampler tests."""

from __future__ import annotations

import numpy as np
import torch

from fastdeploy.model_executor.layers.sample.metadata import SamplingMetadata
from fastdeploy.model_executor.layers.sample.ops import pack_bits


def make_meta(
    batch: int,
    *,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    min_p: float | list[float] = 0.0,
    repetition_penalty: float | list[float] = 1.0,
    presence_penalty: float | list[float] = 0.0,
    frequency_penalty: float | list[float] = 0.0,
    prompt_token_ids: torch.Tensor | None = None,
    output_token_ids: torch.Tensor | None = None,
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    generators: list[torch.Generator | None] | None = None,
    max_num_logprobs: int = -1,
    logprobs_mode: str = "raw_logprobs",
    return_sampling_mask: bool | list[bool] | None = None,
    token_bitmask: torch.Tensor | None = None,
) -> SamplingMetadata:
    """SamplingMetadata for `batch` rows; scalars broadcast to every row."""

    def vec(x, dtype):
        if isinstance(x, (list, tuple)):
            return torch.tensor(x, dtype=dtype)
        return torch.full((batch,), x, dtype=dtype)

    mask = None
    if return_sampling_mask is not None:
        mask = vec(return_sampling_mask, torch.bool)
    rows, cols, vals = logit_bias if logit_bias is not None else (None, None, None)
    return SamplingMetadata(
        temperature=vec(temperature, torch.float32),
        top_k=vec(top_k, torch.int64),
        top_p=vec(top_p, torch.float32),
        min_p=vec(min_p, torch.float32),
        repetition_penalty=vec(repetition_penalty, torch.float32),
        presence_penalty=vec(presence_penalty, torch.float32),
        frequency_penalty=vec(frequency_penalty, torch.float32),
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
        logit_bias_rows=rows,
        logit_bias_cols=cols,
        logit_bias_values=vals,
        generators=generators if generators is not None else [None] * batch,
        max_num_logprobs=max_num_logprobs,
        logprobs_mode=logprobs_mode,
        return_sampling_mask=mask,
        token_bitmask=token_bitmask,
    )


def csr_row(out, r: int) -> list[int]:
    """Kept ids of row r from a SamplerOutput's CSR mask."""
    a, b = int(out.mask_offsets[r]), int(out.mask_offsets[r + 1])
    return out.mask_ids[a:b].tolist()


def token_bitmask(allowed: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A grammar's int32 bitmask [B, ceil(V / 32)] (bit j of word w allows id 32 w + j, as
    xgrammar fills it) from bool [B, V] allowed ids."""
    flags = torch.as_tensor(np.asarray(allowed, dtype=np.bool_))
    flags = torch.nn.functional.pad(flags, (0, -flags.shape[1] % 32))
    return pack_bits(flags).view(torch.int32)
