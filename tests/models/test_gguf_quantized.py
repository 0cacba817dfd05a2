"""The embedded GGUF with its Q4_1 and Q8_0 weights kept in the file's blocks on the CPU
(layers/quantized_linear.py, custom_ops/gguf_matmul_cpu.cpp).

The kernel multiplies by gguf's own float32 dequantization of every weight in float32, so it
is held to the float64 product on the dequantized weight within float32 rounding, and the
model to the dense float32 model. Greedy equality with HF transformers on the held-out
prompts is test_llama_vs_hf.py's, which loads this (default) path.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from fastdeploy.model_executor.layers.attention import allocate_kv_caches
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata, PrefillSeq
from fastdeploy.model_executor.layers.quantized_linear import GGUF_BLOCK_BYTES, GGUFLinear
from fastdeploy.model_executor.model_loader import embedded_model_path, get_model

Q4_1, Q8_0 = 3, 8
BLOCK_SIZE = 16


@torch.inference_mode()
def decode_logits(model, config, batch: int, steps: int = 3) -> torch.Tensor:
    """Logits [steps, batch, vocab] of greedy decode steps after prompts of 9 + 7i tokens, each
    prompt prefilled alone (the PyTorch ops) and the decode steps batched (the fused CPU ops)."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, config.vocab_size, (9 + 7 * i,), generator=gen) for i in range(batch)]
    blocks_per_seq = -(-(len(prompts[-1]) + steps) // BLOCK_SIZE)
    caches = allocate_kv_caches(config, batch * blocks_per_seq, BLOCK_SIZE, torch.float32, "cpu")
    tables = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    last = []
    for i, ids in enumerate(prompts):
        n = len(ids)
        positions = torch.arange(n)
        slots = tables[i][positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=0,
                                 decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
                                 decode_context_lens=torch.zeros(0, dtype=torch.long),
                                 prefills=[PrefillSeq(0, n, n, tables[i])], block_size=BLOCK_SIZE)  # fmt: skip
        last.append(model.compute_logits(model(ids, positions, meta, caches)[-1:]).argmax(-1))
    ids, lens = torch.cat(last), torch.tensor([len(p) for p in prompts])
    out = []
    for _ in range(steps):
        slots = tables[torch.arange(batch), lens // BLOCK_SIZE] * BLOCK_SIZE + lens % BLOCK_SIZE
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch, decode_block_tables=tables,
                                 decode_context_lens=lens + 1, prefills=[], block_size=BLOCK_SIZE)
        logits = model.compute_logits(model(ids, lens.clone(), meta, caches))
        out.append(logits)
        ids, lens = logits.argmax(-1), lens + 1
    return torch.stack(out)


def _random_blocks(rows: int, cols: int, ggml_type: int, gen: torch.Generator) -> torch.Tensor:
    """Random blocks with float16 scales of a plausible size (d in [0.005, 0.02), m in [-0.1, 0))."""
    nb, width = cols // 32, GGUF_BLOCK_BYTES[ggml_type]
    blocks = torch.randint(0, 256, (rows, nb, width), generator=gen, dtype=torch.uint8)
    d = (torch.rand(rows, nb, generator=gen) * 0.015 + 0.005).half()
    blocks[..., 0:2] = d.view(torch.uint8).view(rows, nb, 2)
    if ggml_type == Q4_1:
        m = (-torch.rand(rows, nb, generator=gen) * 0.1).half()
        blocks[..., 2:4] = m.view(torch.uint8).view(rows, nb, 2)
    return blocks.reshape(rows, nb * width)


def _gguf_reference(blocks: torch.Tensor, ggml_type: int, cols: int) -> torch.Tensor:
    """gguf-py's own dequantization, as float64 [rows, cols]."""
    kind = gguf.GGMLQuantizationType(ggml_type)
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), kind).reshape(blocks.shape[0], cols)).double()


def test_dequantized_file_blocks_are_ggufs_own() -> None:
    """The kernel's weights are exactly gguf's dequantization of the file's Q4_1 and Q8_0 tensors."""
    tensors = {t.name: t for t in gguf.GGUFReader(embedded_model_path()).tensors}
    for name in ("blk.0.attn_v.weight", "blk.7.ffn_down.weight", "token_embd.weight"):
        tensor = tensors[name]
        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
        blocks = torch.from_numpy(np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1).copy())
        layer = GGUFLinear(blocks, int(tensor.tensor_type), cols)
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(rows, cols)
        np.testing.assert_array_equal(layer.dequantized().numpy(), expected)


@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
@pytest.mark.parametrize("rows_of_x", [1, 2, 7, 33, 128, 129])  # one row, the tile path, the dequantize-and-mm path
def test_matmul_is_the_float64_product_within_float32_rounding(ggml_type: int, rows_of_x: int) -> None:
    gen = torch.Generator().manual_seed(ggml_type * 1000 + rows_of_x)
    out_features, in_features = 77, 320
    blocks = _random_blocks(out_features, in_features, ggml_type, gen)
    bias = torch.randn(out_features, generator=gen)
    layer = GGUFLinear(blocks, ggml_type, in_features, bias)
    x = torch.randn(rows_of_x, in_features, generator=gen)
    expected = x.double() @ _gguf_reference(blocks, ggml_type, in_features).t() + bias.double()
    y = layer(x)
    assert y.shape == (rows_of_x, out_features) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    # Leading dimensions and a bfloat16 caller: computed in float32, returned in the caller's dtype.
    y3 = layer(x.view(1, rows_of_x, in_features).bfloat16())
    assert y3.shape == (1, rows_of_x, out_features) and y3.dtype == torch.bfloat16


def test_bad_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="not 3 \\(Q4_1\\) or 8 \\(Q8_0\\)"):
        GGUFLinear(torch.zeros(4, 20, dtype=torch.uint8), 2, 32)
    with pytest.raises(ValueError, match="do not hold rows of 64"):
        GGUFLinear(torch.zeros(4, 20, dtype=torch.uint8), Q4_1, 64)


@pytest.fixture(scope="module")
def models():
    quantized, config = get_model(None)
    dense, _ = get_model(None, gguf_quantized=False)
    return quantized, dense, config


def test_default_cpu_model_keeps_the_file_blocks(models) -> None:
    quantized, dense, config = models
    kept = [m for m in quantized.modules() if isinstance(m, GGUFLinear)]
    assert len(kept) == 4 * config.num_hidden_layers + 1  # every projection, and the tied LM head (Q8_0)
    assert isinstance(quantized.lm_head, GGUFLinear) and quantized.lm_head.ggml_type == Q8_0
    assert quantized.model.layers[0].mlp.down_proj.ggml_type == Q4_1
    assert not any(isinstance(m, GGUFLinear) for m in dense.modules())
    assert isinstance(dense.model.layers[0].mlp.down_proj, nn.Linear)
    # The kept weights are the dense ones, fused in the same row order, llama's Q/K rows put back.
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        for layer in (0, 29):
            w = dense.get_submodule(f"model.layers.{layer}.{name}").weight
            assert torch.equal(quantized.get_submodule(f"model.layers.{layer}.{name}").dequantized(), w), name
    assert torch.equal(quantized.lm_head.dequantized(), dense.model.embed_tokens.weight)


def test_decode_logits_equal_the_dense_models(models) -> None:
    """Decode steps at batch 1 and 5 (fused CPU ops, file blocks) against the dense float32 model."""
    quantized, dense, config = models
    for batch in (1, 5):
        ours = decode_logits(quantized, config, batch)
        reference = decode_logits(dense, config, batch)
        torch.testing.assert_close(ours, reference, rtol=0, atol=2e-3)
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))
