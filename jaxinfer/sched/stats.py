"""A snapshot of the scheduler after a schedule(): queue sizes, pages, preemptions, prefix hits."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    num_steps: int  # schedule() calls that scheduled something, before this one
    num_running: int
    num_waiting: int
    num_scheduled_seqs: int  # in the last schedule()
    num_batched_tokens: int  # in the last schedule()
    num_preemptions_total: int
    num_finished_total: int
    num_usable_pages: int  # pool size minus the null page
    num_used_pages: int  # ref count > 0
    num_cached_pages: int  # hashed (in use or kept for prefix hits)
    num_evictions_total: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_live_tokens: int  # tokens of running requests whose K/V are (being) written
    num_allocated_slots: int  # pages held by running requests * page_size

    @property
    def page_usage(self) -> float:
        return self.num_used_pages / self.num_usable_pages

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def kv_utilization(self) -> float:
        """Live tokens / allocated page slots: 1.0 means no slot held by a request is empty."""
        s = self.num_allocated_slots
        return self.num_live_tokens / s if s else 0.0
