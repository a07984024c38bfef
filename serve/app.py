"""The OpenAI-compatible HTTP app (Starlette; uvicorn runs it): the routes, the API key check and
the error handlers.

    app = create_app(async_engine, api_key=None, served_model_name="smollm2-135m")

Routes: POST /v1/completions (serve/completions.py), POST /v1/chat/completions (serve/chat.py),
both with `stream` (serve/streaming.py); GET /v1/models, GET /health, GET /metrics, POST /tokenize,
POST /detokenize (serve/info.py). Every error has OpenAI's shape (serve/errors.py). The app's state
is the one `ServerState` made here, handed to each route.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxinfer.engine.async_engine import AsyncEngine
from serve import DEFAULT_MAX_BODY_BYTES, info
from serve.chat import chat_completions
from serve.completions import completions
from serve.errors import APIError
from serve.metrics import ServerMetrics
from serve.state import ServerState, TokenTexts

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # answered without the API key (load balancers probe it)


def create_app(async_engine: AsyncEngine, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, served_model_name: str = "jaxinfer",
               shutdown_timeout: float = 30.0) -> Starlette:
    """The app over `async_engine`, which it starts with the app and shuts down (draining
    requests for up to `shutdown_timeout` seconds) when the app stops."""
    if max_body_bytes <= 0:
        raise ValueError(f"{max_body_bytes=} must be positive")
    server = ServerState(engine=async_engine, model_name=served_model_name,
                         created=int(time.time()), max_body_bytes=max_body_bytes,
                         shutdown_timeout=shutdown_timeout, metrics=ServerMetrics(async_engine),
                         token_texts=TokenTexts(async_engine.tokenizer))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await async_engine.start()
        yield
        await async_engine.shutdown(timeout=shutdown_timeout)

    def route(path: str, endpoint, method: str) -> Route:
        return Route(path, functools.partial(endpoint, server), methods=[method])

    routes = [
        route("/v1/completions", completions, "POST"),
        route("/v1/chat/completions", chat_completions, "POST"),
        route("/v1/models", info.models, "GET"),
        route("/v1/models/{model:path}", info.model, "GET"),
        route("/health", info.health, "GET"),
        route("/metrics", info.metrics, "GET"),
        route("/tokenize", info.tokenize, "POST"),
        route("/detokenize", info.detokenize, "POST"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        HTTPException: _http_exception, Exception: _internal_error})
    app.state.server = server
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` (constant-time compare) except on OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        provided = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                provided = value
                break
        scheme, _, token = provided.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            return await self.app(scope, receive, send)
        err = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                       code="invalid_api_key")
        response = err.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return APIError(500, "internal server error", code="internal_error").response()
