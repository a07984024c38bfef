"""The step's host-side records: what `Scheduler.schedule()` decided (`SchedulerOutput`, read
by `make_step_input` and handed back to `Scheduler.update()`), what the step sampled
(`RunnerOutput`, numpy copies the runner returns and `Scheduler.update()` consumes), and a step
scheduled while the one before it runs (`AheadStep`, from `Scheduler.schedule_ahead()`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.request import Request, SampledLogprobs
from jaxinfer.sched.stats import SchedulerStats


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    """One sequence (one row) of the step."""

    request: Request
    num_computed_tokens: int  # context already in the cache: the position of the first new token
    num_new_tokens: int  # q_len: 1 for a decode, N for a prefill chunk, 1 + drafts to verify
    samples: bool  # the new tokens reach the end of the known tokens, so a token is sampled
    # Speculative decoding: drafts verified this step (the last new tokens, after the request's
    # last known token), and for a draft model, how many drafts it proposes for the next step
    # (pages are held for their K/V: `Request.num_lookahead_tokens`).
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_lookahead: int = 0
    # Prompt logprobs (SamplingParams.prompt_logprobs): the last new tokens whose logits score the
    # next prompt token, one row each, before the sampled row (if any). Never with drafts.
    num_prompt_rows: int = 0

    @property
    def kv_len(self) -> int:
        """Context length including this step's new tokens."""
        return self.num_computed_tokens + self.num_new_tokens

    @property
    def num_rows(self) -> int:
        """Rows of logits: one per verified position (1 + drafts); the prompt-logprob rows, then
        the sampled one if `samples`; else 1 (ignored unless `samples`). Rows are the item's last
        new tokens."""
        if self.num_prompt_rows:
            return self.num_prompt_rows + self.samples
        return 1 + len(self.spec_token_ids)

    def prompt_row_targets(self) -> list[int]:
        """The prompt token each prompt-logprob row scores: the row at position p scores p + 1."""
        first = self.kv_len - self.num_rows  # position of the item's first row
        return self.request.prompt_token_ids[first + 1:first + 1 + self.num_prompt_rows]

    @property
    def token_ids(self) -> list[int]:
        known = self.request.all_token_ids[self.num_computed_tokens:self.kv_len]
        return known + self.spec_token_ids if self.spec_token_ids else known


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # row order: running decodes, running prefills, admissions
    num_batched_tokens: int
    preempted_request_ids: list[str]  # preempted by this schedule()
    finished_request_ids: list[str]  # finished or aborted since the previous schedule()
    eos_token_ids: frozenset[int]  # so step inputs can ban EOS before min_tokens
    page_table: np.ndarray  # i32[max_num_seqs, max_pages_per_seq] live; row = request.page_table_row
    stats: SchedulerStats

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclasses.dataclass(frozen=True)
class AheadStep:
    """A step scheduled while the one before it runs (`Scheduler.schedule_ahead`): input token
    `token_index[i]` of this step is the token the running step samples in row `source_row[i]`
    (a placeholder until then)."""

    sched_out: SchedulerOutput
    token_index: np.ndarray  # i64[n] into the step's tokens (StepInput.input_ids)
    source_row: np.ndarray  # i64[n] into the running step's RunnerOutput.token_ids

    def fill_tokens(self, input_ids: np.ndarray, sampled: RunnerOutput) -> None:
        """Writes the running step's sampled tokens into this step's `input_ids` (i32[T])."""
        input_ids[self.token_index] = sampled.token_ids[self.source_row]


@dataclasses.dataclass
class RunnerOutput:
    """Host copies of what one step sampled, one entry per real sampled row (rows in
    `SchedulerOutput.scheduled` order, `item.num_rows` each). A verifying item's rows hold its
    emitted tokens (accepted drafts, then the target's own token), then -1."""

    token_ids: np.ndarray  # i32[R]
    logprobs: np.ndarray | None = None  # f32[R] raw-model logprob of each row's token; None: the
    #   runner computed none (a fake model), so no logprobs are recorded
    top_token_ids: np.ndarray | None = None  # i32[R, K] best first; None: no row asked for them
    top_logprobs: np.ndarray | None = None  # f32[R, K]
    draft_token_ids: np.ndarray | None = None  # i32[S, num_speculative_tokens] a draft model's
    #   proposals for the next step, -1 padded (None without a draft model)

    @property
    def has_logprobs(self) -> bool:
        return self.logprobs is not None

    def sampled_logprobs(self, row: int, token_id: int, k: int) -> SampledLogprobs:
        """Row `row`'s logprob of `token_id` and (k > 0) its top-k alternatives."""
        top_ids = [] if self.top_token_ids is None or k == 0 else self.top_token_ids[row][:k].tolist()
        top_lps = [] if self.top_logprobs is None or k == 0 else self.top_logprobs[row][:k].tolist()
        return SampledLogprobs(token_id, float(self.logprobs[row]), top_ids, top_lps)
