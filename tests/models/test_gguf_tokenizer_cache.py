"""A GGUF's tokenizer read back from the disk cache is the one converted from the file; the
cache converts once, converts again when an entry is damaged, and never fails a load."""

from __future__ import annotations

import os
import shutil

import pytest

from fastdeploy.model_executor.model_loader import embedded_model_path, gguf_tokenizer
from fastdeploy.model_executor.model_loader.gguf_tokenizer import (
    CACHE_DIR_ENV,
    COMPLETE_MARKER,
    cache_entry,
    load_gguf_tokenizer,
)

TEXTS = [
    "Hello, world!", "  leading spaces and\ttabs\nnewlines\r\n", "naïve café — 日本語 🎉 emoji",
    "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # code", "1234567890 3.14159 -0.5e-3",
    "\u0000\u00ff\ufffd odd code points", "",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Another?"}]


@pytest.fixture(scope="module")
def converted():
    """The embedded GGUF's tokenizer as transformers converts it (no cache involved)."""
    return gguf_tokenizer.convert_gguf_tokenizer(embedded_model_path())


@pytest.fixture
def conversions(converted, monkeypatch) -> list[str]:
    """The paths the cache converts (each conversion hands out the real one made above)."""
    calls: list[str] = []

    def convert(path: str):
        calls.append(path)
        return converted

    monkeypatch.setattr(gguf_tokenizer, "convert_gguf_tokenizer", convert)
    return calls


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def assert_same_tokenizer(got, want) -> None:
    assert len(got) == len(want) and got.get_vocab() == want.get_vocab()
    assert got.all_special_tokens == want.all_special_tokens
    assert (got.eos_token_id, got.bos_token_id, got.pad_token_id) == (want.eos_token_id, want.bos_token_id,
                                                                       want.pad_token_id)
    assert got.chat_template == want.chat_template
    for text in TEXTS:
        ids = want(text, add_special_tokens=False).input_ids
        assert got(text, add_special_tokens=False).input_ids == ids, text
        assert got(text).input_ids == want(text).input_ids, text
        assert got.decode(ids, skip_special_tokens=True) == want.decode(ids, skip_special_tokens=True)
    rendered = [t.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) for t in (got, want)]
    assert rendered[0] == rendered[1]


def test_the_second_load_reads_the_cache_and_equals_the_conversion(cache_dir, conversions, converted):
    path = embedded_model_path()
    assert load_gguf_tokenizer(path) is converted
    entry = cache_entry(path)
    assert (entry / COMPLETE_MARKER).is_file() and entry.is_relative_to(cache_dir)
    cached = load_gguf_tokenizer(path)
    assert conversions == [path]  # the second load converted nothing
    assert cached is not converted
    assert_same_tokenizer(cached, converted)


def test_an_interrupted_or_damaged_entry_is_converted_again(cache_dir, conversions, converted):
    path = embedded_model_path()
    entry = cache_entry(path)
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text("{not json")  # a save cut short: no marker
    assert load_gguf_tokenizer(path) is converted and len(conversions) == 1
    assert_same_tokenizer(load_gguf_tokenizer(path), converted)
    (entry / "tokenizer.json").write_text("{not json")  # damaged after it was complete
    assert load_gguf_tokenizer(path) is converted and len(conversions) == 2
    assert_same_tokenizer(load_gguf_tokenizer(path), converted)
    assert len(conversions) == 2


def test_a_cache_that_cannot_be_written_still_gives_the_tokenizer(tmp_path, monkeypatch, conversions, converted):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_DIR_ENV, str(blocker / "cache"))  # under a file: no directory can be made
    path = embedded_model_path()
    assert load_gguf_tokenizer(path) is converted and load_gguf_tokenizer(path) is converted
    assert len(conversions) == 2


def test_a_changed_file_gets_a_new_entry(tmp_path, cache_dir):
    copy = tmp_path / "model.gguf"
    shutil.copyfile(embedded_model_path(), copy)
    before = cache_entry(str(copy))
    os.utime(copy, ns=(1, 1))
    assert cache_entry(str(copy)) != before
