"""Shared fixtures: the embedded model's tokenizer (slow to load), xgrammar's TokenizerInfo,
and the grammar backends, each test that takes `grammar_backend` / `compile_service`
running once per backend."""

from __future__ import annotations

import pytest

from fastdeploy.model_executor.guided_decoding import BACKEND_NAMES


@pytest.fixture(scope="session")
def tokenizer(embedded_tokenizer):
    return embedded_tokenizer


@pytest.fixture(scope="session")
def tokenizer_info(tokenizer):
    from fastdeploy.model_executor.guided_decoding.xgrammar_backend import tokenizer_info_from_hf

    return tokenizer_info_from_hf(tokenizer)


@pytest.fixture(scope="session")
def backends(tokenizer, tokenizer_info):
    from fastdeploy.model_executor.guided_decoding import build_backend
    from fastdeploy.model_executor.guided_decoding.xgrammar_backend import XGrammarBackend

    return {"xgrammar": XGrammarBackend(tokenizer_info), "llguidance": build_backend("llguidance", tokenizer)}


@pytest.fixture(scope="session", params=BACKEND_NAMES)
def grammar_backend(request, backends):
    return backends[request.param]


@pytest.fixture(scope="session")
def compile_service(grammar_backend):
    from fastdeploy.model_executor.guided_decoding import GrammarCompileService

    service = GrammarCompileService(grammar_backend, max_workers=2, timeout_s=60.0)
    yield service
    service.shutdown()
