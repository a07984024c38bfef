"""Fan-out and fan-in of a generation request: one engine request (a `Job`) per prompt and sample
(prompts x n), their outputs merged into one stream of (job, output) pairs as they come, each
job's latency and token counts recorded, and the usage of them all.

Closing the merged stream (or cancelling its consumer) aborts every job still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import AsyncIterator

from starlette.requests import Request

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.request import RequestOutput
from jaxinfer.sampling_params import SamplingParams, StructuredOutputs
from serve import responses as R
from serve.disconnect import ClientGone, until_disconnect
from serve.errors import APIError, context_length_error, engine_api_error
from serve.metrics import ServerMetrics
from serve.prompts import Prompt
from serve.sampling import sample_params
from serve.schemas import SamplingFields


@dataclasses.dataclass(frozen=True)
class Job:
    """One engine request: choice `index` of the response."""

    index: int
    prompt_index: int
    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int = 0
    background: bool = False  # service_tier "flex": yields to interactive requests


Finals = dict[int, tuple[Job, RequestOutput]]  # choice index -> its job and its last output


def plan_jobs(engine: AsyncEngine, request_id: str, prompts: list[Prompt], req: SamplingFields, *,
              max_tokens: int | None, logprobs: int | None, prompt_param: str,
              max_tokens_param: str, prompt_logprobs: int | None = None,
              constraint: StructuredOutputs | None = None) -> list[Job]:
    """The jobs of a request, choice index = prompt index * n + sample; APIError (400) when they
    can never run: more choices than the engine admits at once, a prompt (plus max_tokens, or
    plus min_tokens) longer than the context, or a sampling value SamplingParams refuses.

    The context is the bound of the KV pool too: the engine's scheduler refuses to start with a
    pool that cannot hold one sequence of max_model_len tokens, so what fits the context fits the
    pool (and waits, at worst, for pages to free up)."""
    num_choices = len(prompts) * req.n
    if num_choices > engine.max_waiting:
        raise APIError(400, f"this request asks for {num_choices} completions (prompts x n); "
                            f"the server takes at most {engine.max_waiting} at once",
                       param="n", code="invalid_value")
    limit = engine.max_model_len
    for p in prompts:
        num_prompt = len(p.token_ids)
        if num_prompt >= limit:
            raise context_length_error(num_prompt, limit, param=prompt_param, source=prompt_param)
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise context_length_error(num_prompt, limit, param=max_tokens_param,
                                       source=prompt_param, max_tokens=max_tokens)
        if max_tokens is None and req.min_tokens and num_prompt + req.min_tokens > limit:
            raise context_length_error(num_prompt, limit, param="min_tokens", source=prompt_param,
                                       min_tokens=req.min_tokens)
    samples = sample_params(req, max_tokens=max_tokens, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, vocab_size=engine.vocab_size,
                            max_tokens_param=max_tokens_param, constraint=constraint)
    return [Job(p_idx * req.n + i, p_idx, f"{request_id}-{p_idx * req.n + i}", prompt, params,
                req.priority, req.service_tier == "flex")
            for p_idx, prompt in enumerate(prompts) for i, params in enumerate(samples)]


async def fan_in(engine: AsyncEngine, metrics: ServerMetrics, jobs: list[Job],
                 t0: float) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """(job, output) pairs of all jobs as they come, until every job finished; closing or
    cancelling it aborts them all. `t0`: when the request arrived (time.monotonic)."""
    if len(jobs) == 1:
        async with contextlib.aclosing(_job_outputs(engine, metrics, jobs[0], t0)) as outs:
            async for out in outs:
                yield jobs[0], out
        return
    # Bounded: when the consumer stops reading, the pumps stop and each job's engine stream
    # keeps only its newest output (outputs are cumulative), so memory stays flat.
    q: asyncio.Queue = asyncio.Queue(maxsize=len(jobs))

    async def pump(job: Job) -> None:
        try:
            async with contextlib.aclosing(_job_outputs(engine, metrics, job, t0)) as outs:
                async for out in outs:
                    await q.put((job, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await q.put((job, None, e))

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


async def collect(request: Request, engine: AsyncEngine, metrics: ServerMetrics, jobs: list[Job],
                  t0: float, renames: dict[str, str] | None = None) -> Finals:
    """Every job's final output (a non-streaming response). ClientGone when the client left (the
    jobs are aborted); APIError when the engine refused or failed a job (`renames`: engine field
    names -> the API's, for the error's `param`)."""

    async def run() -> Finals:
        finals: Finals = {}
        async with contextlib.aclosing(fan_in(engine, metrics, jobs, t0)) as outs:
            async for job, out in outs:
                finals[job.index] = (job, out)
        return finals

    try:
        return await until_disconnect(request, run())
    except ClientGone:
        raise
    except Exception as e:  # noqa: BLE001 - every failure is an answer
        raise engine_api_error(e, renames) from None


def usage(jobs: list[Job], states: dict[int, R.ChoiceState], finals: Finals) -> dict:
    """The usage of a request: each prompt counted once (not once per sample), every choice's
    output tokens, and the prompt tokens served from the prefix cache."""
    num_prompt: dict[int, int] = {}
    num_cached: dict[int, int] = {}
    for job in jobs:
        num_prompt[job.prompt_index] = len(job.prompt.token_ids)
        final = finals.get(job.index)
        metrics = final[1].metrics if final is not None else None
        cached = metrics.num_cached_tokens if metrics is not None else 0
        num_cached[job.prompt_index] = max(num_cached.get(job.prompt_index, 0), cached)
    num_completion = sum(st.num_output_tokens for st in states.values())
    return R.usage(sum(num_prompt.values()), num_completion, sum(num_cached.values()))


async def _job_outputs(engine: AsyncEngine, metrics: ServerMetrics, job: Job,
                       t0: float) -> AsyncIterator[RequestOutput]:
    """One job's outputs, recording its time to first token, latency and token counts."""
    m = metrics
    first_time = None
    num_tokens = 0
    gen = engine.generate(job.prompt.token_ids, job.params, job.request_id, priority=job.priority,
                          background=job.background)
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
