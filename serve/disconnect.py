"""Stopping a request's work when its client leaves, where sse-starlette does not watch: while a
non-streaming response is computed, and while a stream waits for its first output (its headers
are not sent yet, so that admission errors can still be HTTP errors). Cancelling the work aborts
its engine requests, which frees their pages."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Awaits `awaitable`, cancelling it and raising ClientGone if the client leaves first. The
    request's body must have been read (the watcher reads what comes after it)."""
    task = asyncio.ensure_future(awaitable)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()
