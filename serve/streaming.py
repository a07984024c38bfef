"""Streamed responses (`"stream": true`): Server-Sent Events through sse-starlette.

The response waits for the first output before it starts, so a request the engine refuses (a full
queue, a bad value) still gets its HTTP status (4xx/503) rather than a 200 with an error event.
Then each output becomes the route's chunks (`data: {json}`), an error after the start is sent
in-band as an error chunk, and `data: [DONE]` ends the stream, as OpenAI's clients expect.
sse-starlette watches the connection: a client that leaves cancels the stream, which aborts its
engine requests; it also sends keep-alive comments (`: ping`) on an idle stream. On SIGTERM a
running stream gets the server's shutdown timeout to finish before it is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Protocol

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from jaxinfer.request import RequestOutput
from serve.access_log import note_usage
from serve.disconnect import ClientGone, until_disconnect
from serve.errors import engine_api_error
from serve.jobs import Finals, Job, fan_in
from serve.state import ServerState

DONE = "[DONE]"  # the last event's data


class ChunkWriter(Protocol):
    """A route's chunks for one streamed request."""

    def opening(self) -> list[dict]:
        """Chunks sent before any output (chat: each choice's role)."""

    def chunks(self, job: Job, out: RequestOutput) -> list[dict]:
        """The chunks of a job's new (cumulative) output: its delta, if any."""

    def closing(self, finals: Finals) -> list[dict]:
        """Chunks after the last output (the usage chunk, when asked for)."""

    def usage(self, finals: Finals) -> dict:
        """The request's usage so far (for the access log)."""


async def stream_response(server: ServerState, request: Request, endpoint: str, jobs: list[Job],
                          t0: float, writer: ChunkWriter) -> Response:
    """The stream of `jobs` (see the module doc), or the error response when no output came:
    499 when the client left first, the engine's refusal as an HTTP error."""
    outs = fan_in(server.engine, server.metrics, jobs, t0)
    try:
        first = await until_disconnect(request, outs.__anext__())
    except ClientGone:
        await outs.aclose()
        return server.gone(endpoint)
    except StopAsyncIteration:  # cannot happen: every job ends with a finished output
        first = None
    except Exception as e:  # noqa: BLE001 - every failure is an answer
        await outs.aclose()
        return server.error(endpoint, engine_api_error(e))
    return EventSourceResponse(_events(server, request, endpoint, outs, first, writer), sep="\n",
                               headers={"Cache-Control": "no-cache"},
                               shutdown_grace_period=server.shutdown_timeout)


async def _events(server: ServerState, request: Request, endpoint: str,
                  outs: AsyncIterator[tuple[Job, RequestOutput]],
                  first: tuple[Job, RequestOutput] | None, writer: ChunkWriter) -> AsyncIterator[str]:
    """The data of each event; counts the request's outcome (ok, disconnected, an error status)
    and tells the access log the tokens streamed."""
    outcome = "ok"
    finals: Finals = {}
    try:
        async with contextlib.aclosing(outs):
            for chunk in writer.opening():
                yield _data(chunk)
            pending = [first] if first is not None else []
            while True:
                if pending:
                    job, out = pending.pop()
                else:
                    try:
                        job, out = await outs.__anext__()
                    except StopAsyncIteration:
                        break
                finals[job.index] = (job, out)
                for chunk in writer.chunks(job, out):
                    yield _data(chunk)
        for chunk in writer.closing(finals):
            yield _data(chunk)
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "disconnected"
        raise
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
        err = engine_api_error(e)
        outcome = str(err.status)
        yield _data(err.body())
    finally:
        server.metrics.requests.labels(endpoint, outcome).inc()
        if finals:
            note_usage(request, writer.usage(finals))
    yield DONE


def _data(chunk: dict) -> str:
    # U+0085, U+2028 and U+2029 stay raw in json.dumps's output; readers that split lines as
    # str.splitlines does (httpx's iter_lines) would cut a data line there, so they go escaped
    text = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
    return text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
