"""How many KV cache blocks the worker allocates: a byte budget on CPU, free memory on CUDA."""

from __future__ import annotations

import dataclasses
import gc
import logging

import torch

from fastdeploy.common.config import EngineConfig, ModelConfig
from fastdeploy.model_executor.layers.attention import allocate_kv_caches, kv_cache_bytes_per_block
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata, PrefillSeq
from fastdeploy.model_executor.models.llama import LlamaForCausalLM
from fastdeploy.spec_decode.mtp_gaps import PairStore

logger = logging.getLogger(__name__)


def num_kv_blocks(
    model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype,
    device: torch.device,
) -> int:  # fmt: skip
    block_bytes = kv_cache_bytes_per_block(model_config, config.cache.block_size, dtype)
    if config.speculative is not None and config.speculative.method == "mtp":
        block_bytes += mtp_bytes_per_block(model_config, config.cache.block_size, dtype)
    if device.type != "cuda":
        return max(1, config.cache.kv_cache_memory_bytes // block_bytes)
    return _profile_gpu_blocks(model, model_config, config, dtype, device, block_bytes)


def mtp_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """What MTP keeps per block beside the target's K/V: its one layer's K/V and the kept pairs."""
    one_layer = dataclasses.replace(model_config, num_hidden_layers=1)
    return (kv_cache_bytes_per_block(one_layer, block_size, dtype)
            + block_size * PairStore.bytes_per_slot(model_config.hidden_size, dtype))


@torch.inference_mode()
def _profile_gpu_blocks(
    model: LlamaForCausalLM, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype,
    device: torch.device, block_bytes: int,
) -> int:  # fmt: skip
    """Blocks that fit in `gpu_memory_utilization` of the device after weights and the activation peak.

    The peak is measured, not estimated: one forward pass over the largest step the scheduler can
    send (a fresh prefill of `max_num_batched_tokens` tokens), then logits for `max_num_seqs`
    rows and a sort over them standing in for the sampler's working set.
    """
    sched, bs = config.scheduler, config.cache.block_size
    num_tokens = sched.max_num_batched_tokens
    scratch_blocks = -(-num_tokens // bs)
    # Engines this process dropped but has not collected yet (reference cycles) give their
    # memory back first: it would count as this engine's peak.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    caches = allocate_kv_caches(model_config, scratch_blocks, bs, dtype, device)
    scratch_bytes = sum(c.numel() * c.element_size() for c in caches)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.long, device=device),
        prefills=[PrefillSeq(0, num_tokens, num_tokens, torch.arange(scratch_blocks))],
        block_size=bs,
    )
    input_ids = torch.randint(model_config.vocab_size, (num_tokens,), device=device)
    hidden = model(input_ids, torch.arange(num_tokens, device=device), meta, caches)
    rows = hidden[-1:].expand(min(sched.max_num_seqs, num_tokens), -1)
    model.compute_logits(rows).softmax(-1).sort(-1, descending=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch_bytes
    del caches, hidden, rows
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Memory held outside this process's allocator (CUDA context, other processes) counts too.
    non_torch = total - free - torch.cuda.memory_reserved(device)
    budget = int(total * config.cache.gpu_memory_utilization) - peak - non_torch
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {total / 2**30:.1f} GiB x {config.cache.gpu_memory_utilization}"
            f" minus weights and activations ({peak / 2**30:.1f} GiB) and other use ({non_torch / 2**30:.1f} GiB);"
            " raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    logger.info("KV cache: %d blocks of %d tokens (%.1f GiB); weights+activation peak %.1f GiB",
                num_blocks, bs, num_blocks * block_bytes / 2**30, peak / 2**30)
    return num_blocks
