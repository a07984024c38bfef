"""What one app holds, handed to every route: the engine, the served name, the limits, the metrics
and the token-text cache. `create_app` builds one `ServerState`; nothing is module-level, so two
apps in one process (tests, batch jobs) share nothing."""

from __future__ import annotations

import dataclasses

from starlette.responses import Response

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.tokenizer import Tokenizer
from serve.errors import APIError
from serve.metrics import ServerMetrics

STATUS_CLIENT_GONE = 499  # nginx's "client closed request": logged, never seen by the client


class TokenTexts:
    """Token id -> its text, special tokens included (logprobs name tokens by their text). Keeps
    up to `max_cached` ids; the vocabulary is bounded, so in practice all of them."""

    def __init__(self, tokenizer: Tokenizer, max_cached: int = 1_000_000):
        self._tokenizer = tokenizer
        self._max_cached = max_cached
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def bytes(self, token_id: int) -> list[int]:
        """The token's bytes as a list (logprobs' `bytes`; `Tokenizer.token_bytes`)."""
        data = self._bytes.get(token_id)
        if data is None:
            data = list(self._tokenizer.token_bytes(token_id))
            if len(self._bytes) < self._max_cached:
                self._bytes[token_id] = data
        return data

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._texts) < self._max_cached:
                self._texts[token_id] = text
        return text


@dataclasses.dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    model_name: str  # the name clients send as `model`
    created: int  # unix seconds: the model card's `created`
    max_body_bytes: int  # larger request bodies get 413
    shutdown_timeout: float  # seconds a running stream may go on after SIGTERM
    metrics: ServerMetrics
    token_texts: TokenTexts

    def error(self, endpoint: str, e: APIError) -> Response:
        """`e` as the response, counted under its status."""
        self.metrics.requests.labels(endpoint, str(e.status)).inc()
        return e.response()

    def gone(self, endpoint: str) -> Response:
        """The client left before the response started: counted, answered to nobody."""
        self.metrics.requests.labels(endpoint, "disconnected").inc()
        return Response(status_code=STATUS_CLIENT_GONE)

    def ok(self, endpoint: str) -> None:
        self.metrics.requests.labels(endpoint, "ok").inc()
