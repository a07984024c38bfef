"""Posting batch lines to the server's own ASGI app, many at once, each answer written to a
kill-safe result file (serve/batch_output.py) the moment its request finishes.

Both batch runners use it: `jaxinfer batch` (serve/batch.py), which builds an app of its own, and
the server's /v1/batches (serve/batch_runs.py), which posts to the app it runs in. It imports no
app, so the app may import it.
"""

from __future__ import annotations

import asyncio

import httpx

from serve.batch_input import BatchLine
from serve.batch_output import ResultFile
from serve.batch_rows import answer_row, error_row

RETRY_S = 0.05  # a 503 (waiting queue full, engine warming up) is retried after this long


async def post_lines(app, lines: list[BatchLine], out: ResultFile, progress=None, *,
                     max_in_flight: int = 1024, model_name: str = "batch",
                     overrides: dict | None = None, headers: dict | None = None) -> None:
    """Posts every line to the ASGI `app` (at most `max_in_flight` at once) as `model_name`, with
    `overrides` set in each body, writing each answer to `out` as it comes (and handing it to
    `progress.update`). A line whose handling fails, the app raising included, is answered with
    an error line; only a failure to write the output stops the job."""

    def write(row: dict) -> None:
        out.write(row)
        if progress is not None:
            progress.update(row)

    todo = iter(lines)
    extra = {**(overrides or {}), "model": model_name, "stream": False}
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None,
                                 headers=headers) as client:

        async def worker() -> None:
            for line in todo:  # shared: each line goes to the first worker free
                write(await _answer(client, line, extra))

        async def sync_on_time() -> None:  # an answer written is fsynced in time, even when
            while True:                       # no other answer follows it for a while
                await asyncio.sleep(out.sync_interval_s)
                out.sync_due()

        syncer = asyncio.create_task(sync_on_time()) if out.sync_interval_s > 0 else None
        try:
            await asyncio.gather(*(worker() for _ in range(min(max_in_flight, len(lines)))))
        finally:
            if syncer is not None:
                syncer.cancel()


async def _answer(client: httpx.AsyncClient, line: BatchLine, extra: dict) -> dict:
    try:
        body = {**line.body, **extra}
        body.pop("stream_options", None)
        while True:
            r = await client.post(line.url, json=body)
            if r.status_code != 503:
                break
            await asyncio.sleep(RETRY_S)  # the waiting queue is full: the engine is busy
        try:
            answer = r.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            return error_row(line.custom_id, "internal_error",
                             f"the server answered {r.status_code} without a JSON object: "
                             f"{r.text[:200]!r}")
        return answer_row(line, r.status_code, answer)
    except Exception as e:  # noqa: BLE001 - one line's failure is that line's answer
        return error_row(line.custom_id, "internal_error", f"{type(e).__name__}: {e}")
