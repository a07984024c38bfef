"""What the two generation routes share: the answer to a planned request (a stream, or one JSON
body once every choice is done), and the base of their writers (the request's identity, each
choice's state, the usage chunk)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve import responses as R
from serve.access_log import note_usage
from serve.disconnect import ClientGone
from serve.errors import APIError
from serve.jobs import Finals, Job, collect, usage
from serve.state import ServerState
from serve.streaming import stream_response


class ChoiceWriter:
    """Base of a route's writer: the chunks (streaming) or the body of one request, from its
    jobs' cumulative outputs; each choice's ChoiceState remembers what was sent. Subclasses
    give `chunks`, `body` and `_chunk` (their route's chunk object)."""

    def __init__(self, server: ServerState, req, request_id: str, jobs: list[Job],
                 states: dict[int, R.ChoiceState]):
        self.req = req
        self.request_id = request_id
        self.model_name = server.model_name
        self.token_text = server.token_texts
        self.created = int(time.time())
        self.jobs = jobs
        self.states = states
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.chunk_usage = None if self.include_usage else ...  # `usage: null` in chunks, or no key

    def opening(self) -> list[dict]:
        return []

    def closing(self, finals: Finals) -> list[dict]:
        if not self.include_usage:
            return []
        return [self._chunk([], self.usage(finals))]

    def usage(self, finals: Finals) -> dict:
        return usage(self.jobs, self.states, finals)

    def _chunk(self, choices: list[dict], usage_) -> dict:
        raise NotImplementedError


async def respond(server: ServerState, request: Request, endpoint: str, jobs: list[Job], t0: float,
                  writer: ChoiceWriter, renames: dict[str, str] | None = None) -> Response:
    """The stream of a planned request, or (not streaming) its JSON body once every job is done;
    499 when the client leaves first, the engine's refusal as an HTTP error."""
    if writer.req.stream:
        return await stream_response(server, request, endpoint, jobs, t0, writer)
    try:
        finals = await collect(request, server.engine, server.metrics, jobs, t0, renames)
    except ClientGone:
        return server.gone(endpoint)
    except APIError as e:
        return server.error(endpoint, e)
    server.ok(endpoint)
    body = writer.body(finals)
    note_usage(request, body.get("usage"))
    return JSONResponse(body)
