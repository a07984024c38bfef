"""Where `jaxinfer chat` gets its answers: the engine in this process, or a server's streamed
/v1/chat/completions. Both yield the answer's text as it comes and then tell how many tokens it
had (`tokens`, set when the stream ends)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import httpx

Message = dict[str, str]


@dataclasses.dataclass(frozen=True)
class Sampling:
    max_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None


class InProcess:
    """An LLMEngine built here, stepped while the answer streams."""

    def __init__(self, engine):
        self.engine = engine
        self.tokens = 0
        self._count = 0

    def stream(self, messages: list[Message], sampling: Sampling) -> Iterator[str]:
        from jaxinfer.sampling_params import SamplingParams

        self._count += 1
        request_id, sent, self.tokens = f"chat-{self._count}", 0, 0
        prompt = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        params = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, seed=sampling.seed)
        self.engine.add_request(request_id, prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    self.tokens = len(out.outputs[0].token_ids)
                    text = out.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if out.finished:
                        return
        finally:
            self.engine.abort_request(request_id)  # a no-op once it has finished


class Remote:
    """A server's /v1/chat/completions, streamed (SSE), the usage in the last chunk."""

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=30.0))
        self.model = model or self._first_model()
        self.tokens = 0

    def _first_model(self) -> str:
        r = self._http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def stream(self, messages: list[Message], sampling: Sampling) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **dataclasses.asdict(sampling)}
        if body["seed"] is None:
            del body["seed"]
        self.tokens = 0
        with self._http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"the server answered {r.status_code}: {_message(r)}")
            for line in _sse_lines(r):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "stream error"))
                if chunk.get("usage"):
                    self.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        yield piece

    def close(self) -> None:
        self._http.close()


def _sse_lines(r: httpx.Response) -> Iterator[str]:
    """The lines of a server-sent event stream, split at \\n (and \\r\\n) only: httpx's
    iter_lines also splits at U+2028 and the like, which a server may leave raw in its JSON."""
    rest = ""
    for text in r.iter_text():
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if rest:
        yield rest.removesuffix("\r")


def _message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]
