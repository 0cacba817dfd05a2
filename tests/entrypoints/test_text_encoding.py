"""The prompt encoder's fast path gives transformers' `encode(text, add_special_tokens=False)`;
long text is tokenized off the API server's event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from transformers import PreTrainedTokenizerFast

from fastdeploy.common.text_encoding import encode_ids
from fastdeploy.entrypoints.openai.validation import INLINE_ENCODE_CHARS, encode_texts
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


class ThreadRecordingTokenizer:
    """Encodes one id per character, noting the thread it ran on; slow as a long prompt is."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(threading.get_ident())
        if len(text) > 1000 and len(self.threads) == 1:
            time.sleep(0.2)  # the Rust tokenizer lets go of the GIL as sleep does
        return [ord(c) % 100 for c in text]


@pytest.mark.parametrize("texts", [["x" * (INLINE_ENCODE_CHARS + 1)],
                                   ["x" * 2000] * (INLINE_ENCODE_CHARS // 2000 + 1)])
def test_long_text_is_tokenized_off_the_event_loop(texts):
    """A prompt of megabytes took seconds to tokenize on the event loop, stalling every stream
    the server was sending (one request's many prompts as much as one long one)."""
    tok = ThreadRecordingTokenizer()

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        ids = await encode_texts(tok, texts, "prompt")
        ticker.cancel()
        assert ids == [[ord(c) % 100 for c in text] for text in texts]
        return ticks

    assert asyncio.run(main()) > 5
    assert threading.get_ident() not in tok.threads


def test_short_text_is_tokenized_in_place():
    tok = ThreadRecordingTokenizer()
    assert asyncio.run(encode_texts(tok, ["Hi", "there"], "prompt")) == [[72, 5], [ord(c) % 100 for c in "there"]]
    assert tok.threads == [threading.get_ident()] * 2
