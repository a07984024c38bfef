"""The batches of the server's /v1/batches: each runs as a task on the server's event loop,
posting its lines to the server's own app (serve/batch_post.py), and picks up where it stopped
when the server starts again.

A batch goes validating (its input file read; no usable line: failed) -> in_progress (each answer
appended and flushed to its result file, batches/<id>.jsonl, as its request finishes; fsynced
within a second) -> finalizing (the answers split into an output file, the successes, and an
error file, the failures, both files of purpose "batch_output") -> completed. Cancelling stops
the requests in flight and finalizes what is answered as "cancelled". A batch still running at its
`expires_at` (FilesConfig.expiry_s after its creation) stops the same way, answers each line not
yet answered with an error line (code "batch_expired"), and ends "expired".

The status lives in SQLite (serve/store.py), so a server killed at any point resumes each batch
that is not final when it starts: the lines already in the result file are skipped (by
custom_id), a torn last line is cut and redone (serve/batch_output.py), so no answer is lost or
doubled. Lines run under the served model (the line's `model` is ignored); when the engine runs
the "priority" scheduling policy they carry `priority` = FilesConfig.batch_priority, after
interactive requests (priority 0), whatever the line asked for. Under either policy they run as
`service_tier="flex"`: in the background, behind every interactive request and, while there are
some, in at most a small share of each step (sched/scheduler.py), at most
FilesConfig.max_in_flight lines of a batch at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time

from serve.batch_input import BadLine, BatchLine, read_lines
from serve.batch_objects import batch_errors, file_object
from serve.batch_output import ResultFile
from serve.batch_post import post_lines
from serve.batch_rows import error_row, is_failure, is_result_row
from serve.errors import APIError
from serve.files_config import FilesConfig
from serve.store import Store

logger = logging.getLogger(__name__)

_COUNTS_EVERY_S = 0.5  # request_counts are written to the database at most this often


class BatchRuns:
    def __init__(self, store: Store, config: FilesConfig, *, model_name: str,
                 api_key: str | None = None, scheduling_policy: str = "fcfs"):
        self.store = store
        self.config = config
        self._model_name = model_name
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._overrides = {"service_tier": "flex"}
        if scheduling_policy == "priority":
            self._overrides["priority"] = config.batch_priority
        self._tasks: dict[str, asyncio.Task] = {}
        self._app = None
        self._stopping = False

    async def start(self, app) -> None:
        """Resumes every batch that is not final; `app` is the ASGI app the lines are posted to."""
        self._app = app
        self._stopping = False
        active = {b["id"] for b in self.store.active_batches()}
        for name in os.listdir(self.store.runs_dir):  # a finished batch's result file left by a kill
            if name.endswith(".jsonl") and name[:-len(".jsonl")] not in active:
                os.unlink(os.path.join(self.store.runs_dir, name))
        for batch_id in sorted(active):
            logger.info("resuming batch %s", batch_id)
            self._launch(batch_id)

    async def stop(self) -> None:
        """Stops the tasks without changing any batch's status (they resume at the next start)."""
        self._stopping = True
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def num_active(self) -> int:
        return len(self.store.active_batches())

    def submit(self, obj: dict) -> None:
        self.store.put_batch(obj)
        self._launch(obj["id"])

    def cancel(self, batch_id: str) -> dict:
        obj = self.store.get_batch(batch_id)
        if obj is None:
            raise batch_not_found(batch_id)
        if obj["status"] == "cancelling":
            return obj
        if obj["status"] not in ("validating", "in_progress"):
            raise APIError(400, f"batch {batch_id} is {obj['status']}: only a validating or "
                                "in_progress batch can be cancelled", code="invalid_state")
        obj.update(status="cancelling", cancelling_at=int(time.time()))
        self.store.put_batch(obj)
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()
        return obj

    def result_path(self, batch_id: str) -> str:
        return os.path.join(self.store.runs_dir, f"{batch_id}.jsonl")

    def _launch(self, batch_id: str) -> None:
        task = asyncio.create_task(self._run(batch_id), name=f"batch {batch_id}")
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def _run(self, batch_id: str) -> None:
        obj = self.store.get_batch(batch_id)
        try:
            if obj["status"] in ("validating", "in_progress"):
                await self._process(obj)
        except asyncio.CancelledError:
            if self._stopping or self.store.get_batch(batch_id)["status"] != "cancelling":
                raise
        except _Failed as e:
            obj.update(status="failed", failed_at=int(time.time()),
                       errors=batch_errors(e.code, str(e)))
            self.store.put_batch(obj)
            return
        except Exception as e:
            logger.exception("batch %s failed", batch_id)
            obj.update(status="failed", failed_at=int(time.time()),
                       errors=batch_errors("internal_error", f"{type(e).__name__}: {e}"))
            self.store.put_batch(obj)
            return
        self._finalize(self.store.get_batch(batch_id))

    async def _process(self, obj: dict) -> None:
        lines = self._read_input(obj)
        obj.update(status="in_progress", in_progress_at=obj["in_progress_at"] or int(time.time()))
        obj["request_counts"]["total"] = len(lines)
        self.store.put_batch(obj)
        with ResultFile(self.result_path(obj["id"])) as out:
            keys = {line.custom_id for line in lines}
            counts = _Counts(self.store, obj, out.answers, keys)
            pending = [line for line in lines if line.custom_id not in out.answers]
            for line in pending:
                if isinstance(line, BadLine):
                    counts.update(out_row(out, error_row(line.custom_id, line.code,
                                                         line.message)))
            requests = [line for line in pending if isinstance(line, BatchLine)]
            flusher = asyncio.create_task(counts.flush_on_time())
            try:
                await self._post(obj, requests, out, counts)
            finally:
                flusher.cancel()
            counts.flush()
        obj.update(status="finalizing", finalizing_at=int(time.time()))
        self.store.put_batch(obj)

    async def _post(self, obj: dict, requests: list[BatchLine], out: ResultFile,
                    counts: _Counts) -> None:
        """Posts the batch's `requests` until they are answered or the batch expires (then the
        unanswered ones get an error line each)."""
        try:
            if requests:
                await asyncio.wait_for(
                    post_lines(self._app, requests, out, counts,
                               max_in_flight=self.config.max_in_flight,
                               model_name=self._model_name, overrides=self._overrides,
                               headers=self._headers),
                    timeout=max(obj["expires_at"] - time.time(), 0.0))
        except TimeoutError:
            obj["expired_at"] = int(time.time())
            for line in requests:
                if line.custom_id not in out.answers:
                    counts.update(out_row(out, error_row(
                        line.custom_id, "batch_expired", "This request could not be "
                        "executed before the completion window expired.")))

    def _read_input(self, obj: dict) -> list[BatchLine | BadLine]:
        path = self.store.file_path(obj["input_file_id"])
        try:
            lines = read_lines(path)
        except OSError as e:
            raise _Failed("invalid_file", f"cannot read the input file "
                                          f"{obj['input_file_id']}: {e.strerror}") from None
        if not lines:
            raise _Failed("empty_file", f"the input file {obj['input_file_id']} has no lines")
        return [_checked(line, obj["endpoint"]) for line in lines]

    def _finalize(self, obj: dict) -> None:
        """Splits the result file into the output and error files (ids fixed by the batch's id,
        so finalizing again after a kill replaces them) and makes the batch final."""
        rows = _read_rows(self.result_path(obj["id"]))
        done, failed = [r for r in rows if not is_failure(r)], [r for r in rows if is_failure(r)]
        suffix = obj["id"].removeprefix("batch_")
        for key, kind, part in (("output_file_id", "output", done),
                                ("error_file_id", "error", failed)):
            if part:
                obj[key] = self._add_file(f"file-{kind}-{suffix}", f"{obj['id']}_{kind}.jsonl",
                                          part)
        now = int(time.time())
        if obj["status"] == "cancelling":
            obj.update(status="cancelled", cancelled_at=now)
        elif obj.get("expired_at"):
            obj["status"] = "expired"
        else:
            obj.update(status="completed", completed_at=now)
        if not obj["request_counts"]["total"]:
            obj["request_counts"]["total"] = len(rows)
        obj["request_counts"].update(completed=len(done), failed=len(failed))
        self.store.put_batch(obj)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.result_path(obj["id"]))

    def _add_file(self, file_id: str, filename: str, rows: list[dict]) -> str:
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        temp = self.store.temp_path(file_id)
        with open(temp, "wb") as f:
            f.write(data)
        self.store.add_file(file_object(file_id, filename=filename, size=len(data),
                                        purpose="batch_output"), temp)
        return file_id


def _checked(line: BatchLine | BadLine, endpoint: str) -> BatchLine | BadLine:
    """`line`, or the error it gets in a batch of `endpoint`: the Batches API takes OpenAI batch
    lines only (the plain requests `jaxinfer batch` also reads would get rows of another shape)."""
    if isinstance(line, BadLine):
        return line
    if not line.openai:
        return BadLine(line.number, line.custom_id, "invalid_request",
                       f"line {line.number} is not an OpenAI batch line: it needs 'custom_id', "
                       "'method', 'url' and 'body'")
    if line.url != endpoint:
        return BadLine(line.number, line.custom_id, "invalid_url",
                       f"line {line.number}'s url {line.url!r} is not the batch's endpoint "
                       f"{endpoint!r}")
    return line


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id}'.", code="not_found")


def out_row(out: ResultFile, row: dict) -> dict:
    out.write(row)
    return row


class _Failed(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class _Counts:
    """The batch's request_counts, kept up to date in the database as answers come."""

    def __init__(self, store: Store, obj: dict, answers: dict[str, bool], keys: set[str]):
        self._store, self._obj = store, obj
        failed = sum(answers[k] for k in keys if k in answers)
        obj["request_counts"].update(completed=sum(k in answers for k in keys) - failed,
                                     failed=failed)
        self._written = 0.0
        self._dirty = False

    def update(self, row: dict) -> None:
        self._obj["request_counts"]["failed" if is_failure(row) else "completed"] += 1
        self._dirty = True
        if time.monotonic() - self._written >= _COUNTS_EVERY_S:
            self.flush()

    def flush(self) -> None:
        current = self._store.get_batch(self._obj["id"])
        if current is not None and current["status"] == "cancelling":
            self._obj.update(status="cancelling", cancelling_at=current["cancelling_at"])
        self._store.put_batch(self._obj)
        self._written = time.monotonic()
        self._dirty = False

    async def flush_on_time(self) -> None:
        """Writes counts that `update` left unwritten within _COUNTS_EVERY_S, so the last
        answers of a burst show before the next answer comes, however long that takes."""
        while True:
            await asyncio.sleep(_COUNTS_EVERY_S)
            if self._dirty:
                self.flush()


def _read_rows(path: str) -> list[dict]:
    """The answers of a result file, the first per custom_id (the file was recovered, so every
    line is whole; a missing file has none)."""
    try:
        with open(path, "rb") as f:
            raw = f.read().split(b"\n")
    except FileNotFoundError:
        return []
    rows, seen = [], set()
    for line in raw:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line: its request was not finished
        if is_result_row(row) and row["custom_id"] not in seen:
            seen.add(row["custom_id"])
            rows.append(row)
    return rows


def make_batch_runs(config: FilesConfig, async_engine, *, model_name: str,
                    api_key: str | None) -> BatchRuns:
    """The batches of an app over `async_engine`, stored under `config.data_dir`."""
    engine_config = getattr(async_engine.engine, "engine_config", None)
    return BatchRuns(Store(config.data_dir), config, model_name=model_name, api_key=api_key,
                     scheduling_policy=getattr(engine_config, "scheduling_policy", "fcfs"))
