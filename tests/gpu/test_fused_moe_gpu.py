"""Fused MoE and Qwen3's q/k norm + RoPE kernel on CUDA vs the CPU reference; Qwen3 / Qwen3-MoE end to end.

- `fused_topk` against `route` (the same experts, the same weights);
- `fused_moe` against `moe_reference` in float64 on the CPU, with the same routing, from one
  token to a prefill-sized batch (each of the three tile configurations), bf16 and float32;
- the alignment's invariants (every pair once, each block inside its expert's run);
- a CUDA graph of the fused path replayed on new routing equals the eager call, and the eager
  call makes no synchronising call PyTorch can see;
- `qk_norm_rope_` against the PyTorch ops (RMSNorm per head, then RoPE) in float64;
- tiny random Qwen3 and Qwen3-MoE checkpoints through `LLM` on CUDA (float32, CUDA graphs)
  give the CPU engine's greedy tokens, and a decode step synchronises once.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from fastdeploy import LLM
from fastdeploy.common.sampling_params import SamplingParams
from fastdeploy.model_executor.layers.moe import moe_reference, route
from fastdeploy.model_executor.layers.rotary import apply_rope, rope_cos_sin
from tests.random_hf_models import save_random_hf_model, save_word_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


def _problem(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64) / inter**0.5
    weights, ids = route(torch.randn(tokens, experts, generator=g, dtype=torch.float64), top_k, renormalize=True)
    return x, w13, w2, weights, ids


# (tokens, experts, top_k, hidden, intermediate): decode sizes at Qwen3-30B-A3B's routing
# (128 experts, top 8), a batch that takes the middle tiles, and prefill-sized batches.
SHAPES = [(1, 128, 8, 512, 192), (5, 16, 4, 256, 96), (64, 128, 8, 512, 192), (256, 128, 8, 256, 128),
          (600, 8, 2, 128, 64), (2048, 64, 6, 256, 128)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-E{s[1]}-k{s[2]}" for s in SHAPES])
def test_fused_moe_matches_reference(dtype: torch.dtype, shape: tuple) -> None:
    from fastdeploy.model_executor.layers.fused_moe import fused_moe

    x, w13, w2, weights, ids = _problem(*shape)
    ref = moe_reference(x, w13, w2, weights, ids)
    out = fused_moe(*(t.to("cuda", dtype) for t in (x, w13, w2, weights)), ids.cuda())
    assert out.dtype == dtype and out.shape == ref.shape
    assert _rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("tokens", [1, 64, 600])
def test_fused_moe_tensor_parallel_shards_sum_to_the_whole(tokens: int, ranks: int) -> None:
    """What each tensor-parallel rank computes: its share of every expert's intermediate dim
    (gate/up rows, down columns, as `shard_weight` cuts them), the fused kernel at the shard's
    shapes; the ranks' outputs, summed as the all-reduce sums them, equal the float64 reference
    of the whole experts. One GPU runs every rank's share in turn."""
    from fastdeploy.model_executor.layers.fused_moe import fused_moe

    inter = 192
    x, w13, w2, weights, ids = _problem(tokens, 128, 8, 512, inter)
    ref = moe_reference(x, w13, w2, weights, ids)
    gate, up = w13[:, :inter], w13[:, inter:]
    share = inter // ranks
    total = torch.zeros(ref.shape, dtype=torch.float32, device="cuda")
    for rank in range(ranks):
        cols = slice(rank * share, (rank + 1) * share)
        w13_rank = torch.cat([gate[:, cols], up[:, cols]], dim=1)
        w2_rank = w2[:, :, cols]
        total += fused_moe(*(t.to("cuda", torch.float32) for t in (x, w13_rank, w2_rank, weights)), ids.cuda())
    assert _rel_err(total, ref) < TOL[torch.float32]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 128, 8), (300, 128, 8), (33, 60, 4), (7, 8, 2)])
def test_fused_topk_matches_route(renormalize: bool, tokens: int, experts: int, top_k: int) -> None:
    from fastdeploy.model_executor.layers.fused_moe import fused_topk

    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens))
    ref_weights, ref_ids = route(logits, top_k, renormalize)
    weights, ids = fused_topk(logits.cuda(), top_k, renormalize)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-6, rtol=1e-5)
    bf16_weights, bf16_ids = fused_topk(logits.cuda().bfloat16(), top_k, renormalize)
    assert bf16_weights.dtype == torch.bfloat16 and bf16_ids.shape == (tokens, top_k)


@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_invariants(block_m: int) -> None:
    from fastdeploy.model_executor.layers.fused_moe import align

    experts, top_k = 32, 4
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(300)]).cuda()
    ids[:100] = ids[0]  # a crowded expert set next to sparse ones
    a = align(ids, experts, block_m)
    n, total = ids.numel(), int(a.total)
    pairs = a.sorted_pairs[:total].cpu()
    assert total % block_m == 0 and torch.all(a.sorted_pairs[total:].cpu() == n)
    assert sorted(pairs[pairs < n].tolist()) == list(range(n))  # every pair exactly once
    flat = ids.reshape(-1).cpu()
    block_expert = a.block_expert[: total // block_m].cpu().long()
    rows_expert = block_expert.repeat_interleave(block_m)
    assert torch.equal(flat[pairs[pairs < n].long()], rows_expert[pairs < n])  # each pair in its expert's blocks
    assert torch.all(block_expert[1:] >= block_expert[:-1])


def test_fused_moe_cuda_graph_and_no_sync() -> None:
    from fastdeploy.model_executor.layers.fused_moe import fused_moe, fused_topk

    x, w13, w2, weights, ids = (t.cuda() for t in _problem(8, 128, 8, 256, 128))
    x, w13, w2, weights = (t.to(torch.bfloat16) for t in (x, w13, w2, weights))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # warns at any synchronising call
        try:
            fused_moe(x, w13, w2, weights, ids)
            fused_topk(x[:, :128], 8, True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2):  # new routing and inputs written into the captured buffers
        nx, _, _, nweights, nids = _problem(8, 128, 8, 256, 128, seed=seed)
        x.copy_(nx)
        weights.copy_(nweights)
        ids.copy_(nids)
        graph.replay()
        torch.testing.assert_close(captured, fused_moe(x, w13, w2, weights, ids), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 4, 128), (16, 8, 64), (6, 2, 16)])
def test_qk_norm_rope(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    from fastdeploy.model_executor.layers.triton_fused import qk_norm_rope_

    tokens, eps = 37, 1e-6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.float64)
    qw, kw = torch.rand(head_dim, dtype=torch.float64) + 0.5, torch.rand(head_dim, dtype=torch.float64) + 0.5
    cos, sin = rope_cos_sin(torch.randint(0, 40000, (tokens,)), head_dim, 1e6, torch.float64)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    ref = qkv.clone()
    ref[:, :q_end] = apply_rope(norm(qkv[:, :q_end].view(tokens, heads, head_dim), qw), cos, sin).flatten(1)
    ref[:, q_end:k_end] = apply_rope(norm(qkv[:, q_end:k_end].view(tokens, kv_heads, head_dim), kw), cos,
                                     sin).flatten(1)  # fmt: skip
    out = qkv.to("cuda", dtype)
    qk_norm_rope_(out, cos.to("cuda", dtype), sin.to("cuda", dtype), heads, kv_heads, head_dim,
                  qw.to("cuda", dtype), kw.to("cuda", dtype), eps)  # fmt: skip
    assert _rel_err(out, ref) < TOL[dtype]
    torch.testing.assert_close(out[:, k_end:], qkv[:, k_end:].to("cuda", dtype), atol=0, rtol=0)  # V untouched


VOCAB = 512
MODELS = {
    "qwen3": ("qwen3", {"attention_bias": True}),
    "qwen3_moe": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True,
                                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                    "original_max_position_embeddings": 32}}),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory) -> tuple[str, str]:
    kind, overrides = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_random_hf_model(path / "model", kind, VOCAB, **overrides)
    return str(path / "model"), save_word_tokenizer(path / "tokenizer", VOCAB)


def _greedy(model: str, tokenizer: str, device: str, **kwargs) -> list[tuple[list[int], list[float]]]:
    llm = LLM(model, tokenizer=tokenizer, device=device, dtype="float32", guided_decoding_backend="off",
              max_num_seqs=8, num_kv_blocks=256, **kwargs)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 30, 45, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    result = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def test_model_on_cuda_matches_cpu(model_dir) -> None:
    """float32 on both sides; the GPU's attention and MoE GEMMs use IEEE float32 products where Triton's
    dot would otherwise take TF32, so only summation order differs."""
    cpu = _greedy(*model_dir, "cpu")
    graphs = _greedy(*model_dir, "cuda")
    eager = _greedy(*model_dir, "cuda", enforce_eager=True)
    for (t_cpu, lp_cpu), (t_graph, lp_graph), (t_eager, _) in zip(cpu, graphs, eager, strict=True):
        assert t_graph == t_eager
        assert t_graph == t_cpu
        torch.testing.assert_close(torch.tensor(lp_graph), torch.tensor(lp_cpu), atol=2e-3, rtol=0)


def test_moe_decode_step_synchronises_once(model_dir) -> None:
    """bf16 with CUDA graphs: the MoE layers add no host sync to a decode step (the frame's copy is the one)."""
    from tests.gpu.sync_count import count_step_syncs, steady_decode

    llm = LLM(model_dir[0], tokenizer=model_dir[1], device="cuda", guided_decoding_backend="off", max_num_seqs=8,
              num_kv_blocks=256)  # fmt: skip
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with count_step_syncs(llm.engine.executor.runner) as steps:
        llm.generate(prompts, params)
    decode = steady_decode(steps)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert len(decode) >= 8 and all(s.batch == len(prompts) for s in decode)
    assert all(s.total == 1 for s in decode), [s.sources for s in decode if s.total != 1]
