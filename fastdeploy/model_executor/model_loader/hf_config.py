"""ModelConfig from a Hugging Face `config.json` dict, refusing what the engine does not implement.

Every key of the file is accounted for: it is read into ModelConfig, or it is known not to
change the forward pass (training switches, bookkeeping), or it is checked to have the one
value the engine implements. Anything else stops the load with an error naming the key, so a
checkpoint never runs with part of its math silently dropped.
"""

from __future__ import annotations

from typing import NoReturn

from fastdeploy.common.config import ModelConfig, MoEConfig, RopeScaling

# HF model_type -> ModelConfig.architecture
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}

# Read into ModelConfig (or checked below) for every architecture.
_READ = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "hidden_act",
    "attention_bias", "quantization_config",
}  # fmt: skip
# No effect on inference: training-only settings, bookkeeping, cache switches.
_INERT = {
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "pad_token_id",
    "initializer_range", "attention_dropout", "output_attentions", "output_hidden_states", "return_dict",
    "tokenizer_class", "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "pretraining_tp",  # HF's own forward ignores it: the slices it names sum to the same matmul
    "output_router_logits", "router_aux_loss_coef",  # the auxiliary load-balancing loss (training)
    "is_llama_config", "transformers.js_config",  # written by other tools beside the HF keys
}  # fmt: skip
# Per architecture: keys checked for the implemented value (see `_check_*`) or read for it.
_ARCH_KEYS = {
    "llama": {"mlp_bias", "rope_interleaved"},
    "qwen2": {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "use_mrope"},
    "qwen3": {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "qwen3_moe": {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "num_experts",
                  "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers"},
}  # fmt: skip

_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys each rope type reads; "type" is the older spelling of "rope_type".
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor", "original_max_position_embeddings"},  # transformers ignores the latter here
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"},
}  # fmt: skip


class UnsupportedConfigError(ValueError):
    """A config.json setting that changes the model's math and is not implemented."""


def _refuse(model_type: str, key: str, value: object, why: str = "is not implemented") -> NoReturn:
    raise UnsupportedConfigError(f"config.json of this {model_type} model sets {key}={value!r}, which {why}; "
                                 "refusing to load rather than run different math")


def as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _check_keys(cfg: dict, model_type: str) -> None:
    allowed = _READ | _INERT | _ARCH_KEYS[model_type]
    for key, value in cfg.items():
        # A key set to null (or an empty list/dict) turns nothing on.
        if key not in allowed and value not in (None, [], {}):
            _refuse(model_type, key, value, "is not a setting fastdeploy knows for this architecture")
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse(model_type, "hidden_act", cfg["hidden_act"], "is not SiLU (the only activation implemented)")
    if cfg.get("mlp_bias"):
        _refuse(model_type, "mlp_bias", cfg["mlp_bias"], "adds MLP biases (not implemented)")
    if cfg.get("rope_interleaved"):
        _refuse(model_type, "rope_interleaved", cfg["rope_interleaved"], "asks for GPT-J style RoPE (not implemented)")
    if cfg.get("use_mrope"):
        _refuse(model_type, "use_mrope", cfg["use_mrope"], "asks for multimodal RoPE (not implemented)")
    if cfg.get("use_sliding_window"):
        _refuse(model_type, "use_sliding_window", cfg["use_sliding_window"],
                "turns on sliding-window attention (not implemented)")
    for layer_type in cfg.get("layer_types") or []:
        if layer_type != "full_attention":
            _refuse(model_type, "layer_types", layer_type, "is not full attention (the only kind implemented)")


def _rope(cfg: dict, model_type: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling, from `rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta`."""
    # transformers takes `rope_scaling` first when a file has both.
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in _ROPE_TYPES:
        _refuse(model_type, "rope_scaling.rope_type", rope_type, f"is not one of {_ROPE_TYPES}")
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        _refuse(model_type, "partial_rotary_factor", partial, "rotates part of each head (not implemented)")
    for key, value in params.items():
        if key not in _ROPE_KEYS[rope_type] and value is not None:
            _refuse(model_type, f"rope_scaling.{key}", value, f"is not read by rope_type {rope_type!r}")
    if rope_type == "default":
        return theta, None
    original = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and original is None:
        original = cfg.get("max_position_embeddings", 2048)  # as transformers fills it in
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":  # transformers' rule when the ratio is left implicit
        factor = cfg["max_position_embeddings"] / original
    if factor is None:
        _refuse(model_type, "rope_scaling.factor", None, f"is required by rope_type {rope_type!r}")
    scaling = RopeScaling(rope_type=rope_type, factor=float(factor),
                          original_max_position_embeddings=None if original is None else int(original))
    for key in ("low_freq_factor", "high_freq_factor", "attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            setattr(scaling, key, float(params[key]))
    # transformers reads `beta_* or default`: a 0 or null means the default.
    scaling.beta_fast = float(params.get("beta_fast") or 32.0)
    scaling.beta_slow = float(params.get("beta_slow") or 1.0)
    scaling.truncate = bool(params.get("truncate", True))
    return theta, scaling


_FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
             "ignored_layers"}


def _fp8_block(cfg: dict, model_type: str) -> tuple[int, int] | None:
    """The scale block of an FP8 block-wise checkpoint; None without `quantization_config`."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8":
        _refuse(model_type, "quantization_config.quant_method", quant.get("quant_method"),
                "is not fp8 (the only quantized checkpoints fastdeploy reads)")
    for key, value in quant.items():
        if key not in _FP8_KEYS and value not in (None, [], {}):
            _refuse(model_type, f"quantization_config.{key}", value, "is not a setting fastdeploy knows for fp8")
    if quant.get("fmt", "e4m3") != "e4m3":
        _refuse(model_type, "quantization_config.fmt", quant["fmt"], "is not e4m3")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        _refuse(model_type, "quantization_config.activation_scheme", quant["activation_scheme"],
                "needs calibrated activation scales (not implemented)")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2):
        _refuse(model_type, "quantization_config.weight_block_size", block,
                "is not a block size [rows, cols] (per-tensor FP8 is not implemented)")
    return int(block[0]), int(block[1])


def _moe(cfg: dict) -> MoEConfig:
    # transformers >= 5 writes the latter
    num_experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    return MoEConfig(
        num_experts=int(num_experts),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
        mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
    )


def model_config_from_hf_dict(cfg: dict) -> ModelConfig:
    """ModelConfig from a HF config.json dict (Llama, Qwen2, Qwen3, Qwen3-MoE ForCausalLM).

    Raises UnsupportedConfigError naming the first key whose setting is not implemented.
    """
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedConfigError(f"unsupported model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}")
    _check_keys(cfg, model_type)
    rope_theta, rope_scaling = _rope(cfg, model_type)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=ARCHITECTURES[model_type],
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and never an o_proj bias; the others follow attention_bias for all four.
        attention_bias=model_type == "qwen2" or bias,
        o_proj_bias=model_type != "qwen2" and bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=as_id_list(cfg.get("eos_token_id")),
        rope_scaling=rope_scaling,
        moe=_moe(cfg) if model_type == "qwen3_moe" else None,
        fp8_weight_block=_fp8_block(cfg, model_type),
    )
