"""Batch jobs over JSONL files, answered by the OpenAI server's own routes (in process).

Each input line is either an OpenAI batch line
  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}
or a plain request {"id"?: ..., "prompt" | "messages": ..., "max_tokens"?: ..., "temperature"?: ...}.

Every line goes through the same validation, chat template, sampling and response building as
`jaxinfer serve` (n, logprobs, echo, logit_bias, stop, seed...), over one continuous batch: the
lines are posted to the app through httpx's ASGI transport, many at once, so the engine keeps its
batch full. The model named in a line is ignored: the job runs the model it was given.

Output, one line per input line, in input order:
- an OpenAI batch line gets OpenAI's batch output line
  {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}
  (a 4xx answer is a response with that status; a line that cannot be read gets "error");
- a plain line gets {"custom_id", "text", "finish_reason", "usage"} (the first choice), or
  {"custom_id", "error": {"message", "line"}}.
A bad line never stops the job; the exit code is 1 when some line failed.

It lives with the server because it is a client of the server's app; it builds the engine itself
(`LLMEngine`), not through the Python API (`jaxinfer.llm`), which is the app's sibling, not its base.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import uuid
from typing import Any

import httpx
from tqdm.auto import tqdm

from jaxinfer.engine import EngineClient, LLMEngine
from jaxinfer.engine.async_engine import AsyncEngine
from serve.app import create_app

_URLS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
_RETRY_S = 0.05  # a 503 (waiting queue full) is retried after this long


@dataclasses.dataclass(frozen=True)
class BatchLine:
    index: int
    custom_id: str
    kind: str  # "chat" | "completion"
    body: dict
    openai: bool  # an OpenAI batch line (else a plain request)


def line_identity(obj: Any, index: int) -> tuple[str, bool]:
    """(custom_id, whether it is an OpenAI batch line) of a line's parsed JSON, even a bad one."""
    if not isinstance(obj, dict):
        return str(index), False
    if "body" in obj:
        return str(obj.get("custom_id", index)), True
    return str(obj.get("id", obj.get("custom_id", index))), False


def parse_line(obj: Any, index: int) -> BatchLine:
    """A line's parsed JSON -> BatchLine; ValueError naming what is wrong with it."""
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    custom_id, openai = line_identity(obj, index)
    if openai:
        body = obj["body"]
        url = obj.get("url", _URLS["chat"])
        if url not in _URLS.values():
            raise ValueError(f"url {url!r} must be one of {sorted(_URLS.values())}")
        kind = "chat" if url == _URLS["chat"] else "completion"
        if not isinstance(body, dict):
            raise ValueError("'body' must be a JSON object")
    else:
        body = obj
        kind = "chat" if "messages" in obj else "completion"
    if kind == "chat" and "messages" not in body:
        raise ValueError("a chat line needs 'messages'")
    if kind == "completion" and "prompt" not in body:
        raise ValueError("a completion line needs 'prompt'")
    return BatchLine(index, custom_id, kind, body, openai)


def run_batch(input_path: str, output_path: str, model: str, engine_kwargs: dict) -> int:
    """`jaxinfer batch`: builds the engine for `model` (EngineConfig fields in `engine_kwargs`)
    and runs the file through it (see run_batch_with)."""
    if not os.path.isfile(input_path):
        raise ValueError(f"input file {input_path!r} does not exist")
    return run_batch_with(LLMEngine(model, **engine_kwargs), input_path, output_path)


def run_batch_with(engine: EngineClient, input_path: str, output_path: str, *,
                   use_tqdm: bool = True, max_in_flight: int = 1024) -> int:
    """Runs every line of `input_path` through `engine`; returns 0, or 1 when some line failed.
    At most `max_in_flight` lines are posted at once (the rest wait their turn). The engine must
    not be used by anyone else meanwhile (the job drives it from a thread of its own)."""
    with open(input_path) as f:
        lines = [ln for ln in f if ln.strip()]
    results = asyncio.run(_run(engine, lines, use_tqdm, max_in_flight))
    with open(output_path, "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    num_errors = sum(_failed(r) for r in results)
    print(f"{len(lines) - num_errors} done, {num_errors} failed -> {output_path}", file=sys.stderr)
    return 0 if num_errors == 0 else 1


async def _run(engine: EngineClient, lines: list[str], use_tqdm: bool,
               max_in_flight: int) -> list[dict]:
    model_name = "batch"
    async_engine = AsyncEngine(engine, max_waiting=max(max_in_flight, 1), warmup=False)
    app = create_app(async_engine, served_model_name=model_name)
    slots = asyncio.Semaphore(max_in_flight)
    await async_engine.wait_ready()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                     timeout=None) as client:
            with tqdm(total=len(lines), desc="batch", disable=not use_tqdm) as bar:

                async def one(i: int, text: str) -> dict:
                    async with slots:
                        result = await _answer(client, i, text, model_name)
                    bar.update(1)
                    return result

                return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(lines))))
    finally:
        await async_engine.shutdown()


async def _answer(client, index: int, text: str, model_name: str) -> dict:
    obj = None
    try:
        obj = json.loads(text)
        line = parse_line(obj, index)
    except (ValueError, KeyError) as e:  # json.JSONDecodeError is a ValueError
        custom_id, openai = line_identity(obj, index)
        if openai:
            return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                    "response": None, "error": {"code": "invalid_request", "message": str(e)}}
        return {"custom_id": custom_id, "error": {"message": str(e), "line": index + 1}}
    body = {**line.body, "model": model_name, "stream": False}
    body.pop("stream_options", None)
    while True:
        r = await client.post(_URLS[line.kind], json=body)
        if r.status_code != 503:
            break
        await asyncio.sleep(_RETRY_S)  # the waiting queue is full: the engine is busy
    answer = r.json()
    if line.openai:
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
                "response": {"status_code": r.status_code, "request_id": answer.get("id"),
                             "body": answer},
                "error": None}
    if r.status_code != 200:
        return {"custom_id": line.custom_id,
                "error": {"message": answer["error"]["message"], "line": index + 1}}
    choice = answer["choices"][0]
    return {"custom_id": line.custom_id,
            "text": choice["message"]["content"] if line.kind == "chat" else choice["text"],
            "finish_reason": choice["finish_reason"],
            "usage": {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens")}}


def _failed(result: dict) -> bool:
    if result.get("error") is not None:
        return True
    response = result.get("response")
    return response is not None and response["status_code"] != 200
