"""The OpenAI-compatible HTTP app (Starlette; uvicorn runs it): the routes, the API key check and
the error handlers.

    app = create_app(async_engine, api_key=None, served_model_name="smollm2-135m")

Routes (ENDPOINTS): POST /v1/completions (serve/completions.py), POST /v1/chat/completions
(serve/chat.py), both with `stream` (serve/streaming.py); GET /v1/models, GET /health, GET /metrics,
POST /tokenize, POST /detokenize (serve/info.py); with a FilesConfig, /v1/files and /v1/batches (serve/batch_runs.py
runs the batches on this app); GET /openapi.json, the request schemas of these
routes (serve/openapi.py); GET /v1/engine/stats, the /metrics numbers as JSON
(serve/engine_stats.py); unless `webui=False`, the chat and dashboard page on GET / (serve/page.py,
served without the API key). Every error has OpenAI's shape (serve/errors.py); with
`access_log=True` (`jaxinfer serve`) each request gets one access log line (serve/access_log.py).
The app's state is the one `ServerState` made here, handed to each route.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxinfer.engine.async_engine import AsyncEngine
from serve import DEFAULT_MAX_BODY_BYTES, info
from serve.access_log import AccessLogMiddleware
from serve.batch_runs import make_batch_runs
from serve.batches_routes import FILES_API_ROUTES
from serve.chat import chat_completions
from serve.completions import completions
from serve.engine_stats import engine_stats
from serve.errors import APIError
from serve.files_config import FilesConfig
from serve.metrics import ServerMetrics
from serve.openapi import Operation, openapi_document, openapi_json
from serve.page import PAGE_PATHS, page_routes
from serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from serve.state import STATUS_CLIENT_GONE, ServerState, TokenTexts

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # answered without the API key (load balancers probe it)

# (path, method, handler, the JSON request body's schema): the routes and their OpenAPI document
ENDPOINTS = (
    ("/v1/completions", "POST", completions, CompletionRequest),
    ("/v1/chat/completions", "POST", chat_completions, ChatCompletionRequest),
    ("/v1/models", "GET", info.models, None),
    ("/v1/models/{model:path}", "GET", info.model, None),
    ("/health", "GET", info.health, None),
    ("/metrics", "GET", info.metrics, None),
    ("/v1/engine/stats", "GET", engine_stats, None),
    ("/tokenize", "POST", info.tokenize, TokenizeRequest),
    ("/detokenize", "POST", info.detokenize, DetokenizeRequest),
)


def create_app(async_engine: AsyncEngine, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, served_model_name: str = "jaxinfer",
               shutdown_timeout: float = 30.0, access_log: bool = False,
               files: FilesConfig | None = None, webui: bool = True) -> Starlette:
    """The app over `async_engine`, which it starts with the app and shuts down (draining
    requests for up to `shutdown_timeout` seconds) when the app stops. With `files`, the Files
    and Batches API too (serve/files_routes.py, serve/batches_routes.py)."""
    if max_body_bytes <= 0:
        raise ValueError(f"{max_body_bytes=} must be positive")
    server = ServerState(engine=async_engine, model_name=served_model_name,
                         created=int(time.time()), max_body_bytes=max_body_bytes,
                         shutdown_timeout=shutdown_timeout, metrics=ServerMetrics(async_engine),
                         token_texts=TokenTexts(async_engine.tokenizer))

    runs = (make_batch_runs(files, async_engine, model_name=served_model_name, api_key=api_key)
            if files is not None else None)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await async_engine.start()
        if runs is not None:
            await runs.start(app)  # resumes the batches a stopped server left unfinished
        yield
        if runs is not None:
            await runs.stop()
        await async_engine.shutdown(timeout=shutdown_timeout)

    routes = [Route(path, functools.partial(endpoint, server), methods=[method])
              for path, method, endpoint, _ in ENDPOINTS]
    document = openapi_document([Operation(path, method, _summary(endpoint), body)
                                 for path, method, endpoint, body in ENDPOINTS])
    if runs is not None:
        routes += [Route(path, functools.partial(endpoint, runs), methods=[method])
                   for path, method, endpoint in FILES_API_ROUTES]
        document = openapi_document(
            [Operation(path, method, _summary(endpoint), body)
             for path, method, endpoint, body in ENDPOINTS]
            + [Operation(path, method, _summary(endpoint), None)
               for path, method, endpoint in FILES_API_ROUTES])
    routes.append(Route("/openapi.json", functools.partial(openapi_json, document),
                        methods=["GET"]))
    if webui:
        routes += page_routes()
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        HTTPException: _http_exception, ClientDisconnect: _client_gone,
        Exception: _internal_error})
    app.state.server = server
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key,
                           open_paths=OPEN_PATHS + (PAGE_PATHS if webui else ()))
    if access_log:  # added last: the outermost, so it logs the 401s too
        app.add_middleware(AccessLogMiddleware)
    return app


def _summary(endpoint) -> str:
    """The first line of a handler's docstring."""
    return (endpoint.__doc__ or "").strip().split("\n")[0]


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` (constant-time compare) except on `open_paths`."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app = app
        self._key = api_key.encode()
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths:
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


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """The client left while its request's body was read: nobody to answer, nothing failed."""
    return Response(status_code=STATUS_CLIENT_GONE)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return APIError(500, "internal server error", code="internal_error").response()
