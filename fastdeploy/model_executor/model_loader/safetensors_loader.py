"""HF checkpoint directories: `config.json` + `*.safetensors` (sharded or not)."""

from __future__ import annotations

import glob
import json
import os
import warnings
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from fastdeploy.config import ModelConfig

_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}  # HF model_type -> ModelConfig.architecture


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def model_config_from_hf_dict(cfg: dict) -> ModelConfig:
    """ModelConfig from a HF config.json dict (LlamaForCausalLM / Qwen2ForCausalLM)."""
    model_type = cfg.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_ARCHITECTURES)}")
    # transformers >= 5 writes rope settings under `rope_parameters`; older files use top-level keys.
    rope = cfg.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type") or (cfg.get("rope_scaling") or {}).get("rope_type") or "default"
    if rope_type != "default":
        warnings.warn(f"rope_type {rope_type!r} is not implemented; using plain RoPE", stacklevel=2)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return ModelConfig(
        architecture=_ARCHITECTURES[model_type],
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama only when config says so.
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
    )


def hf_model_config(path: str) -> ModelConfig:
    """ModelConfig from a config.json file or a directory holding one.

    A directory's generation_config.json may list extra stop ids (e.g. Qwen's <|endoftext|>).
    """
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(config_file) as f:
        config = model_config_from_hf_dict(json.load(f))
    gen_file = os.path.join(os.path.dirname(config_file), "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            for eos in _as_id_list(json.load(f).get("eos_token_id")):
                if eos not in config.eos_token_ids:
                    config.eos_token_ids.append(eos)
    return config


def load_safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from every *.safetensors file of the directory, with a progress bar."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    handles = [safe_open(f, framework="pt") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading safetensors weights", unit="tensor") as bar:
        for h in handles:
            for name in h.keys():
                yield name, h.get_tensor(name)
                bar.update(1)
