"""A request's state on the host (`Request`) and what the engine returns (`RequestOutput`).

Host-only (no JAX). Progress is one counter, `num_computed_tokens`: the tokens whose K/V are in the
cache. New tokens of a step = known tokens (prompt + output) - computed; a decode is 1, a prefill
chunk is N, a resumed (preempted) request recomputes prompt + output as one long prompt.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from jaxinfer.sampling_params import SamplingParams

PLACEHOLDER_TOKEN_ID = -1  # an output token not yet known: a step still running samples it


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, pages freed; resumes by recompute
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH_CAPPED = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason: "stop" | "length" | "abort" | None."""
        return self.value if self.is_finished else None

    @classmethod
    def from_finish_reason(cls, reason: "str | RequestStatus") -> "RequestStatus":
        if isinstance(reason, RequestStatus):
            status = reason
        else:
            try:
                status = cls(reason)
            except ValueError:
                raise ValueError(f"{reason=} must be 'stop', 'length' or 'abort'") from None
        if not status.is_finished:
            raise ValueError(f"{reason=} must be a finished status")
        return status


@dataclasses.dataclass
class SampledLogprobs:
    """Logprob of one sampled token, plus the top-k alternatives when they were asked for."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int
    num_draft_tokens: int = 0  # speculative drafts verified
    num_accepted_tokens: int = 0  # of which accepted
    num_spec_steps: int = 0  # steps that verified at least one draft

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed drafts; None when nothing was proposed."""
        n = self.num_draft_tokens
        return self.num_accepted_tokens / n if n else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification step: accepted drafts + the target's own token."""
        n = self.num_spec_steps
        return 1.0 + self.num_accepted_tokens / n if n else None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean inter-token latency after the first token (TPOT)."""
        if self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def queue_time(self) -> float | None:
        return (None if self.first_scheduled_time is None
                else self.first_scheduled_time - self.arrival_time)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the "priority" policy
    background: bool = False  # yields to interactive requests (sched/scheduler.py)
    cache_salt: str | None = None  # mixed into every page hash: separates prefix-cache tenants

    # -- state, owned by the scheduler ------------------------------------------------------
    seed: int | None = None  # resolved when added: sampling_params.seed or a random one
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[SampledLogprobs] = dataclasses.field(default_factory=list)
    # sampling_params.prompt_logprobs: entry i for prompt token i (entry 0 None), filled as the
    # prompt's chunks are computed
    prompt_logprobs: list[SampledLogprobs | None] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are written (or being written this step)
    page_ids: list[int] = dataclasses.field(default_factory=list)  # page of position p: p // ps
    page_table_row: int = -1  # its row in the scheduler's PageTable while running
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of each full page
    num_registered_pages: int = 0  # page_ids[:k] are in the prefix cache (or were tried)
    num_cached_tokens: int = -1  # prefix hit at first admission; -1 until admitted
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    admission_index: int = -1  # order of (re)admission; the highest is preempted first
    has_placeholder: bool = False  # the last output token is PLACEHOLDER_TOKEN_ID (see below)

    # -- timing (time.monotonic seconds) ----------------------------------------------------
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    # -- speculative decoding -----------------------------------------------------------------
    spec_enabled: bool = False  # resolved when added: sampling_params.spec_decode or the engine's
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)  # drafts for the next step
    num_lookahead_tokens: int = 0  # pages held past num_computed_tokens for this step's drafting
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    # acceptance estimate (sched/spec_policy.py): decayed accepted / decayed trials
    spec_accept_num: float = 3.0  # the prior: alpha = 0.75 before any verification
    spec_accept_den: float = 4.0
    spec_idle_steps: int = 0  # decode steps since the last draft was verified

    # -- structured output --------------------------------------------------------------------
    # its constraint's matcher (jaxinfer/structured/matcher.py RequestGrammar: fill_bitmask(row),
    # advance(token) -> stop?), made when added; None: unconstrained
    grammar: Any = None

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids of request_id={self.request_id!r} must not be empty")
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    # -- tokens -----------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        """prompt + output (a live list: do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def next_prompt_logprob_position(self) -> int | None:
        """The position whose logits score the first prompt token not yet scored (token i is
        scored by position i - 1; token 0 never is); None when prompt logprobs were not asked
        for or are complete."""
        if self.sampling_params.prompt_logprobs is None:
            return None
        scored = max(len(self.prompt_logprobs), 1)
        return scored - 1 if scored < self.num_prompt_tokens else None

    def append_output_token(self, token_id: int, now: float) -> None:
        """Appends a sampled token, or puts it in the placeholder's place."""
        if self.has_placeholder:
            self.output_token_ids[-1] = self._all_token_ids[-1] = token_id
            self.has_placeholder = False
        else:
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def append_placeholder(self) -> None:
        """Holds the place of the token a step still running samples, so the next step can be
        scheduled before it is known (scheduling ahead, sched/scheduler.py): counted as generated,
        PLACEHOLDER_TOKEN_ID until `append_output_token` fills it in."""
        assert not self.has_placeholder, f"{self.request_id=} already has a placeholder"
        self.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
        self._all_token_ids.append(PLACEHOLDER_TOKEN_ID)
        self.has_placeholder = True

    def drop_placeholder(self) -> None:
        """Takes the placeholder back (the request ended before its token came)."""
        if self.has_placeholder:
            self.output_token_ids.pop()
            self._all_token_ids.pop()
            self.has_placeholder = False

    # -- status -----------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return self.status.is_finished

    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            last_token_time=self.last_token_time,
            finished_time=self.finished_time,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=max(self.num_cached_tokens, 0),
            num_preemptions=self.num_preemptions,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_spec_steps=self.num_spec_steps,
        )


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]  # cumulative: every output token so far
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id / stop string, None for EOS
    logprobs: list[Any] | None = None  # one entry per token when asked for

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """Cumulative (full text and token ids so far), like vLLM; the server computes deltas."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[Any] | None = None  # SamplingParams.prompt_logprobs: one per prompt
    #   token (the first None), complete once the first output token is there
