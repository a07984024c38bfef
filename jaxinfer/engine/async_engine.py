"""AsyncEngine: runs an engine (an EngineClient: LLMEngine, or a test fake) on its own thread and
streams RequestOutputs to asyncio callers.

The engine is not thread-safe, so every engine call (add, abort, step, warm-up, metrics snapshot)
happens on the one engine thread. The asyncio side talks to it through a command queue and gets
outputs back through per-request asyncio queues, fed with `loop.call_soon_threadsafe` (one callback
per step, not per output). The event loop never waits on a step. The engine's outputs carry token
ids only (`step(detokenize=False)`); each request's text and stop strings are worked out here, in
the request's own `generate` coroutine (engine/outputs.py: TextTracker): off the engine thread, so
detokenizing overlaps the next step, and a consumer that lags decodes only once for several steps.
A stop string found here ends the request on the engine thread (`finish_request`).

    async_engine = AsyncEngine(engine, max_waiting=1024)
    await async_engine.start()                       # warm-up runs on the engine thread
    async for out in async_engine.generate(prompt, params, request_id):
        ...                                          # cumulative RequestOutput; last one finished
    await async_engine.shutdown(timeout=30)          # stop admissions, drain, join

Leaving the `async for` early (client gone, task cancelled) aborts the request, which frees its
pages. A step that fails fails its requests with `EngineError` and the loop keeps serving: the
requests `StepFailed` names (the engine recovered, engine/llm_engine.py), or every request in
flight for any other exception. `failing` says why the engine is unhealthy, for /health: while a
failed step is handled, and after `max_step_failures` consecutive failed steps (the engine cannot
recover by itself; an orchestrator should restart it), until a step succeeds.

Each request's stream holds its newest output only (outputs are cumulative), so a consumer that
stops reading holds one output's memory, and the engine thread never waits on anyone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Sequence

from jaxinfer.engine.client import EngineClient, StepFailed
from jaxinfer.engine.llm_engine import EngineMetrics
from jaxinfer.engine.outputs import TextTracker
from jaxinfer.request import RequestOutput
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while serving this request (an internal error: HTTP 500)."""


class EngineOverloaded(RuntimeError):
    """Too many requests wait for their first token (HTTP 503)."""


class EngineShuttingDown(RuntimeError):
    """The engine no longer admits requests (HTTP 503)."""


@dataclasses.dataclass
class _Stream:
    """A request's newest undelivered output, or its error (touched on the event loop only)."""

    ready: asyncio.Event
    latest: RequestOutput | None = None
    error: BaseException | None = None
    first_token_seen: bool = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
        elif self.latest is None or not self.latest.finished:  # newer outputs replace older ones
            self.latest = item
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """The newest output (a finished one before an error), else the error."""
        await self.ready.wait()
        item, self.latest = self.latest, None
        if item is None or (self.error is not None and not item.finished):
            return self.error
        if self.error is None:
            self.ready.clear()
        return item


_ADD, _ABORT, _FINISH, _CALL = "add", "abort", "finish", "call"
_METRICS_PERIOD_S = 0.05  # while steps run, engine.metrics is read this often (and when one finishes)


class AsyncEngine:
    def __init__(self, engine: EngineClient, *, max_waiting: int = 1024, warmup: bool = True,
                 idle_poll_s: float = 0.05, max_step_failures: int = 3):
        if max_waiting <= 0:
            raise ValueError(f"{max_waiting=} must be positive")
        if max_step_failures <= 0:
            raise ValueError(f"{max_step_failures=} must be positive")
        self.max_step_failures = max_step_failures
        self.engine = engine
        self.max_waiting = max_waiting
        self._do_warmup = warmup
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Touched on the event loop thread only:
        self._streams: dict[str, _Stream] = {}
        self._num_waiting = 0  # admitted requests that have not produced a token yet
        self._accepting = True
        self._idle: asyncio.Event | None = None  # set while nothing is in flight; made in start()
        # Written by the engine thread, read anywhere (whole-object swaps only):
        self.warmup_error: BaseException | None = None
        self.warmup_seconds: float | None = None
        self.metrics_snapshot: EngineMetrics | None = None
        self.num_step_errors = 0
        self.num_consecutive_step_errors = 0
        self.last_step_error: str | None = None
        self._handling_step_error = False

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def grammars(self):
        """The engine's structured-output compiler (its cache is thread-safe: compile off-loop)."""
        return self.engine.grammars

    @property
    def is_ready(self) -> bool:
        """Warm-up is done (with no error) and the engine admits requests."""
        return self._ready.is_set() and self.warmup_error is None and self._accepting

    @property
    def failing(self) -> str | None:
        """Why the engine is unhealthy (a failed step being handled, or `max_step_failures`
        consecutive failed steps), or None."""
        if self._handling_step_error:
            return f"recovering from a failed step ({self.last_step_error})"
        n = self.num_consecutive_step_errors
        if n >= self.max_step_failures:
            return f"{n} consecutive engine steps failed, the last with {self.last_step_error}"
        return None

    @property
    def accepting(self) -> bool:
        """False once `stop_admissions` or `shutdown` ran."""
        return self._accepting

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    async def start(self) -> None:
        """Starts the engine thread (idempotent). Warm-up runs there; `is_ready` turns true after."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        await self.start()
        return await asyncio.to_thread(self._ready.wait, timeout)

    def stop_admissions(self) -> None:
        """New `generate` calls raise EngineShuttingDown; requests in flight go on. Thread-safe."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(setattr, self, "_accepting", False)
                return
            except RuntimeError:
                pass
        self._accepting = False

    async def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops admissions, waits up to `timeout` s for requests in flight, aborts the rest, and
        joins the engine thread."""
        self._accepting = False
        if self._thread is None:
            return
        if self._streams:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                logger.warning("shutdown: aborting %d requests still running after %.0f s",
                               len(self._streams), timeout)
                for request_id in list(self._streams):
                    self._fail(request_id, EngineShuttingDown("the server is shutting down"))
        self._stop.set()
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 60.0)
        self._thread = None

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None,
                       request_id: str, priority: int = 0,
                       background: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields cumulative RequestOutputs for one request; the last has `finished` set.
        `background`: it yields to interactive requests (batch lines; sched/scheduler.py).

        Raises ValueError (bad prompt/params, from `engine.add_request`), EngineOverloaded,
        EngineShuttingDown or EngineError. Closing the iterator early aborts the request."""
        await self.start()
        if not self._accepting:
            raise EngineShuttingDown("the server is shutting down")
        if self._num_waiting >= self.max_waiting:
            raise EngineOverloaded(
                f"{self._num_waiting} requests are waiting; the limit is max_waiting={self.max_waiting}")
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use")
        stream = _Stream(asyncio.Event())
        self._streams[request_id] = stream
        self._num_waiting += 1
        self._idle.clear()
        finished = False
        text = None  # TextTracker, made at the first output (it knows the prompt's token ids)
        try:
            added = concurrent.futures.Future()
            self._send(_ADD, request_id, (prompt, params, priority, background), added)
            await asyncio.wrap_future(added)
            while True:
                item = await stream.get()  # the newest: a lagging consumer skips the others
                if isinstance(item, BaseException):
                    finished = True  # the engine side already dropped it
                    raise item
                if text is None:
                    text = TextTracker(self.tokenizer, item.prompt_token_ids,
                                       params if params is not None else SamplingParams())
                engine_finished = item.finished
                item = text.apply(item)
                if item.finished and not engine_finished:  # a stop string: end it there
                    self._send(_FINISH, request_id, text.stop_reason)
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:
                if not stream.first_token_seen:
                    self._num_waiting -= 1
                if not finished:
                    self._send(_ABORT, request_id)
            if not self._streams:
                self._idle.set()

    async def abort(self, request_id: str) -> None:
        """Aborts a request from outside its `generate` loop; its iterator ends with EngineError."""
        if request_id in self._streams:
            self._send(_ABORT, request_id)
            self._fail(request_id, EngineError(f"request {request_id!r} was aborted"))

    async def call(self, fn, *args):
        """Runs `fn(engine, *args)` on the engine thread between steps and returns its result
        (for reads that must not race the step, e.g. the scheduler's page counts)."""
        await self.start()
        fut = concurrent.futures.Future()
        self._send(_CALL, None, (fn, args), fut)
        return await asyncio.wrap_future(fut)

    # -- event loop side helpers ----------------------------------------------------------------
    def _send(self, kind, request_id, payload=None, future=None) -> None:
        self._commands.put((kind, request_id, payload, future))
        self._wake.set()

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(exc)

    def _dispatch(self, outputs: list, errors: list[tuple[str, BaseException]]) -> None:
        """Runs on the event loop: hands one step's outputs to their streams."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if not stream.first_token_seen and (out.finished or _num_output_tokens(out) > 0):
                stream.first_token_seen = True
                self._num_waiting -= 1
            stream.put(out)
        for request_id, exc in errors:
            self._fail(request_id, exc)

    def _post(self, outputs: list, errors: list | None = None) -> None:
        """Engine thread -> event loop."""
        if not outputs and not errors:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs, errors or [])
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        if self._do_warmup:
            t0 = time.perf_counter()
            try:
                engine.warmup()
            except BaseException as e:  # noqa: BLE001 - reported on /health, the loop still serves
                logger.exception("engine warm-up failed")
                self.warmup_error = e
            self.warmup_seconds = time.perf_counter() - t0
            logger.info("engine warm-up took %.1f s", self.warmup_seconds)
        self._snapshot_metrics()
        self._ready.set()
        in_flight: set[str] = set()
        last_snapshot = time.monotonic()
        while not self._stop.is_set():
            try:
                if self._process_commands(in_flight):
                    self._snapshot_metrics()  # e.g. pages freed by aborts, before the loop idles
                if self._stop.is_set():
                    break
                if not engine.has_unfinished_requests():
                    self._wake.wait(self._idle_poll_s)
                    self._wake.clear()
                    continue
                outputs = engine.step(detokenize=False)
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
                self._on_step_error(e, in_flight)
                continue
            self.num_consecutive_step_errors = 0
            any_finished = False
            for out in outputs:
                if out.finished:
                    in_flight.discard(out.request_id)
                    any_finished = True
            now = time.monotonic()
            if any_finished or now - last_snapshot >= _METRICS_PERIOD_S:
                # before the outputs go out: a client that has its finished response and then
                # reads /metrics sees its request counted
                self._snapshot_metrics()
                last_snapshot = now
            self._post(outputs)
        self._snapshot_metrics()

    def _process_commands(self, in_flight: set[str]) -> int:
        num_done = 0
        while True:
            try:
                kind, request_id, payload, future = self._commands.get_nowait()
            except queue.Empty:
                return num_done
            num_done += 1
            if kind == _ADD:
                if not future.set_running_or_notify_cancel():
                    continue  # its caller left before the add ran (its _ABORT finds nothing)
                prompt, params, priority, background = payload
                try:
                    self.engine.add_request(request_id, prompt, params, priority=priority,
                                            background=background)
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
                else:
                    in_flight.add(request_id)
                    future.set_result(None)
            elif kind == _FINISH:
                if request_id in in_flight:
                    in_flight.discard(request_id)
                    try:
                        self.engine.finish_request(request_id, "stop", stop_reason=payload)
                    except Exception:  # noqa: BLE001
                        logger.exception("finish_request(%r) failed", request_id)
            elif kind == _ABORT:
                if request_id in in_flight:
                    in_flight.discard(request_id)
                    try:
                        self.engine.abort_request(request_id)
                    except Exception:  # noqa: BLE001
                        logger.exception("abort_request(%r) failed", request_id)
            elif kind == _CALL:
                fn, args = payload
                try:
                    future.set_result(fn(self.engine, *args))
                except BaseException as e:  # noqa: BLE001
                    future.set_exception(e)

    def _on_step_error(self, exc: Exception, in_flight: set[str]) -> None:
        self.last_step_error = (str(exc) if isinstance(exc, StepFailed)
                                else f"{type(exc).__name__}: {exc}")
        self._handling_step_error = True
        try:
            errors = self._end_failed(exc, in_flight)
        finally:
            self.num_step_errors += 1
            self.num_consecutive_step_errors += 1
            self._handling_step_error = False
        self._post([], errors)  # after the counters: a client that reads /health next sees them
        self._snapshot_metrics()
        if isinstance(exc, StepFailed):
            return  # the engine recovered by itself
        try:
            wedged = self.engine.has_unfinished_requests()
        except Exception:  # noqa: BLE001
            wedged = True
        if wedged:
            time.sleep(0.1)  # a wedged engine must not spin the CPU

    def _end_failed(self, exc: Exception, in_flight: set[str]) -> list[tuple[str, EngineError]]:
        """Takes the failed step's requests out of `in_flight` -> (request id, its error)."""
        if isinstance(exc, StepFailed):  # the engine ended these and recovered
            failed = sorted(in_flight.intersection(exc.request_ids))
            logger.error("engine step failed (%s); failing its %d requests", exc, len(failed),
                         exc_info=exc.cause)
            err = EngineError(f"the engine failed: {exc}")
        else:
            failed = sorted(in_flight)
            logger.exception("engine step failed; failing %d requests in flight", len(failed))
            err = EngineError(f"the engine failed: {type(exc).__name__}: {exc}")
            for request_id in failed:
                try:
                    self.engine.abort_request(request_id)
                except Exception:  # noqa: BLE001
                    logger.exception("abort_request(%r) failed after a step error", request_id)
        in_flight.difference_update(failed)
        return [(request_id, err) for request_id in failed]

    def _snapshot_metrics(self) -> None:
        try:
            self.metrics_snapshot = self.engine.metrics
        except Exception:  # noqa: BLE001
            logger.debug("engine.metrics failed", exc_info=True)


def _num_output_tokens(out) -> int:
    return sum(len(c.token_ids) for c in out.outputs)
