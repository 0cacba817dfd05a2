"""Configuration dataclasses threaded through the engine, the worker and the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdeploy.common.speculative_config import SpeculativeConfig


@dataclass
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's `rope_scaling` / `rope_parameters` define it.

    linear: every frequency divided by `factor`. llama3: low frequencies divided by `factor`,
    high ones kept, a smooth ramp between (wavelengths set by `original_max_position_embeddings`
    over `low_freq_factor` / `high_freq_factor`). yarn: a ramp between interpolated and
    extrapolated frequencies over the dimensions set by `beta_fast` / `beta_slow`, and cos/sin
    scaled by `attention_factor` (derived from `factor`, `mscale`, `mscale_all_dim` when unset).
    """

    rope_type: str  # "linear" | "llama3" | "yarn"
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass
class MoEConfig:
    """Sparse MLP of Qwen3-MoE: softmax router, top-k experts, SiLU-gated expert MLPs."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each expert's MLP width
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3, Qwen3-MoE)."""

    architecture: str  # "llama", "qwen2", "qwen3" or "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v biases (Qwen2 always; Llama and Qwen3 when the config says)
    o_proj_bias: bool = False  # Llama's and Qwen3's `attention_bias` covers o_proj too, Qwen2's does not
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    rope_scaling: RopeScaling | None = None
    moe: MoEConfig | None = None  # Qwen3-MoE's sparse layers; None: every layer is dense
    # FP8 block-wise checkpoint: (rows, cols) of a weight scale block; the loader dequantizes.
    fp8_weight_block: tuple[int, int] | None = None


@dataclass
class CacheConfig:
    block_size: int = 16
    # Total KV blocks in the pool; None sizes it from `kv_cache_memory_bytes`.
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    # CUDA only: fraction of the device's memory the worker may hold in all (weights,
    # activation peak, KV pool); the pool gets what is left. Ignored when num_blocks is set.
    gpu_memory_utilization: float = 0.9
    # Full blocks are shared between sequences with the same prefix (`scheduler/prefix_hash.py`).
    enable_prefix_caching: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_model_len: int = 2048
    # Tokens processed per step across all sequences (prefill chunks + decodes).
    max_num_batched_tokens: int = 2048


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None  # tokenizer directory or GGUF file; None: the model's own
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16; auto: bfloat16 on CUDA, float32 on CPU
    device: str = "cpu"
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    tensor_parallel_size: int = 1  # worker processes (GPUs) the model's layers are split over
    disable_custom_all_reduce: bool = False  # CUDA TP: NCCL for every all-reduce, not the peer-to-peer kernels
    seed: int = 0
    max_logprobs: int = 20
    enable_keep_sampling_mask: bool = False
    sampling_mask_format: str = "ids"  # ids | bitmap: the default of requests that do not say
    logprobs_mode: str = "raw_logprobs"  # raw_logprobs | processed_logprobs
    guided_decoding_backend: str = "auto"  # auto | xgrammar | llguidance | off
    # Default of requests that do not set `disable_any_whitespace`: JSON without whitespace outside strings.
    guided_decoding_disable_any_whitespace: bool = False
    grammar_compile_timeout_s: float = 30.0
    grammar_cache_mb: int = 512
    reasoning_parser: str | None = None  # a fastdeploy.reasoning name, e.g. "think"
    # Speculative decoding (a fastdeploy.common.speculative_config.SpeculativeConfig); None: off.
    speculative: SpeculativeConfig | None = None
    # auto | on | off: schedule step N+1 while step N runs (see `pipelines_steps`).
    async_scheduling: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


ASYNC_SCHEDULING_MODES = ("auto", "on", "off")


def pipelines_steps(config: EngineConfig) -> bool:
    """Whether the engine schedules and sends step N+1 before step N's tokens are back (the
    sampled tokens reach step N+1 on the device; under tensor parallelism rank 0 broadcasts them
    to the other ranks). `auto`: on CUDA, where the host's share of a step would otherwise leave
    the GPU idle; on CPU the worker computes on the same cores the engine would overlap with.

    With speculation, a step without drafts goes ahead like any decode step (adaptive
    speculation gives a busy batch none; MTP's head still takes in each such step's tokens, from
    the device, before the next step runs). On one GPU both methods draft on the device (MTP's
    module; n-gram lookup in the context the worker keeps there), so their verify steps go ahead
    too, adaptive or fixed; under tensor parallelism a step with drafts runs in turn."""
    mode = config.async_scheduling
    if mode not in ASYNC_SCHEDULING_MODES:
        raise ValueError(f"unknown async_scheduling {mode!r}; expected one of {', '.join(ASYNC_SCHEDULING_MODES)}")
    if mode == "off":
        return False
    return mode == "on" or config.device.startswith("cuda")


# MTP's passes run the target's embedding and output head, which under tensor parallelism are
# vocabulary-parallel collectives every rank must join, while only rank 0 drafts.
MTP_WITH_TENSOR_PARALLEL = ("MTP speculative decoding does not work with --tensor-parallel-size > 1 (only rank 0 "
                            "drafts, and the MTP module's passes need every rank); use n-gram speculation or one rank")


def check_speculation_fits_ranks(config: EngineConfig) -> None:
    """Refuses MTP speculation over more than one tensor-parallel rank, before any process
    starts: the worker would otherwise stop at start-up, and the engine report only that it
    lost the worker. n-gram drafts come from the host and run under tensor parallelism."""
    spec = config.speculative
    if config.tensor_parallel_size > 1 and spec is not None and spec.method == "mtp":
        raise ValueError(MTP_WITH_TENSOR_PARALLEL)


def resolve_dtype(dtype: str, device: str) -> str:
    """The concrete weight/activation dtype name: `auto` is bfloat16 on CUDA, float32 elsewhere."""
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, float32, bfloat16 or float16")
    return dtype
