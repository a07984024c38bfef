"""Which data-parallel replica takes a new request: the least queued prefill work, net of the
prompt's prefix already cached there.

Each replica (jaxinfer/engine/replicas.py) has its own scheduler and page pool. A new request
costs a replica the prompt tokens it must still compute; a replica whose prefix cache holds the
first pages of this prompt saves that many. The router picks the replica with the smallest

    waiting tokens (prompt tokens its requests have not computed yet) - cached prefix tokens

and breaks ties by fewer unfinished requests, then by the lower index, so an idle set fills
round-robin and a shared system prompt keeps going where its pages are. Host-only (no JAX).
"""

from __future__ import annotations

from typing import Sequence

from jaxinfer.sched.page_pool import extend_page_hashes
from jaxinfer.sched.scheduler import Scheduler


def waiting_tokens(scheduler: Scheduler) -> int:
    """Prompt tokens not yet computed, over the waiting and the still-prefilling requests."""
    total = 0
    for req in list(scheduler.waiting) + list(scheduler.running):
        total += max(req.num_prompt_tokens - req.num_computed_tokens, 0)
    return total


def cached_prefix_tokens(scheduler: Scheduler, token_ids: Sequence[int],
                         cache_salt: str | None = None) -> int:
    """Tokens of `token_ids`' leading full pages that the scheduler's prefix cache holds now
    (what an admission would reuse; the last token is always computed). Changes nothing."""
    pool = scheduler.pool
    if not pool.enable_prefix_caching or len(token_ids) < 2:
        return 0
    page_size = scheduler.page_size
    max_pages = (len(token_ids) - 1) // page_size
    hashes = extend_page_hashes([], list(token_ids[:max_pages * page_size]), page_size,
                                cache_salt)
    return len(pool.find_cached_prefix(hashes, max_pages)) * page_size


def pick_replica(schedulers: Sequence[Scheduler], token_ids: Sequence[int] | None,
                 cache_salt: str | None = None) -> int:
    """The index of the replica a request of these prompt tokens should go to (`token_ids`
    None: load alone decides)."""

    def score(i: int) -> tuple[int, int, int]:
        s = schedulers[i]
        hit = 0 if token_ids is None else cached_prefix_tokens(s, token_ids, cache_salt)
        return waiting_tokens(s) - hit, len(s.waiting) + len(s.running), i

    return min(range(len(schedulers)), key=score)
