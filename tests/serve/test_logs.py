"""What the server says it is doing: the access line per request (serve/access_log.py), the ready
line once it listens warm (serve/cli.py), the engine's start-up lines (model, KV pool, warm-up
progress), the logging set-up and the flags that change it (serve/logs.py, jaxinfer/cli.py)."""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
import types

import httpx
import pytest

from jaxinfer.config import EngineConfig
from jaxinfer.engine import LLMEngine
from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.sched.buckets import StepBuckets
from serve import logs
from serve.app import create_app
from serve.cli import make_server
from tests.serve.conftest import MODEL, TIMEOUT, app_client, free_port, sse_events
from tests.serve.fake_engine import FakeEngine

LATENCY = r"\d+\.\d ms"


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "serve.access"]


# -- the access log ----------------------------------------------------------------------------------
def test_one_access_line_per_request_with_tokens(caplog):
    with app_client(access_log=True, api_key="k") as c:
        caplog.set_level(logging.INFO, logger="serve.access")
        caplog.clear()
        c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        events = sse_events(c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "yo"}], "max_tokens": 4,
            "stream": True}).text)
        assert events[-1] == "[DONE]"
        c.post("/v1/completions", json={"prompt": "Hi", "n": 2, "max_tokens": 2})
        c.post("/v1/chat/completions", json={"messages": []})
        c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        c.get("/nowhere")
    lines = access_lines(caplog)
    want = [rf"POST /v1/completions 200 prompt=2 output=3 {LATENCY}",
            rf"POST /v1/chat/completions 200 prompt=\d+ output=4 {LATENCY}",
            rf"POST /v1/completions 200 prompt=2 output=4 {LATENCY}",
            rf"POST /v1/chat/completions 400 {LATENCY}",
            rf"GET /v1/models 401 {LATENCY}",
            rf"GET /nowhere 404 {LATENCY}"]
    assert len(lines) == len(want), lines
    for line, pattern in zip(lines, want):
        assert re.fullmatch(pattern, line), (line, pattern)


def test_no_access_log_unless_asked(caplog):
    caplog.set_level(logging.INFO)
    with app_client() as c:
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert access_lines(caplog) == []


# -- the ready line -----------------------------------------------------------------------------------
def test_ready_line_once_listening_and_warm(caplog):
    caplog.set_level(logging.INFO)
    engine = FakeEngine(warmup_delay_s=0.3)
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, served_model_name=MODEL, access_log=True)
    port = free_port()
    server = make_server(app, async_engine, host="127.0.0.1", port=port,
                         started=time.monotonic() - 2.0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not any(m.startswith("ready:") for m in caplog.messages):
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)
        assert engine.warmed_up
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/health", timeout=TIMEOUT).status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                       timeout=TIMEOUT)
        assert r.status_code == 200
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
    (ready,) = [m for m in caplog.messages if m.startswith("ready:")]
    match = re.fullmatch(rf"ready: http://127\.0\.0\.1:{port} \(3 executables, (\d+\.\d) s\)",
                         ready)
    assert match and float(match.group(1)) >= 2.0, ready
    assert re.fullmatch(rf"POST /v1/completions 200 prompt=2 output=2 {LATENCY}",
                        access_lines(caplog)[-1])
    assert not [r for r in caplog.records if r.name == "uvicorn.access"]  # ours replaces it


# -- the engine's start-up lines ------------------------------------------------------------------------
def test_engine_logs_model_weights_and_kv_pool(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO, logger="jaxinfer.engine")
    LLMEngine(tiny_llama_dir, num_pages=96, page_size=8, max_num_seqs=16,
              max_num_batched_tokens=64, max_model_len=256)
    messages = [r.getMessage() for r in caplog.records if r.name == "jaxinfer.engine.llm_engine"]
    assert any(re.fullmatch(rf"model {re.escape(tiny_llama_dir)}: llama, 2 layers, context 256; "
                            r"\d+\.\d MiB of weights \(float32, quantization auto\)", m)
               for m in messages), messages
    assert "KV cache: 95 pages of 8 tokens = 760 tokens (0.4 MiB)" in messages


class _StubRunner:
    """Counts what warm-up hands it; each new step shape "compiles" in no time."""

    def __init__(self):
        self.compiled: list = []
        self.executed: list = []  # what check_executables was handed
        self.room_checked: list[int] = []  # how many step inputs each check_room call covered
        self.num_compilations = 0

    def compile(self, step_inputs, num_threads=1):
        self.compiled += list(step_inputs)
        self.num_compilations += len(step_inputs)
        return len(step_inputs)

    def check_room(self, step_inputs):
        self.room_checked.append(len(list(step_inputs)))

    def check_executables(self, step_inputs):
        self.executed += list(step_inputs)
        return 0


def test_warmup_logs_its_progress(caplog):
    config = EngineConfig(page_size=8, max_num_seqs=16, max_num_batched_tokens=64,
                          max_model_len=256)
    runner = _StubRunner()
    engine = types.SimpleNamespace(engine_config=config, max_model_len=256, runner=runner,
                                   buckets=StepBuckets.coarse(config, 256), spec_policy=None,
                                   vocab_size=384, bitmask_words=12)
    caplog.set_level(logging.INFO, logger="jaxinfer.engine")
    LLMEngine.warmup(engine)
    total = len(runner.compiled)
    assert total > 1 and runner.executed == runner.compiled  # each run once after compiling
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxinfer.engine.llm_engine"]
    progress = [re.fullmatch(rf"warm-up: (\d+)/{total} step shapes \(\d+\.\d s\)", m)
                for m in lines[:-1]]
    assert progress and all(progress), lines
    done = [int(m.group(1)) for m in progress]
    assert done == sorted(done) and done[-1] < total
    assert runner.room_checked == [total - done[0]]  # after the first chunk: all the rest at once
    assert re.fullmatch(rf"warm-up: {total}/{total} step shapes, {total} executables in "
                        r"\d+\.\d s", lines[-1]), lines


# -- logging set-up and flags ---------------------------------------------------------------------------
@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level,
             {name: logging.getLogger(name).level for name in logs.DETAIL_LOGGERS})
    yield
    handlers, level, detail = saved
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, value in detail.items():
        logging.getLogger(name).setLevel(value)


@pytest.mark.usefixtures("restore_logging")
def test_configure_logging_info_and_debug():
    logs.configure_logging("info")
    root = logging.getLogger()
    assert root.level == logging.INFO
    (handler,) = root.handlers
    assert handler.stream is sys.stderr
    assert handler.formatter._fmt == logs.FORMAT
    for name in logs.DETAIL_LOGGERS:  # per-step-shape and per-httpx-request lines: DEBUG only
        assert logging.getLogger(name).level == logging.WARNING
    logs.configure_logging("DEBUG")
    assert root.level == logging.DEBUG
    for name in logs.DETAIL_LOGGERS:
        assert logging.getLogger(name).getEffectiveLevel() == logging.DEBUG
    with pytest.raises(ValueError, match="log level"):
        logs.configure_logging("chatty")


@pytest.mark.parametrize("argv,level", [
    (["serve"], "INFO"),
    (["serve", "--log-level", "warning"], "WARNING"),
    (["--log-level", "debug", "serve"], "DEBUG"),
    (["generate"], "WARNING"),
    (["generate", "-v"], "INFO"),
    (["batch", "in.jsonl", "out.jsonl"], "WARNING"),
    (["batch", "in.jsonl", "out.jsonl", "-v"], "INFO"),
    (["--log-level", "error", "generate", "-v"], "ERROR"),
])
def test_log_level_of_each_command(argv, level):
    from jaxinfer.cli import build_parser, log_level

    assert log_level(build_parser().parse_args(argv)) == level


def test_serve_flags():
    from jaxinfer.cli import build_parser

    parser = build_parser()
    assert not parser.parse_args(["serve"]).no_access_log
    assert parser.parse_args(["serve", "--no-access-log"]).no_access_log
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--log-level", "chatty"])
