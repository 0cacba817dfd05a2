"""Incremental detokenization: streamed pieces join to the whole decode, with the Rust
tokenizer's own decode and with the Python wrapper's."""

from __future__ import annotations

import random

import pytest

from fastdeploy.output.detokenizer import CLEAN_UP_PROBE, IncrementalDetokenizer, fast_decoder

TEXTS = ["Hello there, world!  Spaces   and\ttabs\nnew lines.", "naïve café — 東京 🎉 emoji and accents",
         "def f(x):\n    return x ** 2  # code", " leading space, trailing space "]


def _stream(tokenizer, ids: list[int], skip_special_tokens: bool, fast: bool, seed: int) -> str:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    if not fast:
        detok._fast = None
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)  # merged deltas bring several tokens at once
        out.append(detok.add(ids[i:i + n]))
        i += n
    return "".join(out)


def test_the_embedded_tokenizer_takes_the_fast_path(embedded_tokenizer):
    assert fast_decoder(embedded_tokenizer) is not None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_the_whole_decode(embedded_tokenizer, skip_special_tokens):
    tok = embedded_tokenizer
    special = [tok.eos_token_id, tok.bos_token_id]
    rng = random.Random(0)
    for seed, text in enumerate(TEXTS):
        ids = tok.encode(text, add_special_tokens=False)
        ids = ids[: len(ids) // 2] + [i for i in special if i is not None] + ids[len(ids) // 2:]
        # Random ids too: pieces of multi-byte characters that never complete.
        ids += [rng.randrange(tok.vocab_size) for _ in range(40)]
        whole = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        for fast in (True, False):
            streamed = _stream(tok, ids, skip_special_tokens, fast, seed)
            # Everything but a trailing incomplete character is out.
            assert whole.startswith(streamed) and len(whole) - len(streamed) <= 4, (fast, streamed, whole)
        assert _stream(tok, ids, skip_special_tokens, True, seed) == _stream(tok, ids, skip_special_tokens, False, seed)


@pytest.fixture
def cleaning_tokenizer():
    """The embedded tokenizer with the wrapper's clean-up of tokenization spaces switched on, as
    Llama 3's tokenizer config has it (recent transformers skip it for BPE unless told)."""
    from fastdeploy.model_executor.model_loader import get_tokenizer

    tok = get_tokenizer(None, None)
    tok.clean_up_tokenization_spaces = True
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    probe = tok.encode(CLEAN_UP_PROBE, add_special_tokens=False)
    if tok.decode(probe) == tok.backend_tokenizer.decode(probe, False):
        pytest.skip("this transformers version cleans up no tokenization spaces")
    return tok


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_fast_path_keeps_the_clean_up_of_tokenization_spaces(cleaning_tokenizer, skip_special_tokens):
    tok = cleaning_tokenizer
    fast = fast_decoder(tok)
    assert fast is not None and fast is not tok.backend_tokenizer.decode
    rng = random.Random(1)
    for seed, text in enumerate([*TEXTS, CLEAN_UP_PROBE, "Is it ? Yes , it 's fine . They 're here !"]):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        ids += [rng.randrange(tok.vocab_size) for _ in range(20)]
        assert fast(ids, skip_special_tokens) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert _stream(tok, ids, skip_special_tokens, True, seed) == _stream(tok, ids, skip_special_tokens, False, seed)
