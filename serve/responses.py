"""OpenAI response bodies and stream chunks, built from the engine's cumulative RequestOutputs.

`ChoiceState` remembers what a choice has already sent, so each streamed chunk carries the delta
(new text, new tokens' logprobs) of a cumulative output.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

TokenText = Callable[[int], str]  # token id -> its text (for logprobs)


class TokenBytes(Protocol):
    """Token id -> its text, and its bytes (serve/state.py: TokenTexts)."""

    def __call__(self, token_id: int) -> str: ...

    def bytes(self, token_id: int) -> list[int]: ...


@dataclasses.dataclass
class ChoiceState:
    index: int
    num_prompt_tokens: int
    prefix: str = ""  # echo: the prompt text, sent before the first delta
    num_chars_sent: int = 0
    num_tokens_sent: int = 0
    text_offset: int = 0  # completions logprobs: offset of the next token's text
    started: bool = False  # chat: the role chunk was sent; completions: the echo was sent
    finish_reason: str | None = None
    num_output_tokens: int = 0
    text: str = ""
    token_logprobs: list = dataclasses.field(default_factory=list)  # non-streaming: all of them

    def delta(self, completion) -> tuple[str, list]:
        """(new text, new logprob entries) of a cumulative CompletionOutput since the last call."""
        text = completion.text
        new_text = text[self.num_chars_sent:] if len(text) > self.num_chars_sent else ""
        self.num_chars_sent = max(self.num_chars_sent, len(text))
        num_tokens = len(completion.token_ids)
        new_logprobs = []
        if completion.logprobs is not None:
            new_logprobs = list(completion.logprobs[self.num_tokens_sent:num_tokens])
        self.num_tokens_sent = num_tokens
        self.num_output_tokens = num_tokens
        self.text = text
        if completion.finish_reason is not None:
            self.finish_reason = finish_reason_of(completion.finish_reason)
        return new_text, new_logprobs


def finish_reason_of(reason: str | None) -> str | None:
    # "abort" only reaches a client when the server itself aborted (shutdown): report it as "stop"
    # would lie; OpenAI has no such value, so keep it visible.
    return reason


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    u = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
         "total_tokens": num_prompt_tokens + num_completion_tokens}
    if num_cached_tokens:
        u["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return u


# -- logprobs -------------------------------------------------------------------------------------
def completion_logprobs(entries: list, token_text: TokenText, state: ChoiceState,
                        num_top: int) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        t = token_text(e.token_id)
        tokens.append(t)
        token_logprobs.append(_f(e.logprob))
        offsets.append(state.text_offset)
        state.text_offset += len(t)
        top = {}
        for tid, lp in list(zip(e.top_token_ids, e.top_logprobs))[:num_top]:
            top.setdefault(token_text(tid), _f(lp))
        top.setdefault(t, _f(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(prompt_token_ids: list[int], entries: list | None, token_text: TokenText,
                  state: ChoiceState, num_top: int) -> dict:
    """The prompt's part of `echo` with `logprobs` (completions shape): its first token has no
    context, so its logprob and top_logprobs are null; `entries` is RequestOutput.prompt_logprobs
    (one per prompt token, the first None)."""
    entries = list(entries or [])
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, tid in enumerate(prompt_token_ids):
        e = entries[i] if i < len(entries) else None
        if e is None:
            t = token_text(tid)
            out["tokens"].append(t)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(state.text_offset)
            state.text_offset += len(t)
            continue
        part = completion_logprobs([e], token_text, state, num_top)
        for k in out:
            out[k].extend(part[k])
    return out


def merge_completion_logprobs(parts: list[dict]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k].extend(p[k])
    return out


def chat_logprobs(entries: list, token_texts: TokenBytes, num_top: int) -> dict:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}; `bytes` are
    the token's own (a token holding part of a character has its part: they add up to the
    content's UTF-8), `token` its text."""
    content = []
    for e in entries:
        top = [{"token": token_texts(tid), "logprob": _f(lp), "bytes": token_texts.bytes(tid)}
               for tid, lp in list(zip(e.top_token_ids, e.top_logprobs))[:num_top]]
        content.append({"token": token_texts(e.token_id), "logprob": _f(e.logprob),
                        "bytes": token_texts.bytes(e.token_id), "top_logprobs": top})
    return {"content": content}


def _f(x) -> float:
    x = float(x)
    return x if x > -1e30 else -9999.0  # -inf is not JSON; OpenAI clients expect a number


# -- bodies -----------------------------------------------------------------------------------------
def completion_body(request_id: str, created: int, model: str, choices: list[dict],
                    usage_: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_, "system_fingerprint": None}


def chat_body(request_id: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_, "system_fingerprint": None}


def completion_chunk(request_id: str, created: int, model: str, choices: list[dict],
                     usage_: Any = ..., ) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "system_fingerprint": None}
    if usage_ is not ...:
        body["usage"] = usage_
    return body


def chat_chunk(request_id: str, created: int, model: str, choices: list[dict],
               usage_: Any = ...) -> dict:
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, "system_fingerprint": None}
    if usage_ is not ...:
        body["usage"] = usage_
    return body

