"""The KV pool's size counts what speculation keeps per block beside the target's K/V."""

from __future__ import annotations

import dataclasses

import torch

from fastdeploy.common.config import CacheConfig, EngineConfig, ModelConfig
from fastdeploy.common.speculative_config import SpeculativeConfig
from fastdeploy.model_executor.layers.attention import allocate_kv_caches
from fastdeploy.spec_decode.mtp_gaps import PairStore
from fastdeploy.worker.kv_cache_sizing import num_kv_blocks

MODEL = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                    max_position_embeddings=128, tie_word_embeddings=True)
BUDGET = 1 << 20


def _allocated_bytes(config: ModelConfig, blocks: int, block_size: int, dtype: torch.dtype) -> int:
    return sum(c.numel() * c.element_size() for c in allocate_kv_caches(config, blocks, block_size, dtype, "cpu"))


def test_mtp_blocks_fit_the_budget_with_the_modules_cache_and_kept_pairs():
    """With MTP each block also holds the module's one-layer K/V and a kept pair per slot (its
    hidden state and token): the blocks the budget gives fit it with all three allocated, and
    one block more would not."""
    cache = CacheConfig(block_size=4, kv_cache_memory_bytes=BUDGET)
    plain = EngineConfig(cache=cache)
    mtp = dataclasses.replace(plain, speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    dtype = torch.float32
    blocks = num_kv_blocks(None, MODEL, mtp, dtype, torch.device("cpu"))  # type: ignore[arg-type]
    one_layer = dataclasses.replace(MODEL, num_hidden_layers=1)

    def used(n: int) -> int:
        return (_allocated_bytes(MODEL, n, 4, dtype) + _allocated_bytes(one_layer, n, 4, dtype)
                + n * 4 * PairStore.bytes_per_slot(MODEL.hidden_size, dtype))

    assert used(blocks) <= BUDGET < used(blocks + 1)
    assert blocks < num_kv_blocks(None, MODEL, plain, dtype, torch.device("cpu"))  # type: ignore[arg-type]
    store = PairStore(8, MODEL.hidden_size, dtype, torch.device("cpu"))
    assert store.hidden.numel() * 4 + store.tokens.numel() * 8 == 8 * PairStore.bytes_per_slot(MODEL.hidden_size, dtype)
