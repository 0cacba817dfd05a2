"""Engine arguments: one dataclass, shared by the CLI and the offline `LLM`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from fastdeploy.common.config import (
    ASYNC_SCHEDULING_MODES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    check_speculation_fits_ranks,
    pipelines_steps,
)
from fastdeploy.common.sampling_params import SAMPLING_MASK_FORMATS
from fastdeploy.common.speculative_config import SpeculativeConfig, parse_speculative_config
from fastdeploy.reasoning import reasoning_parser_names


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "cpu"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    seed: int = 0
    max_num_seqs: int = 64
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_mb: int = 512
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    enable_keep_sampling_mask: bool = False
    sampling_mask_format: str = "ids"
    logprobs_mode: str = "raw_logprobs"
    guided_decoding_backend: str = "auto"
    guided_decoding_disable_any_whitespace: bool = False
    grammar_compile_timeout: float = 30.0
    grammar_cache_mb: int = 512
    reasoning_parser: str | None = None
    speculative_config: str | dict | SpeculativeConfig | None = None
    async_scheduling: str = "auto"

    def create_engine_config(self) -> EngineConfig:
        config = EngineConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            load_format=self.load_format,
            dtype=self.dtype,
            device=self.device,
            enforce_eager=self.enforce_eager,
            tensor_parallel_size=self.tensor_parallel_size,
            disable_custom_all_reduce=self.disable_custom_all_reduce,
            seed=self.seed,
            max_logprobs=self.max_logprobs,
            enable_keep_sampling_mask=self.enable_keep_sampling_mask,
            sampling_mask_format=self.sampling_mask_format,
            logprobs_mode=self.logprobs_mode,
            guided_decoding_backend=self.guided_decoding_backend,
            guided_decoding_disable_any_whitespace=self.guided_decoding_disable_any_whitespace,
            grammar_compile_timeout_s=self.grammar_compile_timeout,
            grammar_cache_mb=self.grammar_cache_mb,
            reasoning_parser=self.reasoning_parser,
            speculative=parse_speculative_config(self.speculative_config),
            async_scheduling=self.async_scheduling,
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_mb * 1024 * 1024,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_model_len=self.max_model_len,
                max_num_batched_tokens=max(self.max_num_batched_tokens, 1),
            ),
        )
        pipelines_steps(config)  # refuses an unknown mode, or "on" where steps cannot overlap
        check_speculation_fits_ranks(config)  # MTP with more than one tensor-parallel rank
        return config

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        parser.add_argument("model", nargs="?", default=None,
                            help="GGUF file or Hugging Face directory; default: the embedded SmolLM2-135M-Instruct")
        parser.add_argument("--tokenizer", default=d.tokenizer,
                            help="tokenizer directory (tokenizer.json / tokenizer_config.json) or GGUF file, for "
                                 "weights that come without one; default: the model's own (a bundled config such "
                                 "as llama3_8b borrows the embedded SmolLM2 tokenizer)")
        parser.add_argument("--load-format", choices=["auto", "gguf", "safetensors", "dummy"], default=d.load_format,
                            help="how to read weights; 'dummy' gives random weights of the model's config")
        parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=d.dtype,
                            help="weights, activations and KV cache; auto: bfloat16 on CUDA, float32 on CPU. "
                                 "On CPU a GGUF's Q4_1/Q8_0 weights stay in the file's blocks whatever the dtype")
        parser.add_argument("--device", default=d.device, help="cpu or cuda")
        parser.add_argument("--enforce-eager", action="store_true",
                            help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                            help="split each layer over this many worker processes, one per GPU (torch.distributed: "
                                 "NCCL on CUDA, gloo on CPU); must divide the attention heads, KV heads and MLP width; "
                                 "refused with MTP speculation (n-gram works)")
        parser.add_argument("--disable-custom-all-reduce", action="store_true",
                            help="CUDA tensor parallelism: NCCL for every sum and for the logits' gather instead "
                                 "of the peer-to-peer kernels over PyTorch's symmetric memory (messages up to 8 MiB; "
                                 "the sums in the norms; logits up to 72 MiB a rank)")
        parser.add_argument("--seed", type=int, default=d.seed, help="seed for dummy weights and unseeded sampling")
        parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                            help="most sequences decoded together in one step")
        parser.add_argument("--max-model-len", type=int, default=d.max_model_len,
                            help="context length: prompt plus completion tokens")
        parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                            help="token budget of one step; longer prompts are prefilled in chunks")
        parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
        parser.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                            help="KV cache blocks in the pool (overrides --kv-cache-memory-mb)")
        parser.add_argument("--kv-cache-memory-mb", type=int, default=d.kv_cache_memory_mb,
                            help="CPU: memory for the KV cache pool")
        parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                            help="CUDA: fraction of GPU memory for weights, activations and the KV pool; "
                                 "the pool takes what the weights and the profiled activation peak leave")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                            default=d.enable_prefix_caching,
                            help="share the K/V of full blocks between requests with the same prefix (on by "
                                 "default; --no-enable-prefix-caching recomputes every prompt)")
        parser.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                            help="largest top_logprobs / logprobs a request may ask for")
        parser.add_argument("--enable-keep-sampling-mask", "--enable_keep_sampling_mask",
                            dest="enable_keep_sampling_mask", action="store_true",
                            help="return `sampling_mask` (the token ids the sampler could draw from after "
                                 "top-k/top-p/min-p) and `sampling_logz` with every generated token")
        parser.add_argument("--sampling-mask-format", choices=list(SAMPLING_MASK_FORMATS),
                            default=d.sampling_mask_format,
                            help="default wire form of `sampling_mask` for requests that do not set "
                                 "`sampling_mask_format`: ids (sorted id lists) or bitmap (one base64 string of "
                                 "ceil(V/8) bytes per token, least significant bit first)")
        parser.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"],
                            default=d.logprobs_mode,
                            help="raw: the model's log-softmax; processed: after penalties, temperature and "
                                 "truncation, renormalised over the kept set")
        parser.add_argument("--guided-decoding-backend", choices=["auto", "xgrammar", "llguidance", "off"],
                            default=d.guided_decoding_backend,
                            help="structured output (response_format, guided_json/regex/choice/grammar, "
                                 "structural_tag): auto takes xgrammar where it enforces every keyword of the "
                                 "schema, else llguidance where it does, else refuses the request (400 naming the "
                                 "keyword); xgrammar or llguidance alone; or off")
        parser.add_argument("--guided-decoding-disable-any-whitespace", action="store_true",
                            help="default of requests that do not set `disable_any_whitespace`: JSON output "
                                 "(json_schema, json_object) without whitespace outside strings")
        parser.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout,
                            help="seconds a grammar may compile before its request fails")
        parser.add_argument("--grammar-cache-mb", type=int, default=d.grammar_cache_mb,
                            help="memory for compiled grammars; an identical schema compiles once")
        parser.add_argument("--reasoning-parser", choices=reasoning_parser_names(), default=d.reasoning_parser,
                            help="split a reasoning model's thinking from its answer: chat returns the text "
                                 "before the end marker (e.g. </think>) as `reasoning_content`, and "
                                 "structured-output constraints start only after that marker")
        parser.add_argument("--speculative-config", default=d.speculative_config, type=_speculative_config_arg,
                            help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": '
                                 '4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": "mtp", '
                                 '"num_speculative_tokens": 2}\' (MTP head: "model": DIR; default: the head shipped '
                                 'for the embedded model; "adaptive": false keeps every draft in every step '
                                 'instead of capping them at what measured steps say pays)')
        parser.add_argument("--async-scheduling", choices=list(ASYNC_SCHEDULING_MODES), default=d.async_scheduling,
                            help="schedule and launch step N+1 while step N runs, its input tokens taken from "
                                 "step N's sampler on the device, so the GPU does not wait for the host between "
                                 "steps; auto: on for CUDA, with or without n-gram or MTP speculation (on one GPU "
                                 "its steps with drafts too)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _speculative_config_arg(text: str) -> SpeculativeConfig | None:
    """Checked while parsing, so a bad config is a usage error naming the problem, not a traceback."""
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
