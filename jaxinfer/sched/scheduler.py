"""Scheduler: which requests run this step and how many tokens each (continuous batching).

Host-only (no JAX). The engine calls, per step:
    sched_out = scheduler.schedule()                  # advances num_computed_tokens
    step_input = make_step_input(sched_out, ...)      # numpy arrays for the compiled step
    runner_out = runner.execute(step_input)           # RunnerOutput: tokens (+ logprobs)
    changed = scheduler.update(sched_out, runner_out) # append, stop, free, cache full pages
and, between steps, `finish_request(id, "stop", stop_reason=s)` for stop strings and
`abort_request(id)`.

schedule() fills a token budget (max_num_batched_tokens) and a sequence budget (max_num_seqs):
running decodes first, then running prefill chunks, then new admissions (FCFS or priority).
A running request that cannot get a page preempts the most recently admitted one by recompute.

Background requests (`Request.background`: batch lines, `service_tier="flex"`) yield to the
others under either policy: they queue behind every interactive request, are preempted first (a
waiting interactive request that finds no sequence slot or pages preempts them), and, while any
interactive request is in the engine (or was, less than `background_linger_s` ago: a chat's
next request or an agent's next call usually follows within that time), share at most
`background_max_num_seqs` sequences and `background_max_num_batched_tokens` tokens of a step, so
a step stays about as short as the interactive requests alone would make it and one arriving
does not wait behind a full-width step. Otherwise they get the whole step.

Speculative decoding: a decoding request with drafts (`Request.spec_token_ids`, set between steps
by `DraftProposer`, runtime/spec_decode.py) schedules 1 + k new tokens, its last token plus the
drafts, which the step verifies; `update` appends the accepted drafts plus the target's own next
token and rolls the rejected drafts back by lowering `num_computed_tokens` (their pages are
freed). How many drafts a request gets is `spec_policy`'s call (sched/spec_policy.py), capped here
by the token budget, the context limit and max_tokens; drafts never preempt anyone (no free page:
no drafts this step).

Scheduling ahead (`schedule_ahead`, the engine's host/device overlap): while step N runs, the step
after it is scheduled, before N's tokens are known. Each request N samples for gets a placeholder
token (`Request.append_placeholder`), so it schedules like a decode whose last token is known;
`AheadStep` says where N's sampled rows go in the new step's input ids, which the engine writes
once N's tokens are back, before it runs the step; `update(N)` then puts each sampled token in its
placeholder's place and applies stops as always. A request whose token at N is its last by
length (max_tokens, the context limit) is left out of N + 1; one that stops at N on a stop token
has already been scheduled into N + 1: that row computes its last token's K/V (a real token, into
its own pages) and `update(N + 1)` ignores it. Only a step that the unknown tokens cannot change
is scheduled ahead: no admissions (the queue is empty, or the sequences are full and nobody is
outranked), no preemptions (every running request's growth fits the free pages), and no request
whose next step depends on its tokens (drafts, a grammar, penalties) or on the last update
(prompt logprobs not yet all scored); otherwise the engine waits for N and schedules as usual.
A speculating request blocks it only while it may have drafts: not once the policy's batch rule
gives it none at the current count of requests (a batch too large to speculate), which is the
count its next n-gram drafts are proposed with.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import random
import time
from typing import Callable, Sequence

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.request import Request, RequestStatus
from jaxinfer.sched.output import AheadStep, RunnerOutput, ScheduledRequest, SchedulerOutput
from jaxinfer.sched.page_pool import PagePool, extend_page_hashes
from jaxinfer.sched.page_table import PageTable
from jaxinfer.sched.spec_policy import SpecPolicy
from jaxinfer.sched.stats import SchedulerStats

POLICIES = ("fcfs", "priority")


@dataclasses.dataclass
class _Budget:
    """Tokens and sequences left in a step; a share of an `outer` budget spends from both."""

    tokens: int
    seqs: int
    outer: "_Budget | None" = None

    @property
    def num_tokens(self) -> int:
        return self.tokens if self.outer is None else min(self.tokens, self.outer.num_tokens)

    @property
    def num_seqs(self) -> int:
        return self.seqs if self.outer is None else min(self.seqs, self.outer.num_seqs)

    def exhausted(self) -> bool:
        return self.num_tokens <= 0 or self.num_seqs <= 0

    def spend(self, num_tokens: int) -> None:
        self.tokens -= num_tokens
        self.seqs -= 1
        if self.outer is not None:
            self.outer.spend(num_tokens)


class Scheduler:
    def __init__(
        self,
        engine_config: EngineConfig,
        num_pages: int,
        max_model_len: int,
        eos_token_ids: Sequence[int] = (),
        *,
        policy: str = "fcfs",
        clock: Callable[[], float] = time.monotonic,
        spec_policy: SpecPolicy | None = None,
        may_draft_next: Callable[[list[int]], bool] | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"{policy=} must be one of {POLICIES}")
        page_size = engine_config.page_size
        if max_model_len < 2:
            raise ValueError(f"{max_model_len=} must be at least 2")
        if (num_pages - 1) * page_size < max_model_len:
            raise ValueError(
                f"{num_pages=} pages of {page_size} tokens (page 0 reserved) cannot hold one "
                f"sequence of {max_model_len=} tokens")
        self.config = engine_config
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.policy = policy
        self.clock = clock
        self.spec_policy = spec_policy
        # whether a request whose prompt + output is this may get drafts after its next token,
        # whichever it is (the n-gram proposer's `may_match_next`); None: it may
        self.may_draft_next = may_draft_next
        self.pool = PagePool(num_pages, page_size, engine_config.enable_prefix_caching)
        self.page_table = PageTable(engine_config.max_num_seqs, -(-max_model_len // page_size))
        self.waiting: collections.deque[Request] = collections.deque()  # head is admitted next
        self.running: list[Request] = []  # admission order
        self._requests: dict[str, Request] = {}
        self._rng = random.Random(engine_config.seed)  # seeds of requests that bring none
        self._finished_ids: list[str] = []
        self._num_admissions = 0
        self._static_quota = 0  # static mode: admissions left in the batch being formed
        self._last = (0, 0)  # (seqs, tokens) of the last schedule()
        self._last_interactive = -float("inf")  # clock() when an interactive request was last in
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_draft_tokens_total = 0
        self.num_accepted_tokens_total = 0
        self.num_spec_steps_total = 0
        self.num_ahead_steps = 0  # steps scheduled ahead (schedule_ahead)
        # (the running step, {request_id: its new tokens in the step scheduled ahead of it})
        self._ahead: tuple[SchedulerOutput, dict[str, int]] | None = None

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"request_id={req.request_id!r} is already in use")
        if req.num_tokens + 1 > self.max_model_len:
            raise ValueError(
                f"prompt of {req.num_tokens} tokens + 1 generated token exceeds "
                f"max_model_len={self.max_model_len}")
        if req.seed is None:
            seed = req.sampling_params.seed
            req.seed = seed if seed is not None else self._rng.getrandbits(32)
        req.status = RequestStatus.WAITING
        self._enqueue(req)  # first: a request that cannot be queued is not left registered
        self._requests[req.request_id] = req

    def abort_request(self, request_id: str) -> Request | None:
        """Frees the request's pages at once; None when it is unknown or already finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, reason: str | RequestStatus,
                       stop_reason: int | str | None = None) -> Request | None:
        """Ends a request ("stop" | "length" | "abort"); the engine uses it for stop strings."""
        status = RequestStatus.from_finish_reason(reason)
        req = self._requests.get(request_id)
        if req is None:
            return None
        if stop_reason is not None:
            req.stop_reason = stop_reason
        self._finish(req, status)
        return req

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def all_requests(self) -> list[Request]:
        return list(self._requests.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        """Requests running or waiting: the count the speculation policy's batch rule reads."""
        return len(self.running) + len(self.waiting)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def recompute_all(self) -> None:
        """Preempts every running request (by recompute: pages freed, back to the queue's head in
        admission order), e.g. after the KV cache was lost and no page holds its K/V any more."""
        for req in reversed(list(self.running)):
            self._preempt(req)

    # -- schedule ---------------------------------------------------------------------------
    def schedule(self, may_preempt: bool = True) -> SchedulerOutput:
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        outranked = self._preempt_outranked() if may_preempt else []
        budgets = (budget, self._background_budget(budget))
        self._schedule_running(budgets, scheduled, preempted, may_preempt)
        if not preempted:  # admitting right after a preemption would only thrash
            self._schedule_waiting(budgets, scheduled)
        return self._make_output(scheduled, outranked + preempted)

    def schedule_ahead(self, inflight: SchedulerOutput) -> AheadStep | None:
        """The step after `inflight` (scheduled, still running), or None where it cannot be
        known before `inflight`'s tokens are (see the module's docstring). Until
        `update(inflight, ...)`, each request `inflight` samples for holds a placeholder."""
        samples = {}  # request_id -> its sampled row in `inflight`
        row = 0
        for item in inflight.scheduled:
            if item.samples and item.request.status is RequestStatus.RUNNING:
                samples[item.request.request_id] = row + item.num_prompt_rows
            row += item.num_rows
        if not self._can_schedule_ahead(samples):
            return None
        for req in self.running:
            if req.request_id in samples:
                req.append_placeholder()
        out = self.schedule(may_preempt=False)
        self._ahead = (inflight, {it.request.request_id: it.num_new_tokens for it in out.scheduled})
        if out.is_empty:
            return None
        token_index, source_row = [], []
        first = 0  # the item's first token in the step
        for it in out.scheduled:
            req = it.request
            if req.has_placeholder:  # a decode (or a request's first one): its input is the token
                token_index.append(first + req.num_tokens - 1 - it.num_computed_tokens)
                source_row.append(samples[req.request_id])
            first += it.num_new_tokens
        self.num_ahead_steps += 1
        return AheadStep(out, token_index=np.asarray(token_index, np.int64),
                         source_row=np.asarray(source_row, np.int64))

    def _can_schedule_ahead(self, samples: dict[str, int]) -> bool:
        """Whether the next step is the same whichever tokens are sampled: no request that may
        have drafts (`_may_speculate`), grammars or penalties (they read the tokens), no prompt
        logprobs still being scored (the next chunk's rows start where `update` left them), no
        admission or outranking (the queue's head would be admitted, or would preempt someone),
        and room in the pool for every running request's next chunk (no preemption)."""
        if self.spec_policy is not None and any(self._may_speculate(r, self.num_requests)
                                                for r in self.running):
            return False
        if self.waiting:
            head = self._rank(self.waiting[0])
            if (len(self.running) < self.config.max_num_seqs
                    or any(self._rank(r) > head for r in self.running)):
                return False
        need = 0
        for req in self.running:
            if (req.grammar is not None or req.sampling_params.has_penalties
                    or req.next_prompt_logprob_position() is not None):
                return False  # its next step reads its tokens, or its prompt logprobs so far
            todo = req.num_tokens + (req.request_id in samples) - req.num_computed_tokens
            chunk = min(todo, self.config.max_num_batched_tokens)
            need += max(self._num_pages_for(req.num_computed_tokens + chunk) - len(req.page_ids), 0)
        return need <= self.pool.num_free_pages

    def _may_speculate(self, req: Request, num_requests: int) -> bool:
        """Whether `req` may have drafts in the step after the running one: it speculates, and it
        verifies drafts in the running step (how many it accepts is not known yet) or holds
        drafts not yet verified, or the policy's batch rule may give it some. n-gram drafts are
        proposed after `update` with the count of requests from before it (DraftProposer), so
        where that rule gives `req` none at that count, it gets none whatever its tokens, and
        none where `may_draft_next` says no lookup can match after its next token; a
        draft model's are planned by `schedule`, after `update`: any speculating request may
        have them."""
        if not req.spec_enabled:
            return False
        if req.spec_token_ids or self.spec_policy.draft_lookahead:
            return True
        if self.spec_policy.max_drafts(req, num_requests) == 0:
            return False
        # no lookup can match after the next token, whatever it is (a scan of the tokens: last)
        return self.may_draft_next is None or self.may_draft_next(req.all_token_ids)

    def _background_budget(self, budget: _Budget) -> _Budget:
        """The share of `budget` background requests may use: all of it, unless an interactive
        request is in the engine or was less than background_linger_s ago (the queue keeps
        interactive ones at its head)."""
        now = self.clock()
        if ((self.waiting and not self.waiting[0].background)
                or any(not r.background for r in self.running)):
            self._last_interactive = now
        elif now - self._last_interactive >= self.config.background_linger_s:
            return budget
        return _Budget(self.config.background_max_num_batched_tokens,
                       self.config.background_max_num_seqs, outer=budget)

    def _rank(self, req: Request) -> tuple:
        """Queue order, smaller first: interactive before background, then (priority policy) a
        lower priority value first, then FCFS."""
        if self.policy == "priority":
            return (req.background, req.priority, req.arrival_time)
        return (req.background,)

    def _victim_key(self, req: Request) -> tuple:
        """Preemption order, larger first: background, then (priority policy) the least urgent,
        then the most recently admitted."""
        if self.policy == "priority":
            return (req.background, req.priority, req.arrival_time, req.admission_index)
        return (req.background, req.admission_index)

    def _preempt_outranked(self) -> list[Request]:
        """When the head of the queue cannot be admitted (no sequence slot, or too few pages for
        its first chunk), running requests it outranks (`_rank`: background ones for an
        interactive head; under the priority policy also less urgent ones) are preempted, by
        recompute, least urgent first, until it can; then it is admitted in this step."""
        preempted: list[Request] = []
        if not self.waiting:
            return preempted
        head = self.waiting[0]
        while self.running:
            victim = max(self.running, key=self._victim_key)
            if self._rank(victim) <= self._rank(head):
                break
            if len(self.running) < self.config.max_num_seqs and self._first_chunk_fits(head):
                break
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _first_chunk_fits(self, req: Request) -> bool:
        """Whether `_try_admit` would find pages for `req`'s first chunk now (changes nothing)."""
        ps = self.page_size
        if self.pool.enable_prefix_caching:
            extend_page_hashes(req.page_hashes, req.all_token_ids, ps, req.cache_salt)
        hit_page_ids = self.pool.find_cached_prefix(req.page_hashes, (req.num_tokens - 1) // ps)
        num_computed = len(hit_page_ids) * ps
        num_new = min(req.num_tokens - num_computed, self.config.max_num_batched_tokens)
        num_pages = (self._num_pages_for(num_computed + num_new) - len(hit_page_ids)
                     + self.pool.num_evictable_among(hit_page_ids))
        return num_pages <= self.pool.num_free_pages

    def _schedule_running(self, budgets, scheduled, preempted, may_preempt=True) -> None:
        step_budget, background_budget = budgets
        # interactive first, and within each kind decodes before prefill chunks
        order = sorted(self.running,
                       key=lambda r: (r.background, r.num_tokens - r.num_computed_tokens > 1))
        for req in order:
            if step_budget.exhausted():
                break
            budget = background_budget if req.background else step_budget
            if budget.exhausted() or req.status is not RequestStatus.RUNNING:
                continue  # over the background share, or preempted by another one's growth
            num_new = min(req.num_tokens - req.num_computed_tokens, budget.num_tokens)
            if num_new <= 0:
                continue  # its token is not back yet (in a step still running; scheduling ahead)
            if req.has_placeholder and self._length_capped(req):
                continue  # the token still being sampled is its last (scheduling ahead)
            spec_ids, lookahead = self._spec_plan(req, num_new, budget)
            if (spec_ids or lookahead) and not self._grow_pages(
                    req, req.num_computed_tokens + num_new + len(spec_ids) + lookahead,
                    scheduled, preempted, may_preempt=False):
                spec_ids, lookahead = [], 0  # drafts never preempt anyone
            if self._grow_pages(req, req.num_computed_tokens + num_new, scheduled, preempted,
                                may_preempt):
                scheduled.append(self._take(req, num_new, budget, spec_ids, lookahead))

    def _spec_plan(self, req: Request, num_new: int, budget: _Budget) -> tuple[list[int], int]:
        """(drafts to verify this step, drafts a draft model proposes in it) for `req`."""
        if self.spec_policy is None or not req.spec_enabled:
            return [], 0
        if req.num_computed_tokens + num_new != req.num_tokens:
            return [], 0  # a mid-prompt chunk samples nothing
        sp = req.sampling_params
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.max_model_len
        spec_ids: list[int] = []
        if num_new == 1 and req.spec_token_ids:
            room = min(budget.num_tokens - 1, self.max_model_len - req.num_tokens,
                       max_tokens - req.num_output_tokens - 1)
            spec_ids = req.spec_token_ids[:max(room, 0)]
        return spec_ids, self._draft_lookahead(req, req.num_tokens + len(spec_ids))

    def _draft_lookahead(self, req: Request, kv_len: int) -> int:
        """Drafts a draft model proposes in a step that ends at `kv_len` (pages are held for them)."""
        if self.spec_policy is None or not self.spec_policy.draft_lookahead or not req.spec_enabled:
            return 0
        sp = req.sampling_params
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.max_model_len
        k = self.spec_policy.num_drafts(req, self.num_requests)
        return max(0, min(k, self.max_model_len - kv_len, max_tokens - req.num_output_tokens - 2))

    def _grow_pages(self, req, num_tokens_after, scheduled, preempted, may_preempt=True) -> bool:
        """Pages for `num_tokens_after` tokens, preempting others if needed (and allowed); False if
        `req` itself had to be preempted (or there were no free pages and no preempting)."""
        num_more = -(-num_tokens_after // self.page_size) - len(req.page_ids)
        if num_more <= 0:
            return True
        while (page_ids := self.pool.allocate(num_more)) is None:
            if not may_preempt:
                return False
            victim = self._pick_victim(req, scheduled)
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        req.page_ids.extend(page_ids)
        self.page_table.append(req.page_table_row, page_ids)
        return True

    def _pick_victim(self, current: Request, scheduled: list[ScheduledRequest]) -> Request:
        taken = {id(s.request) for s in scheduled}
        candidates = [r for r in self.running if r is current or id(r) not in taken]
        return max(candidates, key=self._victim_key)

    def _schedule_waiting(self, budgets, scheduled) -> None:
        step_budget, background_budget = budgets
        static = self.config.scheduling == "static"
        if static and not self.running:
            self._static_quota = self.config.max_num_seqs  # the previous batch is done: form one
        while (self.waiting and not step_budget.exhausted()
               and len(self.running) < self.config.max_num_seqs):
            if static and self._static_quota <= 0:
                return
            budget = background_budget if self.waiting[0].background else step_budget
            if budget.exhausted():
                break  # the rest of the queue is background too
            item = self._try_admit(self.waiting[0], budget)
            if item is None:
                break
            self.waiting.popleft()
            scheduled.append(item)
            self._static_quota -= static
        if static and not step_budget.exhausted():  # stopped by pages, seqs or an empty queue
            self._static_quota = 0  # the batch is formed: nobody joins until it has finished

    def _try_admit(self, req: Request, budget: _Budget) -> ScheduledRequest | None:
        """Admits `req` (prefix hits + pages for its first chunk) or returns None, changing nothing."""
        ps = self.page_size
        if self.pool.enable_prefix_caching:
            extend_page_hashes(req.page_hashes, req.all_token_ids, ps, req.cache_salt)
        # Leave at least the last known token to compute, so the step yields its logits.
        max_hit_pages = (req.num_tokens - 1) // ps
        scored_from = req.next_prompt_logprob_position()
        if scored_from is not None:  # prompt logprobs: compute every position not yet scored
            max_hit_pages = min(max_hit_pages, scored_from // ps)
        hit_page_ids = self.pool.find_cached_prefix(req.page_hashes, max_hit_pages)
        num_computed = len(hit_page_ids) * ps
        num_new = min(req.num_tokens - num_computed, budget.num_tokens)
        lookahead = (self._draft_lookahead(req, req.num_tokens)
                     if num_computed + num_new == req.num_tokens else 0)
        num_hit_evictable = self.pool.num_evictable_among(hit_page_ids)
        num_new_pages = self._num_pages_for(num_computed + num_new + lookahead) - len(hit_page_ids)
        if lookahead and num_new_pages + num_hit_evictable > self.pool.num_free_pages:
            lookahead = 0  # drafting pages never stop an admission
            num_new_pages = self._num_pages_for(num_computed + num_new) - len(hit_page_ids)
        if num_new_pages + num_hit_evictable > self.pool.num_free_pages:
            return None
        self.pool.acquire(hit_page_ids)  # before allocate, so these are not evicted by it
        req.page_ids = hit_page_ids + self.pool.allocate(num_new_pages)
        req.page_table_row = self.page_table.add_row(req.page_ids)
        req.num_registered_pages = len(hit_page_ids)
        req.num_computed_tokens = num_computed
        self.pool.record_prefix_query(req.num_tokens, num_computed)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
            req.first_scheduled_time = self.clock()
        req.status = RequestStatus.RUNNING
        req.admission_index = self._num_admissions
        self._num_admissions += 1
        self.running.append(req)
        return self._take(req, num_new, budget, [], lookahead)

    def _take(self, req: Request, num_new: int, budget: _Budget, spec_ids: list[int] = (),
              lookahead: int = 0) -> ScheduledRequest:
        assert num_new > 0, f"{req.request_id=} has nothing to compute"
        start = req.num_computed_tokens
        samples = start + num_new == req.num_tokens
        num_new += len(spec_ids)
        req.num_computed_tokens += num_new
        req.num_lookahead_tokens = lookahead
        if spec_ids or req.spec_token_ids:
            req.spec_token_ids = list(spec_ids)  # what this step verifies; unscheduled ones drop
        budget.spend(num_new)
        return ScheduledRequest(req, start, num_new, samples=samples,
                                spec_token_ids=req.spec_token_ids if spec_ids else [],
                                num_lookahead=lookahead,
                                num_prompt_rows=self._num_prompt_rows(req, start, num_new))

    @staticmethod
    def _num_prompt_rows(req: Request, start: int, num_new: int) -> int:
        """Positions in [start, start + num_new) whose logits score a prompt token not yet
        scored: a suffix of the chunk (before its sampled position, if it samples)."""
        scored_from = req.next_prompt_logprob_position()
        if scored_from is None:
            return 0
        assert scored_from >= start, f"{req.request_id=}: prompt position {scored_from} skipped"
        return max(0, min(start + num_new, req.num_prompt_tokens - 1) - scored_from)

    def _make_output(self, scheduled, preempted) -> SchedulerOutput:
        num_batched_tokens = sum(s.num_new_tokens for s in scheduled)
        self._last = (len(scheduled), num_batched_tokens)
        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=num_batched_tokens,
            preempted_request_ids=[r.request_id for r in preempted],
            finished_request_ids=finished_ids,
            eos_token_ids=self.eos_token_ids,
            page_table=self.page_table.table,
            stats=self.stats(),
        )

    # -- update -----------------------------------------------------------------------------
    def update(self, sched_out: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Appends each sampled token (rows in `sched_out.scheduled` order, `item.num_rows` per
        item; a mid-prompt chunk's row is ignored), applies token-level stops, frees finished
        requests' pages and caches newly full pages. A verifying item's rows hold its emitted
        tokens (accepted drafts, then the target's own token) and then -1: the rejected drafts are
        rolled back (`num_computed_tokens` lowered, pages past it freed). Returns the requests
        that got a token, in row order (finished ones included)."""
        items = sched_out.scheduled
        token_ids = runner_output.token_ids[:sum(it.num_rows for it in items)].tolist()
        now = self.clock()
        changed = []
        row = 0
        ahead = self._ahead[1] if self._ahead is not None and self._ahead[0] is sched_out else {}
        self._ahead = None
        for item in items:
            req, first_row = item.request, row
            row += item.num_rows
            if req.status is not RequestStatus.RUNNING or (
                    req.num_computed_tokens - ahead.get(req.request_id, 0)
                    != item.num_computed_tokens + item.num_new_tokens):
                continue  # finished or aborted after schedule()
            if item.num_prompt_rows:
                self._record_prompt_logprobs(item, runner_output, first_row)
                first_row += item.num_prompt_rows  # the sampled row, if any
            if not item.samples:
                if req.num_computed_tokens // self.page_size > req.num_registered_pages:
                    self._cache_full_pages(req)
                continue
            if item.spec_token_ids:
                emitted = self._verified(item, token_ids[first_row:row])
            else:
                emitted = token_ids[first_row:first_row + 1]
                if self.spec_policy is not None and req.spec_enabled:
                    self.spec_policy.observe(req, 0, 0)  # a step without drafts
            status = self._append(req, emitted, runner_output, first_row, now)
            if item.spec_token_ids and req.num_computed_tokens >= req.num_tokens:  # rolled back
                req.num_computed_tokens = req.num_tokens - 1
            if req.num_computed_tokens // self.page_size > req.num_registered_pages:
                self._cache_full_pages(req)
            if status is not None:
                self._finish(req, status)
            elif len(req.page_ids) > self._num_pages_for(req.num_computed_tokens) or \
                    req.num_lookahead_tokens:
                self._trim_pages(req)
            changed.append(req)
        if sched_out.scheduled:
            self.num_steps += 1
        return changed

    @staticmethod
    def _record_prompt_logprobs(item: ScheduledRequest, out: RunnerOutput, first_row: int) -> None:
        """The prompt-logprob rows' values: each row's logprob is that of the next prompt token
        (the step scores `StepInput.target_token_ids`), with the row's top-k."""
        req = item.request
        if not out.has_logprobs:
            raise ValueError("prompt logprobs need a runner output with logprobs")
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # the first prompt token has no context
        k = req.sampling_params.prompt_logprobs
        for i, token_id in enumerate(item.prompt_row_targets()):
            req.prompt_logprobs.append(out.sampled_logprobs(first_row + i, token_id, k))

    def _verified(self, item: ScheduledRequest, row_tokens: list[int]) -> list[int]:
        """A verifying item's emitted tokens; counts drafts and acceptances, informs the policy."""
        req, num_draft = item.request, len(item.spec_token_ids)
        num_emitted = row_tokens.index(-1) if -1 in row_tokens else len(row_tokens)
        num_accepted = max(num_emitted - 1, 0)
        req.num_draft_tokens += num_draft
        req.num_accepted_tokens += num_accepted
        req.num_spec_steps += 1
        self.num_draft_tokens_total += num_draft
        self.num_accepted_tokens_total += num_accepted
        self.num_spec_steps_total += 1
        if self.spec_policy is not None:
            self.spec_policy.observe(req, num_draft, num_accepted)
        req.spec_token_ids = []
        return row_tokens[:num_emitted]

    def _append(self, req: Request, emitted: list[int], out: RunnerOutput, first_row: int,
                now: float) -> RequestStatus | None:
        """Appends tokens up to the first stop; returns the stop status or None."""
        num_logprobs = req.sampling_params.logprobs
        for i, token_id in enumerate(emitted):
            req.append_output_token(token_id, now)
            if num_logprobs is not None and out.has_logprobs:
                req.output_logprobs.append(out.sampled_logprobs(first_row + i, token_id, num_logprobs))
            if req.grammar is not None and req.grammar.advance(token_id):
                return RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing else fits
            status = self._check_stop(req, token_id)
            if status is not None:
                return status
        return None

    def _trim_pages(self, req: Request) -> None:
        """Frees the pages past `num_computed_tokens` (rejected drafts, draft lookahead)."""
        keep = self._num_pages_for(req.num_computed_tokens)
        req.num_lookahead_tokens = 0
        if len(req.page_ids) > keep:
            self.pool.free(req.page_ids[keep:])
            del req.page_ids[keep:]
            self.page_table.truncate(req.page_table_row, keep)

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens > sp.min_tokens:  # this token's index >= min_tokens
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in sp.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if self._length_capped(req):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _length_capped(self, req: Request) -> bool:
        """Whether `req` has all the tokens it may have (max_tokens or the context limit)."""
        sp = req.sampling_params
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.max_model_len
        return req.num_output_tokens >= max_tokens or req.num_tokens >= self.max_model_len

    def _cache_full_pages(self, req: Request) -> None:
        if not self.pool.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.page_size
        extend_page_hashes(req.page_hashes, req.all_token_ids, self.page_size, req.cache_salt)
        for i in range(req.num_registered_pages, num_full):
            self.pool.cache_page(req.page_ids[i], req.page_hashes[i])
        req.num_registered_pages = max(req.num_registered_pages, num_full)

    # -- state changes ----------------------------------------------------------------------
    def _enqueue(self, req: Request, front: bool = False) -> None:
        """Into the queue in `_rank` order; under FCFS a preempted request (`front`) goes ahead
        of the others of its kind."""
        if self.policy == "priority" or not front:
            bisect.insort_right(self.waiting, req, key=self._rank)
        else:
            self.waiting.insert(bisect.bisect_left(self.waiting, self._rank(req), key=self._rank),
                                req)

    def _preempt(self, req: Request) -> None:
        """By recompute: pages freed (full ones stay cached), back to the front of the queue."""
        self.running.remove(req)
        self._release_pages(req)
        req.drop_placeholder()
        req.num_computed_tokens = 0
        req.num_lookahead_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._release_pages(req)
        req.drop_placeholder()
        req.status = status
        req.finished_time = self.clock()
        del self._requests[req.request_id]
        self._finished_ids.append(req.request_id)
        self.num_finished += 1

    def _release_pages(self, req: Request) -> None:
        self.pool.free(req.page_ids)
        if req.page_table_row >= 0:
            self.page_table.free_row(req.page_table_row)
        req.page_ids = []
        req.page_table_row = -1
        req.num_registered_pages = 0

    def _num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- stats / checks ---------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        pool = self.pool
        return SchedulerStats(
            num_steps=self.num_steps,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_scheduled_seqs=self._last[0],
            num_batched_tokens=self._last[1],
            num_preemptions_total=self.num_preemptions,
            num_finished_total=self.num_finished,
            num_usable_pages=pool.num_usable_pages,
            num_used_pages=pool.num_used_pages,
            num_cached_pages=pool.num_cached_pages,
            num_evictions_total=pool.num_evictions,
            prefix_cache_query_tokens=pool.counters.num_query_tokens,
            prefix_cache_hit_tokens=pool.counters.num_hit_tokens,
            num_live_tokens=sum(r.num_computed_tokens for r in self.running),
            num_allocated_slots=sum(len(r.page_ids) for r in self.running) * self.page_size,
        )

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
        live = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert live == set(self._requests), "a request is lost or duplicated"
        assert len(live) == len(self.running) + len(self.waiting)
        refs = collections.Counter(p for r in self.running for p in r.page_ids)
        for page_id in range(1, self.pool.num_pages):
            assert self.pool.ref_count(page_id) == refs[page_id], f"{page_id=} ref count is off"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
            assert 0 < r.num_computed_tokens <= r.num_tokens + len(r.spec_token_ids)
            assert r.num_tokens <= self.max_model_len and r.num_computed_tokens <= self.max_model_len
            assert len(r.page_ids) == self._num_pages_for(r.num_computed_tokens + r.num_lookahead_tokens)
            assert len(set(r.page_ids)) == len(r.page_ids)
            assert self.page_table.row(r.page_table_row) == r.page_ids, f"{r.request_id=} page table row"
        assert self.page_table.num_free_rows == self.config.max_num_seqs - len(self.running)
        used_rows = {r.page_table_row for r in self.running}
        assert len(used_rows) == len(self.running)
        assert not self.page_table.table[[i for i in range(self.config.max_num_seqs) if i not in used_rows]].any()
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and not r.page_ids

