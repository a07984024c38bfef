"""Start a server process on 127.0.0.1, wait for /health, stop it with SIGTERM (bounded waits)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, base_url: str, log_path: str):
        self.proc = proc
        self.base_url = base_url
        self.log_path = log_path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"the server did not exit on SIGTERM:\n{self.log()[-4000:]}")


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float, log_path: str) -> float:
    """Seconds until /health answered 200."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                raise AssertionError(f"the server exited ({proc.returncode}):\n{f.read()[-4000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    with open(log_path, errors="replace") as f:
        raise AssertionError(f"/health not 200 after {timeout} s:\n{f.read()[-4000:]}")


@contextlib.contextmanager
def server_process(args: list[str], port: int, *, timeout: float = 120.0, env: dict | None = None):
    """Runs `python <args>` (cwd: the repo root) and yields a ServerProcess once /health is 200."""
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    full_env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
                "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=full_env, stdout=log,
                            stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    server = ServerProcess(proc, base_url, log.name)
    try:
        wait_healthy(base_url, proc, timeout, log.name)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()
        os.unlink(log.name)
