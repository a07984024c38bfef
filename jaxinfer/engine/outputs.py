"""Turns scheduler updates into RequestOutputs: incremental detokenizing and stop strings.

`TextTracker` is one request's text, kept up to date from its cumulative output token ids; it needs
only the tokenizer, so it runs wherever the outputs are consumed: in `OutputProcessor` on the
engine's thread (`LLM.generate`), or, for the server, on the asyncio side (`AsyncEngine`), which
takes token-only outputs from `LLMEngine.step(detokenize=False)` so detokenizing stays off the
step's critical path. A stop string ends the output at the token that completed it (the text is
cut before it, or after with `include_stop_str_in_output`), even when a step produced several
tokens (speculative decoding) or a lagging consumer sees several steps at once.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxinfer.request import CompletionOutput, Request, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer, check_stop, stop_holdback_len


class TextTracker:
    """The output text of one request, fed its cumulative output token ids."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                            skip_special_tokens=params.skip_special_tokens)
        self.stops = params.stop_list()
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens  # stop strings count only after this many tokens
        self.eos_token_ids = tuple(getattr(tokenizer, "eos_token_ids", ()))
        self.done = False  # fed its final tokens
        self.text = ""  # all text decoded so far (before stop truncation)
        self.stopped_text: str | None = None  # the final text once a stop string matched
        self.stop_reason: str | None = None  # the stop string that matched
        self.num_tokens_at_stop: int | None = None  # output tokens up to the one completing it

    @property
    def stopped(self) -> bool:
        return self.stopped_text is not None

    def update(self, token_ids: Sequence[int], finished: bool, finish_reason: str | None = None,
               stop_reason: int | str | None = None) -> bool:
        """Feeds the tokens not seen yet; True when a stop string matched in them. A finished
        request that ended on a stop token (EOS or one of stop_token_ids: `_ended_on_stop_token`)
        leaves that token's text out unless include_stop_str_in_output (as vLLM does). A stop
        string counts only in text after the first min_tokens tokens (as vLLM's)."""
        if self.stopped or self.done:
            return False
        new_ids = token_ids[self.detok.num_tokens_seen:]
        if (finished and not self.include_stop
                and self._ended_on_stop_token(token_ids, finish_reason, stop_reason)):
            new_ids = new_ids[:-1]
        if not self.stops:
            self.text += self.detok.add(new_ids) if new_ids else ""
        else:  # one token at a time: the stop ends the output at the token that completed it
            for token_id in new_ids:
                delta = self.detok.add([token_id])
                if delta and self._check(delta):
                    return True
        if finished:
            self.done = True
            delta = self.detok.flush()
            if delta and self.stops and self._check(delta):
                return True
            self.text += "" if self.stops else delta
        return False

    def _check(self, delta: str) -> bool:
        self.text += delta
        if self.detok.num_tokens_seen <= self.min_tokens:
            return False
        truncated, matched = check_stop(self.text, self.stops, num_new_chars=len(delta),
                                        include=self.include_stop)
        if matched is None:
            return False
        self.stopped_text, self.stop_reason = truncated, matched
        self.num_tokens_at_stop = self.detok.num_tokens_seen
        return True

    def _ended_on_stop_token(self, token_ids: Sequence[int], finish_reason: str | None,
                            stop_reason: int | str | None) -> bool:
        """Whether a finished request's last token stopped it: one of its stop_token_ids (the
        stop_reason) or EOS (no stop_reason). A grammar that completed also ends with "stop" and
        no stop_reason, on a token of its text; a stop string's stop_reason is the string."""
        if finish_reason != "stop" or isinstance(stop_reason, str) or not token_ids:
            return False
        return stop_reason is not None or token_ids[-1] in self.eos_token_ids

    def visible_text(self, finished: bool) -> str:
        """The text to show now: cut at a stop, and while running without the tail that may still
        grow into a stop string."""
        if self.stopped_text is not None:
            return self.stopped_text
        if self.stops and not finished:
            return self.text[: len(self.text) - stop_holdback_len(self.text, self.stops)]
        return self.text

    def apply(self, out: RequestOutput) -> RequestOutput:
        """`out` (token-only, single completion) with its text; ended at a matched stop string."""
        c = out.outputs[0]
        if self.stopped:
            finished = True
        else:
            self.update(c.token_ids, out.finished, c.finish_reason, c.stop_reason)
            finished = out.finished or self.stopped
        token_ids, logprobs = c.token_ids, c.logprobs
        finish_reason, stop_reason = c.finish_reason, c.stop_reason
        if self.stopped:
            n = self.num_tokens_at_stop
            token_ids = token_ids[:n]
            logprobs = None if logprobs is None else logprobs[:n]
            finish_reason, stop_reason = "stop", self.stop_reason
        completion = dataclasses.replace(c, text=self.visible_text(finished), token_ids=token_ids,
                                         logprobs=logprobs, finish_reason=finish_reason,
                                         stop_reason=stop_reason)
        return dataclasses.replace(out, outputs=[completion], finished=finished)


def token_output(req: Request, prompt: str | None) -> RequestOutput:
    """A snapshot of `req` with no text yet (copies: safe to hand to another thread)."""
    finished = req.is_finished()
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=list(req.output_token_ids),
        finish_reason=req.finish_reason() if finished else None,
        stop_reason=req.stop_reason,
        logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None,
    )
    return RequestOutput(request_id=req.request_id, prompt=prompt,
                         prompt_token_ids=req.prompt_token_ids, outputs=[completion],
                         finished=finished, metrics=req.metrics(),
                         prompt_logprobs=((list(req.prompt_logprobs) or [None])
                                          if req.sampling_params.prompt_logprobs is not None
                                          else None))


@dataclasses.dataclass
class _Track:
    prompt: str | None
    text: TextTracker | None  # None when the consumer detokenizes


class OutputProcessor:
    """The outputs of the requests a step updated, and their text when the engine detokenizes.

    It never changes a request: a stop string found in the text is reported by `update_text`,
    and the engine finishes that request before `process` builds the outputs."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._tracks: dict[str, _Track] = {}

    def add(self, req: Request, prompt_text: str | None) -> None:
        self._tracks[req.request_id] = _Track(prompt_text, None)

    def abort(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)

    def update_text(self, updated: list[Request]) -> list[tuple[str, str]]:
        """Detokenizes the new tokens of the `updated` requests; returns (request_id, stop string)
        for each one still running whose text reached a stop string (the caller finishes it)."""
        stopped = []
        for req in updated:
            track = self._tracks.get(req.request_id)
            if track is None:
                continue
            if track.text is None:
                track.text = TextTracker(self.tokenizer, req.prompt_token_ids, req.sampling_params)
            finished = req.is_finished()
            reason = req.finish_reason() if finished else None
            if (track.text.update(req.output_token_ids, finished, reason, req.stop_reason)
                    and not finished):
                stopped.append((req.request_id, track.text.stop_reason))
        return stopped

    def process(self, updated: list[Request], detokenize: bool = True) -> list[RequestOutput]:
        """Outputs of the requests a step updated: with `detokenize`, their text as `update_text`
        left it (cut at a matched stop string); else token-only outputs (the consumer runs a
        TextTracker and ends stopped requests itself)."""
        outputs = []
        for req in updated:
            track = self._tracks.get(req.request_id)
            if track is None:
                continue
            if detokenize:
                outputs.append(track.text.apply(token_output(req, track.prompt)))
            else:
                outputs.append(token_output(req, track.prompt))
            if req.is_finished():
                del self._tracks[req.request_id]
        return outputs
