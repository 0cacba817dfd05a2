"""Model + tokenizer loading: GGUF, HF safetensors directories, or random (dummy) weights."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.model_loader.dummy_loader import dummy_model_config, init_dummy_weights
from fastdeploy.model_executor.model_loader.embedded import embedded_model_path
from fastdeploy.model_executor.model_loader.fp8 import dequantize_fp8_weights
from fastdeploy.model_executor.model_loader.gguf_file import read_gguf
from fastdeploy.model_executor.model_loader.gguf_loader import gguf_model_config, load_gguf_weights
from fastdeploy.model_executor.model_loader.gguf_quantized import keep_gguf_quantized
from fastdeploy.model_executor.model_loader.gguf_tokenizer import load_gguf_tokenizer
from fastdeploy.model_executor.model_loader.safetensors_loader import hf_model_config, load_safetensors_weights
from fastdeploy.model_executor.models.llama import LlamaForCausalLM

__all__ = ["embedded_model_path", "get_model", "get_tokenizer", "resolve_model_path", "tokenizer_path"]

_BUNDLED_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "configs")


def resolve_model_path(model: str | None) -> str:
    """None -> the embedded GGUF; a bare bundled config name (e.g. "llama3_8b") -> its json."""
    if model is None:
        return embedded_model_path()
    bundled = os.path.join(_BUNDLED_CONFIGS, f"{model}.json")
    if not os.path.exists(model) and os.path.isfile(bundled):
        return bundled
    return model


def _load_format(path: str, load_format: str) -> str:
    if load_format != "auto":
        if load_format not in ("gguf", "safetensors", "dummy"):
            raise ValueError(f"unknown load_format {load_format!r}")
        return load_format
    if path.endswith(".gguf"):
        return "gguf"
    if os.path.isdir(path):
        return "safetensors"
    if path.endswith(".json"):
        return "dummy"  # a bare config has no weights to load
    raise ValueError(f"cannot infer the load format of {path!r}: expected a .gguf file or a directory")


def get_model(
    model: str | None,
    load_format: str = "auto",
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    gguf_quantized: bool | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model in eval mode on `device`/`dtype` and fill its weights.

    `gguf_quantized`: on the CPU, a GGUF's Q4_1 and Q8_0 projections and LM head stay in the
    file's blocks (gguf_quantized.py); their kernel multiplies by gguf's float32 dequantization
    of each weight in float32, so the result is the dense float32 model's up to the order of
    sums. None (the default) and True do so on the CPU; False dequantizes every weight. GPUs
    always get dequantized weights.
    """
    path = resolve_model_path(model)
    fmt = _load_format(path, load_format)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    gguf_file = read_gguf(path) if fmt == "gguf" else None
    if gguf_file is not None:
        config = gguf_model_config(gguf_file)
    elif fmt == "safetensors":
        config = hf_model_config(path)
    else:
        config = dummy_model_config(path)

    # Build on the meta device, then allocate once on the target: no wasted random init.
    with torch.device("meta"), _embedding_init_skipped():
        net = LlamaForCausalLM(config)
    net = net.to(dtype=dtype).to_empty(device=device)

    if fmt == "dummy":
        init_dummy_weights(net, seed)
    else:
        weights = load_gguf_weights(path, config, gguf_file) if fmt == "gguf" else load_safetensors_weights(path)
        if config.fp8_weight_block is not None:
            weights = dequantize_fp8_weights(weights, config.fp8_weight_block)
        loaded = net.load_weights(weights)
        missing = sorted(set(dict(net.named_parameters())) - loaded)
        if missing:
            raise ValueError(f"{path}: weights missing from the checkpoint: {missing[:8]}")
        if gguf_file is not None and gguf_quantized is not False and torch.device(device).type == "cpu":
            keep_gguf_quantized(net, gguf_file, config)
    net.eval().requires_grad_(False)
    return net, config


@contextlib.contextmanager
def _embedding_init_skipped() -> Iterator[None]:
    """nn.Embedding's random init, skipped: on the meta device it has nothing to fill, yet its
    normal_ imports torch._dynamo (2-5 s of start-up that nothing else in a CPU process needs)."""
    reset = nn.Embedding.reset_parameters
    nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Embedding.reset_parameters = reset  # type: ignore[method-assign]


def _has_tokenizer_files(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def tokenizer_path(model: str | None, tokenizer: str | None = None) -> str:
    """Where the tokenizer comes from: `tokenizer` when given (a tokenizer directory, a GGUF file, or a
    bundled config name), else the model's own files; a bundled dummy config
    (`fastdeploy/model_executor/models/configs/*.json`) has none and borrows the embedded model's."""
    if tokenizer is not None:
        path = resolve_model_path(tokenizer)
        if not os.path.exists(path):
            raise FileNotFoundError(f"--tokenizer {tokenizer!r}: no such file or directory")
        return path
    path = resolve_model_path(model)
    if os.path.dirname(os.path.abspath(path)) == os.path.abspath(_BUNDLED_CONFIGS) and not _has_tokenizer_files(
            _BUNDLED_CONFIGS):
        return embedded_model_path()
    return path


def get_tokenizer(model: str | None, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """The fast tokenizer of `model`, or the one at `tokenizer`, from local files only (never the network).

    GGUF files carry their tokenizer (and chat template) in metadata, converted once and
    cached on disk (gguf_tokenizer.py); directories (or a config.json's directory) need the
    usual tokenizer files.
    """
    path = tokenizer_path(model, tokenizer)
    if path.endswith(".gguf"):
        return load_gguf_tokenizer(path)
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not _has_tokenizer_files(directory):
        if tokenizer is not None:
            raise FileNotFoundError(f"--tokenizer {tokenizer!r}: no tokenizer.json or tokenizer_config.json in "
                                    f"{directory!r}")
        raise FileNotFoundError(f"no tokenizer files next to {path!r}: pass --tokenizer (offline: "
                                "LLM(tokenizer=...)) with a tokenizer directory or a GGUF file")
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)
