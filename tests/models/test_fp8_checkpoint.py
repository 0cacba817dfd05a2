"""FP8 block-wise checkpoints (e4m3 weights, float32 `weight_scale_inv` per block) against their dequantized weights.

A tiny random Qwen3-MoE is quantized the way the Qwen3 FP8 releases are (every linear weight but
the router and the LM head, blocks that do not divide the shapes), written with the scales in
a different shard from the weights; transformers runs the dequantized weights in float32.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.model_executor.model_loader.fp8 import dequantize_block_fp8
from fastdeploy.model_executor.model_loader.hf_config import UnsupportedConfigError
from tests.models.test_loaders import _our_logits
from tests.random_hf_models import random_hf_model

VOCAB = 256
BLOCK = (32, 48)  # 64-, 96- and 32-wide weights: ragged edge blocks
FP8_MAX = 448.0  # largest finite e4m3 value


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    bh, bw = block
    padded = torch.zeros(-(-rows // bh) * bh, -(-cols // bw) * bw)
    padded[:rows, :cols] = w
    blocks = padded.view(padded.shape[0] // bh, bh, padded.shape[1] // bw, bw)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def _is_quantized(name: str) -> bool:
    return name.endswith("proj.weight")  # q/k/v/o, gate/up/down and every expert's; not mlp.gate or lm_head


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("fp8")
    hf = random_hf_model("qwen3_moe", VOCAB, mlp_only_layers=[1])
    hf.save_pretrained(root / "original")
    state = load_file(str(root / "original" / "model.safetensors"))
    weights, scales, dequantized = {}, {}, {}
    for name, tensor in state.items():
        if _is_quantized(name):
            q, scale = _quantize(tensor, BLOCK)
            weights[name], scales[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_block_fp8(q, scale, BLOCK)
        else:
            weights[name] = dequantized[name] = tensor
    fp8 = root / "fp8"
    fp8.mkdir()
    save_file(scales, str(fp8 / "model-a-scales.safetensors"))  # read first: scales before their weights
    save_file(weights, str(fp8 / "model-b-weights.safetensors"))
    config = json.loads((root / "original" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}  # fmt: skip
    (fp8 / "config.json").write_text(json.dumps(config))
    # The reference: the dequantized weights in transformers' own loading path (it regroups the experts).
    reference = root / "dequantized"
    reference.mkdir()
    save_file(dequantized, str(reference / "model.safetensors"))
    (reference / "config.json").write_text((root / "original" / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    quantization_error = max((dequantized[n] - state[n]).abs().max().item() for n in state if _is_quantized(n))
    assert quantization_error > 1e-3  # the scales matter: raw e4m3 values would be far off
    return str(fp8), str(root / "original"), hf


def test_fp8_checkpoint_matches_its_dequantized_weights(checkpoints) -> None:
    fp8, _, hf_dequantized = checkpoints
    model, config = get_model(fp8)
    assert config.fp8_weight_block == BLOCK and config.moe is not None
    ids = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf_dequantized(ids[None]).logits[0]
    torch.testing.assert_close(_our_logits(model, config, ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant,key", [
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method"),
])  # fmt: skip
def test_other_quantization_refused(checkpoints, tmp_path, quant: dict, key: str) -> None:
    _, original, _ = checkpoints
    config = json.loads(open(f"{original}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(UnsupportedConfigError, match=f"quantization_config.{key}"):
        get_model(str(tmp_path))
