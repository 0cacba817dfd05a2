"""HF checkpoint directories: `config.json` + `*.safetensors` (sharded or not)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.model_loader.hf_config import as_id_list, model_config_from_hf_dict


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
            for eos in as_id_list(json.load(f).get("eos_token_id")):
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
