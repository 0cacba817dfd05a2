"""Shared fixtures: the embedded model's tokenizer (slow to load) and its xgrammar TokenizerInfo."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(embedded_tokenizer):
    return embedded_tokenizer


@pytest.fixture(scope="session")
def tokenizer_info(tokenizer):
    from fastdeploy.model_executor.guided_decoding import tokenizer_info_from_hf

    return tokenizer_info_from_hf(tokenizer)


@pytest.fixture(scope="session")
def compile_service(tokenizer_info):
    from fastdeploy.model_executor.guided_decoding import GrammarCompileService

    service = GrammarCompileService(tokenizer_info, max_workers=2, timeout_s=60.0)
    yield service
    service.shutdown()
