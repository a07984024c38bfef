"""Speculative decoding, host side: the drafts each decoding request carries into the next step.

How a step goes (engine/llm_engine.py, sched/scheduler.py, runtime/step.py):

1. Between steps `DraftProposer.propose` gives each request that decodes next up to k drafts
   (`Request.spec_token_ids`; k is `SpecPolicy`'s call, sched/spec_policy.py): from
   `NgramProposer` (prompt lookup, numpy), or the drafts the draft model proposed inside the step
   just run (`RunnerOutput.draft_token_ids`; runtime/draft_model.py).
2. The scheduler schedules 1 + k new tokens for it (its last token, then the drafts) in the same
   ragged step as everyone's prefills and decodes; the step computes the target's logits at all
   1 + k positions (k + 1 sampled rows) and verifies the drafts on the device
   (runtime/spec_verify.py): n-gram drafts against the tokens sampled at their rows (so a
   request's tokens are those of decoding one token at a time, greedy or seeded), a draft
   model's sampled rows by the rejection rule.
3. `Scheduler.update` appends the emitted tokens and lowers `num_computed_tokens` past the
   rejected drafts; their K/V is simply overwritten later (pages past the end are freed).

Structured output: a constrained request's n-gram drafts are cut to the prefix its grammar accepts
(`RequestGrammar.num_valid_drafts`), and each verified position gets the allowed-token mask of the
grammar after the drafts before it (sched/step_input.py), so greedy and sampled verification both
see the constrained target distribution. A draft-model engine gives constrained requests no
drafts: the draft model samples its k drafts inside the step, where the grammar's masks for its
own drafts are not known, so its q could not be masked as p is.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.request import Request
from jaxinfer.sched.output import RunnerOutput, SchedulerOutput
from jaxinfer.sched.scheduler import Scheduler
from jaxinfer.sched.spec_policy import SpecPolicy


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: find an earlier occurrence of the last n tokens (n = ngram_max down to
    ngram_min) in the request's own prompt + output and propose the tokens that followed it.

    Of the occurrences of the longest n-gram that matches, the one whose match runs furthest back
    (up to k + 1 tokens: the match's length) wins, then the latest that has k tokens after it: a
    copy in progress matches the text it copies for many tokens, a common phrase for few. The
    match's length goes with the drafts to `SpecPolicy`, which trusts a long match with more of
    them. Host-side numpy: one vectorised scan of the tokens per n, then one per token of length.
    """

    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self):
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max} must satisfy "
                             "1 <= ngram_min <= ngram_max")

    def propose(self, token_ids, k: int) -> list[int]:
        """Up to `k` drafts continuing `token_ids` (prompt + output so far); [] when no n-gram
        of the suffix occurred before."""
        return self.lookup(token_ids, k)[0]

    def may_match_next(self, token_ids: list[int]) -> bool:
        """Whether `lookup` may find a match once one more token follows `token_ids`, whichever
        token that is. An n-gram of n >= 2 ending at the new token holds the current last token
        at an earlier position, so with ngram_min >= 2 a last token that occurs nowhere before it
        rules every match out."""
        if self.ngram_min == 1:
            return True
        return token_ids.index(token_ids[-1]) < len(token_ids) - 1

    def lookup(self, token_ids, k: int) -> tuple[list[int], int]:
        """(up to `k` drafts, the length of the match they continue: how many of the last tokens
        the chosen occurrence repeats, at most max(n, k + 1)); ([], 0) when nothing matches."""
        if k <= 0:
            return [], 0
        tokens = np.asarray(token_ids, np.int64)  # i64[L]
        length = tokens.shape[0]
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            suffix = tokens[length - n:]
            starts = np.flatnonzero(tokens[:length - n] == suffix[0])  # a match leaves >= 1 token
            for j in range(1, n):
                starts = starts[tokens[starts + j] == suffix[j]]
            if starts.size:
                lengths = _match_lengths(tokens, starts, n, cap=k + 1)  # i64[S]
                match_len = int(lengths.max())
                longest = starts[lengths == match_len]
                full = longest[longest <= length - n - k]
                start = int(full[-1] if full.size else longest[-1]) + n
                return tokens[start:start + k].tolist(), match_len
        return [], 0


def _match_lengths(tokens: np.ndarray, starts: np.ndarray, n: int, cap: int) -> np.ndarray:
    """For each occurrence `starts` (i64[S]) of the last n of `tokens`: how many of the last tokens
    it repeats, following the match back from n tokens up to `cap` (i64[S], each >= n)."""
    length = tokens.shape[0]
    lengths = np.full(starts.shape, n, np.int64)
    for e in range(n, min(cap, length - 1)):
        before = starts - (e - n) - 1  # the token before the matched part of each occurrence
        grow = (lengths == e) & (before >= 0)
        grow[grow] = tokens[before[grow]] == tokens[length - e - 1]
        if not grow.any():
            break
        lengths[grow] += 1
    return lengths


def ngram_drafts(ngram: NgramProposer, policy: SpecPolicy, req: Request, token_ids,
                 num_requests: int) -> list[int]:
    """The drafts `req` (whose prompt + output is `token_ids`) carries into the next step with
    `num_requests` running or waiting: prompt lookup for as many as the batch allows, cut to
    what the policy gives a match of that length."""
    k_max = policy.max_drafts(req, num_requests)
    drafts, match_len = ngram.lookup(token_ids, k_max)
    if not drafts:
        return []
    return drafts[:policy.num_drafts(req, num_requests, match_len=match_len)]


@dataclasses.dataclass(frozen=True)
class DraftProposer:
    """Sets the drafts of each request that decodes in the next step, after `Scheduler.update`."""

    ngram: NgramProposer | None  # None: the draft model's drafts, from the runner output

    @classmethod
    def from_config(cls, engine_config: EngineConfig) -> "DraftProposer | None":
        """The proposer of `engine_config.speculative_method`; None without speculation."""
        method = engine_config.speculative_method
        if method is None:
            return None
        return cls(NgramProposer(engine_config.ngram_min, engine_config.ngram_max)
                   if method == "ngram" else None)

    def may_draft_next(self, token_ids: list[int]) -> bool:
        """Whether a request whose prompt + output is `token_ids` may get drafts after its next
        token, whichever it is (`Scheduler._may_speculate`): n-gram drafts only where the lookup
        may match; a draft model's always."""
        return self.ngram is None or self.ngram.may_match_next(token_ids)

    def propose(self, sched_out: SchedulerOutput, runner_out: RunnerOutput, updated: list[Request],
                scheduler: Scheduler, num_requests: int) -> None:
        """n-gram lookup for the `updated` requests, as many drafts as `scheduler.spec_policy`
        gives each with `num_requests` running or waiting (the engine passes the count from
        before `update`, the one a step scheduled ahead was decided with: `Scheduler.
        _may_speculate`); or the draft model's drafts of this step (`item.num_lookahead` per
        item)."""
        if self.ngram is not None:
            for req in updated:
                if req.is_finished() or req.num_tokens - req.num_computed_tokens != 1:
                    continue
                drafts = ngram_drafts(self.ngram, scheduler.spec_policy, req, req.all_token_ids,
                                      num_requests)
                if drafts and req.grammar is not None:  # only what the grammar accepts
                    drafts = drafts[:req.grammar.num_valid_drafts(drafts)]
                req.spec_token_ids = drafts
            return
        draft_ids = runner_out.draft_token_ids  # i32[S, K]
        for s, item in enumerate(sched_out.scheduled):
            req = item.request
            if item.num_lookahead and not req.is_finished() and \
                    req.num_tokens - req.num_computed_tokens == 1:
                drafts = draft_ids[s, :item.num_lookahead].tolist()
                req.spec_token_ids = drafts[:drafts.index(-1)] if -1 in drafts else drafts
