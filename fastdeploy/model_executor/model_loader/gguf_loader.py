"""GGUF checkpoints (llama.cpp format): ModelConfig from metadata, dequantised HF-named weights."""

from __future__ import annotations

import re
from collections.abc import Iterator

import gguf
import numpy as np
import torch
from tqdm import tqdm

from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.model_loader.gguf_file import GGUFFile, read_gguf

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# llama.cpp tensor name -> HF name ("{}" is the layer index).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_model_config(path_or_file: str | GGUFFile) -> ModelConfig:
    """ModelConfig from `<arch>.*` metadata (arch = general.architecture)."""
    file = path_or_file if isinstance(path_or_file, GGUFFile) else read_gguf(path_or_file)
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
    tensor_names = {t.name for t in file.tensors}
    embd = next(t for t in file.tensors if t.name == "token_embd.weight")

    def key(suffix: str, default=None):
        return meta.get(f"{arch}.{suffix}", default)

    # RoPE scaling in a GGUF (metadata, or Llama 3.x's per-frequency divisors as a tensor) is not read.
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF sets {arch}.rope.scaling.type={scaling!r}, which is not implemented for GGUF files; "
                         "load the Hugging Face safetensors directory instead")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF holds rope_freqs.weight (Llama 3.x RoPE scaling), which is not implemented for GGUF "
                         "files; load the Hugging Face safetensors directory instead")

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    vocab = key("vocab_size")
    if vocab is None:  # older files: the tokenizer's vocabulary, else the embedding's rows
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else int(embd.shape[1])
    eos_ids = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.get(k)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", key("rope.dimension_count", hidden // heads))),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 2048)),
        # llama.cpp drops output.weight when the head is tied to the embedding.
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's Q/K row permutation (llama only).

    llama.cpp interleaves the two rotary halves of each head (GPT-J style RoPE); HF's
    rotate-half convention needs them back as [first half | second half].
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def load_gguf_weights(
    path: str, config: ModelConfig | None = None, file: GGUFFile | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every weight, dequantised, with a progress bar."""
    file = file or read_gguf(path)
    config = config or gguf_model_config(file)
    for tensor in tqdm(file.tensors, desc="Loading GGUF weights", unit="tensor"):
        name = _hf_name(tensor.name)
        if name is None:  # not a weight of the model (gguf_model_config refused rope_freqs.weight)
            continue
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # dequantize() returns [rows, cols] = HF's [out, in]; F32 is a read-only memmap view.
        w = np.array(w, dtype=np.float32, copy=True).reshape(tuple(reversed([int(d) for d in tensor.shape])))
        if config.architecture == "llama":
            if ".q_proj." in name:
                w = reverse_permute(w, config.num_attention_heads)
            elif ".k_proj." in name:
                w = reverse_permute(w, config.num_key_value_heads)
        yield name, torch.from_numpy(w)
