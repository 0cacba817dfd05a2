"""`--tokenizer` / `LLM(tokenizer=...)`: weights without a tokenizer, and the bundled dummy configs."""

from __future__ import annotations

import argparse
import json

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.args import EngineArgs
from fastdeploy.model_executor.model_loader import embedded_model_path, get_tokenizer, tokenizer_path
from fastdeploy.output.detokenizer import TokenTexts
from tests.random_hf_models import save_random_hf_model, save_word_tokenizer

VOCAB = 300


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("tok")
    model = save_random_hf_model(root / "model", "qwen3_moe", VOCAB, mlp_only_layers=[0])
    return model, save_word_tokenizer(root / "tokenizer", VOCAB)


def test_weights_without_tokenizer_need_the_option(dirs) -> None:
    model, tokenizer = dirs
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        get_tokenizer(model)
    with pytest.raises(FileNotFoundError, match="no such file"):
        get_tokenizer(model, tokenizer + "-missing")
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        get_tokenizer(model, model)  # a directory, but without tokenizer files
    assert get_tokenizer(model, tokenizer).convert_ids_to_tokens(17) == "w17"


def test_offline_llm_with_tokenizer(dirs) -> None:
    model, tokenizer = dirs
    llm = LLM(model, tokenizer=tokenizer, guided_decoding_backend="off", max_num_seqs=4, num_kv_blocks=64)
    out = llm.generate("w5 w6 w7 w8 w9", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert out.prompt_token_ids == [5, 6, 7, 8, 9]
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 6 and out.outputs[0].text.split() == [f"w{t}" for t in tokens if t >= 3]


def test_cli_option() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["llama3_8b", "--load-format", "dummy", "--tokenizer", "tok"]))
    assert args.create_engine_config().tokenizer == "tok"
    assert "--tokenizer" in parser.format_help()
    with pytest.raises(SystemExit):  # a flag the engine does not implement is refused by name, not ignored
        parser.parse_args(["llama3_8b", "--tokenizer-mode", "slow"])


def test_bundled_configs_borrow_the_embedded_tokenizer(tmp_path) -> None:
    """The dummy configs have no tokenizer files; they take the embedded model's (49,152 ids), and ids past
    it decode to empty text instead of failing."""
    for name in ("llama3_8b", "llama3_1_8b", "qwen2_5_7b", "qwen3_8b", "qwen3_30b_a3b"):
        assert tokenizer_path(name) == embedded_model_path()
    assert tokenizer_path("llama3_8b", str(tmp_path)) == str(tmp_path)  # an explicit --tokenizer wins
    config = tmp_path / "config.json"  # a config.json elsewhere has no such fallback
    config.write_text(json.dumps({"model_type": "llama"}))
    assert tokenizer_path(str(config)) == str(config)


def test_ids_past_the_tokenizer_decode_to_nothing(embedded_tokenizer) -> None:
    texts = TokenTexts(embedded_tokenizer)
    assert len(embedded_tokenizer) == 49152
    assert texts.text(100_000) == "" and texts.raw_bytes(100_000) == []
    assert embedded_tokenizer.decode([100, 100_000, 200]) == embedded_tokenizer.decode([100, 200])
