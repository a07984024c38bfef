"""POST /v1/chat/completions: a reply to a conversation (rendered by the model's chat template),
`n` choices, streamed or not. Without max_tokens / max_completion_tokens a reply may run to the
end of the context, as in OpenAI's API. Tool calls (serve/tools.py) come back as
`message.tool_calls` (streamed as `delta.tool_calls`) with finish_reason "tool_calls"."""

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
from serve.prompts import chat_prompt
from serve.schemas import ChatCompletionRequest
from serve.structured import precompile, request_constraint
from serve.tools import ToolPlan, ToolStream, plan_tools
from serve.state import ServerState
from serve.writer import ChoiceWriter, respond

ENDPOINT = "chat"  # the metrics label


async def chat_completions(server: ServerState, request: Request) -> Response:
    """The assistant's reply to a conversation, streamed or not."""
    t0 = time.monotonic()
    engine = server.engine
    try:
        req = await parse_body(request, ChatCompletionRequest,
                               max_body_bytes=server.max_body_bytes, model_name=server.model_name)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        plan = plan_tools(req.tools, req.tool_choice)
        constraint, constraint_param = request_constraint(req.response_format,
                                                          req.structured_outputs)
        if plan.forced:
            if constraint is not None:
                raise APIError(400, f"tool_choice={req.tool_choice!r} forces a tool call: it "
                                    f"cannot be combined with {constraint_param}",
                               param="tool_choice")
            constraint, constraint_param = plan.constraint(), "tools"
        await precompile(engine, constraint, constraint_param)
        prompt = await chat_prompt(engine.tokenizer, req.messages, req.add_generation_prompt,
                                   plan.template_tools, describe_tools=plan.mode == "auto")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = plan_jobs(engine, request_id, [prompt], req, max_tokens=_max_tokens(req),
                         logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                         prompt_param="messages", max_tokens_param=_max_tokens_param(req),
                         constraint=constraint)
    except APIError as e:
        return server.error(ENDPOINT, e)
    return await respond(server, request, ENDPOINT, jobs, t0,
                         ChatWriter(server, req, request_id, jobs, plan),
                         {"max_tokens": _max_tokens_param(req)})


def _max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def _max_tokens_param(req: ChatCompletionRequest) -> str:
    """The API's name of the limit the request set (for errors about it)."""
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


class ChatWriter(ChoiceWriter):
    """The chunks (streaming) or the body of one chat request."""

    def __init__(self, server: ServerState, req: ChatCompletionRequest, request_id: str,
                 jobs: list[Job], plan: ToolPlan | None = None):
        super().__init__(server, req, request_id, jobs,
                         {j.index: R.ChoiceState(j.index, len(j.prompt.token_ids)) for j in jobs})
        self.num_top = req.top_logprobs or 0
        self.plan = plan or ToolPlan("none")
        self.tool_streams = {j.index: ToolStream(self.plan) for j in jobs}

    # -- streaming (serve/streaming.py: ChunkWriter) ---------------------------------------------
    def opening(self) -> list[dict]:
        return [self._chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}], self.chunk_usage)
                for j in self.jobs]

    def chunks(self, job: Job, out: RequestOutput) -> list[dict]:
        st = self.states[job.index]
        c = out.outputs[0]
        new_text, new_lps = st.delta(c)
        if not new_text and not new_lps and c.finish_reason is None:
            return []
        stream = self.tool_streams[job.index]
        deltas = stream.feed(new_text, c.finish_reason is not None)
        if not deltas and not new_lps and c.finish_reason is None:
            return []  # text held back (it may open a tool call)
        deltas = deltas or [{}]
        finish = st.finish_reason if c.finish_reason else None
        if finish == "stop" and stream.num_calls:
            finish = "tool_calls"
        return [self._chunk([{"index": job.index, "delta": delta,
                              "logprobs": self._logprobs(new_lps) if i == 0 else None,
                              "finish_reason": finish if i == len(deltas) - 1 else None}],
                            self.chunk_usage)
                for i, delta in enumerate(deltas)]

    # -- not streaming -------------------------------------------------------------------------
    def body(self, finals: Finals) -> dict:
        choices = []
        for index in sorted(finals):
            _, out = finals[index]
            st = self.states[index]
            c = out.outputs[0]
            st.delta(c)
            message = {"role": "assistant", "content": c.text}
            finish = st.finish_reason
            if self.plan.mode != "none":
                content, calls = self.plan.calls(c.text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": index, "message": message,
                            "logprobs": self._logprobs(list(c.logprobs or [])[:len(c.token_ids)]),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        return R.chat_body(self.request_id, self.created, self.model_name, choices,
                           usage(self.jobs, self.states, finals))

    # -- parts ---------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage_) -> dict:
        return R.chat_chunk(self.request_id, self.created, self.model_name, choices, usage_)

    def _logprobs(self, entries: list) -> dict | None:
        return R.chat_logprobs(entries, self.token_text, self.num_top) if self.req.logprobs else None
