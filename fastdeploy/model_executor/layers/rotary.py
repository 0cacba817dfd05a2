"""Rotary position embedding (HF "rotate-half" convention), with linear / llama3 / yarn frequency scaling.

The scaled frequencies follow transformers' `modeling_rope_utils` op for op in float32, so a
model with `rope_scaling` produces the same cos/sin as its HF implementation.
"""

from __future__ import annotations

import math

import torch

from fastdeploy.common.config import RopeScaling


def _base_inv_freq(head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths divided by the factor, short ones kept, a smooth ramp between."""
    old_context_len = s.original_max_position_embeddings
    assert old_context_len is not None, "set for llama3 by hf_config"
    low_freq_wavelen = old_context_len / s.low_freq_factor
    high_freq_wavelen = old_context_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(s: RopeScaling) -> float:
    """The cos/sin multiplier of yarn: explicit, or derived from the factor (and mscale / mscale_all_dim)."""
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return float(_yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim))
    return _yarn_mscale(s.factor)


def _yarn_inv_freq(head_dim: int, base: float, s: RopeScaling, device: torch.device) -> torch.Tensor:
    """Interpolated (divided by the factor) below the correction range, extrapolated above, a ramp within."""
    original = s.original_max_position_embeddings
    assert original is not None, "set for yarn by hf_config"

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (s.factor * pos_freqs)
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def rope_inv_freq(
    head_dim: int, base: float, scaling: RopeScaling | None, device: torch.device
) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies [head_dim / 2] and the multiplier of cos/sin (1 except for yarn)."""
    if scaling is None:
        return _base_inv_freq(head_dim, base, device), 1.0
    if scaling.rope_type == "linear":
        return _base_inv_freq(head_dim, base, device) / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(head_dim, base, device), scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling, device), yarn_attention_factor(scaling)
    raise ValueError(f"rope_type {scaling.rope_type!r} is not implemented")


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, head_dim] for absolute `positions` [T].

    Angles are computed in float32 from the positions themselves (no cached
    table), so any position up to the model's limit is exact and no buffer has
    to follow the model across devices or dtypes. The few ops that build the
    frequencies run on the device without a host sync, so CUDA graphs capture them.
    """
    inv_freq, attention_factor = rope_inv_freq(head_dim, base, scaling, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [T, heads, head_dim] with cos/sin [T, head_dim]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin
