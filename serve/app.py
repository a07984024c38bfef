"""The OpenAI-compatible HTTP app (Starlette; uvicorn runs it).

    app = create_app(async_engine, api_key=None, served_model_name="smollm2-135m")

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models,
GET /health (503 until warm-up is done), GET /metrics (Prometheus), POST /tokenize, POST /detokenize.
All state lives in the `_Server` object `create_app` builds; nothing is module-level.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Sequence

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxinfer.async_engine import EngineError, EngineOverloaded, EngineShuttingDown
from jaxinfer.sampling_params import SamplingParams
from serve import DEFAULT_MAX_BODY_BYTES
from serve import responses as R
from serve.errors import (APIError, context_length_error, from_validation_error, from_value_error,
                          model_not_found)
from serve.metrics import ServerMetrics
from serve.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                           TokenizeRequest)

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # answered without the API key (load balancers probe it)


class _ClientGone(Exception):
    pass


@dataclasses.dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None  # for echo; None when the client sent token ids


@dataclasses.dataclass
class _Job:
    """One engine request: choice `index` of the response."""

    index: int
    prompt_index: int
    request_id: str
    prompt: _Prompt
    params: SamplingParams
    priority: int = 0


def create_app(async_engine, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               served_model_name: str = "jaxinfer", shutdown_timeout: float = 30.0) -> Starlette:
    if max_body_bytes <= 0:
        raise ValueError(f"{max_body_bytes=} must be positive")
    server = _Server(async_engine, served_model_name, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await async_engine.start()
        yield
        await async_engine.shutdown(timeout=shutdown_timeout)

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        HTTPException: _http_exception, Exception: _internal_error})
    app.state.server = server
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    return app


# -- middleware and error handlers -------------------------------------------------------------------
class _APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` (constant-time compare) except on OPEN_PATHS."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
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


def _engine_api_error(e: BaseException, renames: dict[str, str] | None = None) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, (EngineOverloaded, EngineShuttingDown)):
        return APIError(503, str(e), code="server_overloaded"
                        if isinstance(e, EngineOverloaded) else "server_shutting_down")
    if isinstance(e, ValueError):
        return from_value_error(e, renames)
    if isinstance(e, EngineError):
        return APIError(500, str(e), code="engine_error")
    logger.error("request failed", exc_info=e)
    return APIError(500, f"internal server error: {type(e).__name__}", code="internal_error")


async def _until_disconnect(request: Request, awaitable):
    """Awaits `awaitable`, cancelling it (which aborts its engine requests) if the client leaves."""
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
        raise _ClientGone()
    return task.result()


# -- the server ---------------------------------------------------------------------------------------
class _Server:
    def __init__(self, async_engine, served_model_name: str, max_body_bytes: int):
        self.engine = async_engine
        self.model_name = served_model_name
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.metrics = ServerMetrics(async_engine)
        self._token_texts: dict[int, str] = {}

    # -- small routes ---------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        ae = self.engine
        if ae.is_ready:
            return JSONResponse({"status": "ok"})
        if ae.warmup_error is not None:
            status = f"error: warm-up failed: {type(ae.warmup_error).__name__}: {ae.warmup_error}"
        elif not ae.accepting:
            status = "shutting down"
        else:
            status = "warming up"
        return JSONResponse({"status": status}, status_code=503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def _model_card(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "jaxinfer"}
        if self.engine.max_model_len is not None:
            card["max_model_len"] = self.engine.max_model_len
        return card

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model_name:
            return model_not_found(name).response()
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> Response:
        try:
            req = await self._parse(request, TokenizeRequest)
            if (req.prompt is None) == (req.messages is None):
                raise APIError(400, "give exactly one of `prompt` and `messages`", param="prompt")
            if req.messages is not None:
                prompt = await self._chat_prompt(req.messages, req.add_generation_prompt)
                token_ids = prompt.token_ids
            else:
                token_ids = await asyncio.to_thread(self.engine.tokenizer.encode, req.prompt)
        except APIError as e:
            return e.response()
        return JSONResponse({"tokens": list(token_ids), "count": len(token_ids),
                             "max_model_len": self.engine.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        try:
            req = await self._parse(request, DetokenizeRequest)
            self._check_token_ids(req.tokens, "tokens")
            text = await asyncio.to_thread(self.engine.tokenizer.decode, req.tokens)
        except APIError as e:
            return e.response()
        return JSONResponse({"prompt": text})

    # -- parsing --------------------------------------------------------------------------------
    async def _read_json(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body_bytes
            except ValueError:
                raise APIError(400, "invalid Content-Length header") from None
            if too_big:
                raise self._too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
        body = b"".join(chunks)
        if not body:
            raise APIError(400, "the request body is empty; send a JSON object")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                        code="request_too_large")

    async def _parse(self, request: Request, model_cls):
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from None
        if req.model is not None and req.model != self.model_name:
            raise model_not_found(req.model)
        return req

    def _check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        vocab = self._vocab_size()
        bad = [t for t in token_ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise APIError(400, f"{param} holds token ids outside the vocabulary [0, {vocab}): "
                                f"{bad[:5]}", param=param, code="invalid_value")

    def _vocab_size(self) -> int | None:
        mc = getattr(self.engine.engine, "model_config", None)
        return getattr(mc, "vocab_size", None)

    async def _chat_prompt(self, messages, add_generation_prompt: bool) -> _Prompt:
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        tok = self.engine.tokenizer

        def render():
            text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            if not isinstance(text, str):  # a tokenizer that returns ids
                return _Prompt([int(t) for t in text], None)
            return _Prompt(list(_encode_rendered(tok, text)), text)

        try:
            return await asyncio.to_thread(render)
        except (ValueError, TypeError, KeyError) as e:
            raise APIError(400, f"the chat template failed on these messages: {e}",
                           param="messages", code="invalid_value") from None
        except Exception as e:  # jinja2 TemplateError (raise_exception in the template) and kin
            if type(e).__module__.startswith("jinja2"):
                raise APIError(400, f"the chat template refused these messages: {e}",
                               param="messages", code="invalid_value") from None
            raise

    async def _completion_prompts(self, prompt) -> list[_Prompt]:
        if isinstance(prompt, str):
            texts = [prompt]
        elif prompt and isinstance(prompt[0], str):
            texts = list(prompt)
        elif prompt and isinstance(prompt[0], int):
            self._check_token_ids(prompt, "prompt")
            return [_Prompt(list(prompt), None)]
        else:
            for ids in prompt:
                self._check_token_ids(ids, "prompt")
            return [_Prompt(list(ids), None) for ids in prompt]
        tok = self.engine.tokenizer
        ids_list = await asyncio.to_thread(lambda: [list(tok.encode(t)) for t in texts])
        for text, ids in zip(texts, ids_list):
            if not ids:
                raise APIError(400, f"prompt {text!r} encodes to no tokens", param="prompt",
                               code="invalid_value")
        return [_Prompt(ids, text) for ids, text in zip(ids_list, texts)]

    # -- jobs -----------------------------------------------------------------------------------
    def _make_jobs(self, request_id: str, prompts: list[_Prompt], req, *, max_tokens: int | None,
                   logprobs: int | None, prompt_param: str, max_tokens_param: str,
                   prompt_logprobs: int | None = None) -> list[_Job]:
        num_choices = len(prompts) * req.n
        if num_choices > self.engine.max_waiting:
            raise APIError(400, f"this request asks for {num_choices} completions (prompts x n); "
                                f"the server takes at most {self.engine.max_waiting} at once",
                           param="n", code="invalid_value")
        limit = self.engine.max_model_len
        for p in prompts:
            if limit is not None and len(p.token_ids) >= limit:
                raise context_length_error(len(p.token_ids), limit, param=prompt_param)
            if limit is not None and max_tokens is not None and len(p.token_ids) + max_tokens > limit:
                raise context_length_error(len(p.token_ids), limit, max_tokens, param=max_tokens_param)
        kw: dict[str, Any] = dict(
            n=1, max_tokens=max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, logit_bias=req.logit_bias, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                     "min_p", "repetition_penalty", "min_tokens", "spec_decode"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        vocab = self._vocab_size()
        if vocab is not None and kw.get("top_k", -1) >= vocab:
            kw["top_k"] = -1  # keeping every token: the same as off (and no int32 overflow)
        if req.logit_bias:
            for key in req.logit_bias:
                if not key.lstrip("-").isdigit() or (vocab is not None and not 0 <= int(key) < vocab):
                    raise APIError(400, f"logit_bias key {key!r} is not a token id in [0, {vocab})",
                                   param="logit_bias", code="invalid_value")
        renames = {"max_tokens": max_tokens_param}
        try:
            base = SamplingParams(seed=req.seed, **kw)
            per_sample = [base if req.seed is None else
                          (base if i == 0 else SamplingParams(seed=req.seed + i, **kw))
                          for i in range(req.n)]
        except ValueError as e:
            raise from_value_error(e, renames) from None
        jobs = []
        for p_idx, prompt in enumerate(prompts):
            for i, params in enumerate(per_sample):
                index = p_idx * req.n + i
                jobs.append(_Job(index, p_idx, f"{request_id}-{index}", prompt, params,
                                 req.priority))
        return jobs

    async def _job_outputs(self, job: _Job, t0: float) -> AsyncIterator:
        """One engine request's outputs, recording its latency and token metrics."""
        m = self.metrics
        first_time = None
        num_tokens = 0
        gen = self.engine.generate(job.prompt.token_ids, job.params, job.request_id,
                                   priority=job.priority)
        async with contextlib.aclosing(gen):
            async for out in gen:
                now = time.monotonic()
                n = len(out.outputs[0].token_ids)
                if first_time is None and (n or out.finished):
                    first_time = now
                    m.time_to_first_token.observe(now - t0)
                    m.prompt_tokens.inc(len(out.prompt_token_ids))
                if n > num_tokens:
                    m.generation_tokens.inc(n - num_tokens)
                    num_tokens = n
                if out.finished:
                    m.e2e_latency.observe(now - t0)
                    if n > 1:
                        m.time_per_output_token.observe((now - first_time) / (n - 1))
                yield out

    async def _fan_in(self, jobs: list[_Job], t0: float) -> AsyncIterator[tuple[_Job, Any]]:
        """(job, output) pairs of all jobs as they come; cancelling or closing aborts them all."""
        if len(jobs) == 1:
            async with contextlib.aclosing(self._job_outputs(jobs[0], t0)) as outs:
                async for out in outs:
                    yield jobs[0], out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(job):
            try:
                async with contextlib.aclosing(self._job_outputs(job, t0)) as outs:
                    async for out in outs:
                        q.put_nowait((job, out, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((job, None, e))

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        try:
            num_left = len(jobs)
            while num_left:
                job, out, err = await q.get()
                if err is not None:
                    raise err
                if out.finished:
                    num_left -= 1
                yield job, out
        finally:
            for t in tasks:
                t.cancel()

    # -- the two generation routes ----------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        t0 = time.monotonic()
        try:
            req = await self._parse(request, CompletionRequest)
            if req.best_of is not None and req.best_of != req.n:
                raise APIError(400, "best_of other than n is not supported", param="best_of")
            if req.suffix:
                raise APIError(400, "suffix is not supported", param="suffix")
            prompts = await self._completion_prompts(req.prompt)
            request_id = f"cmpl-{uuid.uuid4().hex}"
            jobs = self._make_jobs(request_id, prompts, req, max_tokens=req.max_tokens,
                                   logprobs=req.logprobs, prompt_param="prompt",
                                   max_tokens_param="max_tokens",
                                   prompt_logprobs=req.logprobs if req.echo else None)
        except APIError as e:
            return self._error("completions", e)
        num_top = req.logprobs or 0
        want_logprobs = req.logprobs is not None
        states = {j.index: R.ChoiceState(j.index, len(j.prompt.token_ids),
                                         prefix=(j.prompt.text if j.prompt.text is not None else
                                                 self.engine.tokenizer.decode(j.prompt.token_ids))
                                         if req.echo else "")
                  for j in jobs}
        created = int(time.time())

        def logprobs_of(job, out, st: R.ChoiceState, entries: list) -> dict | None:
            """The completions logprobs of `entries`, after the prompt's (echo) on first use."""
            if not want_logprobs:
                return None
            parts = []
            if req.echo and not st.started:
                parts.append(R.echo_logprobs(job.prompt.token_ids, out.prompt_logprobs,
                                             self._token_text, st, num_top))
            st.started = True
            parts.append(R.completion_logprobs(entries, self._token_text, st, num_top))
            return R.merge_completion_logprobs(parts)

        def choice(job, out) -> dict | None:
            st = states[job.index]
            c = out.outputs[0]
            new_text, new_lps = st.delta(c)
            if not new_text and not new_lps and c.finish_reason is None and st.prefix == "":
                return None
            text = st.prefix + new_text
            st.prefix = ""
            lp = logprobs_of(job, out, st, new_lps)
            return {"index": job.index, "text": text, "logprobs": lp,
                    "finish_reason": st.finish_reason if c.finish_reason is not None else None}

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            usage_field = None if include_usage else ...

            def chunk(choices, usage_=usage_field):
                return R.completion_chunk(request_id, created, self.model_name, choices, usage_)

            return await self._stream(request, "completions", jobs, t0, states, include_usage,
                                      lambda job, out: ([chunk([ch])] if (ch := choice(job, out)) else []),
                                      [], lambda u: chunk([], u))

        finals, failed = await self._finals(request, "completions", jobs, t0)
        if failed is not None:
            return failed
        choices = []
        for index in sorted(finals):
            job, out = finals[index]
            st = states[index]
            c = out.outputs[0]
            st.delta(c)
            lp = logprobs_of(job, out, R.ChoiceState(index, 0),
                             list(c.logprobs or [])[:len(c.token_ids)])
            choices.append({"index": index, "text": st.prefix + c.text, "logprobs": lp,
                            "finish_reason": st.finish_reason, "stop_reason": c.stop_reason})
        self.metrics.requests.labels("completions", "ok").inc()
        return JSONResponse(R.completion_body(request_id, created, self.model_name, choices,
                                              self._usage(jobs, states, finals)))

    async def chat_completions(self, request: Request) -> Response:
        t0 = time.monotonic()
        try:
            req = await self._parse(request, ChatCompletionRequest)
            if req.top_logprobs is not None and not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            prompt = await self._chat_prompt(req.messages, req.add_generation_prompt)
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            jobs = self._make_jobs(request_id, [prompt], req, max_tokens=max_tokens,
                                   logprobs=logprobs, prompt_param="messages",
                                   max_tokens_param=max_param)
        except APIError as e:
            return self._error("chat", e)
        num_top = req.top_logprobs or 0
        states = {j.index: R.ChoiceState(j.index, len(j.prompt.token_ids)) for j in jobs}
        created = int(time.time())

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            usage_field = None if include_usage else ...

            def chunk(choices, usage_=usage_field):
                return R.chat_chunk(request_id, created, self.model_name, choices, usage_)

            def on_output(job, out) -> list[dict]:
                st = states[job.index]
                c = out.outputs[0]
                new_text, new_lps = st.delta(c)
                if not new_text and not new_lps and c.finish_reason is None:
                    return []
                delta = {"content": new_text} if new_text else {}
                lp = R.chat_logprobs(new_lps, self._token_text, num_top) if req.logprobs else None
                return [chunk([{"index": job.index, "delta": delta, "logprobs": lp,
                                "finish_reason": st.finish_reason if c.finish_reason else None}])]

            role_chunks = [chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]) for j in jobs]
            return await self._stream(request, "chat", jobs, t0, states, include_usage, on_output,
                                      role_chunks, lambda u: chunk([], u))

        finals, failed = await self._finals(request, "chat", jobs, t0, {"max_tokens": max_param})
        if failed is not None:
            return failed
        choices = []
        for index in sorted(finals):
            job, out = finals[index]
            st = states[index]
            c = out.outputs[0]
            st.delta(c)
            lp = (R.chat_logprobs(list(c.logprobs or [])[:len(c.token_ids)], self._token_text, num_top)
                  if req.logprobs else None)
            choices.append({"index": index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": lp, "finish_reason": st.finish_reason,
                            "stop_reason": c.stop_reason})
        self.metrics.requests.labels("chat", "ok").inc()
        return JSONResponse(R.chat_body(request_id, created, self.model_name, choices,
                                        self._usage(jobs, states, finals)))

    async def _finals(self, request, endpoint, jobs, t0, renames=None):
        """Non-streaming: waits for every job's final output. -> ({index: (job, out)}, None), or
        (None, the error Response) when the client left or the engine failed the request."""
        async def collect():
            finals = {}
            async with contextlib.aclosing(self._fan_in(jobs, t0)) as outs:
                async for job, out in outs:
                    finals[job.index] = (job, out)
            return finals

        try:
            return await _until_disconnect(request, collect()), None
        except _ClientGone:
            return None, self._gone(endpoint)
        except Exception as e:  # noqa: BLE001
            return None, self._error(endpoint, _engine_api_error(e, renames))

    # -- streaming --------------------------------------------------------------------------------
    async def _stream(self, request, endpoint, jobs, t0, states, include_usage, on_output,
                      opening_chunks, usage_chunk) -> Response:
        """Waits for the first output (so admission errors are still HTTP errors), then streams."""
        outs = self._fan_in(jobs, t0)
        finals: dict[int, tuple] = {}
        try:
            first = await _until_disconnect(request, outs.__anext__())
        except _ClientGone:
            await outs.aclose()
            return self._gone(endpoint)
        except StopAsyncIteration:  # cannot happen: every job yields a finished output
            first = None
        except Exception as e:  # noqa: BLE001
            await outs.aclose()
            return self._error(endpoint, _engine_api_error(e))

        async def body():
            outcome = "ok"
            try:
                async with contextlib.aclosing(outs):
                    for c in opening_chunks:
                        yield R.sse(c)
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
                        for c in on_output(job, out):
                            yield R.sse(c)
                if include_usage:
                    yield R.sse(usage_chunk(self._usage(jobs, states, finals)))
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "disconnected"
                raise
            except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
                err = _engine_api_error(e)
                outcome = str(err.status)
                yield R.sse(err.body())
            finally:
                self.metrics.requests.labels(endpoint, outcome).inc()
            yield R.SSE_DONE

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- helpers ----------------------------------------------------------------------------------
    def _usage(self, jobs: list[_Job], states: dict, finals: dict) -> dict:
        num_prompt = {}
        num_cached = {}
        for job in jobs:
            num_prompt[job.prompt_index] = len(job.prompt.token_ids)
            final = finals.get(job.index)
            metrics = getattr(final[1], "metrics", None) if final else None
            cached = getattr(metrics, "num_cached_tokens", 0) or 0
            num_cached[job.prompt_index] = max(num_cached.get(job.prompt_index, 0), cached)
        num_completion = sum(st.num_output_tokens for st in states.values())
        return R.usage(sum(num_prompt.values()), num_completion, sum(num_cached.values()))

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < 1_000_000:
                self._token_texts[token_id] = text
        return text

    def _error(self, endpoint: str, e: APIError) -> Response:
        self.metrics.requests.labels(endpoint, str(e.status)).inc()
        return e.response()

    def _gone(self, endpoint: str) -> Response:
        self.metrics.requests.labels(endpoint, "disconnected").inc()
        return Response(status_code=499)


def _encode_rendered(tok, text: str) -> list[int]:
    """Token ids of an already rendered chat prompt (the template wrote any BOS itself)."""
    encode_chat = getattr(tok, "encode_chat_prompt", None)
    if encode_chat is not None:
        return encode_chat(text)
    try:
        return tok.encode(text, add_special_tokens=False)
    except TypeError:
        return tok.encode(text)
