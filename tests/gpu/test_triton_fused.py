"""Fused Triton norm / RoPE / SiLU*mul on CUDA vs float64 references of the PyTorch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdeploy.model_executor.layers.rotary import apply_rope, rope_cos_sin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "cols"), [(1, 576), (37, 4096), (300, 3584)])
def test_add_rms_norm(dtype: torch.dtype, rows: int, cols: int) -> None:
    from fastdeploy.model_executor.layers.triton_fused import add_rms_norm

    x, r = torch.randn(rows, cols, dtype=torch.float64), torch.randn(rows, cols, dtype=torch.float64)
    w = torch.rand(cols, dtype=torch.float64) + 0.5
    s = x + r
    ref = w * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref_plain = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    xd, rd, wd = (t.to("cuda", dtype) for t in (x, r, w))
    out, res = add_rms_norm(xd, rd, wd, 1e-5)
    plain = add_rms_norm(xd, None, wd, 1e-5)
    assert _rel_err(out, ref) < TOL[dtype]
    assert _rel_err(plain, ref_plain) < TOL[dtype]
    torch.testing.assert_close(res, xd + rd, atol=0, rtol=0)  # the residual sum, rounded like torch's add


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (28, 4, 128)])
def test_rope_in_place_on_fused_qkv(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    from fastdeploy.model_executor.layers.triton_fused import rope_

    tokens = 50
    positions = torch.randint(0, 8000, (tokens,))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.float64)
    cos, sin = rope_cos_sin(positions, head_dim, 500000.0, torch.float64)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    ref = qkv.clone()
    ref[:, :q_end] = apply_rope(qkv[:, :q_end].view(tokens, heads, head_dim), cos, sin).reshape(tokens, -1)
    ref[:, q_end:k_end] = apply_rope(qkv[:, q_end:k_end].view(tokens, kv_heads, head_dim), cos, sin).reshape(
        tokens, -1)
    out = qkv.to("cuda", dtype)
    rope_(out, cos.to("cuda", dtype), sin.to("cuda", dtype), heads, kv_heads, head_dim)
    assert _rel_err(out, ref) < TOL[dtype]
    torch.testing.assert_close(out[:, k_end:], qkv[:, k_end:].to("cuda", dtype), atol=0, rtol=0)  # V untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (28, 4, 128)])
def test_rope_writes_k_and_v_into_the_paged_cache(dtype: torch.dtype, qk_norm: bool, heads: int, kv_heads: int,
                                                  head_dim: int) -> None:
    """With a CacheWrite the kernels leave qkv as without one, and the cache holds exactly what the
    scatter of the rotated K and of V (Attention's unfused path) would write; other slots untouched."""
    from fastdeploy.model_executor.layers.attention_metadata import CacheWrite
    from fastdeploy.model_executor.layers.triton_fused import qk_norm_rope_, rope_

    tokens, num_blocks, block_size = 37, 16, 16
    gen = torch.Generator().manual_seed(heads + kv_heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to("cuda", dtype)
    cos, sin = (t.to("cuda", dtype) for t in rope_cos_sin(torch.randint(0, 8000, (tokens,), generator=gen),
                                                           head_dim, 500000.0, torch.float64))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].cuda()
    qw, kw = (torch.rand(head_dim, generator=gen).to("cuda", dtype) + 0.5 for _ in range(2))

    def run(out: torch.Tensor, cache: CacheWrite | None) -> None:
        if qk_norm:
            qk_norm_rope_(out, cos, sin, heads, kv_heads, head_dim, qw, kw, 1e-6, cache)
        else:
            rope_(out, cos, sin, heads, kv_heads, head_dim, cache)

    plain, fused = qkv.clone(), qkv.clone()
    run(plain, None)
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype, device="cuda")
    run(fused, CacheWrite(kv_cache, slots))
    torch.testing.assert_close(fused, plain, atol=0, rtol=0)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    expected = torch.full_like(kv_cache, 7.0)
    expected[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, plain[:, q_end:k_end].view(tokens, kv_heads,
                                                                                               head_dim))
    expected[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, plain[:, k_end:].view(tokens, kv_heads, head_dim))
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "cols"), [(1, 1536), (64, 14336), (5, 1000)])
def test_silu_mul(dtype: torch.dtype, rows: int, cols: int) -> None:
    from fastdeploy.model_executor.layers.triton_fused import silu_mul

    gate_up = torch.randn(rows, 2 * cols, dtype=torch.float64)
    ref = F.silu(gate_up[:, :cols]) * gate_up[:, cols:]
    assert _rel_err(silu_mul(gate_up.to("cuda", dtype)), ref) < TOL[dtype]
