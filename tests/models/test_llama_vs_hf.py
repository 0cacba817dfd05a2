"""The embedded SmolLM2 GGUF through our paged model vs HF transformers, greedy decoding.

The HF reference is built independently of our loader: a hand-written LlamaConfig and
transformers' own GGUF tensor processor (name map + Q/K reverse permutation).
"""

from __future__ import annotations

import gguf
import pytest
import torch
from transformers import LlamaConfig, PreTrainedTokenizerFast
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers.initialization import no_init_weights
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

from fastdeploy.common.config import ModelConfig
from fastdeploy.model_executor.layers.attention import allocate_kv_caches
from fastdeploy.model_executor.layers.attention_metadata import AttentionMetadata, PrefillSeq
from fastdeploy.model_executor.model_loader import embedded_model_path, get_model, get_tokenizer
from fastdeploy.model_executor.models.llama import LlamaForCausalLM

NEW_TOKENS = 64
BLOCK_SIZE = 16
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one paragraph why the sky is blue.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, how are you?' into Spanish.",
    "def fib(n):\n    # complete this Python function",
    "Give me a short motivational quote for a Monday morning, and explain who might have said it.",
    "hi",
]


class PagedRunner:
    """Test-local stand-in for the model runner: block allocation + AttentionMetadata per step."""

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, num_blocks: int = 128, seed: int = 0) -> None:
        self.model = model
        self.kv_caches = allocate_kv_caches(config, num_blocks, BLOCK_SIZE, torch.float32, "cpu")
        # Shuffled free list: sequences get scattered, non-contiguous blocks.
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.blocks: dict[int, list[int]] = {}
        self.mixed_steps = 0  # steps that batched several decodes with a prefill chunk

    def add(self, sid: int, prompt: list[int]) -> None:
        self.tokens[sid], self.computed[sid], self.blocks[sid] = list(prompt), 0, []

    def release(self, sid: int) -> None:
        self.free.extend(self.blocks.pop(sid))
        del self.tokens[sid], self.computed[sid]

    def _schedule(self, sid: int, n: int) -> tuple[list[int], list[int], list[int]]:
        start = self.computed[sid]
        while len(self.blocks[sid]) * BLOCK_SIZE < start + n:
            self.blocks[sid].append(self.free.pop())
        positions = list(range(start, start + n))
        slots = [self.blocks[sid][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
        self.computed[sid] = start + n
        return self.tokens[sid][start : start + n], positions, slots

    @torch.no_grad()
    def step(self, decodes: list[int], prefills: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """Run one step; returns float32 logits of each scheduled sequence's last token."""
        ids, pos, slots, last_rows = [], [], [], {}
        for sid in decodes:
            assert self.computed[sid] == len(self.tokens[sid]) - 1
            t, p, s = self._schedule(sid, 1)
            ids += t
            pos += p
            slots += s
            last_rows[sid] = len(ids) - 1
        num_decode = len(ids)
        max_blocks = max((len(self.blocks[sid]) for sid in decodes), default=1)
        tables = torch.zeros(num_decode, max_blocks, dtype=torch.long)
        for i, sid in enumerate(decodes):
            tables[i, : len(self.blocks[sid])] = torch.tensor(self.blocks[sid])
        chunks = []
        for sid, n in prefills:
            t, p, s = self._schedule(sid, n)
            chunks.append(PrefillSeq(len(ids), n, self.computed[sid], torch.tensor(self.blocks[sid])))
            ids += t
            pos += p
            slots += s
            last_rows[sid] = len(ids) - 1
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            num_decode_tokens=num_decode,
            decode_block_tables=tables,
            decode_context_lens=torch.tensor([self.computed[sid] for sid in decodes], dtype=torch.long),
            prefills=chunks,
            block_size=BLOCK_SIZE,
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), meta, self.kv_caches)
        rows = list(last_rows.values())
        logits = self.model.compute_logits(hidden[rows])
        return dict(zip(last_rows, logits, strict=True))


def _run(
    runner: PagedRunner, prompts: dict[int, list[int]], plan: dict[int, tuple[int, list[int]]], n_new: int
) -> dict[int, tuple[list[int], list[float]]]:
    """Greedy-decode `n_new` tokens for every sequence, following `plan`.

    plan[sid] = (first step, prefill chunk sizes). Each step batches the decodes of
    every sequence past its prompt with the next prefill chunk of the others.
    Returns sid -> (tokens, log-probs of the chosen tokens).
    """
    out: dict[int, tuple[list[int], list[float]]] = {sid: ([], []) for sid in plan}
    pending = {sid: list(chunks) for sid, (_, chunks) in plan.items()}
    step = 0
    while any(len(out[sid][0]) < n_new for sid in plan):
        decodes = [sid for sid in plan if sid in runner.tokens and not pending[sid] and len(out[sid][0]) < n_new]
        prefills = []
        for sid, (start, _) in plan.items():
            if step >= start and pending[sid]:
                if sid not in runner.tokens:
                    runner.add(sid, prompts[sid])
                prefills.append((sid, pending[sid].pop(0)))
        runner.mixed_steps += len(decodes) > 1 and bool(prefills)
        for sid, logits in runner.step(decodes, prefills).items():
            if runner.computed[sid] == len(runner.tokens[sid]):  # prompt finished, or a decode
                token = int(logits.argmax())
                out[sid][0].append(token)
                out[sid][1].append(float(logits.log_softmax(-1)[token]))
                runner.tokens[sid].append(token)
        step += 1
    for sid in plan:
        runner.release(sid)
    return out


def _two_chunks(prompt: list[int]) -> list[int]:
    return [len(prompt) // 2, len(prompt) - len(prompt) // 2]


@torch.no_grad()
def _hf_greedy(
    hf: HFLlamaForCausalLM, prompts: list[list[int]], n_new: int
) -> tuple[list[list[int]], list[list[float]], list[float]]:
    """HF greedy loop over the left-padded batch with HF's own KV cache.

    Returns tokens, log-probs of the chosen tokens, and each sequence's smallest top-1/top-2
    logit gap (to tell a real mismatch from a near-tie in the error message).
    """
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = hf(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    tokens, logprobs, gaps = [], [], []
    for _ in range(n_new):
        logits = out.logits[:, -1].float()
        token = logits.argmax(-1)
        tokens.append(token)
        logprobs.append(logits.log_softmax(-1).gather(1, token[:, None])[:, 0])
        top2 = logits.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        out = hf(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                 past_key_values=out.past_key_values, use_cache=True)  # fmt: skip
    return (torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist(),
            torch.stack(gaps, 1).min(1).values.tolist())  # fmt: skip


def _hf_reference_model(path: str) -> HFLlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    with no_init_weights():  # every weight comes from the GGUF: skip the random init
        hf = HFLlamaForCausalLM(config).float().eval()
    processor = LlamaTensorProcessor(config=config.to_dict())
    name_map = get_gguf_hf_weights_map(hf, processor)
    state = {}
    for tensor in gguf.GGUFReader(path).tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weights = processor.process(weights=weights, name=tensor.name).weights
        state[name_map[tensor.name]] = torch.from_numpy(weights.copy())
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    hf.tie_weights()
    return hf


@pytest.fixture(scope="module")
def setup(embedded_tokenizer):
    path = embedded_model_path()
    model, config = get_model(None)
    tokenizer = embedded_tokenizer  # get_tokenizer(None), shared with other directories (tests/conftest.py)
    hf = _hf_reference_model(path)
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        ).input_ids
        for p in PROMPTS
    ]
    return model, config, tokenizer, hf, prompts


def test_tokenizer_and_config(setup, tmp_path) -> None:
    _, config, tokenizer, _, prompts = setup
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert "<|im_start|>" in tokenizer.chat_template
    tokenizer.save_pretrained(tmp_path)  # a HF directory's tokenizer loads the same
    reloaded = get_tokenizer(str(tmp_path))
    assert reloaded.chat_template == tokenizer.chat_template
    assert reloaded("Hello, world!").input_ids == tokenizer("Hello, world!").input_ids
    assert config.eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert (config.architecture, config.num_hidden_layers, config.vocab_size) == ("llama", 30, 49152)
    assert config.head_dim == 64
    assert (config.num_attention_heads, config.num_key_value_heads, config.rope_theta) == (9, 3, 100000.0)
    assert config.tie_word_embeddings and not config.attention_bias and config.bos_token_id == 1
    assert prompts[0][:1] == [tokenizer.convert_tokens_to_ids("<|im_start|>")]


def test_greedy_matches_hf(setup) -> None:
    """All 8 prompts: 2 prefill chunks each, then 63 batched decode steps (D = 8)."""
    model, config, tokenizer, hf, prompts = setup
    ours = _run(PagedRunner(model, config), dict(enumerate(prompts)),
                {i: (0, _two_chunks(p)) for i, p in enumerate(prompts)}, NEW_TOKENS)  # fmt: skip
    ref_tokens, ref_logprobs, gaps = _hf_greedy(hf, prompts, NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        tokens, logprobs = ours[i]
        assert tokens == ref_tokens[i], (
            f"prompt {tokenizer.decode(prompt)!r}: ours {tokenizer.decode(tokens)!r} "
            f"vs HF {tokenizer.decode(ref_tokens[i])!r}; min top-2 gap {gaps[i]:.2e}"
        )
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs[i]), atol=1e-3, rtol=0)


def test_batched_equals_alone(setup) -> None:
    """Staggered arrivals: decodes of several sequences (D > 1) share steps with other
    sequences' prefill chunks; every sequence must match running it alone."""
    model, config, _, _, prompts = setup
    n_new = 8
    chosen = {0: prompts[7], 1: prompts[1], 2: prompts[6], 3: prompts[3]}
    plan = {0: (0, [len(chosen[0])]), 1: (0, [7, len(chosen[1]) - 7]), 2: (1, [len(chosen[2])]),
            3: (3, [20, len(chosen[3]) - 20])}  # fmt: skip
    runner = PagedRunner(model, config, seed=1)
    batched = _run(runner, chosen, plan, n_new)
    assert runner.mixed_steps > 0
    for sid, prompt in chosen.items():
        tokens, logprobs = _run(runner, {0: prompt}, {0: (0, _two_chunks(prompt))}, n_new)[0]
        assert batched[sid][0] == tokens
        torch.testing.assert_close(torch.tensor(batched[sid][1]), torch.tensor(logprobs), atol=1e-4, rtol=0)
