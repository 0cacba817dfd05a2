import pytest

from tests.e2e.server import RunningServer

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def server():
    srv = RunningServer("--max-num-seqs", "40", "--max-model-len", "1024", "--num-kv-blocks", "2048",
                        api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture
def async_client(server):
    """A fresh client per test: its connection pool belongs to the test's own event loop."""
    import openai

    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, timeout=300, max_retries=0)
