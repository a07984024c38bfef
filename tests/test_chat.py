"""`jaxinfer chat` driven through a pseudo-terminal (pexpect): against the fake-engine server
(--url), a question's answer streams, the next question carries the history (the server's access
log shows a longer prompt), /reset forgets it, /exit quits; and in process on the tiny Llama."""

from __future__ import annotations

import os
import re
import sys
import time

import pexpect

from tests.serve.conftest import free_port
from tests.serve.fake_engine import GREEDY_TEXT
from tests.serve.server_process import ROOT, server_process

STATS = r"\[(\d+) tokens, [\d.]+ tok/s, first token \d+ ms\]"


def spawn(args: list[str], timeout: float) -> pexpect.spawn:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "TERM": "dumb"}
    return pexpect.spawn(sys.executable, ["-m", "jaxinfer.cli", "chat", *args], cwd=ROOT,
                         env=env, encoding="utf-8", timeout=timeout, dimensions=(50, 200))


def ask(child: pexpect.spawn, question: str) -> tuple[str, int]:
    """(the streamed answer, its token count from the stats line)."""
    child.sendline(question)
    child.expect(STATS)
    tokens = int(child.match.group(1))
    answer = child.before.replace("\r", "")
    answer = answer.split(question + "\n", 1)[-1].strip("\n")
    child.expect_exact(">>> ")
    return answer, tokens


def prompt_lengths(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"POST /v1/chat/completions 200 prompt=(\d+)", log)]


def test_chat_against_a_server_with_history_reset_and_exit():
    port = free_port()
    with server_process(["-m", "tests.serve.fake_server", "--port", str(port)], port,
                        timeout=60.0) as srv:
        child = spawn(["--url", srv.base_url, "--temperature", "0", "--max-tokens", "12"], 60.0)
        child.expect_exact(">>> ")
        answer, tokens = ask(child, "Hello there")
        assert tokens == 12 and len(answer) == 12 and answer in GREEDY_TEXT * 2, answer
        ask(child, "And again")
        child.sendline("/reset")
        child.expect_exact("(conversation cleared)")
        child.expect_exact(">>> ")
        ask(child, "Hello there")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
        deadline = time.monotonic() + 10
        while len(prompt_lengths(srv.log())) < 3:
            assert time.monotonic() < deadline, srv.log()[-2000:]
            time.sleep(0.05)
        first, second, after_reset = prompt_lengths(srv.log())
        assert second > first + 12  # the first question and answer came along
        assert after_reset == first


def test_chat_in_process_tiny_model(tiny_llama_dir):
    child = spawn(["--model", str(tiny_llama_dir), "--temperature", "0", "--max-tokens", "8",
                   "--num-pages", "64", "--page-size", "8", "--max-num-seqs", "2",
                   "--max-num-batched-tokens", "64", "--max-model-len", "256"], 600.0)
    child.expect_exact(">>> ")
    _, tokens = ask(child, "Hello")
    assert 1 <= tokens <= 8
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_remote_reads_data_lines_whole_whatever_line_breaks_their_text_holds():
    """A reply holding U+2028, U+2029 or U+0085: the server escapes them in its data lines, and
    the chat client splits a stream at newlines only (httpx's iter_lines also splits at those),
    so a server that leaves them raw is read whole too."""
    import json as json_module

    import httpx

    from jaxinfer.chat.backends import Remote, Sampling
    from serve.streaming import _data

    text = "one\u2028two\u2029three\x85four"
    escaped = _data({"choices": [{"index": 0, "delta": {"content": text}}]})
    assert escaped.splitlines() == [escaped]  # one line, for any line splitter
    assert json_module.loads(escaped)["choices"][0]["delta"]["content"] == text
    raw = json_module.dumps({"choices": [{"index": 0, "delta": {"content": text}}]},
                            ensure_ascii=False)
    for line in (escaped, raw):
        body = f"data: {line}\r\n\r\ndata: [DONE]\r\n\r\n".encode()

        def handler(request, body=body):
            return httpx.Response(200, content=body,
                                  headers={"content-type": "text/event-stream"})

        remote = Remote("http://test", model="m")
        remote._http = httpx.Client(base_url="http://test", transport=httpx.MockTransport(handler))
        assert "".join(remote.stream([{"role": "user", "content": "hi"}], Sampling())) == text
        remote.close()
