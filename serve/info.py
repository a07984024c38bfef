"""The routes that generate nothing: GET /health (503 until warm-up is done, or while the engine
fails), GET /metrics (Prometheus), GET /v1/models[/{model}], POST /tokenize, POST /detokenize."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve.body import parse_body
from serve.errors import APIError, model_not_found
from serve.prompts import chat_prompt, check_token_ids
from serve.schemas import DetokenizeRequest, TokenizeRequest
from serve.state import ServerState


async def health(server: ServerState, request: Request) -> Response:
    """200 once warm-up is done and requests are admitted, else 503 with the reason (also while
    a failed engine step is handled, and after repeated consecutive ones: restart the server)."""
    engine = server.engine
    failing = engine.failing
    if engine.is_ready and failing is None:
        return JSONResponse({"status": "ok"})
    if failing is not None:
        status = f"error: {failing}"
    elif engine.warmup_error is not None:
        error = engine.warmup_error
        status = f"error: warm-up failed: {type(error).__name__}: {error}"
    elif not engine.accepting:
        status = "shutting down"
    else:
        status = "warming up"
    return JSONResponse({"status": status}, status_code=503)


async def metrics(server: ServerState, request: Request) -> Response:
    """Prometheus metrics of the server and the engine."""
    return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def models(server: ServerState, request: Request) -> Response:
    """The served model, as a list."""
    return JSONResponse({"object": "list", "data": [_model_card(server)]})


async def model(server: ServerState, request: Request) -> Response:
    """The served model's card (404 for any other name)."""
    name = request.path_params["model"]
    if name != server.model_name:
        return model_not_found(name).response()
    return JSONResponse(_model_card(server))


async def tokenize(server: ServerState, request: Request) -> Response:
    """The token ids of a prompt, or of messages through the chat template."""
    tokenizer = server.engine.tokenizer
    try:
        req = await parse_body(request, TokenizeRequest, max_body_bytes=server.max_body_bytes,
                               model_name=server.model_name)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`", param="prompt")
        if req.messages is not None:
            prompt = await chat_prompt(tokenizer, req.messages, req.add_generation_prompt)
            token_ids = prompt.token_ids
        else:
            token_ids = await asyncio.to_thread(tokenizer.encode, req.prompt)
    except APIError as e:
        return e.response()
    return JSONResponse({"tokens": list(token_ids), "count": len(token_ids),
                         "max_model_len": server.engine.max_model_len})


async def detokenize(server: ServerState, request: Request) -> Response:
    """The text of token ids."""
    try:
        req = await parse_body(request, DetokenizeRequest, max_body_bytes=server.max_body_bytes,
                               model_name=server.model_name)
        check_token_ids(req.tokens, server.engine.vocab_size, "tokens")
        text = await asyncio.to_thread(server.engine.tokenizer.decode, req.tokens)
    except APIError as e:
        return e.response()
    return JSONResponse({"prompt": text})


def _model_card(server: ServerState) -> dict:
    return {"id": server.model_name, "object": "model", "created": server.created,
            "owned_by": "jaxinfer", "max_model_len": server.engine.max_model_len}
