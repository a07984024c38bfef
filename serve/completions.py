"""POST /v1/completions: text completions of one or more prompts, `n` each, streamed or not; with
`echo` the prompt comes first, and `echo` with `logprobs` scores the prompt's tokens too."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from jaxinfer.request import RequestOutput
from serve import responses as R
from serve.body import parse_body
from serve.errors import APIError
from serve.jobs import Finals, Job, plan_jobs, usage
from serve.prompts import completion_prompts
from serve.schemas import CompletionRequest
from serve.structured import precompile, request_constraint
from serve.state import ServerState
from serve.writer import ChoiceWriter, respond

ENDPOINT = "completions"  # the metrics label


async def completions(server: ServerState, request: Request) -> Response:
    """Completions of a prompt (or several), streamed or not."""
    t0 = time.monotonic()
    engine = server.engine
    try:
        req = await parse_body(request, CompletionRequest, max_body_bytes=server.max_body_bytes,
                               model_name=server.model_name)
        if req.best_of is not None and req.best_of < req.n:
            raise APIError(400, f"best_of={req.best_of} must be >= n={req.n}", param="best_of",
                           code="invalid_value")
        if req.best_of is not None and req.best_of > req.n:
            raise APIError(400, "best_of > n is not supported (choices are not re-ranked); "
                                "send best_of equal to n or leave it out", param="best_of",
                           code="invalid_value")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = await completion_prompts(engine.tokenizer, req.prompt, engine.vocab_size)
        constraint, constraint_param = request_constraint(req.response_format,
                                                          req.structured_outputs)
        await precompile(engine, constraint, constraint_param)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        jobs = plan_jobs(engine, request_id, prompts, req, max_tokens=req.max_tokens,
                         logprobs=req.logprobs, prompt_param="prompt",
                         max_tokens_param="max_tokens",
                         prompt_logprobs=req.logprobs if req.echo else None,
                         constraint=constraint)
    except APIError as e:
        return server.error(ENDPOINT, e)
    return await respond(server, request, ENDPOINT, jobs, t0,
                         CompletionWriter(server, req, request_id, jobs))


class CompletionWriter(ChoiceWriter):
    """The chunks (streaming) or the body of one completions request (with `echo`, each choice
    starts with its prompt)."""

    def __init__(self, server: ServerState, req: CompletionRequest, request_id: str,
                 jobs: list[Job]):
        decode = server.engine.tokenizer.decode
        super().__init__(server, req, request_id, jobs, {
            j.index: R.ChoiceState(j.index, len(j.prompt.token_ids), prefix=(
                (j.prompt.text if j.prompt.text is not None else decode(j.prompt.token_ids))
                if req.echo else "")) for j in jobs})

    # -- streaming (serve/streaming.py: ChunkWriter) ---------------------------------------------

    def chunks(self, job: Job, out: RequestOutput) -> list[dict]:
        st = self.states[job.index]
        c = out.outputs[0]
        new_text, new_lps = st.delta(c)
        if not new_text and not new_lps and c.finish_reason is None and st.prefix == "":
            return []
        text = st.prefix + new_text
        st.prefix = ""
        choice = {"index": job.index, "text": text,
                  "logprobs": self._logprobs(job, out, st, new_lps),
                  "finish_reason": st.finish_reason if c.finish_reason is not None else None}
        return [self._chunk([choice], self.chunk_usage)]

    # -- not streaming -------------------------------------------------------------------------
    def body(self, finals: Finals) -> dict:
        choices = []
        for index in sorted(finals):
            job, out = finals[index]
            st = self.states[index]
            c = out.outputs[0]
            st.delta(c)
            lp = self._logprobs(job, out, R.ChoiceState(index, 0),
                                list(c.logprobs or [])[:len(c.token_ids)])
            choices.append({"index": index, "text": st.prefix + c.text, "logprobs": lp,
                            "finish_reason": st.finish_reason, "stop_reason": c.stop_reason})
        return R.completion_body(self.request_id, self.created, self.model_name, choices,
                                 usage(self.jobs, self.states, finals))

    # -- parts ---------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage_) -> dict:
        return R.completion_chunk(self.request_id, self.created, self.model_name, choices, usage_)

    def _logprobs(self, job: Job, out: RequestOutput, st: R.ChoiceState,
                  entries: list) -> dict | None:
        """The completions logprobs of `entries`, after the prompt's (echo) on first use."""
        if self.req.logprobs is None:
            return None
        num_top = self.req.logprobs
        parts = []
        if self.req.echo and not st.started:
            parts.append(R.echo_logprobs(job.prompt.token_ids, out.prompt_logprobs,
                                         self.token_text, st, num_top))
        st.started = True
        parts.append(R.completion_logprobs(entries, self.token_text, st, num_top))
        return R.merge_completion_logprobs(parts)
