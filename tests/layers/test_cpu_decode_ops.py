"""The fused CPU decode ops (custom_ops/cpu_decode_ops.cpp) against the PyTorch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.layers.attention import Attention
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata
from fastdeploy.model_executor.layers.cpu_kernels import cpu_ops
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.rotary import apply_rope, rope_cos_sin
from fastdeploy.model_executor.model_loader.dummy_loader import init_dummy_weights
from fastdeploy.model_executor.models.llama import LlamaForCausalLM

BS, NUM_BLOCKS = 4, 64


def _decode_inputs(heads: int, kv_heads: int, head_dim: int, lens: list[int], seed: int):
    """qkv of one decode token per sequence, a cache of random past K/V in scattered blocks, and metadata."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen)
    cache = torch.randn(2, NUM_BLOCKS, BS, kv_heads, head_dim, generator=gen)
    order = torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1  # block 0: the padding of short tables
    width = -(-max(lens) // BS)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for s, n in enumerate(lens):
        blocks = -(-n // BS)
        tables[s, :blocks] = order[used:used + blocks]
        used += blocks
    context = torch.tensor(lens)
    positions = context - 1
    slots = tables[torch.arange(len(lens)), positions // BS] * BS + positions % BS
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=len(lens), decode_block_tables=tables,
                             decode_context_lens=context, prefills=[], block_size=BS)
    cos, sin = rope_cos_sin(positions, head_dim, 1e4, torch.float32)
    return qkv, cache, meta, cos, sin


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 24), (2, 1, 8)])
# Many sequences: one task per (sequence, KV head). Few (fewer pairs than twice the threads): each
# pair's keys split into parts merged after, including parts left empty by a short sequence.
@pytest.mark.parametrize("lens", [[1, 5, 17, 33, 4], [33], [1], [3, 41]])
def test_rope_paged_decode_equals_rope_then_paged_attention(heads: int, kv_heads: int, head_dim: int,
                                                            lens: list[int]) -> None:
    qkv, cache, meta, cos, sin = _decode_inputs(heads, kv_heads, head_dim, lens, seed=heads)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rope(q.reshape(-1, heads, head_dim), cos, sin)
    k = apply_rope(k.reshape(-1, kv_heads, head_dim), cos, sin)
    ref_cache = cache.clone()
    expected = Attention(heads, kv_heads, head_dim, head_dim**-0.5)(
        q, k, v.reshape(-1, kv_heads, head_dim), ref_cache, meta)
    rotated = torch.cat([q.flatten(1), k.flatten(1), v], dim=-1)
    out = cpu_ops().rope_paged_decode(qkv, cos, sin, cache, meta.slot_mapping, meta.decode_block_tables,
                                      meta.decode_context_lens, heads, kv_heads, head_dim, head_dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(qkv, rotated, rtol=0, atol=1e-6)  # q/k rotated in place
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=1e-6)  # the new K/V written, nothing else


def test_rope_paged_decode_refuses_out_of_range_tables() -> None:
    qkv, cache, meta, cos, sin = _decode_inputs(2, 1, 8, [3, 9], seed=0)
    args = (2, 1, 8, 8**-0.5)
    bad_tables = meta.decode_block_tables.clone()
    bad_tables[1, 1] = NUM_BLOCKS
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_ops().rope_paged_decode(qkv, cos, sin, cache, meta.slot_mapping, bad_tables,
                                    meta.decode_context_lens, *args)
    with pytest.raises(RuntimeError, match="context length 40 out of range"):
        cpu_ops().rope_paged_decode(qkv, cos, sin, cache, meta.slot_mapping, meta.decode_block_tables,
                                    torch.tensor([3, 40]), *args)


@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm_equals_rmsnorm(add: bool) -> None:
    gen = torch.Generator().manual_seed(int(add))
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    x, residual = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
    if add:
        expected, expected_residual = norm(x, residual)
    else:
        expected, expected_residual = norm(x), residual.clone()  # the residual is left alone
    cpu_ops().add_rms_norm_(x, residual if add else None, norm.weight, norm.eps)
    torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)


def test_silu_mul_equals_silu_times_up() -> None:
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops().silu_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_model_decode_step_equals_the_pytorch_ops() -> None:
    """A random Llama's decode step outside autograd (fused ops) equals the same step with autograd on
    (the PyTorch ops, as MTP head training runs it)."""
    config = ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    init_dummy_weights(model, seed=0)
    lens = [3, 20, 9]
    _, cache, meta, _, _ = _decode_inputs(6, 2, 16, lens, seed=1)
    ids = torch.tensor([5, 17, 60])
    positions = meta.decode_context_lens - 1
    caches = [cache.clone() for _ in range(3)]
    with torch.no_grad():
        fused = model.compute_logits(model(ids, positions, meta, caches))
    reference_caches = [cache.clone() for _ in range(3)]
    with torch.enable_grad():
        reference = model.compute_logits(model(ids, positions, meta, reference_caches)).detach()
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-4)
    for ours, theirs in zip(caches, reference_caches, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
