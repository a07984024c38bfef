"""Helpers for the server tests: an in-process app over a fake engine, SSE parsing, a free port."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time

import pytest
from starlette.testclient import TestClient

from jaxinfer.engine.async_engine import AsyncEngine
from serve.app import create_app
from tests.serve.fake_engine import FakeEngine

TIMEOUT = 30.0
MODEL = "fake-model"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@contextlib.contextmanager
def app_client(engine: FakeEngine | None = None, *, max_waiting: int = 1024, wait_ready=True,
               **app_kwargs):
    """A TestClient (lifespan on: the engine thread starts, warms up, and is joined at exit)."""
    engine = engine or FakeEngine()
    ae = AsyncEngine(engine, max_waiting=max_waiting)
    app = create_app(ae, served_model_name=MODEL, **app_kwargs)
    headers = {}
    if app_kwargs.get("api_key"):
        headers["Authorization"] = f"Bearer {app_kwargs['api_key']}"
    with TestClient(app, headers=headers) as client:
        if wait_ready:
            wait_healthy(client)
        yield client


def wait_healthy(client, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get("/health").status_code == 200:
            return
        time.sleep(0.02)
    raise AssertionError("/health did not turn 200")


def sse_events(text: str) -> list:
    """The `data:` payloads of an SSE body: parsed JSON, or the string "[DONE]". Comment blocks
    (`: ping`, sse-starlette's keep-alive) are skipped, as SSE clients do."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block or block.startswith(":"):
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# Ports for test servers: below Linux's ephemeral range (32768-60999 by default), where the kernel
# picks the ports of bind(("", 0)) and of outgoing connections, and a range of 1000 for each
# pytest-xdist worker, so a port handed to one worker's server cannot be handed to the other's
# (or taken by a client's connection) while that server is still starting.
PORTS_BASE, PORTS_PER_WORKER = 20000, 1000


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on now, from this test process's own range."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    first = PORTS_BASE + PORTS_PER_WORKER * (int(worker) % 12 if worker.isdigit() else 0)
    for port in random.sample(range(first, first + PORTS_PER_WORKER), PORTS_PER_WORKER):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORTS_PER_WORKER - 1}")
