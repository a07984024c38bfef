"""The access log: one line per HTTP request on the `serve.access` logger (INFO), written when the
response is done: method, path, status, the prompt and output tokens where the route knows them,
and the latency, e.g.

    POST /v1/chat/completions 200 prompt=31 output=64 1840.2 ms

It replaces uvicorn's own access log, which knows neither tokens nor requests answered in process
(batch jobs). A route tells it the token counts with `note_usage` (on the request's state).
"""

from __future__ import annotations

import logging
import time

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("serve.access")

_USAGE = "usage"  # the key in the request's state


def note_usage(request: Request, usage: dict | None) -> None:
    """Hands a response's usage (prompt_tokens, completion_tokens) to the access log line."""
    if usage:
        setattr(request.state, _USAGE, (usage["prompt_tokens"], usage["completion_tokens"]))


class AccessLogMiddleware:
    """Logs each HTTP request once it is answered (a request that raised counts as a 500)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        status: int | None = None

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            status = status or 500
            raise
        finally:
            usage = state.get(_USAGE)
            tokens = f" prompt={usage[0]} output={usage[1]}" if usage else ""
            logger.info("%s %s %s%s %.1f ms", scope["method"], scope["path"],
                        status if status is not None else "-", tokens,
                        (time.perf_counter() - t0) * 1e3)
