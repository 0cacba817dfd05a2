import pytest

from fastdeploy import LLM


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The embedded model with default engine arguments, shared by the engine tests."""
    return LLM(max_num_seqs=32)
