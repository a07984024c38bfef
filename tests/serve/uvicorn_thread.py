"""A uvicorn server in a thread of the test process, over an app on a given engine: real HTTP on
127.0.0.1 (a free port) with the app's lifespan, for tests that need sockets (slow readers,
concurrency, fuzzing) without a process of their own.

    with serving(FakeEngine(), max_waiting=8) as (base_url, async_engine):
        httpx.get(f"{base_url}/health")
"""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import uvicorn

from jaxinfer.engine.async_engine import AsyncEngine
from serve.app import create_app
from tests.serve.conftest import MODEL, free_port


@contextlib.contextmanager
def serving(engine, max_waiting: int = 1024, timeout: float = 30.0):
    """Yields (base URL, the AsyncEngine) once /health answers 200; stops the server at exit."""
    ae = AsyncEngine(engine, max_waiting=max_waiting)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ae, served_model_name=MODEL), host="127.0.0.1",
                                           port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health").status_code == 200:
                break
        time.sleep(0.05)
    try:
        yield base, ae
    finally:
        server.should_exit = True
        thread.join(timeout)
        assert not thread.is_alive()
