"""EngineClient: what a driver of the engine (AsyncEngine, LLM, the test fakes) may call.

`LLMEngine` is the implementation; a fake used by the server tests implements the same protocol,
so production code calls these members without probing for them. Every call comes from one
thread (the engine is not thread-safe; AsyncEngine gives it a thread of its own).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from jaxinfer.request import RequestOutput
from jaxinfer.sampling_params import SamplingParams


class StepFailed(RuntimeError):
    """`step()` failed and the engine recovered: the requests of that step (`request_ids`) are
    ended (aborted, their pages freed), the others go on. Any other exception from `step()`
    leaves the engine's state unknown to its caller."""

    def __init__(self, request_ids: Sequence[str], cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = tuple(request_ids)
        self.cause = cause


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Any  # jaxinfer.tokenizer.Tokenizer (encode, decode, apply_chat_template, ...)
    max_model_len: int  # prompt + output tokens of one request at most

    @property
    def vocab_size(self) -> int:
        """Token ids run over [0, vocab_size)."""

    @property
    def metrics(self) -> Any:
        """A snapshot of counters and gauges (llm_engine.EngineMetrics)."""

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    background: bool = False) -> None:
        """Queues a request (`background`: it yields to interactive ones); ValueError (naming the problem) for a request that cannot run."""

    def abort_request(self, request_id: str) -> None:
        """Ends a request now and frees its pages; unknown ids are ignored."""

    def finish_request(self, request_id: str, reason: str = "stop",
                       stop_reason: str | int | None = None) -> None:
        """Ends a request as finished (e.g. at a stop string its consumer found)."""

    def has_unfinished_requests(self) -> bool:
        ...

    def step(self, detokenize: bool = True) -> list[RequestOutput]:
        """One scheduling step; the outputs of the requests it changed (cumulative). With
        detokenize=False they carry token ids only and stop strings are the caller's. Raises
        StepFailed when the step failed and only its own requests were lost."""

    def warmup(self) -> None:
        """Compiles (or loads) every executable now, so no request waits through a compile."""
