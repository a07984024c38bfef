"""Turns scheduler updates into RequestOutputs: incremental detokenizing and stop strings."""

from __future__ import annotations

import dataclasses

from jaxinfer.request import CompletionOutput, Request, RequestOutput
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer, check_stop, stop_holdback_len


@dataclasses.dataclass
class _Track:
    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    text: str = ""  # all text decoded so far (before stop truncation)
    stop_reason: str | int | None = None
    stopped_text: str | None = None  # the final text once a stop string matched


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._tracks: dict[str, _Track] = {}

    def add(self, req: Request, prompt_text: str | None) -> None:
        sp = req.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                       skip_special_tokens=sp.skip_special_tokens)
        self._tracks[req.request_id] = _Track(req, prompt_text, detok)

    def abort(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)

    def drain_aborted(self) -> list[RequestOutput]:
        return []

    def process(self, updated: list[Request], scheduler) -> list[RequestOutput]:
        outputs = []
        for req in updated:
            track = self._tracks.get(req.request_id)
            if track is None:
                continue
            self._detokenize(track, scheduler)
            outputs.append(self._output(track))
            if track.request.is_finished():
                del self._tracks[req.request_id]
        return outputs

    def _detokenize(self, track: _Track, scheduler) -> None:
        req = track.request
        new_ids = req.output_token_ids[track.detok.num_tokens_seen:]
        delta = track.detok.add(new_ids) if new_ids else ""
        if req.is_finished():
            delta += track.detok.flush()
        track.text += delta
        stops = req.sampling_params.stop_list()
        if stops and delta and track.stopped_text is None:
            truncated, matched = check_stop(track.text, stops, num_new_chars=len(delta),
                                            include=req.sampling_params.include_stop_str_in_output)
            if matched is not None:
                track.stopped_text = truncated
                track.stop_reason = matched
                if not req.is_finished():
                    scheduler.finish_request(req.request_id, "stop", stop_reason=matched)

    def _output(self, track: _Track) -> RequestOutput:
        req = track.request
        finished = req.is_finished()
        if track.stopped_text is not None:
            text = track.stopped_text
        else:
            text = track.text
            stops = req.sampling_params.stop_list()
            if stops and not finished:  # hold back a tail that may still become a stop string
                text = text[: len(text) - stop_holdback_len(text, stops)]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason() if finished else None,
            stop_reason=track.stop_reason if track.stop_reason is not None else req.stop_reason,
            logprobs=req.output_logprobs if req.sampling_params.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=track.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=req.metrics(),
        )

