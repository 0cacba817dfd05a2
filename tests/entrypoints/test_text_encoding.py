"""The prompt encoder's fast path gives transformers' `encode(text, add_special_tokens=False)`."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from fastdeploy.common.text_encoding import encode_ids
from tests.random_hf_models import save_word_tokenizer

TEXTS = [
    "",
    " ",
    "Hello, world! How are you?",
    "  leading and trailing spaces \t\n\n  ",
    "héllo wörld 你好 🤖 naïve café",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text between<|endoftext|>",
    "code: def f(x):\n    return x ** 2  # comment\n" * 40,
    "a" * 5000,
    " ".join(str(i) for i in range(3000)),
]


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_embedded_tokenizer_gives_transformers_ids(embedded_tokenizer, split_special_tokens):
    tok = embedded_tokenizer
    before = tok.split_special_tokens
    tok.split_special_tokens = split_special_tokens
    try:
        for text in TEXTS:
            expected = tok.encode(text, add_special_tokens=False)
            assert encode_ids(tok, text) == expected, text[:40]
    finally:
        tok.split_special_tokens = before
    assert encode_ids(tok, "<|im_start|>") == tok.encode("<|im_start|>", add_special_tokens=False)


def test_word_level_tokenizer_gives_transformers_ids(tmp_path):
    tok = PreTrainedTokenizerFast.from_pretrained(save_word_tokenizer(tmp_path, 64))
    for text in ["w3 w4 w5", "w63 w0 unknown w7", "", "   w9   "]:
        assert encode_ids(tok, text) == tok.encode(text, add_special_tokens=False)


def test_a_tokenizer_with_an_encode_of_its_own_keeps_it(embedded_tokenizer):
    class Marked(type(embedded_tokenizer)):
        def encode(self, text, **kwargs):
            return [7, *super().encode(text, **kwargs)]

    marked = Marked.__new__(Marked)
    marked.__dict__.update(embedded_tokenizer.__dict__)
    assert encode_ids(marked, "hello") == [7, *embedded_tokenizer.encode("hello", add_special_tokens=False)]
