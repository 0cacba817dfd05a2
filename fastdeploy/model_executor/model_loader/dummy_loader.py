"""Random weights for a ModelConfig: benchmarks and tests without a real checkpoint."""

from __future__ import annotations

import torch

from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.model_loader.gguf_loader import gguf_model_config
from fastdeploy.model_executor.model_loader.safetensors_loader import hf_model_config


def dummy_model_config(path: str) -> ModelConfig:
    """ModelConfig from a GGUF's metadata, a config.json file, or a directory holding one."""
    if path.endswith(".gguf"):
        return gguf_model_config(path)
    return hf_model_config(path)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Seeded N(0, std) for every parameter, ones for the norm weights.

    Parameters are filled in name order from one generator so the result depends
    only on the seed, the config and the device.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=gen)
