"""`jaxinfer serve` as a real process on the tiny random Llama: the official `openai` client end to
end, and 20 streams of which half are dropped (every page free afterwards, /health ok).

Warm-up is off (`--no-warmup`: compiling every bucket takes minutes on a small CPU); the shapes
these tests use compile on first use, into a compilation cache shared by the test run.
"""

from __future__ import annotations

import openai
import pytest

from tests.serve.api_checks import check_drop_half_of_20_streams, check_openai_api
from tests.serve.conftest import free_port
from tests.serve.server_process import server_process

TIMEOUT = 600.0
MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    port = free_port()
    cache = tmp_path_factory.mktemp("jax-cache")
    args = ["-m", "jaxinfer.cli", "--log-level", "INFO", "serve", str(tiny_llama_dir),
            "--port", str(port), "--served-model-name", MODEL, "--num-pages", "96",
            "--page-size", "8", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--max-model-len", "256", "--no-warmup", "--compilation-cache-dir", str(cache)]
    with server_process(args, port, timeout=TIMEOUT) as srv:
        yield srv


def test_openai_client_against_tiny_engine_server(tiny_server):
    with openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="none", timeout=TIMEOUT,
                       max_retries=0) as client:
        check_openai_api(client, MODEL)


def test_tiny_engine_drop_half_of_20_streams(tiny_server):
    check_drop_half_of_20_streams(tiny_server.base_url, MODEL, keep_tokens=40, drop_tokens=200,
                                  timeout=TIMEOUT)
