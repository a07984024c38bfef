"""`jaxinfer batch` as a real process on the tiny random Llama, SIGKILLed and run again: after a
kill before any line is out, in the middle, and after every line is out, a rerun leaves exactly
one line per custom_id, keeps the lines written before the kill byte for byte, cuts a torn last
line, and gives the greedy answers of an uninterrupted run.

The processes share a compilation cache of their own, so only the first one compiles. The input has one quick
line (2 tokens) and long ones (150+ tokens, 4 sequences at a time): the first line is out
seconds before the job ends, which leaves time to kill it in the middle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.serve.server_process import ROOT
from tests.serve.test_batch_job import strip_ids

ENGINE_FLAGS = ["--num-pages", "128", "--page-size", "8", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "64", "--max-model-len", "256"]
GREEDY = {"temperature": 0, "ignore_eos": True}
TIMEOUT = 600.0


def requests() -> list[dict]:
    lines = [{"id": "quick", "prompt": "Hello", "max_tokens": 2, **GREEDY}]
    lines += [{"id": f"long-{i}", "prompt": f"The quick brown fox number {i}",
               "max_tokens": 150 + 5 * i, **GREEDY} for i in range(9)]
    lines.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40,
                           **GREEDY}})
    return lines


NUM_LINES = len(requests())


class BatchCommand:
    """`python -m jaxinfer.cli batch IN OUT ...` over one input, with a shared cache."""

    def __init__(self, model: str, workdir):
        self.model = model
        self.workdir = workdir
        self.input = workdir / "in.jsonl"
        self.input.write_text("".join(json.dumps(x) + "\n" for x in requests()))
        # JAXINFER_CACHE_DIR: the test session's own (tests/conftest.py)
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}

    def start(self, out) -> subprocess.Popen:
        with open(str(out) + ".log", "a") as log:  # the child keeps its own copy of the fd
            return subprocess.Popen(
                [sys.executable, "-m", "jaxinfer.cli", "batch", str(self.input), str(out),
                 "--model", self.model, "--compilation-cache-dir", str(self.workdir / "jax"),
                 *ENGINE_FLAGS], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def run(self, out) -> tuple[int, str]:
        """Runs to the end: (exit status, what it printed this time)."""
        start = os.path.getsize(str(out) + ".log") if os.path.exists(str(out) + ".log") else 0
        proc = self.start(out)
        try:
            rc = proc.wait(TIMEOUT)
        finally:
            kill(proc)
        with open(str(out) + ".log", "rb") as f:
            return rc, f.read()[start:].decode(errors="replace")

    def kill_when(self, out, ready) -> subprocess.Popen:
        """Starts a run and SIGKILLs it as soon as `ready(out)` holds (or once it exited)."""
        proc = self.start(out)
        deadline = time.monotonic() + TIMEOUT
        try:
            while not ready(out) and proc.poll() is None:
                assert time.monotonic() < deadline, "the job never got there"
                time.sleep(0.005)
        finally:
            kill(proc)
        return proc


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def num_complete_lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def rows_by_id(path) -> dict[str, dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in rows}
    assert len(by_id) == len(rows), "one line per custom_id"
    return by_id


@pytest.fixture(scope="module")
def command(tiny_llama_dir, tmp_path_factory) -> BatchCommand:
    return BatchCommand(str(tiny_llama_dir), tmp_path_factory.mktemp("batch-kill"))


@pytest.fixture(scope="module")
def reference(command):
    """An uninterrupted run's output (bytes, rows by custom_id)."""
    out = command.workdir / "reference.jsonl"
    rc, log = command.run(out)
    assert rc == 0, log[-4000:]
    assert f"{NUM_LINES} done now, 0 already done, 0 failed" in log
    assert "out tok/s" in log  # the progress bar
    rows = rows_by_id(out)
    assert len(rows) == NUM_LINES and all(r.get("error") is None for r in rows.values())
    assert rows["chat"]["response"]["status_code"] == 200
    return out.read_bytes(), rows


def test_kill_before_any_line_then_in_the_middle_then_finish(command, reference):
    out = command.workdir / "killed.jsonl"
    # (a) killed once the output exists (it is opened before the engine is built): no line yet
    proc = command.kill_when(out, lambda p: p.exists())
    assert proc.returncode == -signal.SIGKILL and out.read_bytes() == b""

    # (b) a rerun, killed as soon as its first line is out
    proc = command.kill_when(out, lambda p: num_complete_lines(p) >= 1)
    assert proc.returncode == -signal.SIGKILL, "the job ended before it could be killed"
    data = out.read_bytes()
    written = data[:data.rfind(b"\n") + 1]
    assert 1 <= written.count(b"\n") < NUM_LINES
    if data == written:  # as if the kill came in the middle of a write
        out.write_bytes(written + b'{"custom_id": "long-3", "text": "par')

    rc, log = command.run(out)
    assert rc == 0, log[-4000:]
    assert out.read_bytes().startswith(written)  # the lines out before the kill, unchanged
    rows = rows_by_id(out)
    _, expected = reference
    assert set(rows) == set(expected)
    for key, row in rows.items():
        assert strip_ids(row) == strip_ids(expected[key]), key
    num_before = written.count(b"\n")
    assert f"{NUM_LINES - num_before} done now, {num_before} already done, 0 failed" in log
    assert "cut a torn last line" in log


def test_kill_after_every_line_is_out(command, reference):
    out = command.workdir / "complete.jsonl"
    command.kill_when(out, lambda p: num_complete_lines(p) >= NUM_LINES)
    data = out.read_bytes()
    assert data.count(b"\n") == NUM_LINES
    rows = rows_by_id(out)
    _, expected = reference
    assert {k: strip_ids(r) for k, r in rows.items()} == {
        k: strip_ids(r) for k, r in expected.items()}
    rc, log = command.run(out)  # nothing left to do: no engine is built
    assert rc == 0, log[-4000:]
    assert out.read_bytes() == data
    assert f"0 done now, {NUM_LINES} already done, 0 failed" in log
