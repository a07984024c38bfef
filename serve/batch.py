"""Batch jobs over JSONL files, answered by the OpenAI server's own routes (in process), safe to
kill at any moment and rerun.

    jaxinfer batch requests.jsonl results.jsonl --model smollm2-135m

Every line (serve/batch_input.py: OpenAI batch lines or plain {prompt | messages} requests) goes
through the same validation, chat template, sampling and response building as `jaxinfer serve`
(n, logprobs, echo, logit_bias, stop, seed...), over one continuous batch: the lines are posted to
the app through httpx's ASGI transport, many at once, so the engine keeps its batch full. The
model named in a line is ignored: the job runs the model it was given.

Each answer (serve/batch_rows.py) is appended to the output and flushed as soon as its request
finishes, so the output is in completion order, not input order (sort by custom_id if that
matters), and a killed job loses only the requests still running. Run the same command again to
finish the job: the lines already answered (by custom_id) are skipped, a torn last line is cut
away and redone (serve/batch_output.py). Answers that are errors count as answered: remove their
lines from the output to retry them. A line that fails, even one whose handling raises inside the
app, gets an error line of its own and the job goes on. Exit status: 0 when every line has an
answer that is not an error, 1 when some are errors (2, from the command, on bad usage).

It lives with the server because it is a client of the server's app; the command
(serve/batch_cli.py) builds the engine itself (`LLMEngine`), not through the Python API
(`jaxinfer.llm`), which is the app's sibling, not its base.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections.abc import Callable

from jaxinfer.engine import EngineClient
from jaxinfer.engine.async_engine import AsyncEngine
from serve.app import create_app
from serve.batch_input import BadLine, BatchLine, read_lines
from serve.batch_output import ResultFile
from serve.batch_progress import Progress, Summary
from serve.batch_post import post_lines
from serve.batch_rows import error_row

MODEL_NAME = "batch"  # the model name the job's requests carry (the app serves only this one)


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    max_in_flight: int = 1024  # lines posted at once; the rest wait their turn
    sync_interval_s: float = 1.0  # an answer is fsynced at most this long after it is written
    progress: bool = True  # the tqdm bar on stderr

    def __post_init__(self):
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight={self.max_in_flight} must be at least 1")
        if self.sync_interval_s < 0:
            raise ValueError(f"sync_interval_s={self.sync_interval_s} must not be negative")


def run_batch(input_path: str, output_path: str, make_engine: Callable[[], EngineClient],
              options: BatchOptions = BatchOptions()) -> int:
    """Runs the lines of `input_path` not yet answered in `output_path` through the engine that
    `make_engine` builds, called only when some line is left; returns the exit status (0 or 1).
    ValueError on bad usage (no input file, the output a directory or in use by another job...).
    The engine must not be used by anyone else meanwhile (the job drives it from its own thread)."""
    lines = _read_input(input_path, output_path)
    with ResultFile(output_path, sync_interval_s=options.sync_interval_s) as out:
        keys = {line.custom_id for line in lines}
        pending = [line for line in lines if line.custom_id not in out.answers]
        already_done = len(lines) - len(pending)
        unknown = sum(key not in keys for key in out.answers)
        requests = [line for line in pending if isinstance(line, BatchLine)]
        for line in pending:
            if isinstance(line, BadLine):  # answered without an engine
                out.write(error_row(line.custom_id, line.code, line.message))
        if requests:
            engine = make_engine()
            progress = Progress(len(lines), len(lines) - len(requests), enabled=options.progress)
            try:
                asyncio.run(_serve_lines(engine, requests, out, progress, options))
            finally:
                progress.close()
        summary = Summary(total=len(lines),
                          done_now=sum(k in out.answers for k in keys) - already_done,
                          already_done=already_done,
                          failed=sum(out.answers.get(k, False) for k in keys),
                          torn_bytes=out.torn_bytes, unknown=unknown)
    print(summary.line(output_path), file=sys.stderr)
    return summary.exit_status


def run_batch_with(engine: EngineClient, input_path: str, output_path: str,
                   options: BatchOptions = BatchOptions()) -> int:
    """`run_batch` over an engine built already."""
    return run_batch(input_path, output_path, lambda: engine, options)


def _read_input(input_path: str, output_path: str) -> list[BatchLine | BadLine]:
    if not os.path.isfile(input_path):
        raise ValueError(f"input file {input_path!r} does not exist"
                         if not os.path.exists(input_path) else
                         f"input {input_path!r} is not a file")
    if os.path.exists(output_path) and os.path.samefile(input_path, output_path):
        raise ValueError("the output file must not be the input file")
    try:
        return read_lines(input_path)
    except OSError as e:
        raise ValueError(f"cannot read the input {input_path!r}: {e.strerror}") from None


async def _serve_lines(engine: EngineClient, lines: list[BatchLine], out: ResultFile,
                       progress: Progress, options: BatchOptions) -> None:
    # no cap on waiting requests: post_lines keeps max_in_flight lines in flight, and a line of
    # many choices (n x prompts) must run whatever that setting is
    async_engine = AsyncEngine(engine, max_waiting=sys.maxsize, warmup=False)
    app = create_app(async_engine, served_model_name=MODEL_NAME)
    await async_engine.wait_ready()
    try:
        await post_lines(app, lines, out, progress, max_in_flight=options.max_in_flight,
                         model_name=MODEL_NAME)
    finally:
        await async_engine.shutdown()
