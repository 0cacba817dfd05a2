"""Fixtures shared by several test directories."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedded_tokenizer():
    """The embedded model's tokenizer, `get_tokenizer(None)` (several seconds to build from the
    GGUF): built once for the session; the tests only read it."""
    from fastdeploy.model_executor.model_loader import get_tokenizer

    return get_tokenizer(None)
