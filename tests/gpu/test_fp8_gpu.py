"""An FP8 block-wise checkpoint (tests/models/test_fp8_checkpoint.py's tiny Qwen3-MoE) on CUDA.

The weights are dequantized as they load, on whatever device the model lives on; this runs the
checkpoint through `LLM` on CUDA (float32, CUDA graphs, the fused MoE path) and holds it to the
CPU engine on the same checkpoint, which the CPU test holds to transformers on the dequantized
weights.
"""

from __future__ import annotations

import gc

import pytest
import torch

from fastdeploy import LLM
from fastdeploy.common.sampling_params import SamplingParams
from tests.models.test_fp8_checkpoint import VOCAB, checkpoints  # noqa: F401 (the fixture)
from tests.random_hf_models import save_word_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _greedy(model: str, tokenizer: str, device: str) -> list[tuple[list[int], list[float]]]:
    llm = LLM(model, tokenizer=tokenizer, device=device, dtype="float32", guided_decoding_backend="off",
              max_num_seqs=4, num_kv_blocks=128)  # fmt: skip
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 21, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1))
    result = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def test_fp8_checkpoint_on_cuda_matches_cpu(checkpoints, tmp_path) -> None:  # noqa: F811
    fp8, _, _ = checkpoints
    tokenizer = save_word_tokenizer(tmp_path / "tokenizer", VOCAB)
    cpu = _greedy(fp8, tokenizer, "cpu")
    cuda = _greedy(fp8, tokenizer, "cuda")
    for (tokens_cpu, lp_cpu), (tokens_cuda, lp_cuda) in zip(cpu, cuda, strict=True):
        assert tokens_cuda == tokens_cpu
        torch.testing.assert_close(torch.tensor(lp_cuda), torch.tensor(lp_cpu), atol=2e-3, rtol=0)
